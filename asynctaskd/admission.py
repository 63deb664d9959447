"""Admission limits in Redis: how `[[limits]]` entries are stored, copied to the shards,
and how the worker takes tokens (SPEC section 7; the scripts are limits, sync_limits, take,
and the admission part of the prelude).

Where things live:

- `<ns>:{adm}:limits` (scope -> JSON) is the source of truth: written by `limits`, from a
  config file at daemon start and SIGHUP, or at runtime by the client and CLI (a runtime
  entry wins over the config file until it is cleared). `<ns>:{adm}:rates` is the token
  bucket table derived from it, `<ns>:{adm}:version` moves with every change.
- Each shard has its own copy of what its scripts need, `<ns>:{sN}:admission`, written by
  `sync_limits` with the version it reflects; every daemon checks the version each second
  and syncs a shard that is behind. In-flight caps are split between shards (each shard
  holds its share; the shares add up to the cap, except that each shard gets at least 1,
  so a cap below the number of shards is raised to it; see `cap_share`).
- Token buckets live in the `{adm}` slot, tasks in their shard's: a worker takes tokens for
  the lanes its last claim reported waiting, claims with them, and refunds what the claim
  did not use. A crash in between loses at most one batch of tokens for one refill time.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import anyio
import msgspec

from .config import HandlerConfig, LimitConfig, decode_hook
from .errors import InvalidTask, ScriptError, StoreUnavailable
from .keys import HANDLER_KEY_RE, Keys
from .plans import Reads, SimplePlan, read
from .store import Ops, Store, read_many

if TYPE_CHECKING:
    from .client import AsyncClient
    from .metrics import Metrics

logger = logging.getLogger(__name__)

__all__ = [
    "LIMIT_FIELDS",
    "Entry",
    "Stored",
    "cap_share",
    "check_scope",
    "config_entries",
    "decode_stored",
    "encode_limit",
    "handler_entries",
    "limit_from_options",
    "limit_from_stored",
    "observe",
    "read_limits",
    "run_sync",
    "shard_table",
    "sync",
    "write",
]

SYNC_BATCH: Final = 1000  # held tasks moved back per sync_limits call
LIMIT_FIELDS: Final = (
    "submit_rate",
    "submit_burst",
    "query_rate",
    "query_burst",
    "max_in_flight",
    "quota",
    "quota_period",
)


class Stored(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One entry of `<ns>:{adm}:limits`, as JSON (protocol v1, docs/protocol.md)."""

    source: str  # "config", "runtime", or "handler" (a handler's provider, no limits)
    buckets: dict[str, str]  # token buckets: name -> "<tokens per second> <burst>"
    limit: dict[str, Any] = {}  # the LimitConfig fields that are set
    provider: str = ""  # handler entries: the provider the handler's tasks count against


def _burst(rate: float, burst: int | None) -> int:
    return burst if burst is not None else max(1, math.ceil(rate))


def encode_limit(limit: LimitConfig, source: str) -> bytes:
    """The stored JSON of a limit: its fields, and the token buckets it defines."""
    buckets: dict[str, str] = {}
    key = limit.scope
    if limit.submit_rate is not None:
        buckets[f"submit:{key}"] = _spec(
            limit.submit_rate, _burst(limit.submit_rate, limit.submit_burst)
        )
    if limit.query_rate is not None:
        buckets[f"query:{key}"] = _spec(
            limit.query_rate, _burst(limit.query_rate, limit.query_burst)
        )
    if limit.quota is not None:
        buckets[f"quota:{key}"] = _spec(limit.quota / float(limit.quota_period), limit.quota)
    fields = {
        name: float(value) if name == "quota_period" else value
        for name in (*LIMIT_FIELDS, "note")
        if (value := getattr(limit, name)) not in (None, "")
    }
    if limit.quota is None:
        fields.pop("quota_period", None)
    return msgspec.json.encode(Stored(source=source, buckets=buckets, limit=fields))


def _spec(rate: float, burst: int) -> str:
    return f"{rate:.9g} {burst}"


def handler_entries(handlers: Iterable[HandlerConfig]) -> list[tuple[str, bytes]]:
    """Scope 'handler:<key>' entries naming the provider of handlers that have one."""
    return [
        (
            f"handler:{h.key}",
            msgspec.json.encode(Stored(source="handler", buckets={}, provider=h.provider)),
        )
        for h in handlers
        if h.provider and h.provider != h.key
    ]


def decode_stored(scope: str, raw: bytes | str) -> Stored:
    """Read one stored entry back; a clear error when it is not what we wrote."""
    try:
        return msgspec.json.decode(raw, type=Stored)
    except msgspec.DecodeError as exc:
        raise ValueError(f"stored limit {scope!r} is unreadable: {exc}") from None


class Entry(msgspec.Struct, frozen=True):
    """A stored limit as the client and CLI show it."""

    scope: str
    source: str  # "config" (a config file) or "runtime" (client or CLI)
    limit: LimitConfig


SCOPE_RE: Final = re.compile(r"(provider|tenant):(?P<name>.+)|account:(?P<p>[^/]+)/(?P<a>.+)")


def check_scope(scope: object) -> str:
    """A scope as stored ('provider:<p>', 'account:<p>/<a>', 'tenant:<t>', 'tenant:*')."""
    if isinstance(scope, str) and SCOPE_RE.fullmatch(scope):
        kind, _, name = scope.partition(":")
        names = name.split("/") if kind == "account" else [name]
        if all(HANDLER_KEY_RE.fullmatch(n) or (kind == "tenant" and n == "*") for n in names):
            return scope
    raise InvalidTask(
        f"a limit scope looks like provider:<p>, account:<p>/<a>, tenant:<t> or tenant:*, "
        f"got {scope!r:.80}"
    )


def limit_from_stored(scope: str, stored: Stored) -> LimitConfig:
    kind, _, name = scope.partition(":")
    who: dict[str, str] = {}
    if kind == "tenant":
        who["tenant"] = name
    elif kind == "account":
        who["provider"], _, who["account"] = name.partition("/")
    else:
        who["provider"] = name
    return msgspec.convert({**who, **stored.limit}, LimitConfig, dec_hook=decode_hook)


def limit_from_options(**options: Any) -> LimitConfig:
    """Build a LimitConfig from keyword options (client/CLI); InvalidTask if it is wrong."""
    try:
        limit = msgspec.convert(
            {k: v for k, v in options.items() if v is not None},
            LimitConfig,
            dec_hook=decode_hook,
        )
    except (msgspec.ValidationError, ValueError) as exc:
        message, _, where = str(exc).partition(" - at `$.")
        where = where.rstrip("`")
        raise InvalidTask(f"invalid limit: {where + ': ' if where else ''}{message}") from None
    problems = [f"{name}: {message}" for name, message in limit.problems()]
    if problems:
        raise InvalidTask("invalid limit: " + "; ".join(problems))
    return limit


def cap_share(cap: int, shard: int, shards: int) -> int:
    """This shard's part of an in-flight cap: the parts add up to the cap (at least 1 each)."""
    return max(1, cap // shards + (1 if shard < cap % shards else 0))


def shard_table(stored: Mapping[str, Stored], shard: int, shards: int) -> dict[str, str]:
    """What `sync_limits` writes into one shard's admission hash."""
    table: dict[str, str] = {}
    for scope, entry in stored.items():
        if scope.startswith("handler:"):
            if entry.provider:
                table[f"provider:{scope[len('handler:') :]}"] = entry.provider
            continue
        cap = entry.limit.get("max_in_flight")
        if isinstance(cap, int) and cap > 0:
            table[f"cap:{scope}"] = str(cap_share(cap, shard, shards))
        for phase in ("submit", "query"):
            if f"{phase}:{scope}" in entry.buckets:
                table[f"rate:{phase}:{scope}"] = "1"
    return table


def limits_entries(stored_raw: Mapping[Any, Any]) -> dict[str, Stored]:
    """Decode an HGETALL of <ns>:{adm}:limits; entries that cannot be read are skipped
    with a log line (one bad entry must not switch every limit off)."""
    out: dict[str, Stored] = {}
    for scope_b, raw in stored_raw.items():
        scope = scope_b.decode() if isinstance(scope_b, bytes) else str(scope_b)
        try:
            out[scope] = decode_stored(scope, raw)
        except ValueError as exc:
            logger.error("%s; ignoring it until it is set again", exc)
    return out


def read_limits(keys: Keys) -> SimplePlan[tuple[int, dict[str, Stored]]]:
    """The stored limits and their version, in one round trip."""
    prefix = keys.admission()
    version, raw = yield Reads(read("get", prefix + "version"), read("hgetall", prefix + "limits"))
    return int(version or 0), limits_entries(raw)


def write(
    ops: Ops, mode: str, entries: Sequence[tuple[str, bytes | str]]
) -> SimplePlan[tuple[int, int, list[str]]]:
    """Write limit entries (the limits script), then bring every shard up to date.
    Returns the new version, how many scopes changed, and the scopes a runtime entry
    kept (mode 'config')."""
    result = yield ops.limits(mode, entries)
    yield from sync(ops, force=True)
    return result  # type: ignore[no-any-return]


def config_entries(
    limits: Sequence[LimitConfig], handlers: Iterable[HandlerConfig]
) -> list[tuple[str, bytes | str]]:
    """What a config file's [[limits]] and [[handlers]] write (mode 'config')."""
    entries: list[tuple[str, bytes | str]] = [
        (limit.scope, encode_limit(limit, "config")) for limit in limits
    ]
    return entries + list(handler_entries(handlers))


def sync(ops: Ops, *, force: bool = False) -> SimplePlan[int]:
    """Bring every shard's admission table to the stored version; with `force`, also look
    at every shard's holds (the periodic lift). Returns how many held tasks moved."""
    keys = ops.keys
    shards = range(keys.shards)
    replies = yield Reads(
        read("get", keys.admission() + "version"),
        *(read("get", keys.tag(shard) + ":admission_version") for shard in shards),
    )
    version = int(replies[0] or 0)
    behind = [s for s in shards if int(replies[1 + s] or -1) < version]
    if not behind and not force:
        return 0
    _, stored = yield from read_limits(keys)
    moved = 0
    for shard in shards if force else behind:
        table = shard_table(stored, shard, keys.shards)
        for _ in range(100):  # each call moves at most SYNC_BATCH; bounded in all
            _, n, remaining = yield ops.sync_limits(shard, version, table, SYNC_BATCH)
            moved += n
            if remaining == 0 or n == 0:
                break
    return moved


QUOTA_SCAN: Final = 1000  # quota window registry entries looked at per pass


async def expire_quota_windows(store: Store, cursor: int = 0) -> tuple[int, int]:
    """Delete the counters of tenant quota windows that have ended (lua/quota.lua keeps a
    registry of them): producers may only add to them. One SSCAN page per call; returns
    (the next cursor, how many were deleted)."""
    prefix = store.keys.admission()
    registry = prefix + "quota_windows"
    now, (cursor, members) = await read_many(
        store, [read("time"), read("sscan", registry, cursor, count=QUOTA_SCAN)]
    )
    now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
    ended = []
    for raw in members:
        member = _text(raw)
        period, _, rest = member.partition(":")
        _, _, window = rest.rpartition(":")
        try:
            end_ms = (int(window) + 2) * int(period)  # still the previous window until then
        except ValueError:
            end_ms = 0  # not a name lua/quota.lua writes: drop it from the registry
        if end_ms <= now_ms:
            ended.append(member)
    if ended:
        await read_many(
            store,
            [read("delete", *(prefix + "quota:" + m for m in ended)), read("srem", registry, *ended)],
        )
    return int(cursor), len(ended)


async def run_sync(client: AsyncClient, store: Store, metrics: Metrics) -> None:
    """Daemon loop: follow limit changes within a second; every 5 s also lift holds that
    no longer apply, refresh the admission gauges and delete ended quota windows."""
    passes = 0
    quota_cursor = 0
    while True:
        try:
            await client.sync_limits(force=passes % 5 == 0)
            if passes % 5 == 0:
                await observe(store, metrics)
                quota_cursor, _ = await expire_quota_windows(store, quota_cursor)
        except (StoreUnavailable, ScriptError) as exc:
            metrics.store_errors.labels("admission").inc()
            logger.warning("admission sync failed: %s", exc)
        except Exception:  # a background loop must never end the daemon
            metrics.store_errors.labels("admission").inc()
            logger.exception("admission sync failed unexpectedly; trying again in a second")
        passes += 1
        await anyio.sleep(1.0)


def _scope_label(scope: str) -> str:
    return "tenant" if scope.startswith("tenant:") else scope


async def observe(store: Store, metrics: Metrics) -> None:
    """Admission gauges: tasks waiting by what holds them, caps in use and configured."""
    waiting: dict[tuple[str, str], int] = {}
    in_use: dict[str, int] = {}
    prefix = store.keys.admission()
    (raw,) = await read_many(store, [read("hgetall", prefix + "limits")])
    stored = limits_entries(raw)
    caps = {
        scope: int(entry.limit["max_in_flight"])
        for scope, entry in stored.items()
        if isinstance(entry.limit.get("max_in_flight"), int)
    }
    for shard in range(store.keys.shards):
        tag = store.keys.tag(shard) + ":"
        lanes, capholds, paused = await read_many(
            store,
            [
                read("smembers", tag + "lanes"),
                read("srandmember", tag + "capholds", 1000),
                read("hkeys", tag + "paused"),
            ],
        )
        dims = [("rate", "rate:" + _text(x)) for x in lanes]
        dims += [("cap", _text(x)) for x in capholds]
        dims += [("pause", _text(x)) for x in paused]
        explicit = [s for s in caps if not s.endswith(":*")]
        counts = await read_many(
            store,
            [read("zcard", tag + "held:" + dim) for _, dim in dims]
            + [read("scard", tag + "inflight:" + scope) for scope in explicit],
        )
        for (kind, dim), n in zip(dims, counts, strict=False):
            scope = dim.split(":", 1)[1] if kind != "pause" else dim
            key = (kind, _scope_label(scope))
            waiting[key] = waiting.get(key, 0) + int(n)
        for scope, n in zip(explicit, counts[len(dims) :], strict=True):
            in_use[_scope_label(scope)] = in_use.get(_scope_label(scope), 0) + int(n)
    metrics.admission_waiting.clear()
    for (kind, scope), n in waiting.items():
        metrics.admission_waiting.labels(kind, scope).set(n)
    metrics.in_flight_capped.clear()
    for scope, n in in_use.items():
        metrics.in_flight_capped.labels(scope).set(n)
    metrics.cap_limit.clear()
    for scope, cap in caps.items():
        metrics.cap_limit.labels(scope).set(cap)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
