"""A tenant's overview, for its viewers (and for operators who pick a tenant): its task
counts by status, its parked and stalled tasks, its paused state and its last hour of
finished tasks.

No counter is kept per tenant, and none is added: the daemons' scripts stay as they are.
This reads what exists instead, a bounded walk of the status indexes newest first (parked
tasks first, then the other live statuses, then the settled ones; the shards in turn, a
page of each at a time) that reads each entry's tenant, and the finish time of settled
ones, with one `SORT_RO ... GET` per page (or `ZRANGE` and `HMGET`s where the server
refuses GET patterns: the find's page reader). It reads at most `WALK` entries and for
`WALK_BUDGET_S`, each status an equal share of what is left: a status whose indexes were
read to the end has its count complete, the others "at least" the count, with the time
from which it is whole (the newest entry the walk did not reach entered the status before
it). docs/console.md has the figures at 1,000,000 tasks.
"""

from __future__ import annotations

import time
from typing import Any, Final

from asynctaskd.client import AsyncClient
from asynctaskd.keys import Keys, ready_due_ms
from asynctaskd.model import Status

from .browse import read_page
from .overview import BUCKET_MS, HOUR_MS, STALL_S

__all__ = ["WALK", "tenant_overview"]

WALK: Final = 200_000  # index entries read per overview, at most
WALK_BUDGET_S: Final = 1.0  # and no new page is read after this long
READY_READ: Final = 1_000  # entries of each ready set checked for the tenant's stalls
_PAGE: Final = 5_000
_ENDED: Final = {Status.SUCCEEDED: 0, Status.FAILED: 1, Status.TRACKING_TIMED_OUT: 1}
# What needs a human first, then the other live statuses, then the settled ones
ORDER: Final = sorted(Status, key=lambda s: (s is not Status.SUBMIT_UNKNOWN, s.is_terminal))


async def tenant_overview(
    client: AsyncClient, keys: Keys, tenant: str, *, operator: bool
) -> dict[str, Any]:
    """The overview of `tenant`. Where the walk stopped is another tenant's business: a
    viewer gets the times rounded up to the minute (still true: a count whole since a time
    is whole since any later one) and not how many entries, of all tenants, were read."""
    redis = client.redis
    seconds, micros = await redis.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    walk = _Walk(redis, keys, tenant.encode(), now_ms)
    await walk.run()
    parked_for_lookup = 0
    if walk.parked:
        async with redis.pipeline(transaction=False) as pipe:
            for shard, task_id in walk.parked:
                pipe.zscore(keys.lookups(shard), task_id)
            parked_for_lookup = sum(score is not None for score in await pipe.execute())
    parked = walk.counts[Status.SUBMIT_UNKNOWN]
    stalls = await _stalls(redis, keys, tenant, now_ms)
    paused = {k: v for k, v in (await client.paused()).items() if k == f"tenant:{tenant}"}
    attention = []
    if parked - parked_for_lookup:
        n = parked - parked_for_lookup
        attention.append({"kind": "submit_unknown", "count": n,
                          "text": f"{n} SUBMIT_UNKNOWN task(s) wait for an operator"})  # fmt: skip
    if stalls["count"]:
        more = "at least " if stalls["partial"] else ""
        text = (f"{more}{stalls['count']} task(s) ready for up to {stalls['waited']:.0f} s "
                "past due: claims are behind")  # fmt: skip
        attention.append({"kind": "stall", "count": stalls["count"], "text": text})
    if paused:
        attention.append({"kind": "paused", "count": 0, "text": f"tenant {tenant} is paused"})
    start = now_ms - HOUR_MS
    ended_since = max([start] + [at for s in _ENDED if (at := walk.since[s]) is not None])
    # None: every entry of the status's indexes was read; else the count is of the tasks
    # that entered the status from then on (epoch seconds), a lower bound.
    whole_since = {s.value: None if at is None else at / 1000 for s, at in walk.since.items()}
    series = {"start": start / 1000, "bucket": BUCKET_MS / 1000, "since": ended_since / 1000,
              "succeeded": walk.series[0], "failed": walk.series[1]}  # fmt: skip
    return {
        "now": now_ms / 1000,
        "tenant": tenant,
        "attention": attention,
        "by_status": {s.value: walk.counts[s] for s in Status},
        "whole_since": whole_since,
        "scanned": walk.scanned if operator else None,
        "parked_for_lookup": parked_for_lookup,
        "parked_for_operator": parked - parked_for_lookup,
        "stalls": stalls,
        "paused": paused,
        "series": series,
    }


class _Walk:
    """The bounded walk: counts per status, and where each incomplete one stopped."""

    def __init__(self, redis: Any, keys: Keys, owner: bytes, now_ms: int) -> None:
        self.redis, self.keys, self.owner, self.now_ms = redis, keys, owner, now_ms
        self.deadline = time.monotonic() + WALK_BUDGET_S
        self.sort = [True]  # SORT_RO's GET patterns until the server refuses them
        self.scanned = 0
        self.counts = dict.fromkeys(Status, 0)
        self.since: dict[Status, int | None] = dict.fromkeys(Status)
        self.series = ([0] * 60, [0] * 60)
        self.parked: list[tuple[int, str]] = []

    async def run(self) -> None:
        """Each status's walk gets an equal share of what budget is left (entries and
        time), so that a big settled status cannot leave the others unread; what a status
        does not use goes to those after it."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for status in ORDER:
                for shard in range(self.keys.shards):
                    pipe.zcard(self.keys.index(shard, status))
            sizes = [int(n) for n in await pipe.execute()]
        per = self.keys.shards
        todo = [(st, sizes[i * per : (i + 1) * per]) for i, st in enumerate(ORDER)]
        todo = [(st, sz) for st, sz in todo if any(sz)]
        for i, (status, sz) in enumerate(todo):
            share = len(todo) - i
            entries = self.scanned + (WALK - self.scanned) // share
            deadline = time.monotonic() + max(0.0, self.deadline - time.monotonic()) / share
            await self._status(status, sz, entries, deadline)

    async def _status(self, status: Status, sizes: list[int], top: int, deadline: float) -> None:
        offsets = [0] * len(sizes)
        left = [shard for shard, size in enumerate(sizes) if size]
        while left and self.scanned < top and time.monotonic() < deadline:
            for shard in list(left):
                n = min(_PAGE, top - self.scanned)
                if n <= 0:
                    break
                entries = await read_page(
                    self.redis, self.keys.index(shard, status), self.keys.task_prefix(shard),
                    offsets[shard], n, "finished_ms", True, self.sort,
                )  # fmt: skip
                self.scanned += len(entries)
                offsets[shard] += len(entries)
                self._count(status, shard, entries)
                if len(entries) < n or offsets[shard] >= sizes[shard]:
                    left.remove(shard)
        if left:  # from the newest entry the walk did not reach on, the count is whole
            stops = [await self._score_at(status, shard, offsets[shard]) for shard in left]
            self.since[status] = -(-max(stops) // BUCKET_MS) * BUCKET_MS  # a whole minute

    def _count(self, status: Status, shard: int, entries: list[Any]) -> None:
        mine = [(m, finished) for m, finished, who in entries if who == self.owner]
        self.counts[status] += len(mine)
        if status is Status.SUBMIT_UNKNOWN:
            self.parked += [(shard, m.decode()) for m, _ in mine]
        which = _ENDED.get(status)
        if which is None:
            return
        start = self.now_ms - HOUR_MS
        for _, finished in mine:
            at = int(finished) if finished and finished.isdigit() else 0
            if at >= start:
                self.series[which][min(59, (at - start) // BUCKET_MS)] += 1

    async def _score_at(self, status: Status, shard: int, offset: int) -> int:
        """When the entry at `offset` (newest first) entered the status: the newest one not
        read (the walk's count of that shard is whole from just after it)."""
        got = await self.redis.execute_command(
            "ZRANGE", self.keys.index(shard, status), offset, offset, "REV", "WITHSCORES"
        )
        return int(float(got[1])) + 1 if got else 0


async def _stalls(redis: Any, keys: Keys, tenant: str, now_ms: int) -> dict[str, Any]:
    """The tenant's tasks due STALL_S ago or more and still in a ready set, among the first
    READY_READ entries of each (`partial` when a set held more)."""
    overdue: list[tuple[int, bytes, float]] = []
    partial = False
    for shard in range(keys.shards):
        for phase in ("submit", "query"):
            entries = await redis.zrange(keys.ready(shard, phase), 0, READY_READ - 1,
                                         withscores=True)  # fmt: skip
            partial |= len(entries) == READY_READ
            overdue += [(shard, m, now_ms - ready_due_ms(s)) for m, s in entries
                        if now_ms - ready_due_ms(s) >= STALL_S * 1000]  # fmt: skip
    count, waited = 0, 0.0
    if overdue:
        async with redis.pipeline(transaction=False) as pipe:
            for shard, member, _ in overdue:
                pipe.hget(keys.task(shard, member.decode()), "tenant")
            owners = await pipe.execute()
        for (_, _, lag), owner in zip(overdue, owners, strict=True):
            if owner == tenant.encode():
                count, waited = count + 1, max(waited, lag / 1000)
    return {"count": count, "waited": waited, "partial": partial}
