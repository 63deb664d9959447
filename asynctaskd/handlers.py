"""The Handler protocol, its outcome types, the call context, and the handler registry."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import httpx
import msgspec

from .config import HandlerConfig
from .errors import ConfigError
from .transport import Fetcher, fetcher_for

__all__ = [
    "Failed",
    "Handler",
    "HandlerContext",
    "HandlerEntry",
    "Running",
    "Submitted",
    "Succeeded",
    "load_handlers",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "asynctaskd.handlers"


class Submitted(msgspec.Struct, frozen=True):
    """The vendor accepted the job: its id, and anything else the queries need."""

    external_id: str
    query: dict[str, Any] = {}


class Running(msgspec.Struct, frozen=True, kw_only=True):
    """The vendor job is still going. All fields optional.

    `handle` replaces the stored query handle (vendors that rotate cursors);
    `next_poll` (seconds) asks for the next query sooner or later than configured: kept
    exact, but never past the task's deadline nor beyond the poll interval or
    `retry.max_error_delay`, whichever is longer.
    """

    progress: float | None = None
    stage: str | None = None
    message: str | None = None
    handle: dict[str, Any] | None = None
    next_poll: float | None = None


class Succeeded(msgspec.Struct, frozen=True):
    """The vendor job finished; `result` is JSON-like data stored with the task."""

    result: Any = None


class Failed(msgspec.Struct, frozen=True):
    """The vendor job failed for good. `result`, if not None, is what the job produced
    before it failed (a batch's partial output, billed all the same): stored as the task's
    result beside the error."""

    code: str
    message: str = ""
    result: Any = None


class HandlerContext(msgspec.Struct, kw_only=True):
    """What a handler call knows about its task, plus shared tools.

    `idempotency_key` is stable across resubmits of the same task: send it to vendors
    that deduplicate (and declare `idempotent_submit = True`).

    `http` is a stock `httpx.AsyncClient` (with the handler's proxy and response-size
    settings); `fetch` is the fast way to make a plain call through it (see
    `asynctaskd.transport.Fetcher`): ``reply = await ctx.fetch("GET", url)``.
    """

    task_id: str
    idempotency_key: str
    handler: str
    tenant: str
    account: str
    provider: str
    submit_attempt: int
    poll_count: int
    deadline_at: float
    cancel_requested: bool
    http: httpx.AsyncClient
    logger: logging.LoggerAdapter[logging.Logger]
    metadata: Any = None

    @property
    def fetch(self) -> Fetcher:
        """`await ctx.fetch(method, url, headers=..., json=... or content=...)` -> `Reply`:
        one request through `http`'s connections without httpx's per-request objects."""
        return fetcher_for(self.http)


@runtime_checkable
class Handler(Protocol):
    """A vendor integration: submit once, query many times.

    Optional methods, looked up with getattr: `async def cancel(self, handle, ctx)`
    (best-effort remote cancel) and `async def finalize(self, result, ctx) -> result`
    (e.g. copy files behind temporary result URLs before the task succeeds).
    """

    key: str
    idempotent_submit: bool

    async def submit(self, params: Any, ctx: HandlerContext) -> Submitted: ...

    async def query(
        self, handle: dict[str, Any], ctx: HandlerContext
    ) -> Running | Succeeded | Failed: ...


class HandlerEntry(msgspec.Struct, frozen=True, kw_only=True):
    """A registered handler and the settings the worker applies to it."""

    key: str
    handler: Any  # a Handler; Any because Protocols are not msgspec types
    provider: str
    concurrency: int | None = None
    poll_interval: float | None = None

    @property
    def idempotent(self) -> bool:
        return bool(getattr(self.handler, "idempotent_submit", False))

    def hook(self, name: str) -> Callable[..., Awaitable[Any]] | None:
        fn = getattr(self.handler, name, None)
        return fn if callable(fn) else None


def _import_factory(spec: str, where: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{where}: cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{where}: {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(f"{where}: {spec!r} is not callable")
    return obj  # type: ignore[no-any-return]  # checked callable just above


def check_handler(obj: Any, key: str, where: str) -> None:
    """Raise ConfigError unless `obj` looks like a Handler for `key`."""
    missing = [n for n in ("submit", "query") if not callable(getattr(obj, n, None))]
    if missing:
        raise ConfigError(f"{where}: the handler has no {' or '.join(missing)}() method")
    obj_key = getattr(obj, "key", key)
    if obj_key != key:
        raise ConfigError(f"{where}: the handler says its key is {obj_key!r}, config says {key!r}")
    if not isinstance(getattr(obj, "idempotent_submit", False), bool):
        raise ConfigError(f"{where}: idempotent_submit must be True or False")


def load_handlers(
    configs: list[HandlerConfig],
    *,
    entry_points: bool = True,
    builders: Mapping[str, Callable[[HandlerConfig], Any]] | None = None,
) -> dict[str, HandlerEntry]:
    """Build every handler: config entries first, then the entry-point group.

    `builders` maps a handler `type` other than "python" (e.g. "http") to a function
    that builds the handler from its config entry.
    """
    out: dict[str, HandlerEntry] = {}
    for i, hc in enumerate(configs):
        where = f"handlers[{i}] ({hc.key})"
        if hc.type == "python":
            factory = _import_factory(hc.factory, where)
            try:
                handler = factory(dict(hc.options))
            except Exception as exc:
                raise ConfigError(f"{where}: factory {hc.factory} failed: {exc}") from exc
        else:
            build = (builders or {}).get(hc.type)
            if build is None:
                raise ConfigError(f"{where}: handler type {hc.type!r} is not available")
            handler = build(hc)
        if getattr(handler, "key", None) is None:
            with contextlib.suppress(AttributeError):  # a read-only key is checked below
                handler.key = hc.key
        check_handler(handler, hc.key, where)
        poll = float(hc.poll_interval) if hc.poll_interval is not None else None
        out[hc.key] = HandlerEntry(
            key=hc.key,
            handler=handler,
            provider=hc.provider or hc.key,
            concurrency=hc.concurrency,
            poll_interval=poll,
        )
    if entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in out:
                continue  # config wins over an installed plugin
            where = f"entry point {ep.name} ({ep.value})"
            try:
                handler = ep.load()({})
            except Exception as exc:
                raise ConfigError(f"{where}: failed to load: {exc}") from exc
            check_handler(handler, ep.name, where)
            out[ep.name] = HandlerEntry(key=ep.name, handler=handler, provider=ep.name)
    return out


def valid_progress(value: Any) -> float | None:
    """A progress value the store accepts: a finite number clamped into 0..1."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value):
        return None
    return min(1.0, max(0.0, float(value)))
