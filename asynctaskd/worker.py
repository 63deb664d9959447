"""The daemon loop: claim due work, run handler calls concurrently, save outcomes, drain.

One claim loop feeds a task group of handler calls, bounded by `max_inflight` slots;
it claims only as many tasks as it has free slots, so nothing claimed waits for a slot.
A renewal loop extends every held lease in one call per shard and cancels a call whose
lease is gone. Every outcome goes through `Store.save`, which enforces fence and version.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import random
import secrets
import socket
import time
from typing import Any, Literal

import anyio
import httpx

from .codec import check_json_like, encode_json
from .config import Config
from .crashes import Crashes, describe
from .errors import HandlerError, InvalidTask, PermanentError, ScriptError, StoreUnavailable
from .handlers import (
    Failed,
    HandlerContext,
    HandlerEntry,
    Running,
    Submitted,
    Succeeded,
    valid_progress,
)
from .metrics import Metrics
from .model import Phase, Status, Task
from .retry import (
    SubmitFailure,
    backoff,
    clamp_delay,
    classify_submit_error,
    delay_ms,
    retry_after,
)
from .store import PROMOTE_LIMIT, Batcher, Claimed, Code, Gate, Lease, Reconciled, Result, Store

__all__ = ["Worker", "default_worker_id"]

logger = logging.getLogger(__name__)

_MAX_TEXT = 1000  # stage/message stored at most this long
CallPhase = Phase | Literal["find"]  # "find": a vendor lookup of a parked task
_LOOKUP_BATCH = 32  # lookups claimed per shard and round at most
_LOOKUP_POLL = 1.0  # seconds between looks at due:find when nothing told us more


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class _Active:
    """A call in flight: the lease it holds and the timeout that cuts it short.

    The call runs inside `cut`, an asyncio timeout that has no deadline except while a
    query runs (the task's deadline). The renewal loop makes it expire at once when the
    lease is gone. One asyncio timeout per call instead of an anyio cancel scope (plus
    `fail_after` per query): this runs thousands of times a second, and the anyio scope
    cost ~10 us per call here (~20 us for `fail_after`) against ~3 us.
    """

    __slots__ = (
        "cut",
        "cut_now",
        "deadline",
        "handler",
        "landing",
        "lease",
        "lookups",
        "lost",
        "phase",
        "running",
        "saved",
        "saving",
        "started",
        "token",
    )

    def __init__(self, lease: Lease, phase: CallPhase, handler: str) -> None:
        self.lease = lease
        self.phase = phase
        self.handler = handler  # metric label: a registered key, or "other"
        self.saved = False  # an outcome landed, or there is nothing left to give back
        self.saving = False  # a save is in flight: a NO_LEASE from renew may be that save
        self.landing = False  # a must-land save runs in the landing group
        self.cut = asyncio.timeout(None)
        self.deadline: float | None = None  # loop time the running query is cut at
        self.running = False  # inside `cut` (it can only be rescheduled then)
        self.cut_now = False  # the lease is gone: the call must stop
        self.lost = False
        self.started = False  # submit marked started: cancelling now would be ambiguous
        self.token = ""  # this call's start token (withdraw takes back only its own mark)
        self.lookups = 0  # a lookup: the parked task's lookups so far, this one included

    def cancel(self) -> None:
        """Stop the call as soon as it next waits (at once if it is waiting now)."""
        self.cut_now = True
        if self.running and not self.cut.expired():
            self.cut.reschedule(0.0)  # in the past: fires on the next loop iteration

    def set_deadline(self, when: float | None, arm_by: float = math.inf) -> None:
        """Cut the call at loop time `when` (None: no deadline), unless it is being cut.

        A deadline later than `arm_by` is only noted, and armed by `arm_near` once it
        comes near: most queries end long before their task's deadline, and arming and
        disarming the timeout costs ~3 us, over 2% of a poll.
        """
        self.deadline = when
        if self.cut_now or self.cut.expired():
            return
        if when is None:
            if self.cut.when() is not None:
                self.cut.reschedule(None)
        elif when <= arm_by:
            self.cut.reschedule(when)

    def arm_near(self, arm_by: float) -> None:
        """Arm a noted deadline that now falls before `arm_by`."""
        if self.deadline is not None and self.deadline <= arm_by and self.cut.when() is None:
            self.set_deadline(self.deadline)


class Worker:
    """Claims and runs tasks for the handlers it was given. See module docstring."""

    def __init__(
        self,
        store: Store,
        handlers: dict[str, HandlerEntry],
        config: Config,
        *,
        http: httpx.AsyncClient,
        handler_http: dict[str, httpx.AsyncClient] | None = None,
        metrics: Metrics | None = None,
        worker_id: str | None = None,
        gate: Gate | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.handlers = handlers
        self.config = config
        self.http = http
        self.handler_http = handler_http or {}  # handlers with a proxy or size limit of their own
        self.metrics = metrics or Metrics()
        self.crashes = Crashes(self.metrics)
        self.id = worker_id or config.worker.id or default_worker_id()
        self.gate = gate
        self.batcher = Batcher(store, gate)
        # Read at scrape time rather than set twice per call.
        self.metrics.inflight.set_function(lambda: len(self._active))
        self._loggers: dict[str, logging.Logger] = {}
        self.rng = rng or random.Random()
        w = config.worker
        self.max_inflight = w.max_inflight
        self.lease_ms = max(1000, round(float(w.lease) * 1000))
        self.claim_linger = float(w.claim_linger)
        self.poll_jitter = config.retry.poll_jitter
        self._active: dict[str, _Active] = {}
        self._handler_slots = {
            key: anyio.Semaphore(e.concurrency) for key, e in handlers.items() if e.concurrency
        }
        self._slot_freed = anyio.Event()
        self._nudge = anyio.Event()
        self._intake = anyio.CancelScope()
        self.first_pass = anyio.Event()  # set after the first claim round (READY=1)
        # Rate lanes (asynctaskd.admission): tasks waiting per (shard, phase) and lane, as
        # the last claim reported, and when a lane's next token is expected.
        self._waiting: dict[tuple[int, Phase], dict[str, int]] = {}
        self._token_at: dict[str, float] = {}
        self._landing: asyncio.TaskGroup | None = None
        self._everything = anyio.CancelScope()
        self._stopping = False
        self._burst = False
        self._sleep_until = math.inf
        self._due_hint = math.inf  # earliest due time a save set since the last claim round
        self.last_claim_at = time.monotonic()
        self.due_waiting_since: float | None = None
        self.completed = 0
        # Start tokens: unique to each start of this worker, and across workers and restarts.
        self._token_prefix = f"{secrets.token_hex(6)}-"
        self._token_serial = itertools.count(1)
        # Handlers that can look their vendor jobs up (find): their parked tasks are
        # claimed by `lookup` (lua/lookup.lua) when due; without any, nothing of this runs.
        self._finders = sorted(key for key, e in handlers.items() if e.finds)
        self._lookup_at = 0.0  # epoch seconds: when to look at due:find next
        self._lookups_due = False  # the last look saw lookups scheduled (or took some)

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._stopping

    @property
    def inflight(self) -> int:
        return len(self._active)

    def use_gate(self, gate: Gate | None) -> None:
        """Gate the started marks of submits from now on with `gate`."""
        self.gate = self.batcher.gate = gate

    def stop(self, *, now: bool = False) -> None:
        """Stop claiming; let calls finish for `shutdown_grace` (or not at all if now)."""
        self._stopping = True
        self._intake.cancel()
        grace = 0.0 if now else float(self.config.worker.shutdown_grace)
        self._everything.deadline = min(self._everything.deadline, anyio.current_time() + grace)

    async def run(self) -> None:
        """Claim and run until stopped, then drain (see daemon.py for the whole order)."""
        # The batcher outlives the calls: saves during a drain still need it. Saves that
        # must land (a vendor handle in hand) run in `landing`, outside the calls' group,
        # so cancelling a call at the end of the grace period cannot drop them. `landing`
        # is an asyncio TaskGroup for the same reason as `calls` (one task per submit);
        # nothing cancels it but a cancellation of run() itself, never a drain.
        async with anyio.create_task_group() as outer:
            outer.start_soon(self.batcher.run)
            async with asyncio.TaskGroup() as landing:
                self._landing = landing
                await self._run_calls()
            outer.cancel_scope.cancel()

    async def _run_calls(self) -> None:
        with self._everything:
            async with anyio.create_task_group() as aux:
                aux.start_soon(self._renew_loop)
                # Handler calls are spawned thousands of times a second: an asyncio
                # TaskGroup (still structured) costs ~11 us a task here, anyio's
                # start_soon ~100 us. Cancelling `_everything` cancels this host
                # task, and the TaskGroup then cancels every call once.
                async with asyncio.TaskGroup() as calls:
                    with self._intake:
                        await self._claim_loop(calls)
                    # Intake stopped: wait for calls, then stop the renewal loop.
                    while self._active:
                        await self._wait_slot(1.0)
                aux.cancel_scope.cancel()

    async def run_until_idle(self) -> None:
        """Claim until nothing is due, finish every call, return (tests and benchmarks)."""
        self._burst = True
        await self.run()

    # --- claiming -------------------------------------------------------------------------

    async def _claim_loop(self, calls: asyncio.TaskGroup) -> None:
        shards = range(self.store.keys.shards)
        while True:
            free = self.max_inflight - len(self._active)
            if free <= 0:
                await self._wait_slot(1.0)
                continue
            got = 0
            more = False
            busy_before = bool(self._active)  # a call may save new due work during the pass
            self._due_hint = math.inf  # this round's claims see what was saved before it
            next_due: float = math.inf
            if self._finders and time.time() >= self._lookup_at:
                got += await self._claim_lookups(calls)
            if self._lookups_due:
                # Lookups are scheduled: wake for them. Otherwise due:find is looked at
                # each round (at most once a _LOOKUP_POLL), and at least every idle wait.
                next_due = min(next_due, self._lookup_at)
            for shard in shards:
                free = self.max_inflight - len(self._active)
                if free <= 0:
                    more = True
                    break
                claimed, shard_more, shard_due = await self._claim_shard(calls, shard, free)
                got += claimed
                more = more or shard_more
                next_due = min(next_due, shard_due)
            if not self.first_pass.is_set():
                self.first_pass.set()
            if got:
                self.last_claim_at = time.monotonic()
            self._watch(got, more, next_due)
            if got and not more and self.claim_linger:
                # The round found less than it asked for and nothing is left ready (a claim
                # promotes up to PROMOTE_LIMIT newly due tasks, so a backlog shows as ready):
                # wait a moment, so that the next round takes what comes due meanwhile in one
                # round trip. Every round costs the daemon and Redis a fixed price, and under
                # a steady stream of due work, claiming again at once made rounds of a few
                # tasks each (+20% daemon CPU per poll in W3). A full round, or work still
                # ready, claims again at once; a drain cuts the wait short.
                await anyio.sleep(self.claim_linger)
                continue
            if got or more:
                continue
            if self._burst:
                if not busy_before and not self._active and next_due == math.inf:
                    return
                await self._wait_slot(0.05)
                continue
            await self._idle(next_due)

    async def _claim_shard(
        self, calls: asyncio.TaskGroup, shard: int, free: int
    ) -> tuple[int, bool, float]:
        """Claim and launch up to `free` tasks of one shard: (how many, whether more may be
        claimable now, the earliest time something else comes due)."""
        # Query work is cheap and keeps vendor jobs moving: it gets half the free slots,
        # submit work the rest. Both phases are claimed in one round trip: under load a
        # reply waits its turn in a busy event loop (~5 ms here), and the claims of a round
        # would wait for each other. One free slot cannot be shared: query work first, and
        # submit work only if there was none.
        if free == 1:
            got, more, next_due = await self._claim_phases(calls, shard, [("query", 1)])
            if got:
                return got, True, next_due  # submit work was not asked for
            got, submit_more, submit_due = await self._claim_phases(calls, shard, [("submit", 1)])
            return got, more or submit_more, min(next_due, submit_due)
        batch = self.config.worker.batch_size
        query_n = min(batch, free // 2)
        wanted: list[tuple[Phase, int]] = [
            ("query", query_n),
            ("submit", min(batch, free - query_n)),
        ]
        return await self._claim_phases(calls, shard, wanted)

    async def _claim_phases(
        self, calls: asyncio.TaskGroup, shard: int, wanted: list[tuple[Phase, int]]
    ) -> tuple[int, bool, float]:
        """Claim `wanted` (phase, how many) of one shard in one round trip; as _claim_shard."""
        more = False
        next_due = math.inf
        got = 0
        grants = [await self._take_tokens(shard, phase, n) for phase, n in wanted]
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
            lanes_next = await self._after_claim(shard, phase, granted, result.lanes)
            more = more or lanes_next <= now or bool(result.ready_left)
            next_due = min(next_due, lanes_next)
            if result.next_due_ms:
                next_due = min(next_due, result.next_due_ms / 1000)
            if result.claimed:
                self.metrics.claimed.labels(phase).inc(len(result.claimed))
                due_lag = self.metrics.due_lag.labels(phase)
                for claimed in result.claimed:
                    self._launch(calls, claimed, phase, now, due_lag)
            got += len(result.claimed)
            self.metrics.quarantined.inc(len(result.corrupt))
            for task_id, why in result.refused:
                self.metrics.requests_dropped.inc()
                logger.warning("dropped a create request: %s", why, extra={"task_id": task_id})
        if failed:
            await anyio.sleep(0.5)
        return got, more, next_due

    async def _claim_lookups(self, calls: asyncio.TaskGroup) -> int:
        """Claim and launch the due vendor lookups of parked tasks (bounded per shard and
        round, and by the free slots); schedule the next look at due:find."""
        now = time.time()
        next_at = now + _LOOKUP_POLL  # others park tasks too (the reaper): look again soon
        got = 0
        self._lookups_due = False
        for shard in range(self.store.keys.shards):
            n = min(_LOOKUP_BATCH, self.max_inflight - len(self._active))
            if n <= 0:
                next_at = now
                break
            try:
                batch = await self.store.lookup(shard, n, self.lease_ms, self.id, self._finders)
            except (StoreUnavailable, ScriptError) as exc:
                self.metrics.store_errors.labels("lookup").inc()
                logger.warning("lookup claim failed, retrying: %s", exc)
                continue
            self.metrics.quarantined.inc(len(batch.corrupt))
            for claimed, lookups in zip(batch.claimed, batch.lookups, strict=True):
                key = claimed.task.handler
                active = _Active(claimed.lease, "find", key)
                active.lookups = lookups
                self._active[claimed.lease.task_id] = active
                calls.create_task(self._run_call(claimed, active))
            got += len(batch.claimed)
            self._lookups_due = self._lookups_due or bool(batch.claimed or batch.next_due_ms)
            if len(batch.claimed) >= n:
                next_at = now  # a full batch: more may be due
            elif batch.next_due_ms:
                # never sooner than a moment: what is due may be another daemon's handler's
                next_at = min(next_at, max(batch.next_due_ms / 1000, now + 0.25))
        self._lookup_at = next_at
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

    def _watch(self, got: int, more: bool, next_due: float) -> None:
        """Track 'due work exists but nothing was claimed' for the watchdog."""
        due_now = more or next_due <= time.time()
        if got or not due_now or len(self._active) >= self.max_inflight:
            self.due_waiting_since = None
        elif self.due_waiting_since is None:
            self.due_waiting_since = time.monotonic()

    @property
    def stalled_for(self) -> float:
        """Seconds that due work has waited with free slots and no claim (0 if none)."""
        if self.due_waiting_since is None:
            return 0.0
        return time.monotonic() - self.due_waiting_since

    async def _idle(self, next_due: float) -> None:
        """Sleep until the earliest due time, new work (wake marker), or a local nudge."""
        cap = 5.0  # below the client socket timeout, so a blocked read is never cut short
        # A save during the last claim round may have made something due before what that
        # round saw: its nudge had nobody to wake, so take its time here instead.
        next_due = min(next_due, self._due_hint)
        timeout = min(cap, max(0.0, next_due - time.time()))
        if timeout <= 0.001:
            return
        self._sleep_until = time.time() + timeout
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
            self._sleep_until = math.inf

    def _scheduled(self, delay: float) -> None:
        """A save made something due sooner than the claim loop's wake-up: wake it."""
        at = time.time() + delay
        self._due_hint = min(self._due_hint, at)
        if at < self._sleep_until:
            self._nudge.set()

    async def _wait_slot(self, timeout: float) -> None:
        self._slot_freed = anyio.Event()
        with anyio.move_on_after(timeout):
            await self._slot_freed.wait()

    def _launch(
        self, calls: asyncio.TaskGroup, claimed: Claimed, phase: Phase, now: float, due_lag: Any
    ) -> None:
        task = claimed.task
        key = task.handler
        active = _Active(claimed.lease, phase, key if key in self.handlers else "other")
        self._active[claimed.lease.task_id] = active
        if task.due_at is not None:
            due_lag.observe(max(0.0, now - task.due_at))
        calls.create_task(self._run_call(claimed, active))

    # --- lease renewal --------------------------------------------------------------------

    async def _renew_loop(self) -> None:
        interval = self.lease_ms / 3000
        while True:
            await anyio.sleep(interval)
            if not self._active:
                continue
            # Query deadlines within a lease are armed: at least two passes before them.
            arm_by = asyncio.get_running_loop().time() + self.lease_ms / 1000
            for active in self._active.values():
                active.arm_near(arm_by)
            held = [a for a in self._active.values() if not a.saved]
            try:
                codes = await self.store.renew(self.lease_ms, [a.lease for a in held])
            except Exception as exc:  # the renewal loop must outlive any one failure
                self.metrics.store_errors.labels("renew").inc()
                logger.warning("lease renewal failed: %s", exc)
                continue
            for active in held:
                code = codes.get(active.lease.task_id, Code.OK)
                # Skip calls that saved (and gave the lease back) while renew was in flight.
                if code is Code.OK or active.saved or active.saving or active.lost:
                    continue
                task_id = active.lease.task_id
                active.lost = True
                self.metrics.leases_lost.inc()
                logger.warning(
                    "lease lost (%s), cancelling the call",
                    code.name,
                    extra={"task_id": task_id, "fence": active.lease.fence},
                )
                # A started submit may still return a handle that the late-save rule
                # accepts (same fence); only a newer fence makes it pointless.
                if not (active.started and code is Code.NO_LEASE):
                    active.cancel()

    # --- one call -------------------------------------------------------------------------

    async def _run_call(self, claimed: Claimed, active: _Active) -> None:
        task = claimed.task
        entry = self.handlers.get(task.handler)
        try:
            try:
                async with active.cut:
                    active.running = True
                    if active.cut_now:  # cancelled before it began
                        active.cut.reschedule(0.0)
                    if entry is None:
                        await self._unknown_handler(active, task)
                    else:
                        if active.phase == "submit":
                            call = self._submit
                        else:
                            call = self._query if active.phase == "query" else self._find
                        # Awaited here, not in a helper: every coroutine between a call
                        # and the loop is passed through each time the call resumes.
                        sem = self._handler_slots.get(entry.key)
                        if sem is None:
                            await call(entry, task, active)
                        else:
                            async with sem:
                                await call(entry, task, active)
            except TimeoutError:
                if not active.cut.expired():
                    raise  # not ours
                if not active.cut_now:
                    # The query ran past the task's deadline: the save times the task out.
                    await self._save(active, task.status, delay=0)
            finally:
                active.running = False
        except StoreUnavailable as exc:
            self.metrics.store_errors.labels("call").inc()
            logger.warning(
                "Redis unavailable while handling the task; its lease will expire: %s",
                exc,
                extra={"task_id": task.id, "handler": task.handler},
            )
        except Exception:
            self.metrics.handler_crashes.labels(task.handler).inc()
            logger.exception(
                "unexpected error handling task; its lease will expire and the reaper acts",
                extra={"task_id": task.id, "handler": task.handler},
            )
        finally:
            self._forget(active)
            self.completed += 1
            if not active.lost and not active.saved and not active.landing:
                await self._release(active)
            self._slot_freed.set()

    def _forget(self, active: _Active) -> None:
        """The call no longer holds its lease: free its slot (once)."""
        task_id = active.lease.task_id
        if self._active.get(task_id) is active:
            del self._active[task_id]
            self._slot_freed.set()

    async def _release(self, active: _Active) -> None:
        """Give back a lease without an outcome (shielded, capped): peers take it at once.
        A submit cut off after its vendor call started is parked by the script itself; one
        cut off before (its start sent, the vendor not called) takes its mark back."""
        with anyio.move_on_after(2.0, shield=True):
            try:
                if active.token and not active.started:
                    fields: dict[str, Any] = {
                        "error_code": "INTERRUPTED_BEFORE_SUBMIT",
                        "error_message": "",
                    }
                    await self.store.run(
                        self.store.ops.withdraw(active.lease, active.token, fields=fields)
                    )
                    return
                codes = await self.store.release([active.lease])
                code = codes.get(active.lease.task_id)
                if code is Code.STARTED:
                    logger.warning(
                        "submit interrupted after the vendor call started: SUBMIT_UNKNOWN",
                        extra={"task_id": active.lease.task_id},
                    )
            except Exception as exc:  # cleanup must never kill the worker
                logger.warning("release failed; the lease will expire: %s", exc)

    def _ctx(self, entry: HandlerEntry, task: Task, lease: Lease) -> HandlerContext:
        extra = {"task_id": task.id, "handler": task.handler, "fence": lease.fence}
        handler_logger = self._loggers.get(task.handler)
        if handler_logger is None:
            handler_logger = logging.getLogger(f"asynctaskd.handler.{task.handler}")
            self._loggers[task.handler] = handler_logger
        return HandlerContext(
            task_id=task.id,
            idempotency_key=task.id,
            handler=task.handler,
            tenant=task.tenant,
            account=task.account,
            provider=entry.provider if task.provider == task.handler else task.provider,
            submit_attempt=task.submit_attempts,
            poll_count=task.poll_count,
            deadline_at=task.deadline_at,
            cancel_requested=task.cancel_requested,
            http=self.handler_http.get(task.handler, self.http),
            logger=logging.LoggerAdapter(handler_logger, extra),
            metadata=task.metadata,
        )

    # --- saving ---------------------------------------------------------------------------

    async def _save(
        self,
        active: _Active,
        status: Status,
        *,
        delay: float = 0.0,
        fields: dict[str, Any] | None = None,
        must_land: bool = False,
        withdraw: bool = False,
    ) -> Result | None:
        if must_land:
            return await self._save_landing(
                active, status, delay=delay, fields=fields, withdraw=withdraw
            )
        active.saving = True
        try:
            return await self._save_once(active, status, delay=delay, fields=fields)
        finally:
            active.saving = False

    async def _save_started(
        self,
        active: _Active,
        status: Status,
        *,
        delay: float = 0.0,
        fields: dict[str, Any] | None = None,
    ) -> Result | None:
        """The outcome of a submit whose vendor call started: a fact the task must not lose
        (given up, the task would be parked in SUBMIT_UNKNOWN for an operator)."""
        return await self._save(active, status, delay=delay, fields=fields, must_land=True)

    async def _save_landing(
        self,
        active: _Active,
        status: Status,
        *,
        delay: float,
        fields: dict[str, Any] | None,
        withdraw: bool = False,
    ) -> Result | None:
        """Save a vendor handle from a task of its own in the landing group: if this call
        is cancelled meanwhile (drain, lost lease), the save still runs to the end. The
        call waits for it, so it keeps its slot and its lease stays renewed."""
        if self._landing is None:  # not running under run(): nothing to outlive
            return await self._save_once(
                active, status, delay=delay, fields=fields, must_land=True, withdraw=withdraw
            )
        landed: asyncio.Future[Result | None] = asyncio.get_running_loop().create_future()

        async def land() -> None:
            active.saving = True
            result = None
            try:
                result = await self._save_once(
                    active, status, delay=delay, fields=fields, must_land=True, withdraw=withdraw
                )
            except Exception:
                # Never let one save end the landing group (and the worker with it); a
                # handle that did not land leaves the task to lease expiry (SUBMIT_UNKNOWN).
                logger.exception(
                    "saving %s failed", status, extra={"task_id": active.lease.task_id}
                )
            finally:
                active.saving = False
                active.landing = False
                if not landed.done():  # a cancelled wait cancels the future
                    landed.set_result(result)

        active.landing = True
        self._landing.create_task(land())
        return await landed

    async def _save_once(
        self,
        active: _Active,
        status: Status,
        *,
        delay: float = 0.0,
        fields: dict[str, Any] | None = None,
        must_land: bool = False,
        withdraw: bool = False,
    ) -> Result | None:
        """Save an outcome; retry while Redis is away (and, if must_land, while the fence
        is current: a returned vendor handle is never dropped). With `withdraw`, the
        outcome is PENDING_SUBMIT by `withdraw` (the call's start token, not its version).

        No shield here: every cancellation a call sees is asyncio's own (its timeout, the
        calls' TaskGroup), which an anyio shield would not stop. A save that must outlive
        its call runs in a task of its own instead (`_save_landing`)."""
        cfg = self.config.worker
        give_up_at = time.monotonic() + (
            float(cfg.save_retry_for) if must_land else self.lease_ms / 1000
        )
        attempt = 0
        while True:
            attempt += 1
            try:
                if withdraw:
                    call = self.store.ops.withdraw(
                        active.lease, active.token, delay_ms=delay_ms(delay), fields=fields
                    )
                else:
                    call = self.store.ops.save(
                        active.lease, status, delay_ms=delay_ms(delay), fields=fields
                    )
                result, _ = await self.batcher.call(call)
            except StoreUnavailable as exc:
                self.metrics.store_errors.labels("save").inc()
                if time.monotonic() > give_up_at:
                    logger.error(
                        "giving up saving %s: %s",
                        status,
                        exc,
                        extra={"task_id": active.lease.task_id},
                    )
                    return None
                await anyio.sleep(min(2.0, 0.05 * 2 ** min(attempt, 6)))
                continue
            if result.ok:
                active.saved = True
                self._forget(active)
                final = result.status or status
                self.metrics.transitions.labels(active.handler, final.value).inc()
                if not final.is_settled:
                    self._scheduled(delay if final is status else 0.0)
                elif final is Status.SUBMIT_UNKNOWN and active.handler in self._finders:
                    self._lookup_at = 0.0  # parked due for a lookup: look at once
                    self._lookups_due = True
                    self._scheduled(0.0)
                return result
            # A rejection is final, NO_LEASE included: an expired lease that was not
            # reaped still accepts the save, and a parked task accepts the late save;
            # NO_LEASE means the task moved on (canceled, requeued, resolved).
            # A refused withdraw: the mark is not this call's (STARTED), or the task moved on.
            what = "withdraw" if withdraw else "save"
            self.metrics.rejected_writes.labels(what, result.code.name.lower()).inc()
            logger.warning(
                "%s refused: %s",
                what,
                result.code.name,
                extra={"task_id": active.lease.task_id, "fence": active.lease.fence},
            )
            active.saved = True  # nothing more to do with this lease
            return result

    # --- submit phase -----------------------------------------------------------------------

    async def _submit(self, entry: HandlerEntry, task: Task, active: _Active) -> None:
        idem = entry.idempotent
        active.token = f"{self._token_prefix}{next(self._token_serial)}"
        try:
            result, durable = await self.batcher.call(
                self.store.ops.start(active.lease, idem, active.token, entry.find_visible_ms),
                gated=True,
            )
        except StoreUnavailable as exc:
            # The start may have run with its reply lost (the connection dropped, the master
            # died): the vendor was not called, so take the mark back, or the reaper parks
            # the task in SUBMIT_UNKNOWN for an operator when the lease expires.
            logger.warning(
                "start unconfirmed, taking it back: %s",
                exc,
                extra={"task_id": task.id, "fence": active.lease.fence},
            )
            await self._withdraw(active, "START_UNCONFIRMED", str(exc)[:_MAX_TEXT], delay=0.5)
            return
        if self.gate is not None:
            self.metrics.durability_gate.labels("ok" if durable else "timeout").observe(
                self.batcher.gate_seconds
            )
        if result.code is Code.CANCEL_REQUESTED:
            active.lease = Lease(active.lease.task_id, active.lease.fence, result.version)
            await self._save(active, Status.CANCELED)
            return
        if not result.ok:
            self.metrics.rejected_writes.labels("start", result.code.name.lower()).inc()
            active.saved = result.code is not Code.ILLEGAL  # ILLEGAL: release it
            return
        active.lease = Lease(active.lease.task_id, active.lease.fence, result.version)
        if not durable:
            # The started mark might not survive a failover: do not call the vendor.
            await self._withdraw(active, "DURABILITY_TIMEOUT", "", delay=0.5)
            return
        active.started = True
        ctx = self._ctx(entry, task, active.lease)
        ctx.submit_attempt = task.submit_attempts + 1
        t0 = time.perf_counter()
        outcome = "ok"
        try:
            out = await entry.handler.submit(task.params, ctx)
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:
            outcome = "error"
            await self._submit_failed(entry, task, active, exc)
            return
        finally:
            self.metrics.calls.labels(task.handler, "submit", outcome).observe(
                time.perf_counter() - t0
            )
        if (
            not isinstance(out, Submitted)
            or not isinstance(out.external_id, str)
            or not out.external_id
        ):
            await self._submit_failed(
                entry,
                task,
                active,
                InvalidTask(f"submit() returned {type(out).__name__}, not Submitted(external_id)"),
            )
            return
        try:
            handle = encode_json({"external_id": out.external_id, "query": out.query})
            check_json_like(out.query, "Submitted.query")
        except (InvalidTask, TypeError) as exc:
            handle = encode_json({"external_id": out.external_id, "query": {}})
            logger.error(
                "Submitted.query is not JSON data, dropped: %s", exc, extra={"task_id": task.id}
            )
        poll = entry.poll_interval or float(self.config.retry.poll_interval)
        await self._save(
            active,
            Status.SUBMITTED,
            delay=clamp_delay(self._jittered(poll), time.time(), task.deadline_at),
            fields={
                "external_id": out.external_id[:512],
                "handle": handle,
                "error_code": "",
                "error_message": "",
                "throttles": "",
            },
            must_land=True,
        )

    async def _withdraw(
        self, active: _Active, code: str, message: str, *, delay: float = 0.0
    ) -> Result | None:
        """The submit's vendor call did not happen: take back its start mark, if it is in
        Redis and its own (its token; a fence can be handed out twice across a failover),
        with the lease. Retried as a vendor handle is, across a failover too."""
        fields = {"error_code": code, "error_message": message}
        return await self._save(
            active, Status.PENDING_SUBMIT, delay=delay, fields=fields, must_land=True, withdraw=True
        )

    async def _submit_failed(
        self, entry: HandlerEntry, task: Task, active: _Active, exc: BaseException
    ) -> None:
        kind = classify_submit_error(exc)
        code, message = describe(exc)
        retry = self.config.retry
        attempts = task.submit_attempts + 1
        self.crashes.report(task.handler, task.id, "submit", attempts, exc)
        log_extra = {"task_id": task.id, "handler": task.handler, "fence": active.lease.fence}
        if kind is SubmitFailure.AMBIGUOUS and entry.idempotent:
            kind = SubmitFailure.NEVER_SENT  # the vendor dedups on the idempotency key
        if kind is SubmitFailure.PERMANENT:
            await self._save_started(
                active, Status.FAILED, fields={"error_code": code, "error_message": message}
            )
        elif kind is SubmitFailure.AMBIGUOUS:
            logger.warning("submit outcome unknown: %s", message, extra=log_extra)
            await self._save_started(
                active, Status.SUBMIT_UNKNOWN, fields={"error_code": code, "error_message": message}
            )
        elif kind is SubmitFailure.THROTTLED:
            throttles = task.throttles + 1
            await self._save_started(
                active,
                Status.PENDING_SUBMIT,
                delay=self._retry_delay(exc, throttles, task),
                fields={"error_code": code, "error_message": message, "throttles": throttles},
            )
        elif attempts > retry.max_submit_retries:
            await self._save_started(
                active,
                Status.FAILED,
                fields={
                    "error_code": "SUBMIT_RETRIES_EXHAUSTED",
                    "error_message": (
                        f"{attempts} submit attempts never reached the vendor; last: {message}"
                    ),
                },
            )
        else:
            delay = self._retry_delay(exc, attempts, task)
            await self._save_started(
                active,
                Status.PENDING_SUBMIT,
                delay=delay,
                fields={"error_code": code, "error_message": message},
            )

    # --- lookups of parked tasks -----------------------------------------------------------

    async def _find(self, entry: HandlerEntry, task: Task, active: _Active) -> None:
        """Ask the vendor for the job of a parked task (handler.find) and let `reconcile`
        settle the task from the answer (lua/reconcile.lua holds the rules)."""
        find = entry.hook("find")
        assert find is not None  # lookup hands out tasks of handlers with find only
        ctx = self._ctx(entry, task, active.lease)
        t0 = time.perf_counter()
        result = "none"
        found: Any = None
        failure: BaseException | None = None
        try:
            found = await find(task.params, ctx)
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:
            failure = exc
        if failure is None and found is not None:
            if (
                not isinstance(found, Submitted)
                or not isinstance(found.external_id, str)
                or not found.external_id
            ):
                failure = InvalidTask(
                    f"find() returned {type(found).__name__}, not Submitted(external_id) or None"
                )
            else:
                result = "found"
        if failure is not None:
            result = "error"
        self.metrics.calls.labels(
            task.handler, "find", "ok" if failure is None else "error"
        ).observe(time.perf_counter() - t0)
        self.metrics.lookups.labels(task.handler, result).inc()
        retry = self.config.retry
        retry_s = backoff(
            active.lookups,
            float(retry.first_error_delay),
            float(retry.max_error_delay),
            retry.jitter,
            self.rng,
        )
        max_lookups = entry.find_max_tries
        message = ""
        handle = b""
        external_id = ""
        if failure is not None:
            code, message = describe(failure)
            message = f"{code}: {message}"[:_MAX_TEXT]
            self.crashes.report(task.handler, task.id, "find", active.lookups, failure)
            if isinstance(failure, PermanentError):
                max_lookups = 1  # the vendor cannot answer this: an operator decides now
            retry_s = max(retry_after(failure) or 0.0, retry_s)
        elif isinstance(found, Submitted):
            external_id = found.external_id[:512]
            try:
                check_json_like(found.query, "Submitted.query")
                handle = encode_json({"external_id": found.external_id, "query": found.query})
            except (InvalidTask, TypeError):
                handle = encode_json({"external_id": found.external_id, "query": {}})
        call = self.store.ops.reconcile(
            active.lease,
            result,
            retry_ms=delay_ms(retry_s),
            max_lookups=max_lookups,
            give_up_ms=entry.find_give_up_ms,
            external_id=external_id,
            handle_json=handle,
            message=message,
        )
        active.saving = True
        try:
            done: Reconciled = (await self.batcher.call(call))[0]
        except StoreUnavailable as exc:
            self.metrics.store_errors.labels("reconcile").inc()
            logger.warning("reconcile failed; the lookup's lease will expire: %s", exc,
                           extra={"task_id": task.id})  # fmt: skip
            return
        finally:
            active.saving = False
        active.saved = True
        self._forget(active)
        if not done.ok:
            self.metrics.rejected_writes.labels("reconcile", done.code.name.lower()).inc()
            return
        if done.what in ("found", "resubmitted", "gave_up"):
            self.metrics.reconciled.labels(active.handler, done.what).inc()
            log = logger.warning if done.what == "gave_up" else logger.info
            log("parked task reconciled: %s -> %s", done.what, done.status,
                extra={"task_id": task.id, "handler": task.handler})  # fmt: skip
        if done.status is not None and not done.status.is_settled:
            self._scheduled(0.0)

    # --- query phase ------------------------------------------------------------------------

    async def _query(self, entry: HandlerEntry, task: Task, active: _Active) -> None:
        ctx = self._ctx(entry, task, active.lease)
        query_handle = _query_handle(task)
        if task.cancel_requested:
            await self._cancel_remote(entry, task, query_handle, ctx)
            await self._save(active, Status.CANCELED)
            return
        t0 = time.perf_counter()
        outcome = "ok"
        # The call's timeout cuts the query at the task's deadline (_run_call then saves);
        # it is lifted before any save, so only the vendor call is cut.
        budget = max(0.0, task.deadline_at - time.time()) + 0.05
        now = asyncio.get_running_loop().time()
        active.set_deadline(now + budget, now + self.lease_ms / 1000)  # see set_deadline
        failure: BaseException | None = None
        try:
            out = await entry.handler.query(query_handle, ctx)
        except anyio.get_cancelled_exc_class():
            if active.cut.expired() and not active.cut_now:
                outcome = "deadline"
            raise
        except BaseException as exc:
            outcome = "error"
            failure = exc
        finally:
            active.set_deadline(None)
            self.metrics.calls.labels(task.handler, "query", outcome).observe(
                time.perf_counter() - t0
            )
        if failure is not None:
            await self._query_failed(task, active, failure)
            return
        now = time.time()
        poll = entry.poll_interval or float(self.config.retry.poll_interval)
        if isinstance(out, Running):
            hint = out.next_poll  # a handler's own hint is kept exact (not NaN, not < 0)...
            if hint is not None and hint >= 0:
                # ...within what the config would ever wait: it may come from a vendor.
                delay = min(float(hint), max(poll, float(self.config.retry.max_error_delay)))
            else:
                delay = self._jittered(poll)
            fields: dict[str, Any] = {
                "poll_count": task.poll_count + 1,
                "consecutive_errors": "",
                "throttles": "",
            }
            progress = valid_progress(out.progress)
            if progress is not None:
                fields["progress"] = repr(progress)
            if isinstance(out.stage, str):
                fields["stage"] = out.stage[:_MAX_TEXT]
            if isinstance(out.message, str):
                fields["message"] = out.message[:_MAX_TEXT]
            if isinstance(out.handle, dict):
                try:
                    check_json_like(out.handle, "Running.handle")
                    fields["handle"] = encode_json(
                        {"external_id": task.external_id, "query": out.handle}
                    )
                except InvalidTask as exc:
                    logger.error(
                        "ignoring a replacement handle: %s", exc, extra={"task_id": task.id}
                    )
            await self._save(
                active,
                Status.RUNNING,
                delay=clamp_delay(delay, now, task.deadline_at),
                fields=fields,
            )
        elif isinstance(out, Succeeded):
            await self._succeeded(entry, task, active, ctx, out.result)
        elif isinstance(out, Failed):
            code = out.code if isinstance(out.code, str) and out.code else "VENDOR_FAILED"
            fields = {
                "error_code": code[:200],
                "error_message": str(out.message)[:_MAX_TEXT],
                "poll_count": task.poll_count + 1,
                "throttles": "",
            }
            if out.result is not None:  # what the job made before it failed
                try:
                    check_json_like(out.result, "Failed.result")
                    fields["result"] = encode_json(out.result)
                except InvalidTask as exc:
                    logger.error(
                        "Failed.result is not JSON data, dropped: %s",
                        exc,
                        extra={"task_id": task.id},
                    )
            await self._save(active, Status.FAILED, fields=fields)
        else:
            await self._query_failed(
                task,
                active,
                InvalidTask(f"query() returned {type(out).__name__}, not Running/Succeeded/Failed"),
            )

    async def _succeeded(
        self, entry: HandlerEntry, task: Task, active: _Active, ctx: HandlerContext, result: Any
    ) -> None:
        finalize = entry.hook("finalize")
        if finalize is not None:
            try:
                result = await finalize(result, ctx)
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as exc:
                await self._query_failed(task, active, exc)
                return
        try:
            check_json_like(result, "result")
            blob = encode_json(result)
        except InvalidTask as exc:
            await self._save(
                active,
                Status.FAILED,
                fields={"error_code": "INVALID_RESULT", "error_message": str(exc)[:_MAX_TEXT]},
            )
            return
        await self._save(
            active,
            Status.SUCCEEDED,
            fields={
                "result": blob,
                "poll_count": task.poll_count + 1,
                "progress": "1.0",
                "throttles": "",
            },
        )

    async def _query_failed(self, task: Task, active: _Active, exc: BaseException) -> None:
        retry = self.config.retry
        code, message = describe(exc)
        self.crashes.report(task.handler, task.id, "query", task.poll_count + 1, exc)
        if isinstance(exc, PermanentError):
            await self._save(
                active, Status.FAILED, fields={"error_code": code, "error_message": message}
            )
            return
        if getattr(exc, "throttled", False):
            # No error budget spent, but each throttle in a row waits twice as long (with
            # jitter, up to max_error_delay), or what the vendor asked for if longer.
            throttles = task.throttles + 1
            await self._save(
                active,
                task.status,
                delay=self._retry_delay(exc, throttles, task),
                fields={"error_code": code, "error_message": message, "throttles": throttles},
            )
            return
        errors = task.consecutive_errors + 1
        if errors >= retry.max_consecutive_errors:
            await self._save(
                active,
                Status.FAILED,
                fields={
                    "error_code": "QUERY_ERRORS",
                    "error_message": f"{errors} query errors in a row; last: {code}: {message}"[
                        :_MAX_TEXT
                    ],
                    "consecutive_errors": errors,
                },
            )
            return
        await self._save(
            active,
            task.status,
            delay=self._retry_delay(exc, errors, task),
            fields={"consecutive_errors": errors, "error_code": code, "error_message": message},
        )

    def _jittered(self, poll: float) -> float:
        """A scheduled poll's delay: `poll` times a random factor in [1 - j, 1 + j].

        A claim takes due tasks together and their saves land together, so tasks submitted
        (or recovered after a crash) in one burst would stay in lockstep for good: the
        vendor would see bursts instead of a steady rate, and the burst's last tasks would
        wait behind the rest on every poll. A little jitter spreads them within a few polls.
        A handler's own `next_poll` hint is kept exact (within bounds: see `_query`)."""
        if not self.poll_jitter:
            return poll
        return poll * (1.0 + self.rng.uniform(-self.poll_jitter, self.poll_jitter))

    def _retry_delay(self, exc: BaseException, failures: int, task: Task) -> float:
        """Backoff for the n-th failure in a row, but never sooner than a Retry-After; and
        never later than `max_error_delay` or the task's deadline, whatever it asked for."""
        r = self.config.retry
        most = float(r.max_error_delay)
        wait = backoff(failures, float(r.first_error_delay), most, r.jitter, self.rng)
        delay = max(retry_after(exc) or 0.0, wait)
        return clamp_delay(delay, time.time(), task.deadline_at, cap=most)

    async def _cancel_remote(
        self, entry: HandlerEntry, task: Task, query_handle: dict[str, Any], ctx: HandlerContext
    ) -> None:
        cancel = entry.hook("cancel")
        if cancel is None:
            return
        with anyio.move_on_after(max(1.0, self.lease_ms / 2000)):
            try:
                await cancel(query_handle, ctx)
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as exc:
                logger.warning("remote cancel failed: %s", exc, extra={"task_id": task.id})

    async def _unknown_handler(self, active: _Active, task: Task) -> None:
        message = f"no handler {task.handler!r} is registered in daemon {self.id}"
        if active.phase == "submit":
            # Nothing was sent: the task cannot run anywhere that lacks the handler.
            await self._save(
                active,
                Status.FAILED,
                fields={"error_code": "UNKNOWN_HANDLER", "error_message": message},
            )
        else:
            await self._query_failed(task, active, HandlerError(message, code="UNKNOWN_HANDLER"))


def _query_handle(task: Task) -> dict[str, Any]:
    """What query() and cancel() receive: the stored query fields plus the external id."""
    handle = task.handle or {}
    query = dict(handle.get("query") or {})
    query.setdefault("external_id", handle.get("external_id") or task.external_id)
    return query
