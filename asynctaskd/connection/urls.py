"""A Redis URL and TLS options, checked and split into what redis-py takes (`_Target`).

Bad settings are `_Problem`s naming the setting ("url" or a `TlsOptions` field), raised
as `ConfigError` by `_checked`, or listed by `connection_problems` for the config check.
TLS files are read and parsed here, before any connection is made.
"""

from __future__ import annotations

import difflib
import ssl
from pathlib import Path
from typing import Any, Final, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

import msgspec
import redis
import redis.asyncio
import redis.asyncio.connection
import redis.connection

from asynctaskd.errors import ConfigError

__all__ = [
    "SCHEMES",
    "SOCKET_NAME",
    "TlsOptions",
    "connection_problems",
    "local_url",
    "socket_path",
]

SCHEMES: Final = (
    "redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel", "redis+cluster",
    "rediss+cluster",
)  # fmt: skip
CLUSTER_SHAPE: Final = "redis+cluster://HOST:PORT[,HOST:PORT...]"
SENTINEL_PORT: Final = 26379
SENTINEL_SHAPE: Final = "redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"

Verify = Literal["full", "ca", "none"]

# What each tls_verify mode means in redis-py's terms.
_VERIFY: Final[dict[str, dict[str, Any]]] = {
    "full": {"ssl_cert_reqs": "required", "ssl_check_hostname": True},
    "ca": {"ssl_cert_reqs": "required", "ssl_check_hostname": False},
    "none": {"ssl_cert_reqs": "none", "ssl_check_hostname": False},
}
# TlsOptions field -> the redis-py option (and URL query name) it sets.
_TLS_FILES: Final = (("ca", "ssl_ca_certs"), ("cert", "ssl_certfile"), ("key", "ssl_keyfile"))
_TLS_QUERY: Final = frozenset(
    {
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password",
        "ssl_cert_reqs",
        "ssl_check_hostname",
        "ssl_ciphers",
        "ssl_min_version",
        "ssl_include_verify_flags",
        "ssl_exclude_verify_flags",
    }
)
# Query options of redis://, rediss:// and unix:// URLs: those redis-py parses, plus the
# string-valued connection arguments it passes through as they are.
_URL_QUERY: Final = (
    frozenset(redis.connection.URL_QUERY_ARGUMENT_PARSERS)
    | _TLS_QUERY
    | {"client_name", "username", "password"}
)
_SENTINEL_QUERY: Final = frozenset({"sentinel_auth"})
_SENTINEL_TLS_QUERY: Final = frozenset(
    {
        "ssl_ca_certs",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password",
        "ssl_cert_reqs",
        "ssl_check_hostname",
    }
)
_CERT_REQS: Final = ("none", "optional", "required")
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})


class TlsOptions(msgspec.Struct, frozen=True, kw_only=True):
    """TLS settings that are not in the URL: PEM file paths and how to verify the server.

    `verify`: "full" (the default: the chain must lead to `ca`, or to the system's CAs, and
    the certificate must name the host connected to), "ca" (chain only, any name), "none"
    (no verification; for tests).
    """

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    verify: Verify | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ca, self.cert, self.key, self.verify))


class _Problem(Exception):
    """One bad setting: `field` is "url" or a TlsOptions field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class _Target(msgspec.Struct, kw_only=True):
    """A URL and its TLS options, checked and split into what redis-py takes."""

    scheme: str
    tls: dict[str, Any]  # ssl_* arguments for redis-py, from TlsOptions and the URL
    files: list[tuple[str, str]]  # (field, path) of each TLS file, read before connecting
    # Sentinel and Cluster:
    hosts: list[tuple[str, int]] = []  # the sentinels, or the cluster's seed nodes
    userinfo: dict[str, str] = {}
    # Sentinel only:
    service: str = ""
    db: int = 0
    sentinel_auth: bool = False
    key_password: str = ""  # ssl_password from the URL, to read an encrypted key

    @property
    def sentinel(self) -> bool:
        return self.scheme.endswith("+sentinel")

    @property
    def cluster(self) -> bool:
        return self.scheme.endswith("+cluster")


def connection_problems(url: str, tls: TlsOptions | None = None) -> list[tuple[str, str]]:
    """Problems with a URL and TLS options as (field, message), without touching any file.

    `field` is "url" or a TlsOptions field name ("ca", "cert", "key", "verify").
    """
    try:
        _resolve(url, tls or TlsOptions())
    except _Problem as problem:
        return [(problem.field, problem.message)]
    return []


# The unix socket of the embedded server of a data dir (asynctaskd.embedded.EmbeddedServer)
SOCKET_NAME: Final = "valkey.sock"


def socket_path(data_dir: Path) -> Path:
    """Where the embedded server of `redis.data_dir` listens."""
    return data_dir / "valkey" / SOCKET_NAME


def local_url(url: str) -> str:
    """`embedded:///path/to/data_dir[?db=N]` as the unix:// URL of that data dir's server;
    any other URL as it is."""
    if not url.startswith("embedded:"):
        return url
    rest = url.removeprefix("embedded:")
    path, _, query = rest.removeprefix("//").partition("?")
    if not path.startswith("/"):
        raise ConfigError(
            f"embedded URL {url!r}: name the data dir by its absolute path, e.g. "
            "embedded:///var/lib/asynctaskd (redis.data_dir of the daemon's config)"
        )
    return f"unix://{socket_path(Path(path))}" + (f"?{query}" if query else "")


# ---- checking a URL and TLS options ----


def _checked(url: str, tls: TlsOptions | None) -> _Target:
    """The resolved target, with its TLS files read; ConfigError naming the setting."""
    tls = tls or TlsOptions()
    try:
        target = _resolve(url, tls)
        _check_files(target)
    except _Problem as problem:
        raise ConfigError(f"{_label(problem.field)}: {problem.message}") from None
    return target


def _label(field: str) -> str:
    if field == "url":
        return "Redis URL"
    if field.startswith("ssl_"):
        return f"Redis URL option {field}"
    return f"redis.tls_{field}"


def _resolve(url: str, tls: TlsOptions) -> _Target:
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise _Problem("url", f"not a valid URL ({exc})") from None
    scheme = parts.scheme
    if "://" not in url:
        raise _Problem("url", "expected a URL like redis://HOST:6379/0")
    if scheme not in SCHEMES:
        shown = f"{scheme}://" if scheme else "none"
        raise _Problem(
            "url",
            f"unknown scheme {shown}: expected redis://, rediss://, unix://, "
            "redis+sentinel://, rediss+sentinel://, redis+cluster:// or rediss+cluster://",
        )
    query = _query(parts.query)
    secure = scheme.startswith("rediss")
    sentinel = scheme.endswith("+sentinel")
    cluster = scheme.endswith("+cluster")
    if not secure:
        tls_url = (
            "rediss+sentinel://" if sentinel else "rediss+cluster://" if cluster else "rediss://"
        )
        if tls.is_set:
            field = next(f for f in ("ca", "cert", "key", "verify") if getattr(tls, f) is not None)
            raise _Problem(field, f"TLS options need a {tls_url} URL, but the URL is {scheme}://")
        if tls_names := sorted(set(query) & _TLS_QUERY):
            raise _Problem("url", f"option {tls_names[0]} needs a {tls_url} URL")
    if sentinel:
        allowed = _SENTINEL_QUERY | (_SENTINEL_TLS_QUERY if secure else frozenset())
    elif cluster:
        allowed = _SENTINEL_TLS_QUERY if secure else frozenset()
    else:
        allowed = _URL_QUERY
    for name in query:
        if name not in allowed:
            raise _Problem("url", _unknown_option(name, scheme, allowed))
    tls_args, files, key_password = (
        _tls_arguments(tls, query, sentinel or cluster) if secure else ({}, [], "")
    )
    if cluster:
        target = _cluster_target(parts)
        target.scheme, target.tls, target.files = scheme, tls_args, files
        target.key_password = key_password
        return target
    if sentinel:
        target = _sentinel_target(parts, query)
        target.scheme, target.tls, target.files = scheme, tls_args, files
        target.key_password = key_password
        return target
    try:
        redis.asyncio.connection.parse_url(url)
    except ValueError as exc:
        raise _Problem("url", str(exc)) from None
    return _Target(scheme=scheme, tls=tls_args, files=files, key_password=key_password)


def _query(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in parse_qsl(text, keep_blank_values=True):
        if name in out:
            raise _Problem("url", f"option {name} is given twice")
        out[name] = value
    return out


def _unknown_option(name: str, scheme: str, allowed: frozenset[str]) -> str:
    close = difflib.get_close_matches(name, sorted(allowed), n=1)
    if close:
        return f"unknown option {name!r} in the {scheme}:// URL; did you mean {close[0]!r}?"
    if scheme.endswith("+sentinel"):
        known = ", ".join(sorted(allowed))
        return f"unknown option {name!r} in the {scheme}:// URL; known: {known}"
    return f"unknown option {name!r} in the {scheme}:// URL"


def _tls_arguments(
    tls: TlsOptions, query: dict[str, str], sentinel: bool
) -> tuple[dict[str, Any], list[tuple[str, str]], str]:
    """ssl_* arguments for redis-py, the TLS files to read first, and the key's password.

    Options in a rediss:// URL reach redis-py through the URL itself; through Sentinel
    there is no URL redis-py could read, so they are converted here.
    """
    args: dict[str, Any] = {}
    files: list[tuple[str, str]] = []
    for field, option in _TLS_FILES:
        value: str | None = getattr(tls, field)
        if value is not None and option in query:
            raise _Problem(field, f"set it here or as {option} in the URL, not both")
        if value is not None:
            if not value:
                raise _Problem(field, "expected the path of a PEM file, got an empty string")
            args[option] = value
            files.append((field, value))
        elif query.get(option):
            files.append((option, query[option]))
    if tls.verify is not None:
        both = sorted({"ssl_cert_reqs", "ssl_check_hostname"} & set(query))
        if both:
            raise _Problem("verify", f"set it here or as {both[0]} in the URL, not both")
        args.update(_VERIFY[tls.verify])
    reqs = query.get("ssl_cert_reqs")
    if reqs is not None and reqs not in _CERT_REQS:
        raise _Problem("url", f"ssl_cert_reqs must be one of {', '.join(_CERT_REQS)}, got {reqs!r}")
    if (tls.key is not None or query.get("ssl_keyfile")) and not (
        tls.cert is not None or query.get("ssl_certfile")
    ):
        field = "key" if tls.key is not None else "ssl_keyfile"
        raise _Problem(field, "a client key needs its certificate (tls_cert or ssl_certfile)")
    if sentinel:
        for name, value in query.items():
            if name == "ssl_check_hostname":
                args[name] = _flag(name, value)
            elif name in _SENTINEL_TLS_QUERY:
                args[name] = value
    return args, files, query.get("ssl_password", "")


def _flag(name: str, value: str) -> bool:
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise _Problem("url", f"{name} must be yes or no, got {value!r}")


def _sentinel_target(parts: Any, query: dict[str, str]) -> _Target:
    userinfo, at, hosts = parts.netloc.rpartition("@")
    credentials: dict[str, str] = {}
    if at:
        user, colon, password = userinfo.partition(":")
        if user:
            credentials["username"] = unquote(user)
        if colon and password:
            credentials["password"] = unquote(password)
    sentinels = [_address(item) for item in hosts.split(",")] if hosts else []
    if not sentinels:
        raise _Problem("url", f"no sentinel address: expected {SENTINEL_SHAPE}")
    path = [unquote(p) for p in parts.path.split("/")[1:]]
    if path and path[-1] == "" and len(path) > 1:
        path.pop()  # a trailing slash
    if not path or not path[0]:
        raise _Problem("url", f"no master service name: expected {SENTINEL_SHAPE}")
    if len(path) > 2:
        raise _Problem("url", f"too many path parts after the service: expected {SENTINEL_SHAPE}")
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise _Problem("url", f"database must be a number, got {path[1]!r}")
        db = int(path[1])
    if parts.fragment:
        raise _Problem("url", f"unexpected fragment '#{parts.fragment}'")
    return _Target(
        scheme="",
        tls={},
        files=[],
        hosts=sentinels,
        service=path[0],
        db=db,
        userinfo=credentials,
        sentinel_auth=_flag("sentinel_auth", query.get("sentinel_auth", "no")),
    )


def _cluster_target(parts: Any) -> _Target:
    """Seeds of a cluster (any nodes; the client discovers the rest), database 0 only."""
    userinfo, at, hosts = parts.netloc.rpartition("@")
    credentials: dict[str, str] = {}
    if at:
        user, colon, password = userinfo.partition(":")
        if user:
            credentials["username"] = unquote(user)
        if colon and password:
            credentials["password"] = unquote(password)
    seeds = [_address(item, 6379, "node") for item in hosts.split(",")] if hosts else []
    if not seeds:
        raise _Problem("url", f"no node address: expected {CLUSTER_SHAPE}")
    if parts.path not in ("", "/", "/0"):
        raise _Problem("url", f"Redis Cluster has only database 0: expected {CLUSTER_SHAPE}")
    if parts.fragment:
        raise _Problem("url", f"unexpected fragment '#{parts.fragment}'")
    return _Target(scheme="", tls={}, files=[], hosts=seeds, userinfo=credentials)


def _address(
    item: str, default_port: int = SENTINEL_PORT, what: str = "sentinel"
) -> tuple[str, int]:
    """host, host:port or [v6]:port; the port defaults to `default_port` (Sentinel's)."""
    text = item.strip()
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise _Problem("url", f"bad {what} address {item!r}: expected [IPv6]:PORT")
        port_text = rest[1:]
    else:
        host, colon, port_text = text.rpartition(":")
        if not colon:
            host, port_text = text, ""
        elif ":" in host:
            raise _Problem("url", f"bad {what} address {item!r}: put IPv6 in brackets")
    if not host:
        raise _Problem("url", f"bad {what} address {item!r}: no host")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _Problem("url", f"bad {what} address {item!r}: port must be 1-65535")
    return host, int(port_text)


def _check_files(target: _Target) -> None:
    """Read and parse every TLS file now, so a bad one is named before any connection."""
    paths = dict(target.files)
    for field, path in target.files:
        try:
            Path(path).read_bytes()
        except OSError as exc:
            raise _Problem(field, f"cannot read {path!r}: {exc.strerror or exc}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for field in ("ca", "ssl_ca_certs"):
        if field in paths:
            try:
                context.load_verify_locations(cafile=paths[field])
            except ssl.SSLError as exc:
                raise _Problem(
                    field, f"{paths[field]!r} holds no PEM certificate ({exc.reason or exc})"
                ) from None
    cert_field = "cert" if "cert" in paths else "ssl_certfile"
    key_field = "key" if "key" in paths else "ssl_keyfile"
    if cert_field not in paths:
        return
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=paths[cert_field])
    except ssl.SSLError as exc:
        raise _Problem(
            cert_field, f"{paths[cert_field]!r} holds no PEM certificate ({exc.reason or exc})"
        ) from None
    try:
        # An empty password, never a prompt: an encrypted key fails here instead of
        # blocking a daemon on a terminal prompt.
        context.load_cert_chain(
            paths[cert_field], paths.get(key_field), password=target.key_password
        )
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            key = paths.get(key_field, paths[cert_field])
            message = f"{key!r} is not the key of the certificate {paths[cert_field]!r}"
            raise _Problem(key_field if key_field in paths else cert_field, message) from None
        if key_field not in paths:
            raise _Problem(
                cert_field,
                f"{paths[cert_field]!r} holds no private key: set its key file too",
            ) from None
        raise _Problem(
            key_field,
            f"{paths[key_field]!r} is not an unencrypted PEM private key ({exc.reason or exc})",
        ) from None
