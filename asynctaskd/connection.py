"""Turns a Redis URL and TLS options into redis-py clients: TCP, TLS, unix socket or Sentinel.

URLs:
  redis://[user[:password]@]host[:port][/db][?option=value...]
  rediss://...                      the same over TLS
  unix://[user[:password]@]/path/to/redis.sock[?db=N]
  embedded:///path/to/data_dir[?db=N]   the embedded server of a daemon's redis.data_dir
  redis+sentinel://[user[:password]@]host[:port][,host[:port]...]/service[/db][?sentinel_auth=yes]
  rediss+sentinel://...             the same, with TLS to the sentinels and to the master
  redis+cluster://[user[:password]@]host[:port][,host[:port]...]   Redis Cluster seeds
  rediss+cluster://...              the same, with TLS to every node

Options in the query of a redis:// or rediss:// URL are those redis-py reads (`db`,
`ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`, `ssl_cert_reqs`, `ssl_check_hostname`, ...).
TLS files can also come from `TlsOptions` (the daemon's `[redis]` keys `tls_ca`, `tls_cert`,
`tls_key`, `tls_verify`); one setting in both places is an error, never a silent override.

Through Sentinel the client asks the sentinels for the master of `service` before each new
connection, so after a failover it reconnects to the promoted replica. User name and
password (from the URL or the credentials passed in) authenticate to the Redis nodes; the
sentinels get them too with `sentinel_auth=yes`. An asyncio client only ever uses
connections to the master the sentinels named last, and `follow_master` (run by the
daemon) asks them again every so often, so a failover is followed even while the old
master still answers.

Bad settings raise `ConfigError` before any connection is made: TLS files are read and
parsed up front, so a missing CA file or a key that does not fit its certificate is named
at start rather than at the first command.
"""

from __future__ import annotations

import difflib
import logging
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

import anyio
import msgspec
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.connection
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.cluster
import redis.connection
import redis.exceptions
import redis.retry
import redis.sentinel
from redis.backoff import NoBackoff

from .errors import ConfigError

__all__ = [
    "SCHEMES",
    "TlsOptions",
    "connection_problems",
    "follow_master",
    "master_address",
    "open_async",
    "open_sync",
]

logger = logging.getLogger(__name__)

SCHEMES: Final = (
    "redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel", "redis+cluster",
    "rediss+cluster",
)  # fmt: skip
CLUSTER_SHAPE: Final = "redis+cluster://HOST:PORT[,HOST:PORT...]"
# Per node: a cluster client cannot wait for a free connection, it fails, so allow many.
CLUSTER_MAX_CONNECTIONS: Final = 1000
SENTINEL_PORT: Final = 26379
CONNECT_TIMEOUT_S: Final = 5.0
SENTINEL_CONNECT_TIMEOUT_S: Final = 2.0
HEALTH_CHECK_INTERVAL_S: Final = 30
RESP_VERSION: Final = 2  # what asyncio clients speak unless the URL asks otherwise
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


def open_async(
    url: str,
    tls: TlsOptions | None = None,
    *,
    credentials: Mapping[str, str] | None = None,
    max_connections: int = 64,
    socket_timeout: float | None = 10.0,
) -> redis.asyncio.Redis:
    """An asyncio client whose pool waits for a free connection instead of failing.

    Redis runs commands one at a time, so a few dozen connections serve thousands of
    concurrent handler calls; callers queue for a connection rather than erroring.
    `credentials` (username, password) are used unless the URL names its own.
    """
    url = local_url(url)
    target = _checked(url, tls)
    options = _options(credentials, socket_timeout)
    # RESP2, whatever redis-py's default (RESP3 from redis-py 8): the store reads replies
    # off the parser, which is only safe where no push frame can arrive (asynctaskd.wire).
    # A URL's protocol=3 still wins; the store then reads through redis-py's own path.
    options["protocol"] = RESP_VERSION
    if target.cluster:
        nodes = [redis.asyncio.cluster.ClusterNode(h, p) for h, p in target.hosts]
        cluster: redis.asyncio.Redis = redis.asyncio.RedisCluster(  # type: ignore[assignment]  # same commands, own class
            startup_nodes=nodes,
            max_connections=CLUSTER_MAX_CONNECTIONS,
            **_cluster_options(target, options),
        )
        return cluster
    if not target.sentinel:
        # As BlockingConnectionPool.from_url, whose URL options always win, except that
        # the connection class is ours (from_url would keep redis-py's for rediss://).
        arguments: dict[str, Any] = {
            **options,
            **target.tls,
            **redis.asyncio.connection.parse_url(url),
        }
        if target.scheme != "unix":
            secure = target.scheme == "rediss"
            arguments["connection_class"] = _AsyncTlsConnection if secure else _AsyncTcpConnection
        pool = redis.asyncio.BlockingConnectionPool(
            max_connections=max_connections, timeout=None, **arguments
        )
        return redis.asyncio.Redis(connection_pool=pool)
    node, sentinel = _sentinel_options(target, options, redis.asyncio.retry.Retry(NoBackoff(), 0))
    manager = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call]  # unannotated in redis-py
        target.hosts, sentinel_kwargs=sentinel, **node
    )
    client: redis.asyncio.Redis = manager.master_for(
        target.service,
        redis_class=_AsyncSentinelRedis,
        connection_pool_class=_BlockingSentinelPool,
        max_connections=max_connections,
        timeout=None,
    )
    return client


def open_sync(
    url: str,
    tls: TlsOptions | None = None,
    *,
    credentials: Mapping[str, str] | None = None,
    socket_timeout: float | None = 10.0,
) -> redis.Redis:
    """A blocking client for producers in sync code; the same URLs as `open_async`."""
    url = local_url(url)
    target = _checked(url, tls)
    options = _options(credentials, socket_timeout)
    if target.cluster:
        nodes = [redis.cluster.ClusterNode(h, p) for h, p in target.hosts]  # type: ignore[no-untyped-call]  # unannotated in redis-py
        cluster_sync: redis.Redis = redis.cluster.RedisCluster(  # type: ignore[assignment]  # same commands, own class
            startup_nodes=nodes, **_cluster_options(target, options)
        )
        return cluster_sync
    if not target.sentinel:
        if target.scheme != "unix":
            secure = target.scheme == "rediss"
            options["connection_class"] = _SyncTlsConnection if secure else _SyncTcpConnection
        return redis.Redis.from_url(url, **options, **target.tls)
    node, sentinel = _sentinel_options(target, options, redis.retry.Retry(NoBackoff(), 0))
    manager = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]  # unannotated in redis-py
        target.hosts, sentinel_kwargs=sentinel, **node
    )
    client: redis.Redis = manager.master_for(  # type: ignore[no-untyped-call]  # unannotated
        target.service, redis_class=_SyncSentinelRedis
    )
    return client


# ---- clients, pools and connections ----

_PLAIN_HINT: Final = (
    "the server hung up before answering: if this port speaks TLS, use a rediss:// URL"
)
_CERT_HINT: Final = (
    "if the server requires client certificates (tls-auth-clients), set tls_cert and "
    "tls_key, or ssl_certfile and ssl_keyfile in the URL"
)


def _dropped(exc: Exception) -> bool:
    """A connection that was accepted, then closed during the handshake."""
    text = str(exc)
    return any(m in text for m in ("while reading", "while writing", "closed by server"))


def _hinted(exc: Exception, hint: str) -> redis.exceptions.ConnectionError:
    return redis.exceptions.ConnectionError(f"{exc} ({hint})")


def _cert_missing(exc: Exception, certfile: object) -> bool:
    return not certfile and (_dropped(exc) or "certificate required" in str(exc))


# redis-py reports a TLS port answered in plain text, or a missing client certificate, as
# a bare "Connection reset by peer" or "EOF occurred in violation of protocol"; these
# connection classes add what to check.


class _AsyncTcpConnection(redis.asyncio.Connection):
    async def connect(self) -> None:
        try:
            await super().connect()  # type: ignore[no-untyped-call]  # unannotated in redis-py
        except redis.exceptions.ConnectionError as exc:
            if _dropped(exc):
                raise _hinted(exc, _PLAIN_HINT) from exc
            raise


class _AsyncTlsConnection(redis.asyncio.SSLConnection):
    async def connect(self) -> None:
        try:
            await super().connect()  # type: ignore[no-untyped-call]  # unannotated in redis-py
        except redis.exceptions.ConnectionError as exc:
            if _cert_missing(exc, self.certfile):
                raise _hinted(exc, _CERT_HINT) from exc
            raise


class _SyncTcpConnection(redis.connection.Connection):
    def connect(self) -> None:
        try:
            super().connect()  # type: ignore[no-untyped-call]  # unannotated in redis-py
        except redis.exceptions.ConnectionError as exc:
            if _dropped(exc):
                raise _hinted(exc, _PLAIN_HINT) from exc
            raise


class _SyncTlsConnection(redis.connection.SSLConnection):
    def connect(self) -> None:
        try:
            super().connect()  # type: ignore[no-untyped-call]  # unannotated in redis-py
        except redis.exceptions.ConnectionError as exc:
            if _cert_missing(exc, self.certfile):
                raise _hinted(exc, _CERT_HINT) from exc
            raise


class _BlockingSentinelPool(
    redis.asyncio.sentinel.SentinelConnectionPool, redis.asyncio.BlockingConnectionPool
):
    """Sentinel discovery with the waiting pool of `open_async` (redis-py's sentinel pool
    fails with "Too many connections" when every connection is busy), handing out only
    connections to the master the sentinels named last.

    redis-py asks the sentinels only when it opens a connection, drops only the idle
    connections when the answer changes, and takes a connection back as it is. After a
    failover whose old master is still alive (it stalled, or the sentinels lost sight of
    it), the connections opened before would go on writing to that old master, which takes
    writes until Sentinel demotes it and then throws them away, while new connections write
    to the new master: one client on two masters whose data diverge, each refusing the
    fences and leases the other handed out. A connection to any other address is closed
    here before it is used again, and reconnects through the sentinels.
    """

    _announced: tuple[str, int] | None = None  # the master last logged

    async def get_master_address(self) -> Any:
        after = await super().get_master_address()  # type: ignore[no-untyped-call]  # unannotated in redis-py
        before, self._announced = self._announced, after
        if before is not None and after != before:  # once, however many connections asked
            logger.warning(
                "Sentinel names a new master, %s:%s (was %s:%s): following it", *after, *before
            )
        return after

    async def ensure_connection(self, connection: Any) -> None:
        # One tuple comparison per connection handed out: the pool's own check that follows
        # costs more. `master_address` is None until the first discovery.
        if connection.is_connected and (connection.host, connection.port) != self.master_address:
            await connection.disconnect()
        await super().ensure_connection(connection)


class _AsyncSentinelRedis(redis.asyncio.Redis):
    """Closes the connections to the sentinels along with its own."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            manager = getattr(self.connection_pool, "sentinel_manager", None)
            if manager is not None:
                await manager.aclose()


class _SyncSentinelRedis(redis.Redis):
    """Closes the connections to the sentinels along with its own."""

    def close(self) -> None:
        try:
            super().close()
        finally:
            manager = getattr(self.connection_pool, "sentinel_manager", None)
            if manager is not None:
                manager.close()


def master_address(client: redis.asyncio.Redis) -> tuple[str, int] | None:
    """The master a Sentinel client talks to now (None before its first connection, and
    for any other client)."""
    pool = getattr(client, "connection_pool", None)  # a cluster client has none
    if isinstance(pool, _BlockingSentinelPool):
        address: tuple[str, int] | None = pool.master_address
        return address
    return None


async def follow_master(client: redis.asyncio.Redis, interval: float) -> None:
    """Ask the sentinels for the master every `interval` seconds, forever; returns at once
    for a client that does not go through Sentinel.

    Without it a client notices a failover only when a connection breaks. A master that
    dies breaks them all, but one that stalled, or that the sentinels lost sight of, comes
    back still a master and takes writes until Sentinel demotes it, and those writes are
    lost then. Once the sentinels name another master, every connection to the old one is
    closed before its next use (`_BlockingSentinelPool`). A failed question changes
    nothing: the next one, or the next new connection, asks again.
    """
    pool = getattr(client, "connection_pool", None)  # a cluster client has none
    if not isinstance(pool, _BlockingSentinelPool):
        return
    while True:
        await anyio.sleep(interval)
        try:
            await pool.get_master_address()
        except (redis.exceptions.RedisError, OSError) as exc:
            logger.debug("asking the sentinels for the master failed: %s", exc)


def _options(credentials: Mapping[str, str] | None, socket_timeout: float | None) -> dict[str, Any]:
    return {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        **(credentials or {}),
    }


def _cluster_options(target: _Target, options: dict[str, Any]) -> dict[str, Any]:
    """Connection arguments for every node of a cluster: TLS to each node when asked."""
    kwargs = {**options, **target.userinfo}
    if target.tls:
        kwargs.update(target.tls, ssl=True)
    return kwargs


def _sentinel_options(
    target: _Target, options: dict[str, Any], no_retry: object
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Connection arguments for the master, and for the sentinels.

    Each sentinel is asked once (`no_retry`) with a short connect timeout: discovery moves
    on to the next sentinel by itself, while redis-py's default retry would back off for
    seconds on a sentinel that is down before trying the next.
    """
    node = {**options, **target.userinfo, "db": target.db, **target.tls}
    sentinel: dict[str, Any] = {
        "socket_timeout": options["socket_timeout"],
        "socket_connect_timeout": SENTINEL_CONNECT_TIMEOUT_S,
        "retry": no_retry,
    }
    if target.sentinel_auth:
        sentinel.update({k: node[k] for k in ("username", "password") if k in node})
    if target.tls:
        node["ssl"] = True  # the sentinel pool picks its TLS connection class from this
        sentinel.update(target.tls, ssl=True)
    return node, sentinel


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
