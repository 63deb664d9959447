"""Admission limits in Redis: how `[[limits]]` entries are stored, copied to the shards,
and how the worker takes tokens (docs/architecture.md, Admission; the scripts are limits,
sync_limits, take, and the admission part of lua/_schedule.lua).

Where things live:

- `<ns>:{adm}:limits` (scope -> JSON) is the source of truth: written by `limits`, from a
  config file at daemon start and SIGHUP, or at runtime by the client and CLI (a runtime
  entry wins over the config file until it is cleared). `<ns>:{adm}:rates` is the token
  bucket table derived from it, `<ns>:{adm}:version` moves with every change.
- Each shard has its own copy of what its scripts need, `<ns>:{sN}:admission`, with the
  version it reflects; every daemon checks the version each second and syncs a shard that
  is behind. A sync builds the new copy beside the old one in bounded chunks
  (`stage_limits`, under a lease so one daemon builds a shard at a time) and swaps it in
  whole (`sync_limits`), so a claim never finds a shard without its limits, whatever
  their number; a build that cannot finish leaves the old copy in place, logged and
  counted. In-flight caps are split between shards (each shard holds its share; the
  shares add up to the cap, except that each shard gets at least 1, so a cap below the
  number of shards is raised to it; see `cap_share`).
- Token buckets live in the `{adm}` slot, tasks in their shard's: a worker takes tokens for
  the lanes its last claim reported waiting, claims with them, and refunds what the claim
  did not use. A crash in between loses at most one batch of tokens for one refill time.
"""

from __future__ import annotations

import logging
import math
import re
import secrets
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio
import msgspec

from .config import HandlerConfig, LimitConfig, decode_hook
from .errors import InvalidTask, NotPermitted, ScriptError, StoreUnavailable
from .keys import HANDLER_KEY_RE, Keys
from .plans import Pause, Reads, SimplePlan, read, run_on_store
from .store import Call, Ops, Store, read_many

if TYPE_CHECKING:
    from .metrics import Metrics

logger = logging.getLogger(__name__)

__all__ = [
    "LIMIT_FIELDS",
    "Entry",
    "Stored",
    "SyncReport",
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
# Pairs per limits or stage_limits call: the scripts take at most 1000, so one call's
# arguments and work stay bounded however many limits there are.
CHUNK: Final = 1000
# A shard's table build stays its daemon's this long after each call (stage_limits): long
# past one round trip, short enough that a build whose daemon died blocks nobody for long.
STAGE_LEASE_MS: Final = 10_000
T = TypeVar("T")
# How a pass can fail a shard (another daemon building its table, "busy", is no failure).
_FAILED: Final = frozenset({"incomplete", "refused", "unavailable"})
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


_STORED: Final = msgspec.json.Decoder(Stored)


def decode_stored(scope: str, raw: bytes | str) -> Stored:
    """Read one stored entry back; a clear error when it is not what we wrote."""
    try:
        return _STORED.decode(raw)
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
    if options.get("quota_period") is not None and options.get("quota") is None:
        # stored without a quota it would mean nothing, and read back as the default
        raise InvalidTask("invalid limit: quota_period applies to a quota: give quota too")
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
    """What `sync_limits` swaps into one shard's admission hash."""
    return _for_shard(_table(stored), shard, shards)


def _table(stored: Mapping[str, Stored]) -> dict[str, str | int]:
    """Every shard's table at once: a cap is left whole, for `_for_shard` to split."""
    table: dict[str, str | int] = {}
    for scope, entry in stored.items():
        if scope.startswith("handler:"):
            if entry.provider:
                table[f"provider:{scope[len('handler:') :]}"] = entry.provider
            continue
        cap = entry.limit.get("max_in_flight")
        if isinstance(cap, int) and cap > 0:
            table[f"cap:{scope}"] = cap
        for phase in ("submit", "query"):
            if f"{phase}:{scope}" in entry.buckets:
                table[f"rate:{phase}:{scope}"] = "1"
    return table


def _for_shard(table: Mapping[str, str | int], shard: int, shards: int) -> dict[str, str]:
    return {
        field: str(cap_share(value, shard, shards)) if isinstance(value, int) else value
        for field, value in table.items()
    }


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
    version, raw = yield Reads(read("get", keys.limits_version()), read("hgetall", keys.limits()))
    return int(version or 0), limits_entries(raw)


def write(
    ops: Ops, mode: str, entries: Sequence[tuple[str, bytes | str]]
) -> Generator[Call[Any] | Reads | Pause, Any, tuple[int, int, list[str]]]:
    """Write limit entries (the limits script, in chunks), then bring every shard up to
    date. Mode 'config' is a config file's whole list: its entries go first, then the
    stored config entries it no longer lists are pruned, so a limit that both lists keep
    is never missing in between. Returns the new version, how many scopes changed, and the
    scopes a runtime entry kept (mode 'config').

    When it returns, every shard enforces the new limits, unless a sync of a shard failed
    (logged; the daemons' next pass tries again): a shard whose table another daemon is
    building is waited for, up to the build's lease, so a daemon starts claiming, and
    `set_limit` returns, only once the limits are in force."""
    version, changed, kept = yield from _write_chunks(ops, mode, entries)
    if mode == "config":
        listed = {scope for scope, _ in entries}
        _, stored = yield from read_limits(ops.keys)
        gone: list[tuple[str, bytes | str]] = [
            (scope, "")
            for scope, entry in sorted(stored.items())
            if entry.source == "config" and scope not in listed
        ]
        if gone:
            version, pruned, _ = yield from _write_chunks(ops, "prune", gone)
            changed += pruned
    report = yield from sync(ops, force=True)
    pause, waited = 0.02, 0.0
    while report.stale and not report.failed and waited < STAGE_LEASE_MS / 1000 + 1:
        yield Pause(pause)
        waited += pause
        pause = min(0.5, pause * 2)
        report = yield from sync(ops)
    return version, changed, kept


def _write_chunks(
    ops: Ops, mode: str, entries: Sequence[tuple[str, bytes | str]]
) -> SimplePlan[tuple[int, int, list[str]]]:
    version, changed, kept = 0, 0, []
    for chunk in _chunks(entries, CHUNK):
        version, n, k = yield ops.limits(mode, chunk)
        changed += n
        kept += k
    return version, changed, kept


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """Runs of at most `size` items; one empty run when there are none."""
    for start in range(0, max(len(items), 1), size):
        yield items[start : start + size]


def config_entries(
    limits: Sequence[LimitConfig], handlers: Iterable[HandlerConfig]
) -> list[tuple[str, bytes | str]]:
    """What a config file's [[limits]] and [[handlers]] write (mode 'config')."""
    entries: list[tuple[str, bytes | str]] = [
        (limit.scope, encode_limit(limit, "config")) for limit in limits
    ]
    return entries + list(handler_entries(handlers))


class SyncReport(msgspec.Struct, frozen=True):
    """What one pass of `sync` did."""

    moved: int = 0  # held tasks moved back to where they wait now
    stale: int = 0  # shards still on limits older than the stored ones after the pass
    # shard -> why the pass could not finish it: 'incomplete' (its staged table was not
    # whole at the swap), 'refused' (Redis refused a call), 'unavailable'
    failed: dict[int, str] = {}


def sync(ops: Ops, *, force: bool = False) -> SimplePlan[SyncReport]:
    """Bring every shard's admission table to the stored version; with `force`, also look
    at every shard's holds (the periodic lift).

    A shard behind the version gets its new table staged in chunks and swapped in whole;
    until then, and whenever that cannot finish, it keeps enforcing its previous table.
    Failures are logged here, per shard, and reported; the next pass tries again.
    """
    keys = ops.keys
    shards = range(keys.shards)
    replies = yield Reads(
        read("get", keys.limits_version()),
        *(read("get", keys.admission_version(shard)) for shard in shards),
    )
    version = int(replies[0] or 0)
    behind = {s for s in shards if int(replies[1 + s] or -1) < version}
    if not behind and not force:
        return SyncReport()
    whole: dict[str, str | int] = {}
    if behind:
        _, stored = yield from read_limits(keys)
        whole = _table(stored)  # once: the shards' tables differ only in cap shares
    moved, stale, failed = 0, 0, {}
    for shard in shards if force else sorted(behind):
        outcome, size, synced = "", 0, shard not in behind
        try:
            token = ""
            if shard in behind:
                table = list(_for_shard(whole, shard, keys.shards).items())
                token, size = secrets.token_hex(8), len(table)
                outcome = yield from _stage(ops, shard, version, token, table)
                synced = outcome == "current"
                if outcome:
                    token = ""  # nothing of ours to swap in; still lift holds below
            applied, n, remaining = yield ops.sync_limits(shard, version, SYNC_BATCH, token, size)
            if token:  # 1 swapped in; 0 the shard had this version or a newer one already
                synced = applied != -1
                outcome = "incomplete" if applied == -1 else ""
            moved += n
            for _ in range(99):  # each call moves at most SYNC_BATCH; bounded in all
                if remaining == 0 or n == 0:
                    break
                _, n, remaining = yield ops.sync_limits(shard, version, SYNC_BATCH)
                moved += n
        except (StoreUnavailable, ScriptError, NotPermitted) as exc:
            outcome = "unavailable" if isinstance(exc, StoreUnavailable) else "refused"
            logger.error(
                "admission sync of shard %d failed, %s: %s. The shard keeps enforcing the "
                "limits it has (stored version %d); the next pass tries again within a "
                "second. NOPERM: the daemons' Redis user lacks a command docs/deploy.md "
                "lists; OOM: Redis is at maxmemory.",
                shard, outcome, exc, version, extra={"shard": shard},
            )  # fmt: skip
        if outcome == "incomplete":
            logger.error(
                "admission sync of shard %d did not finish: its new table (version %d, "
                "%d entries) was not whole when it was to be swapped in, because building "
                "it took over %.0f s between calls or its staging key was removed. The "
                "shard keeps enforcing its previous limits; the next pass builds it again "
                "within a second. If this repeats, look at Redis latency "
                '(asynctaskd_redis_call_seconds{script="stage_limits"}).',
                shard, version, size, STAGE_LEASE_MS / 1000, extra={"shard": shard},
            )  # fmt: skip
        stale += not synced
        if outcome in _FAILED:
            failed[shard] = outcome
    return SyncReport(moved=moved, stale=stale, failed=failed)


def _stage(
    ops: Ops, shard: int, version: int, token: str, table: Sequence[tuple[str, str]]
) -> SimplePlan[str]:
    """Stage a shard's whole table under `token`; '' when it is staged, else why not:
    'current' (the shard has this version or a newer one), 'busy' (another build owns the
    shard), 'incomplete' (this build lost the shard part way)."""
    for i, chunk in enumerate(_chunks(table, CHUNK)):
        state = yield ops.stage_limits(shard, version, token, STAGE_LEASE_MS, i == 0, chunk)
        if state == 0:
            return "current"
        if state == -1:
            return "busy" if i == 0 else "incomplete"
    return ""


QUOTA_SCAN: Final = 1000  # quota window registry entries looked at per pass


async def expire_quota_windows(store: Store, cursor: int = 0) -> tuple[int, int]:
    """Delete the counters of tenant quota windows that have ended (lua/quota.lua keeps a
    registry of them): producers may only add to them. One SSCAN page per call; returns
    (the next cursor, how many were deleted)."""
    registry = store.keys.quota_windows()
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
            [
                read("delete", *(store.keys.quota_window(m) for m in ended)),
                read("srem", registry, *ended),
            ],
        )
    return int(cursor), len(ended)


async def apply_config(
    store: Store, limits: Sequence[LimitConfig], handlers: Sequence[HandlerConfig]
) -> tuple[str, ...]:
    """Write a config file's [[limits]] (a daemon, at start and on SIGHUP); returns the
    scopes whose runtime entry was kept."""
    _, _, kept = await run_on_store(
        store, write(store.ops, "config", config_entries(limits, handlers))
    )
    return tuple(kept)


async def run_sync(store: Store, metrics: Metrics) -> None:
    """Daemon loop: follow limit changes within a second; every 5 s also lift holds that
    no longer apply, refresh the admission gauges and delete ended quota windows."""
    passes = 0
    quota_cursor = 0
    while True:
        try:
            report = await run_on_store(store, sync(store.ops, force=passes % 5 == 0))
            metrics.admission_stale_shards.set(report.stale)
            for kind in report.failed.values():
                metrics.admission_sync_failures.labels(kind).inc()
            if passes % 5 == 0:
                await observe(store, metrics)
                quota_cursor, _ = await expire_quota_windows(store, quota_cursor)
        except (StoreUnavailable, ScriptError, NotPermitted) as exc:
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
    (raw,) = await read_many(store, [read("hgetall", store.keys.limits())])
    stored = limits_entries(raw)
    caps = {
        scope: int(entry.limit["max_in_flight"])
        for scope, entry in stored.items()
        if isinstance(entry.limit.get("max_in_flight"), int)
    }
    for shard in range(store.keys.shards):
        lanes, capholds, paused = await read_many(
            store,
            [
                read("smembers", store.keys.lanes(shard)),
                read("srandmember", store.keys.capholds(shard), 1000),
                read("hkeys", store.keys.paused(shard)),
            ],
        )
        dims = [("rate", "rate:" + _text(x)) for x in lanes]
        dims += [("cap", _text(x)) for x in capholds]
        dims += [("pause", _text(x)) for x in paused]
        explicit = [s for s in caps if not s.endswith(":*")]
        counts = await read_many(
            store,
            [read("zcard", store.keys.held(shard, dim)) for _, dim in dims]
            + [read("scard", store.keys.inflight(shard, scope)) for scope in explicit],
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
