"""The worker: wires the components together and runs the claim loop and the calls.

See the package docstring for the parts and how a call moves through them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import socket
import time

import anyio
import httpx

from asynctaskd.config import Config
from asynctaskd.errors import StoreUnavailable
from asynctaskd.handlers import HandlerEntry
from asynctaskd.metrics import Metrics
from asynctaskd.store import Batcher, Claimed, Gate, Store

from .call import CALLING, DONE, Call, InFlight
from .claiming import Claimer, Round
from .leases import Leases
from .outcomes import timed_out
from .saving import Saver
from .vendor import Vendor

logger = logging.getLogger(__package__)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Worker:
    """Claims and runs tasks for the handlers it was given. See the package docstring."""

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
        self.metrics = metrics or Metrics()
        self.id = worker_id or config.worker.id or default_worker_id()
        self.gate = gate
        self.batcher = Batcher(store, gate)
        w = config.worker
        self.max_inflight = w.max_inflight
        self.lease_ms = max(1000, round(float(w.lease) * 1000))
        self.claim_linger = float(w.claim_linger)
        self._handler_slots = {
            key: anyio.Semaphore(e.concurrency) for key, e in handlers.items() if e.concurrency
        }
        # The components, wired here and nowhere else.
        self.calls = InFlight(self.max_inflight)
        self.claimer = Claimer(
            store,
            config,
            self.metrics,
            self.calls,
            worker_id=self.id,
            lease_ms=self.lease_ms,
            handlers=handlers,
            finders=sorted(key for key, e in handlers.items() if e.finds),
            run_call=self._run_call,
        )
        self.leases = Leases(store, self.metrics, self.calls, self.lease_ms)
        self.saver = Saver(
            store, self.batcher, config, self.metrics, self.calls, self.claimer, self.lease_ms
        )
        self.vendor = Vendor(
            store,
            self.batcher,
            config,
            self.metrics,
            self.calls,
            self.claimer,
            self.saver,
            worker_id=self.id,
            lease_ms=self.lease_ms,
            http=http,
            handler_http=handler_http or {},
            rng=rng or random.Random(),
        )
        self.crashes = self.vendor.crashes
        # Read at scrape time rather than set twice per call.
        active = self.calls.active
        self.metrics.inflight.set_function(lambda: len(active))
        self._intake = anyio.CancelScope()
        self.first_pass = anyio.Event()  # set after the first claim round (READY=1)
        self._everything = anyio.CancelScope()
        self._stopping = False
        self._burst = False
        self.last_claim_at = time.monotonic()
        self.due_waiting_since: float | None = None
        self.completed = 0

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._stopping

    @property
    def inflight(self) -> int:
        return len(self.calls.active)

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
                self.saver.landing = landing
                await self._run_calls()
            outer.cancel_scope.cancel()

    async def _run_calls(self) -> None:
        with self._everything:
            async with anyio.create_task_group() as aux:
                aux.start_soon(self.leases.renew_loop)
                # Handler calls are spawned thousands of times a second: an asyncio
                # TaskGroup (still structured) costs a tenth of anyio's start_soon per
                # task. Cancelling `_everything` cancels this host
                # task, and the TaskGroup then cancels every call once.
                async with asyncio.TaskGroup() as calls:
                    with self._intake:
                        await self._claim_loop(calls)
                    # Intake stopped: wait for calls, then stop the renewal loop.
                    while self.calls.active:
                        await self.calls.wait_slot(1.0)
                aux.cancel_scope.cancel()

    async def run_until_idle(self) -> None:
        """Claim until nothing is due, finish every call, return (tests and benchmarks)."""
        self._burst = True
        await self.run()

    # --- the claim loop -------------------------------------------------------------------

    async def _claim_loop(self, calls: asyncio.TaskGroup) -> None:
        inflight = self.calls
        while True:
            if inflight.free <= 0:
                await inflight.wait_slot(1.0)
                continue
            busy_before = bool(inflight.active)  # a call may save new due work in the round
            found = await self.claimer.round(calls)
            if not self.first_pass.is_set():
                self.first_pass.set()
            if found.got:
                self.last_claim_at = time.monotonic()
            self._watch(found)
            if found.got and not found.more and self.claim_linger:
                # The round found less than it asked for and nothing is left ready (a claim
                # promotes up to PROMOTE_LIMIT newly due tasks, so a backlog shows as ready):
                # wait a moment, so that the next round takes what comes due meanwhile in one
                # round trip. Every round costs the daemon and Redis a fixed price, and under
                # a steady stream of due work, claiming again at once made rounds of a few
                # tasks each (+20% daemon CPU per poll in W3). A full round, or work still
                # ready, claims again at once; a drain cuts the wait short.
                await anyio.sleep(self.claim_linger)
                continue
            if found.got or found.more:
                continue
            if self._burst:
                if not busy_before and not inflight.active and found.next_due == math.inf:
                    return
                await inflight.wait_slot(0.05)
                continue
            await self.claimer.idle(found.next_due)

    def _watch(self, found: Round) -> None:
        """Track 'due work exists but nothing was claimed' for the watchdog."""
        due_now = found.more or found.next_due <= time.time()
        if found.got or not due_now or self.calls.free <= 0:
            self.due_waiting_since = None
        elif self.due_waiting_since is None:
            self.due_waiting_since = time.monotonic()

    @property
    def stalled_for(self) -> float:
        """Seconds that due work has waited with free slots and no claim (0 if none)."""
        if self.due_waiting_since is None:
            return 0.0
        return time.monotonic() - self.due_waiting_since

    # --- one call -------------------------------------------------------------------------

    async def _run_call(self, claimed: Claimed, active: Call) -> None:
        task = claimed.task
        entry = self.handlers.get(task.handler)
        vendor = self.vendor
        try:
            try:
                async with active.cut:
                    active.begin()  # a call lost before it began is cut at once
                    if entry is None:
                        await vendor.unknown_handler(active, task)
                    else:
                        if active.phase == "submit":
                            call = vendor.submit
                        else:
                            call = vendor.query if active.phase == "query" else vendor.find
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
                if active.state is CALLING:  # not LOST: the cut is the task's deadline
                    # The query ran past the task's deadline: the save times the task out.
                    out = timed_out(task)
                    await self.saver.save(active, out.status, delay=out.delay)
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
            self.calls.forget(active)  # frees its slot, if a save did not (and says so)
            self.completed += 1
            # DONE, the common case (an outcome landed), owes nothing: not even a call.
            withdraw = None if active.state is DONE else active.end()
            if withdraw is not None:  # the call owes its lease: give it back
                await self.leases.release(active, withdraw=withdraw)
                self.calls.slot_freed.set()
