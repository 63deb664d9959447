"""Claiming: claim rounds over the shards (submit and query work in one round trip per
shard, within the rate lanes' tokens), lookups of parked tasks, and the idle wait."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any

import anyio

from asynctaskd.config import Config
from asynctaskd.errors import ScriptError, StoreUnavailable
from asynctaskd.metrics import Metrics
from asynctaskd.model import Phase
from asynctaskd.store import PROMOTE_LIMIT, Claimed, Store

from .call import Call, InFlight

logger = logging.getLogger(__package__)

_LOOKUP_BATCH = 32  # lookups claimed per shard and round at most
_LOOKUP_POLL = 1.0  # seconds between looks at due:find when nothing told us more

RunCall = Callable[[Claimed, Call], Coroutine[Any, Any, None]]


@dataclass(frozen=True, slots=True)
class Round:
    """What a claim round (or part of one) found."""

    got: int = 0  # tasks claimed and launched
    more: bool = False  # more may be claimable now
    next_due: float = math.inf  # epoch seconds: the earliest time something else comes due


class Claimer:
    """Claims due work into free slots and launches a call for each task (`run_call`)."""

    def __init__(
        self,
        store: Store,
        config: Config,
        metrics: Metrics,
        inflight: InFlight,
        *,
        worker_id: str,
        lease_ms: int,
        handlers: Collection[str],
        finders: list[str],
        run_call: RunCall,
    ) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        self.inflight = inflight
        self.id = worker_id
        self.lease_ms = lease_ms
        self.handlers = handlers
        self.run_call = run_call  # Worker._run_call: one call, to the end
        self.shards = range(store.keys.shards)
        # Rate lanes (asynctaskd.admission): tasks waiting per (shard, phase) and lane, as
        # the last claim reported, and when a lane's next token is expected.
        self._waiting: dict[tuple[int, Phase], dict[str, int]] = {}
        self._token_at: dict[str, float] = {}
        self._nudge = anyio.Event()
        self.sleep_until = math.inf
        self.due_hint = math.inf  # earliest due time a save set since the last claim round
        # Handlers that can look their vendor jobs up (find): their parked tasks are
        # claimed by `lookup` (lua/lookup.lua) when due; without any, nothing of this runs.
        self.finders = finders
        self.lookup_at = 0.0  # epoch seconds: when to look at due:find next
        self.lookups_due = False  # the last look saw lookups scheduled (or took some)

    async def round(self, calls: asyncio.TaskGroup) -> Round:
        """Claim and launch what fits in the free slots, lookups first, shard by shard."""
        self.due_hint = math.inf  # this round's claims see what was saved before it
        got = 0
        more = False
        next_due = math.inf
        if self.finders and time.time() >= self.lookup_at:
            got += await self._claim_lookups(calls)
        if self.lookups_due:
            # Lookups are scheduled: wake for them. Otherwise due:find is looked at
            # each round (at most once a _LOOKUP_POLL), and at least every idle wait.
            next_due = self.lookup_at
        for shard in self.shards:
            free = self.inflight.free
            if free <= 0:
                more = True
                break
            part = await self._claim_shard(calls, shard, free)
            got += part.got
            more = more or part.more
            next_due = min(next_due, part.next_due)
        return Round(got, more, next_due)

    async def _claim_shard(self, calls: asyncio.TaskGroup, shard: int, free: int) -> Round:
        """Claim and launch up to `free` tasks of one shard."""
        # Query work is cheap and keeps vendor jobs moving: it gets half the free slots,
        # submit work the rest. Both phases are claimed in one round trip: under load a
        # reply waits its turn in a busy event loop (~5 ms here), and the claims of a round
        # would wait for each other. One free slot cannot be shared: query work first, and
        # submit work only if there was none.
        if free == 1:
            query = await self._claim_phases(calls, shard, [("query", 1)])
            if query.got:
                return Round(query.got, True, query.next_due)  # submit work was not asked for
            submit = await self._claim_phases(calls, shard, [("submit", 1)])
            return Round(
                submit.got, query.more or submit.more, min(query.next_due, submit.next_due)
            )
        batch = self.config.worker.batch_size
        query_n = min(batch, free // 2)
        wanted: list[tuple[Phase, int]] = [
            ("query", query_n),
            ("submit", min(batch, free - query_n)),
        ]
        return await self._claim_phases(calls, shard, wanted)

    async def _claim_phases(
        self, calls: asyncio.TaskGroup, shard: int, wanted: list[tuple[Phase, int]]
    ) -> Round:
        """Claim `wanted` (phase, how many) of one shard in one round trip."""
        more = False
        next_due = math.inf
        got = 0
        # Rate lanes wait in few shards and phases: no call at all where none does.
        waiting = self._waiting
        grants = [
            await self._take_tokens(shard, phase, n) if waiting.get((shard, phase)) else {}
            for phase, n in wanted
        ]
        claims = [
            self.store.ops.claim(shard, phase, n, self.lease_ms, self.id, PROMOTE_LIMIT, granted)
            for (phase, n), granted in zip(wanted, grants, strict=True)
        ]
        try:
            results = await self.store.claim_each(claims)
        except (StoreUnavailable, ScriptError) as exc:
            results = [exc] * len(claims)
        failed = False
        now = time.time()
        for (phase, _), granted, result in zip(wanted, grants, results, strict=True):
            if isinstance(result, Exception):
                # ScriptError: data the script could not handle; keep the daemon up (other
                # shards and phases still work) and say so loudly.
                self.metrics.store_errors.labels("claim").inc()
                logger.warning("claim failed, retrying: %s", result)
                failed = more = True
                continue
            lanes_next = math.inf
            if granted or result.lanes or waiting.get((shard, phase)):
                lanes_next = await self._after_claim(shard, phase, granted, result.lanes)
            more = more or lanes_next <= now or bool(result.ready_left)
            next_due = min(next_due, lanes_next)
            if result.next_due_ms:
                next_due = min(next_due, result.next_due_ms / 1000)
            if result.claimed:
                self.metrics.claimed.labels(phase).inc(len(result.claimed))
                due_lag = self.metrics.due_lag.labels(phase)
                loop = asyncio.get_running_loop()  # once, not per call (a getpid on 3.11)
                for claimed in result.claimed:
                    self._launch(calls, claimed, phase, now, due_lag, loop)
            got += len(result.claimed)
            self.metrics.quarantined.inc(len(result.corrupt))
            for task_id, why in result.refused:
                self.metrics.requests_dropped.inc()
                logger.warning("dropped a create request: %s", why, extra={"task_id": task_id})
        if failed:
            await anyio.sleep(0.5)
        return Round(got, more, next_due)

    def _launch(
        self,
        calls: asyncio.TaskGroup,
        claimed: Claimed,
        phase: Phase,
        now: float,
        due_lag: Any,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        task = claimed.task
        key = task.handler
        call = Call(claimed.lease, phase, key if key in self.handlers else "other", loop)
        self.inflight.active[claimed.lease.task_id] = call
        if task.due_at is not None:
            due_lag.observe(max(0.0, now - task.due_at))
        calls.create_task(self.run_call(claimed, call))

    async def _claim_lookups(self, calls: asyncio.TaskGroup) -> int:
        """Claim and launch the due vendor lookups of parked tasks (bounded per shard and
        round, and by the free slots); schedule the next look at due:find."""
        now = time.time()
        next_at = now + _LOOKUP_POLL  # others park tasks too (the reaper): look again soon
        got = 0
        self.lookups_due = False
        for shard in self.shards:
            n = min(_LOOKUP_BATCH, self.inflight.free)
            if n <= 0:
                next_at = now
                break
            try:
                batch = await self.store.lookup(shard, n, self.lease_ms, self.id, self.finders)
            except (StoreUnavailable, ScriptError) as exc:
                self.metrics.store_errors.labels("lookup").inc()
                logger.warning("lookup claim failed, retrying: %s", exc)
                continue
            self.metrics.quarantined.inc(len(batch.corrupt))
            for claimed, lookups in zip(batch.claimed, batch.lookups, strict=True):
                call = Call(claimed.lease, "find", claimed.task.handler)
                call.lookups = lookups
                self.inflight.active[claimed.lease.task_id] = call
                calls.create_task(self.run_call(claimed, call))
            got += len(batch.claimed)
            self.lookups_due = self.lookups_due or bool(batch.claimed or batch.next_due_ms)
            if len(batch.claimed) >= n:
                next_at = now  # a full batch: more may be due
            elif batch.next_due_ms:
                # never sooner than a moment: what is due may be another daemon's handler's
                next_at = min(next_at, max(batch.next_due_ms / 1000, now + 0.25))
        self.lookup_at = next_at
        return got

    async def _take_tokens(self, shard: int, phase: Phase, n: int) -> dict[str, int]:
        """Tokens for the rate lanes whose tasks wait in this shard (asynctaskd.admission)."""
        waiting = self._waiting.get((shard, phase))
        if not waiting:
            return {}
        now = time.time()
        want = {
            lane: min(count, n)
            for lane, count in waiting.items()
            if count > 0 and self._token_at.get(lane, 0.0) <= now
        }
        if not want:
            return {}
        try:
            got = await self.store.run(self.store.ops.take("take", want))
        except StoreUnavailable as exc:
            logger.warning("taking rate-limit tokens failed: %s", exc)
            return {}
        grants: dict[str, int] = {}
        for lane, (granted, wait_ms) in got.items():
            if granted:
                grants[lane] = granted
                self.metrics.tokens.labels(lane, "granted").inc(granted)
            if granted < want[lane]:
                self.metrics.tokens.labels(lane, "denied").inc(want[lane] - granted)
                self._token_at[lane] = now + max(wait_ms, 1) / 1000
        return grants

    async def _after_claim(
        self,
        shard: int,
        phase: Phase,
        grants: dict[str, int],
        lanes: dict[str, tuple[int, int]],
    ) -> float:
        """Refund unused tokens, note what waits; returns when a lane can go on (inf: none)."""
        self._waiting[(shard, phase)] = {lane: w for lane, (_, w) in lanes.items() if w > 0}
        unused = {}
        for lane, granted in grants.items():
            used = lanes.get(lane, (0, 0))[0]
            if used < granted:
                unused[lane] = granted - used
                if used == 0:  # what waits there is not claimable now: don't spin on it
                    self._token_at[lane] = time.time() + 0.05
        if unused:
            for lane, count in unused.items():
                self.metrics.tokens.labels(lane, "refunded").inc(count)
            try:
                await self.store.run(self.store.ops.take("refund", unused))
            except StoreUnavailable as exc:  # lost tokens come back with the next refill
                logger.warning("refunding %d unused tokens failed: %s", sum(unused.values()), exc)
        nxt = math.inf
        for lane, waiting in self._waiting[(shard, phase)].items():
            if waiting:
                nxt = min(nxt, self._token_at.get(lane, 0.0))
        return nxt

    # --- waiting for work -------------------------------------------------------------------

    async def idle(self, next_due: float) -> None:
        """Sleep until the earliest due time, new work (wake marker), or a local nudge."""
        cap = 5.0  # below the client socket timeout, so a blocked read is never cut short
        # A save during the last claim round may have made something due before what that
        # round saw: its nudge had nobody to wake, so take its time here instead.
        next_due = min(next_due, self.due_hint)
        timeout = min(cap, max(0.0, next_due - time.time()))
        if timeout <= 0.001:
            return
        self.sleep_until = time.time() + timeout
        self._nudge = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:

                async def blpop() -> None:
                    try:
                        with anyio.move_on_after(timeout + 1.0):
                            await self.store.wait_wake(timeout)
                    except Exception as exc:  # an idle wait must never end the daemon
                        logger.warning("waiting for work failed: %s", exc)
                        await anyio.sleep(min(timeout, 0.5))
                    tg.cancel_scope.cancel()

                async def nudged() -> None:
                    await self._nudge.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(blpop)
                tg.start_soon(nudged)
        finally:
            self.sleep_until = math.inf

    def scheduled(self, delay: float) -> None:
        """A save made something due sooner than the claim loop's wake-up: wake it."""
        at = time.time() + delay
        if at < self.due_hint:
            self.due_hint = at
        # Only an idle wait needs the nudge (one that begins makes a new one): not set on
        # every save while the loop claims.
        sleep_until = self.sleep_until
        if at < sleep_until and sleep_until != math.inf:
            self._nudge.set()

    def look_now(self) -> None:
        """A task was parked due for a lookup: look at due:find at once."""
        self.lookup_at = 0.0
        self.lookups_due = True
        self.scheduled(0.0)
