"""TOML config decoded into frozen msgspec Structs; errors name the key and the file line."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, ClassVar, Final, Literal, get_args, get_origin
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import msgspec
import msgspec.toml

from .connection import SCHEMES, TlsOptions, connection_problems
from .errors import ConfigError
from .keys import HANDLER_KEY_RE, SETTINGS

__all__ = [
    "Config",
    "Delay",
    "Duration",
    "HandlerConfig",
    "LimitConfig",
    "LogConfig",
    "MetricsConfig",
    "ReaperConfig",
    "RedisConfig",
    "RetryConfig",
    "WebConfig",
    "WorkerConfig",
    "decode_hook",
    "line_of",
    "load_config",
    "parse_config",
    "parse_listen",
]

_DURATION: Final = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)")
_NAMESPACE: Final = re.compile(r"[A-Za-z0-9_.\-]{1,32}")
_FACTORY: Final = re.compile(r"[\w.]+:[\w.]+")
_SECRET_NAME: Final = re.compile(r"token|secret|password|key|authorization", re.IGNORECASE)
_MASK: Final = "***"
_USERINFO_PASSWORD: Final = re.compile(r"(://[^:/@]*:)[^/]*@")
_REDIS_SCHEMES: Final = frozenset(SCHEMES)

_KeyPath = tuple[str | int, ...]  # ("handlers", 1, "factory") for $.handlers[1].factory


class Duration(float):
    """Seconds. Config accepts 30, 2.5, "250ms", "30s", "5m", "1h", "7d"; always positive."""

    _UNITS: ClassVar[dict[str, float]] = {
        "ms": 0.001,
        "s": 1.0,
        "m": 60.0,
        "h": 3600.0,
        "d": 86400.0,
    }

    @classmethod
    def parse(cls, value: object) -> Duration:
        """Build a Duration from a number of seconds or a string with a unit; ValueError if not."""
        seconds = cls._seconds(value)
        if seconds is None:
            raise ValueError(f"expected seconds or a duration like '30s' or '5m', got {value!r}")
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"expected a positive duration, got {value!r}")
        return cls(seconds)

    @classmethod
    def _seconds(cls, value: object) -> float | None:
        """The seconds `value` says (a number, or a string with a unit), or None."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and (m := _DURATION.fullmatch(value.strip())):
            return float(m[1]) * cls._UNITS[m[2]]
        return None


class Delay(Duration):
    """A Duration that may also be 0, which turns off what it delays."""

    @classmethod
    def parse(cls, value: object) -> Delay:
        seconds = cls._seconds(value)
        if seconds is None or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"expected 0 or a duration like '2ms' or '1s', got {value!r}")
        return cls(seconds)


def decode_hook(type_: type, value: object) -> object:
    """msgspec dec_hook for the config types (Duration, Delay), for every decoder of config
    data."""
    if type_ is Duration or type_ is Delay:
        return type_.parse(value)
    raise NotImplementedError(f"no decoder for {type_!r}")


def _encode_custom(value: object) -> object:
    if isinstance(value, Duration):
        return float(value)
    raise NotImplementedError(f"no encoder for {type(value)!r}")


class RedisConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The `[redis]` table: where tasks live and how hard writes are made durable."""

    # Credentials are deliberately not config keys: they come from the environment
    # (REDIS_USERNAME, REDIS_PASSWORD) or from files in $CREDENTIALS_DIRECTORY (systemd
    # LoadCredential=), never from this file.
    url: str = "redis://127.0.0.1:6379/0"  # "embedded": start a private Valkey in data_dir
    namespace: str = "atd"  # 1-32 of [A-Za-z0-9_.-]; prefixes every key
    shards: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    data_dir: str = ".asynctaskd"  # for url = "embedded"
    socket_timeout: Duration = Duration(5)
    durability: Literal["auto", "waitaof", "wait", "off"] = "auto"
    durability_timeout: Duration = Duration(1)
    # How often the daemon reads the server's persistence settings again to report what
    # its gate enforces (metrics, /readyz, heartbeat); a reconnect also triggers a check.
    durability_check_interval: Duration = Duration(60)
    wait_replicas: Annotated[int, msgspec.Meta(ge=0)] = 0
    # TLS for rediss:// and rediss+sentinel:// URLs: PEM files, read when the daemon starts.
    # The URL options ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_cert_reqs do the same;
    # a setting given both ways is an error.
    tls_ca: str | None = None  # CA certificates the server's must chain to; unset: system CAs
    tls_cert: str | None = None  # client certificate, for servers that require one
    tls_key: str | None = None  # the client certificate's private key, unencrypted
    tls_verify: Literal["full", "ca", "none"] | None = None  # unset: "full"

    @property
    def tls(self) -> TlsOptions:
        """The TLS keys as `connection.TlsOptions`."""
        return TlsOptions(
            ca=self.tls_ca, cert=self.tls_cert, key=self.tls_key, verify=self.tls_verify
        )


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The `[worker]` table: claiming, leases, concurrency and shutdown."""

    id: str = ""  # empty: hostname-pid
    max_inflight: Annotated[int, msgspec.Meta(ge=1)] = 1000
    lease: Duration = Duration(10)
    batch_size: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 100
    shutdown_grace: Duration = Duration(30)
    max_reclaims: Annotated[int, msgspec.Meta(ge=0)] = 5
    watchdog: Duration = Duration(60)
    # How long the save of a returned vendor handle is retried while our fence is current.
    save_retry_for: Duration = Duration(300)
    # After a claim round that found less due work than it asked for, wait this long before
    # the next, so that it takes what comes due meanwhile in one round trip (0: at once).
    claim_linger: Delay = Delay(0.002)


class RetryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The `[retry]` table: poll cadence and error backoff."""

    poll_interval: Duration = Duration(5)
    first_error_delay: Duration = Duration(1)
    # Also caps a Retry-After, and a next_poll hint beyond the poll interval.
    max_error_delay: Duration = Duration(300)
    max_consecutive_errors: Annotated[int, msgspec.Meta(ge=1)] = 10
    max_submit_retries: Annotated[int, msgspec.Meta(ge=0)] = 5  # never-sent, before FAILED
    jitter: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.2
    # Each scheduled poll waits poll_interval times a random factor in [1 - j, 1 + j], so
    # that tasks submitted or recovered together do not stay in lockstep.
    poll_jitter: Annotated[float, msgspec.Meta(ge=0, le=0.5)] = 0.05


class ReaperConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The `[reaper]` table: expired leases, deadlines and purging finished tasks."""

    interval: Duration = Duration(1)
    batch: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 1000
    retention: Duration = Duration(7 * 86400)
    purge_interval: Duration = Duration(60)


class MetricsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The `[metrics]` table: the /metrics, /healthz and /readyz listener."""

    enabled: bool = True
    listen: str = "127.0.0.1:9464"  # host:port; IPv6 as [::1]:9464


class WebConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The `[web]` table: `asynctaskd web`, the HTTP API for producers in any language
    (docs/api.md). TLS is left to a reverse proxy in front of it."""

    listen: str = "127.0.0.1:8080"  # host:port; IPv6 as [::1]:8080
    # Largest request body accepted, in bytes; bigger ones are refused (413) unread.
    max_body: Annotated[int, msgspec.Meta(ge=1024, le=64 * 1024 * 1024)] = 1024 * 1024
    # How long a token read from Redis is trusted: a revoke takes effect within this.
    token_cache: Duration = Duration(5)
    # Comment lines sent on an idle event stream, so that proxies do not cut it.
    keepalive: Duration = Duration(15)
    # Redis connections of the web process. Each open event stream holds one while it
    # waits for changes (up to 5 s at a time); other requests queue for a free one.
    redis_connections: Annotated[int, msgspec.Meta(ge=4, le=10000)] = 256


class LogConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The `[log]` table."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["json", "logfmt", "text"] = "json"


class HandlerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One `[[handlers]]` table: a handler key and how to build its Handler."""

    key: str  # 1-64 of [A-Za-z0-9_.:-]
    type: Literal["python", "http"] = "python"
    factory: str = ""  # python: "package.module:callable", called with options
    options: dict[str, Any] = {}
    concurrency: Annotated[int, msgspec.Meta(ge=1)] | None = None
    poll_interval: Duration | None = None  # None: retry.poll_interval
    provider: str = ""  # admission provider; empty: the handler key
    # The handler's HTTP client: a proxy for every request ("" for none; unset: the
    # HTTP_PROXY/HTTPS_PROXY/ALL_PROXY/NO_PROXY environment), and the largest response
    # body it accepts (unset: asynctaskd.transport.DEFAULT_MAX_RESPONSE_BYTES).
    proxy: str | None = None
    max_response_bytes: Annotated[int, msgspec.Meta(ge=1)] | None = None


_Rate = Annotated[float, msgspec.Meta(gt=0)]
_Count = Annotated[int, msgspec.Meta(ge=1, le=1_000_000_000)]


class LimitConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One `[[limits]]` table: whom it applies to, and its limits (docs/architecture.md, Admission).

    Whom: `provider` (all its handlers and accounts), `provider` with `account` (one vendor
    account), or `tenant` ("*": every tenant that has no entry of its own). Limits:
    vendor calls per second with a burst, in-flight caps, and a tenant's submit quota.
    """

    provider: str = ""
    account: str = ""
    tenant: str = ""
    submit_rate: _Rate | None = None  # vendor submits per second, shared by every daemon
    submit_burst: _Count | None = None  # default: the rate, rounded up
    query_rate: _Rate | None = None  # vendor status queries per second
    query_burst: _Count | None = None
    max_in_flight: _Count | None = None  # tasks in SUBMITTING..RUNNING and SUBMIT_UNKNOWN
    quota: _Count | None = None  # tenant: submits accepted per quota_period
    quota_period: Duration = Duration(86400.0)
    note: str = ""

    @property
    def scope(self) -> str:
        """'provider:<p>', 'account:<p>/<a>' or 'tenant:<t>': the key limits are stored by."""
        if self.tenant:
            return f"tenant:{self.tenant}"
        if self.account:
            return f"account:{self.provider}/{self.account}"
        return f"provider:{self.provider}"

    def problems(self) -> Iterator[tuple[str, str]]:
        """Each rule the entry breaks, as (key, message)."""
        if bool(self.tenant) == bool(self.provider):
            yield "provider", "name exactly one of provider (optionally with account) or tenant"
            return
        if self.account and not self.provider:
            yield "account", "an account belongs to a provider: name the provider too"
        for name in ("provider", "account", "tenant"):
            value = getattr(self, name)
            if (
                value
                and not HANDLER_KEY_RE.fullmatch(value)
                and not (name == "tenant" and value == "*")
            ):
                yield name, "expected 1-64 characters of A-Z a-z 0-9 _ . : - (tenant: or '*')"
        for rate in ("submit_rate", "query_rate"):
            value = getattr(self, rate)
            if value is not None and not math.isfinite(value):
                yield rate, "expected a finite number of calls per second"
        for burst, rate in (("submit_burst", "submit_rate"), ("query_burst", "query_rate")):
            if getattr(self, burst) is not None and getattr(self, rate) is None:
                yield burst, f"a burst needs {rate}"
        if self.tenant:
            for name in ("submit_rate", "query_rate"):
                if getattr(self, name) is not None:
                    yield name, "rates apply to a provider or account; tenants have quota"
        elif self.quota is not None:
            yield "quota", "quotas apply to tenants; providers and accounts have rates"
        limits = (self.submit_rate, self.query_rate, self.max_in_flight, self.quota)
        if all(v is None for v in limits):
            yield (
                "max_in_flight",
                "set at least one of submit_rate, query_rate, max_in_flight, quota",
            )


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole daemon config; every table is optional and defaults as documented."""

    redis: RedisConfig = RedisConfig()
    worker: WorkerConfig = WorkerConfig()
    retry: RetryConfig = RetryConfig()
    reaper: ReaperConfig = ReaperConfig()
    metrics: MetricsConfig = MetricsConfig()
    log: LogConfig = LogConfig()
    web: WebConfig = WebConfig()
    handlers: list[HandlerConfig] = []
    limits: list[LimitConfig] = []

    def redacted(self) -> dict[str, Any]:
        """The effective config as plain data, with URL passwords and secret options masked."""
        data: dict[str, Any] = msgspec.to_builtins(self, enc_hook=_encode_custom)
        data["redis"]["url"] = _mask_url(data["redis"]["url"])
        for handler in data["handlers"]:
            handler["options"] = _mask_secrets(handler["options"])
        return data


def parse_listen(listen: str) -> tuple[str, int]:
    """Split "host:port" (IPv6 as "[::1]:9464") into host and port; ValueError if malformed."""
    host, sep, port_text = listen.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"expected host:port with IPv6 in brackets, got {listen!r}")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"expected host:port with a port in 0..65535, got {listen!r}")
    return host, int(port_text)


def load_config(path: Path) -> Config:
    """Read and validate a TOML config file; ConfigError names the file, line and key."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    return parse_config(text, source=str(path))


def parse_config(text: str, source: str = "<string>") -> Config:
    """Decode and validate TOML text; `source` names it in ConfigError messages."""
    try:
        config = msgspec.toml.decode(text, type=Config, dec_hook=decode_hook)
    except msgspec.ValidationError as exc:
        path, message = _explain(str(exc))
        raise ConfigError(_format(source, text, [path], message)) from exc
    except msgspec.DecodeError as exc:
        raise ConfigError(_format_syntax(source, str(exc))) from exc
    problems = [_format(source, text, paths, msg) for paths, msg in _check(config, text)]
    if problems:
        raise ConfigError("\n".join(problems))
    return config


def _check(config: Config, text: str) -> Iterator[tuple[list[str], str]]:
    """Rules msgspec cannot express: each problem with the key paths that locate it."""
    if config.redis.url != "embedded" and _scheme(config.redis.url) not in _REDIS_SCHEMES:
        yield (
            ["$.redis.url"],
            "expected a redis://, rediss://, unix://, redis+sentinel://, rediss+sentinel://, "
            "redis+cluster:// or rediss+cluster:// URL, or 'embedded'",
        )
    elif config.redis.url != "embedded":
        for field, message in connection_problems(config.redis.url, config.redis.tls):
            key = f"tls_{field}" if field in ("ca", "cert", "key", "verify") else "url"
            yield [f"$.redis.{key}"], message
    else:
        for key in ("tls_ca", "tls_cert", "tls_key", "tls_verify"):
            if getattr(config.redis, key) is not None:
                yield [f"$.redis.{key}"], "the embedded server speaks plain TCP: remove tls_*"
                break
    if not _NAMESPACE.fullmatch(config.redis.namespace):
        yield ["$.redis.namespace"], "expected 1-32 characters of A-Z a-z 0-9 _ . -"
    if config.worker.lease < 1:
        yield ["$.worker.lease"], f"must be at least 1s, got {float(config.worker.lease):g}s"
    if config.worker.claim_linger > 1:
        yield (
            ["$.worker.claim_linger"],
            f"must be at most 1s, got {float(config.worker.claim_linger):g}s: it delays "
            "due work after every claim round that found little (a few ms is plenty)",
        )
    first, most = config.retry.first_error_delay, config.retry.max_error_delay
    if first > most:
        yield (
            ["$.retry.first_error_delay", "$.retry.max_error_delay"],
            f"{float(first):g}s must not exceed retry.max_error_delay ({float(most):g}s)",
        )
    # the daemons write it to each shard's settings as retention_ms (docs/protocol.md)
    retention_ms, (lo, hi) = round(float(config.reaper.retention) * 1000), SETTINGS["retention_ms"]
    if not lo <= retention_ms <= hi:
        yield (
            ["$.reaper.retention"],
            f"must be from 1ms to {hi // 86_400_000}d (10 years), "
            f"got {float(config.reaper.retention):g}s",
        )
    try:
        parse_listen(config.metrics.listen)
    except ValueError as exc:
        yield ["$.metrics.listen"], str(exc)
    try:
        parse_listen(config.web.listen)
    except ValueError as exc:
        yield ["$.web.listen"], str(exc)
    if not 0 < config.web.token_cache <= 300:
        yield ["$.web.token_cache"], "must be more than 0s and at most 5m"
    if not 1 <= config.web.keepalive <= 300:
        yield ["$.web.keepalive"], "must be from 1s to 5m"
    first_seen: dict[str, int] = {}
    for i, handler in enumerate(config.handlers):
        at = f"$.handlers[{i}]"
        if not HANDLER_KEY_RE.fullmatch(handler.key):
            yield [f"{at}.key"], "expected 1-64 characters of A-Z a-z 0-9 _ . : -"
        elif handler.key in first_seen:
            other = first_seen[handler.key]
            where = line_of(text, f"$.handlers[{other}].key")
            also = f"line {where}" if where is not None else f"handlers[{other}]"
            yield [f"{at}.key"], f"duplicate handler key {handler.key!r} (also at {also})"
        else:
            first_seen[handler.key] = i
        if handler.provider and not HANDLER_KEY_RE.fullmatch(handler.provider):
            yield [f"{at}.provider"], "expected 1-64 characters of A-Z a-z 0-9 _ . : -"
        if handler.type == "python":
            if not handler.factory:
                yield [f"{at}.factory", at], "required for python handlers"
            elif not _FACTORY.fullmatch(handler.factory):
                yield (
                    [f"{at}.factory"],
                    f"expected 'package.module:callable', got {handler.factory!r}",
                )
        else:
            if handler.factory:
                yield [f"{at}.factory"], "only python handlers take a factory"
            if not handler.options:
                yield [f"{at}.options", at], "http handlers need an options table"
    scopes: dict[str, int] = {}
    for i, limit in enumerate(config.limits):
        at = f"$.limits[{i}]"
        for name, message in limit.problems():
            yield [f"{at}.{name}", at], message
        if limit.scope in scopes:
            yield [at], f"a second entry for {limit.scope} (also limits[{scopes[limit.scope]}])"
        scopes.setdefault(limit.scope, i)


def _scheme(url: str) -> str:
    try:
        return urlsplit(url).scheme
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return ""


# ---- error messages: msgspec path -> key and line ----

_UNKNOWN: Final = re.compile(r"Object contains unknown field `([^`]*)`")
_MISSING: Final = re.compile(r"Object missing required field `([^`]*)`")
_AT: Final = re.compile(r"(.*?)(?: - at `(\$[^`]*)`)?", re.DOTALL)
_SEGMENT: Final = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_TOML_TYPES: Final = {"object": "table", "str": "string", "int": "integer", "bool": "boolean"}


def _explain(error: str) -> tuple[str, str]:
    """Turn a msgspec ValidationError message into (path of the offending key, message)."""
    m = _AT.fullmatch(error)
    assert m is not None  # the pattern matches any string
    message, path = m[1], m[2] or "$"
    if unknown := _UNKNOWN.fullmatch(message):
        name = unknown[1]
        close = difflib.get_close_matches(name, _field_names(_segments(path)), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"{path}.{name}", f"unknown key{hint}"
    if missing := _MISSING.fullmatch(message):
        return f"{path}.{missing[1]}", "missing required key"
    if message.startswith("Invalid enum value"):
        choices = _literal_choices(_segments(path))
        if choices:
            message += f"; expected one of {', '.join(map(repr, choices))}"
    message = re.sub(r"`([^`]*)`", lambda t: _TOML_TYPES.get(t[1], t[1]), message)
    return path, message[:1].lower() + message[1:]


def _format(source: str, text: str, paths: list[str], message: str) -> str:
    line = _locate(text, paths)
    where = source if line is None else f"{source}:{line}"
    key = _display(paths[0])
    return f"{where}: {key}: {message}" if key else f"{where}: {message}"


def _format_syntax(source: str, error: str) -> str:
    m = re.fullmatch(r"(.*) \(at line (\d+), column (\d+)\)", error, re.DOTALL)
    if m is None:
        return f"{source}: invalid TOML: {error}"
    return f"{source}:{m[2]}:{m[3]}: invalid TOML: {m[1]}"


def _display(path: str) -> str:
    return path.removeprefix("$").removeprefix(".")


def _segments(path: str) -> _KeyPath:
    """("handlers", 1, "factory") for "$.handlers[1].factory" or "handlers[1].factory"."""
    path = path.removeprefix("$")
    if path and path[0] not in ".[":
        path = f".{path}"
    return tuple(int(index) if index else name for name, index in _SEGMENT.findall(path))


def _struct_at(segments: _KeyPath) -> type[msgspec.Struct] | None:
    struct: type[msgspec.Struct] = Config
    for segment in segments:
        if isinstance(segment, int):
            continue  # list indices: the element type was taken at the list field
        field = next((f for f in msgspec.structs.fields(struct) if f.name == segment), None)
        if field is None:
            return None
        field_type = field.type
        if get_origin(field_type) is list:
            field_type = get_args(field_type)[0]
        if not (isinstance(field_type, type) and issubclass(field_type, msgspec.Struct)):
            return None
        struct = field_type
    return struct


def _field_names(segments: _KeyPath) -> list[str]:
    struct = _struct_at(segments)
    return [] if struct is None else [f.name for f in msgspec.structs.fields(struct)]


def _literal_choices(segments: _KeyPath) -> tuple[object, ...]:
    struct = _struct_at(segments[:-1])
    if struct is None:
        return ()
    for field in msgspec.structs.fields(struct):
        if field.name != segments[-1]:
            continue
        if get_origin(field.type) is Literal:
            return get_args(field.type)
        for member in get_args(field.type):  # Literal[...] | None
            if get_origin(member) is Literal:
                return get_args(member)
    return ()


# ---- line_of: where a key path is set in TOML text ----

_KEY_PART: Final = r"""(?:[A-Za-z0-9_\-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_DOTTED_KEY: Final = rf"{_KEY_PART}(?:\s*\.\s*{_KEY_PART})*"
_ARRAY_HEADER: Final = re.compile(rf"\s*\[\[\s*({_DOTTED_KEY})\s*\]\]")
_TABLE_HEADER: Final = re.compile(rf"\s*\[\s*({_DOTTED_KEY})\s*\]")
_KEY_LINE: Final = re.compile(rf"\s*({_DOTTED_KEY})\s*=")
_KEY_PART_RE: Final = re.compile(_KEY_PART)


def line_of(text: str, path: str) -> int | None:
    """The 1-based line of `text` where a key path like `$.handlers[1].factory` is set.

    Tables count from their header (`[worker]`, the second `[[handlers]]`), keys from
    `key =` (dotted keys and `[a.b]` headers included). None when the path is not in text.
    """
    return _key_lines(text).get(_segments(path))


def _locate(text: str, paths: list[str]) -> int | None:
    """The line of the first path found in text, else of the nearest enclosing table."""
    lines = _key_lines(text)
    for path in paths:
        if (line := lines.get(_segments(path))) is not None:
            return line
    for path in paths:
        segments = _segments(path)
        while segments:
            segments = segments[:-1]
            if (line := lines.get(segments)) is not None:
                return line
    return None


def _key_lines(text: str) -> dict[_KeyPath, int]:
    lines: dict[_KeyPath, int] = {}
    table: _KeyPath = ()
    last_index: dict[_KeyPath, int] = {}  # array-of-tables path -> last index
    depth, delimiter = 0, ""
    for number, line in enumerate(text.split("\n"), start=1):
        if depth or delimiter:  # inside a multi-line array, inline table or string
            depth, delimiter = _skip_value(line, depth, delimiter)
            continue
        if m := _ARRAY_HEADER.match(line):
            path = _resolve(_split_key(m[1]), last_index)
            index = last_index[path] = last_index.get(path, -1) + 1
            lines.setdefault(path, number)
            table = (*path, index)
            lines.setdefault(table, number)
        elif m := _TABLE_HEADER.match(line):
            table = _resolve(_split_key(m[1]), last_index)
            lines.setdefault(table, number)
        elif m := _KEY_LINE.match(line):
            keys = _split_key(m[1])
            for n in range(1, len(keys) + 1):
                lines.setdefault((*table, *keys[:n]), number)
            depth, delimiter = _skip_value(line[m.end() :], 0, "")
    return lines


def _split_key(dotted: str) -> list[str]:
    parts = [m[0] for m in _KEY_PART_RE.finditer(dotted)]
    return [p[1:-1] if p[0] in "\"'" else p for p in parts]


def _resolve(keys: list[str], last_index: dict[_KeyPath, int]) -> _KeyPath:
    """A header's path, with the current index after each array-of-tables prefix."""
    path: _KeyPath = ()
    for key in keys[:-1]:
        path = (*path, key)
        if path in last_index:
            path = (*path, last_index[path])
    return (*path, keys[-1])


def _skip_value(text: str, depth: int, delimiter: str) -> tuple[int, str]:
    """Scan part of a value: return the bracket depth and open multi-line string, if any."""
    i, n = 0, len(text)
    while i < n:
        if delimiter:
            if delimiter == '"""' and text[i] == "\\":
                i += 2
            elif text.startswith(delimiter, i):
                i, delimiter = i + 3, ""
            else:
                i += 1
            continue
        c = text[i]
        if c == "#":
            break
        if text.startswith('"""', i) or text.startswith("'''", i):
            i, delimiter = i + 3, text[i : i + 3]
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
        elif c == "'":
            end = text.find("'", i + 1)
            i = n if end < 0 else end + 1
        else:
            depth += (c in "[{") - (c in "]}")
            i += 1
    return max(depth, 0), delimiter


# ---- redaction for check-config ----


def _mask_url(url: str) -> str:
    """Mask the password and secret-looking query parameters in a URL.

    Sentinel URLs (`redis+sentinel://user:pw@host1:26379,host2:26379/service`) have one
    user info for all their hosts, masked like any other; a URL too malformed to split
    still loses whatever sits between `user:` and `@`.
    """
    try:
        parts = urlsplit(url)
        has_password = parts.password is not None
    except ValueError:
        return _USERINFO_PASSWORD.sub(rf"\g<1>{_MASK}@", url)
    if has_password:
        userinfo, _, host = parts.netloc.rpartition("@")
        parts = parts._replace(netloc=f"{userinfo.partition(':')[0]}:{_MASK}@{host}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(_SECRET_NAME.search(name) for name, _ in query):
        masked = [(n, _MASK if _SECRET_NAME.search(n) else v) for n, v in query]
        parts = parts._replace(query=urlencode(masked, safe="*"))
    return urlunsplit(parts)


def _mask_secrets(value: Any) -> Any:
    """Options with secret-looking keys masked, recursively; URLs lose their passwords."""
    if isinstance(value, dict):
        return {k: _MASK if _SECRET_NAME.search(k) else _mask_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask_secrets(v) for v in value]
    if isinstance(value, str) and "://" in value:
        return _mask_url(value)
    return value
