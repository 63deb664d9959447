"""The config's tables as frozen msgspec Structs, one per table (`[redis]`, `[worker]`,
`[retry]`, `[reaper]`, `[metrics]`, `[telemetry]`, `[log]`, `[web]`, `[[handlers]]`,
`[[limits]]`), and `Config`, the whole file."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import msgspec

from asynctaskd.connection import TlsOptions
from asynctaskd.keys import HANDLER_KEY_RE

from .durations import Delay, Duration, _encode_custom
from .redaction import _mask_secrets, _mask_url

__all__ = [
    "Config",
    "HandlerConfig",
    "LimitConfig",
    "LogConfig",
    "MetricsConfig",
    "ReaperConfig",
    "RedisConfig",
    "RetryConfig",
    "TelemetryConfig",
    "WebConfig",
    "WorkerConfig",
]


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


class TelemetryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The `[telemetry]` table: traces (docs/tracing.md)."""

    # A span around every vendor call, a child of the trace context its task was
    # submitted with; needs `asynctaskd[otel]` and a TracerProvider. Off, nothing of
    # OpenTelemetry is imported, even where it is installed.
    otel: bool = False


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
    # Redis connections of the web process; requests queue for a free one. The open
    # event streams share one per shard (web.feed), plus at most 16 for their snapshots.
    redis_connections: Annotated[int, msgspec.Meta(ge=4, le=10000)] = 256
    # /metrics (asynctaskd_web_*), /healthz and /readyz on a listener of their own, as the
    # daemon's [metrics] listen; "" serves none. Not on `listen`: no token to scrape it.
    metrics_listen: str = ""


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
    telemetry: TelemetryConfig = TelemetryConfig()
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
