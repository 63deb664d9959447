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
    "Resubmit",
    "Running",
    "Submitted",
    "Succeeded",
    "load_handlers",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "asynctaskd.handlers"
DEFAULT_FIND_MAX_TRIES = 20  # lookups of one parked task before an operator decides
DEFAULT_FIND_GIVE_UP_AFTER = 86400.0  # seconds after the start mark, likewise
_MAX_FIND_SECONDS = 316224000.0  # 10 years: what the scripts take as a time in ms


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


class Resubmit(msgspec.Struct, frozen=True, kw_only=True):
    """The vendor job ended having done nothing, and submitting it again later is the fix
    (an OpenAI batch failed with token_limit_exceeded: the queue was full, nothing ran).

    The task goes back to PENDING_SUBMIT, its handle dropped, and is submitted again after
    `after` seconds (or the error backoff), bounded like `next_poll`. Each submit counts
    against `retry.max_submit_retries`; past it the task fails with `code`. Return it only
    for a job that provably did nothing: the new submit creates another job (so not for a
    vendor that dedups on `ctx.idempotency_key`, which stays the same: it would answer
    with the job that ended)."""

    code: str
    message: str = ""
    after: float | None = None


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
    (best-effort remote cancel), `async def finalize(self, result, ctx) -> result`
    (e.g. copy files behind temporary result URLs before the task succeeds), and
    `async def find(self, params, ctx) -> Submitted | None`: the vendor job created for
    this task (found by `ctx.idempotency_key`, `ctx.task_id`, or a client reference the
    submit sent), or None when the vendor has none. A task whose submit may or may not
    have reached the vendor (SUBMIT_UNKNOWN) is then settled by asking: a job found is
    tracked, and "none" from a lookup made at least `find_visible_after` seconds after
    the submit started puts the task back for a normal submit. A handler with `find`
    declares `find_visible_after` (seconds, counted from the start mark, which precedes
    the vendor call: include the longest a submit call can take, its timeout, besides
    the vendor's listing lag); optionally `find_max_tries` (default 20) and
    `find_give_up_after` (seconds from the start mark, default a day), after which the
    task is left to an operator. Errors from `find` are classified like query errors
    (`PermanentError` gives up at once).
    """

    key: str
    idempotent_submit: bool

    async def submit(self, params: Any, ctx: HandlerContext) -> Submitted: ...

    async def query(
        self, handle: dict[str, Any], ctx: HandlerContext
    ) -> Running | Succeeded | Failed | Resubmit: ...


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

    @property
    def finds(self) -> bool:
        """The handler can look its vendor job up (`find`)."""
        return self.hook("find") is not None

    @property
    def find_visible_ms(self) -> int | None:
        """What the start mark records for a handler with `find` (None without)."""
        if not self.finds:
            return None
        return round(float(self.handler.find_visible_after) * 1000)

    @property
    def find_max_tries(self) -> int:
        return int(getattr(self.handler, "find_max_tries", DEFAULT_FIND_MAX_TRIES))

    @property
    def find_give_up_ms(self) -> int:
        seconds = getattr(self.handler, "find_give_up_after", DEFAULT_FIND_GIVE_UP_AFTER)
        return round(float(seconds) * 1000)

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
    if callable(getattr(obj, "find", None)):
        _check_find_settings(obj, where)


def _check_find_settings(obj: Any, where: str) -> None:
    """A handler with find() declares find_visible_after, and may set the give-up bounds."""
    for name, default, high in (
        ("find_visible_after", None, _MAX_FIND_SECONDS),
        ("find_give_up_after", DEFAULT_FIND_GIVE_UP_AFTER, _MAX_FIND_SECONDS),
        ("find_max_tries", DEFAULT_FIND_MAX_TRIES, 10000),
    ):
        value = getattr(obj, name, default)
        whole = name == "find_max_tries"
        ok = (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and (1 if whole else 0) <= value <= high
            and (not whole or isinstance(value, int))
        )
        if not ok:
            kind = "an integer from 1" if whole else "seconds from 0"
            raise ConfigError(
                f"{where}: a handler with find() needs {name} ({kind} to {high:g}), got {value!r}"
            )


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
