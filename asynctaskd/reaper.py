"""Expired leases, deadlines of unclaimed tasks, retention, and the exact status gauges."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Final, NamedTuple

import anyio

from .config import Config
from .connection import master_address
from .errors import ScriptError, StoreUnavailable
from .keys import next_ready_band, ready_due_ms
from .metrics import Metrics
from .model import Phase, Status
from .store import PAUSE_KINDS, Store, read_many

__all__ = ["Backlog", "Grace", "observe", "read_backlog", "run_reaper"]

logger = logging.getLogger(__name__)


async def reap_once(store: Store, config: Config, metrics: Metrics, *, reap: bool = True) -> int:
    """One bounded pass over every shard; returns how many tasks it acted on. Without
    `reap`, only the deadlines of unclaimed tasks are swept."""
    acted = 0
    limit = config.reaper.batch
    for shard in range(store.keys.shards):
        reaped = await store.reap(shard, limit, config.worker.max_reclaims) if reap else []
        for task_id, status in reaped:
            metrics.reaped.labels(status.value).inc()
            logger.info("reaped an expired lease -> %s", status, extra={"task_id": task_id})
            acted += 1
        sweep = await store.time_out(shard, limit)
        metrics.timed_out.inc(len(sweep.timed_out))
        acted += len(sweep.timed_out)
        for task_id, why in sweep.refused:  # as a claim that takes requests in reports them
            metrics.requests_dropped.inc()
            logger.warning("dropped a create request: %s", why, extra={"task_id": task_id})
    return acted


async def purge_once(store: Store, config: Config) -> int:
    older_than_ms = round(float(config.reaper.retention) * 1000)
    purged = 0
    for shard in range(store.keys.shards):
        purged += len(await store.expire(shard, older_than_ms, config.reaper.batch))
    return purged


PHASES: Final[tuple[Phase, Phase]] = ("submit", "query")
LIVE_WINDOW = 30.0  # a daemon whose heartbeat is older than this is not counted as live
# Priority bands looked at per ready set. The head of a band is its oldest entry (FIFO by
# due time within a band), so the age is exact for up to this many distinct priorities.
_MAX_BANDS: Final = 16


async def _pipelined(
    store: Store, reads: list[tuple[str, tuple[Any, ...], dict[str, Any]]]
) -> list[Any]:
    """Run read commands in one round trip (a read-only gauge needs no script)."""
    return await read_many(store, reads)


def _score(reply: Any) -> float | None:
    """The score of a one-entry ZRANGE ... WITHSCORES reply, or None when the set is empty."""
    return float(reply[0][1]) if reply else None


def _next_band(key: str, score: float) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    lowest = next_ready_band(score)
    return ("zrangebyscore", (key, lowest, "+inf"), {"start": 0, "num": 1, "withscores": True})


class Backlog(NamedTuple):
    """Unclaimed due work per phase, and how many daemons heartbeat: cluster-wide."""

    oldest_age: dict[Phase, float]  # seconds the most overdue unclaimed task has waited
    ready: dict[Phase, int]  # tasks due now and not claimed
    live_daemons: int


async def read_backlog(store: Store) -> Backlog:
    """Age of the most overdue unclaimed task and the due count per phase; live daemons.

    Unclaimed work that is due sits at the head of `due:<phase>` (due, not yet promoted by
    a claim) or in `ready:<phase>`, whose order is priority first: so each priority band's
    head is read, one pipelined round trip per band (usually one or two). Ages are
    measured against the server's TIME, like the due times the scripts write.
    """
    keys = store.keys
    sets = [(shard, phase) for shard in range(keys.shards) for phase in PHASES]
    reads: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        ("time", (), {}),
        ("hgetall", (keys.daemons(),), {}),
    ]
    local_now_ms = int(time.time() * 1000)  # only bounds the due count; ages use TIME
    for shard, phase in sets:
        reads.append(("zrange", (keys.scheduled(shard, phase), 0, 0), {"withscores": True}))
        reads.append(("zrange", (keys.ready(shard, phase), 0, 0), {"withscores": True}))
    for shard, phase in sets:
        reads.append(("zcard", (keys.ready(shard, phase),), {}))
        reads.append(("zcount", (keys.scheduled(shard, phase), "-inf", local_now_ms), {}))
    replies = await _pipelined(store, reads)
    sec, usec = replies[0]
    now_ms = int(sec) * 1000 + int(usec) // 1000
    oldest_due_ms = dict.fromkeys(PHASES, float(now_ms))
    band_heads: list[tuple[str, Phase, float]] = []  # (ready key, phase, score of a band head)
    for i, (shard, phase) in enumerate(sets):
        due_score, ready_score = _score(replies[2 + 2 * i]), _score(replies[3 + 2 * i])
        if due_score is not None:
            oldest_due_ms[phase] = min(oldest_due_ms[phase], due_score)
        if ready_score is not None:
            band_heads.append((keys.ready(shard, phase), phase, ready_score))
    for band in range(_MAX_BANDS):
        for _key, phase, score in band_heads:
            oldest_due_ms[phase] = min(oldest_due_ms[phase], ready_due_ms(score))
        if not band_heads or band == _MAX_BANDS - 1:
            break
        # The head of the next band: the lowest score from the next band's start on.
        nexts = await _pipelined(store, [_next_band(key, score) for key, _, score in band_heads])
        band_heads = [
            (key, phase, head)
            for (key, phase, _), reply in zip(band_heads, nexts, strict=True)
            if (head := _score(reply)) is not None
        ]
    ages = {phase: max(0.0, (now_ms - due_ms) / 1000) for phase, due_ms in oldest_due_ms.items()}
    ready = dict.fromkeys(PHASES, 0)
    counts = replies[2 + 2 * len(sets) :]
    for i, (_shard, phase) in enumerate(sets):
        ready[phase] += int(counts[2 * i]) + int(counts[2 * i + 1])
    return Backlog(ages, ready, _live(replies[1], now_ms / 1000))


def _live(daemons: dict[Any, Any], now: float) -> int:
    """Registry entries whose heartbeat is recent (a crashed daemon's entry stays behind)."""
    live = 0
    for raw in daemons.values():
        try:
            heartbeat_at = float(json.loads(raw)["heartbeat_at"])
        except (ValueError, TypeError, KeyError):
            continue  # not a record this version understands: not counted
        if now - heartbeat_at <= LIVE_WINDOW:
            live += 1
    return live


async def observe(store: Store, metrics: Metrics) -> None:
    """Refresh the cluster-wide gauges: tasks by status (from the script-maintained
    counters), the oldest pending age and due count per phase, the live daemons, and the
    parked tasks waiting for a vendor lookup or for an operator."""
    counts = await store.counts()
    for status in Status:
        metrics.tasks.labels(status.value).set(counts.get(status.value, 0))
    by_handler: dict[str, dict[str, int]] = {}
    for name, value in counts.items():
        status_name, sep, handler = name.partition("@")
        if sep:
            by_handler.setdefault(handler, {})[status_name] = value
    # Every status of every handler seen, 0 where its counter is absent: a handler whose
    # tasks never waited in a status (a claim straight from the intake writes no
    # PENDING_SUBMIT counter) still has that series, as one whose counter went back to 0.
    for handler, row in by_handler.items():
        for status in Status:
            metrics.tasks_by_handler.labels(status.value, handler).set(row.get(status.value, 0))
    backlog = await read_backlog(store)
    for phase in PHASES:
        metrics.oldest_pending_age.labels(phase).set(backlog.oldest_age[phase])
        metrics.ready_tasks.labels(phase).set(backlog.ready[phase])
    metrics.live_daemons.set(backlog.live_daemons)
    for kind, count in (await store.parked()).items():
        metrics.parked.labels(kind).set(count)
    paused = await store.paused()
    for kind in PAUSE_KINDS:
        metrics.paused.labels(kind).set(sum(1 for d in paused if d.startswith(kind + ":")))


class Grace:
    """When expired leases are left to their holders: for one lease after Redis is back.

    While Redis is unreachable (an outage, a failover) nobody can renew a lease, and after
    a failover the new master has the leases as they were when it stopped replicating:
    every lease held then comes back expired, its holder alive and busy. The holders renew
    within a third of a lease once they reach Redis again (renew takes an expired lease
    that was not reaped yet); a reaper that got there first would park every started
    submit in SUBMIT_UNKNOWN and count a reclaim against every query call. So after a
    pass that failed, or a change of master, nothing is reaped until one lease after the
    next pass that succeeds. An outage that begins within a lease of the last hold's end
    brings no hold of its own: a Redis that fails on and off still has the leases of dead
    holders reaped at least half of the time.
    """

    def __init__(self, lease: float, master: tuple[str, int] | None = None) -> None:
        self.lease = lease
        self.master = master
        self.away = False  # a pass failed, or the master changed, since the last success
        self.holds = False  # this time away ends in a hold
        self.hold_until = 0.0  # monotonic
        self.next_hold = 0.0  # a time away that begins before this brings no hold

    def failed(self, now: float) -> None:
        if not self.away:
            self.away = True
            self.holds = now >= self.next_hold

    def reaping(self, now: float, master: tuple[str, int] | None) -> bool:
        """Whether the pass beginning now may reap."""
        if master != self.master:
            if self.master is not None:
                self.failed(now)
            self.master = master
        if self.away and self.holds:
            return False
        return now >= self.hold_until

    def succeeded(self, now: float) -> None:
        if self.away and self.holds:
            self.hold_until = now + self.lease
            self.next_hold = self.hold_until + self.lease
        self.away = False


async def run_reaper(store: Store, config: Config, metrics: Metrics) -> None:
    """Run forever: reap and sweep every interval, purge every purge_interval."""
    interval = float(config.reaper.interval)
    purge_every = float(config.reaper.purge_interval)
    next_purge = time.monotonic() + purge_every
    grace = Grace(float(config.worker.lease), master_address(store.redis))
    while True:
        try:
            reap = grace.reaping(time.monotonic(), master_address(store.redis))
            acted = await reap_once(store, config, metrics, reap=reap)
            await observe(store, metrics)
            if time.monotonic() >= next_purge:
                next_purge = time.monotonic() + purge_every
                purged = await purge_once(store, config)
                if purged:
                    logger.info("purged %d tasks past retention", purged)
            grace.succeeded(time.monotonic())
        except (StoreUnavailable, ScriptError) as exc:
            if isinstance(exc, StoreUnavailable):
                grace.failed(time.monotonic())
            metrics.store_errors.labels("reaper").inc()
            logger.warning("reaper pass failed: %s", exc)
            acted = 0
        # A full batch means more may be waiting: go again at once.
        if acted < config.reaper.batch:
            await anyio.sleep(interval)
