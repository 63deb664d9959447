"""The vendor calls: submit, query (cut at the task's deadline) and find, each with its
handler context. What each returns or raises is mapped by `Outcomes` (pure) to a `Save`
(or a `Reconcile`), which this module reports, logs and hands to `Saver`.

With `[telemetry] otel` each handler call is awaited inside a span (`tracing.VendorSpans`);
without, `self.spans` is None and a call pays only that test."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import secrets
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio
import httpx

from asynctaskd.config import Config
from asynctaskd.crashes import Crashes
from asynctaskd.errors import StoreUnavailable
from asynctaskd.handlers import HandlerContext, HandlerEntry, Succeeded
from asynctaskd.metrics import Metrics
from asynctaskd.model import Status, Task
from asynctaskd.store import Batcher, Code, Lease, Reconciled, Store
from asynctaskd.tracing import vendor_spans

from .call import CALLING, Call, InFlight
from .claiming import Claimer
from .outcomes import MAX_TEXT, Outcomes, Save, canceled
from .saving import Saver

T = TypeVar("T")

logger = logging.getLogger(__package__)


class _Handler:
    """What the calls of one handler share: looked up once, not on every poll."""

    __slots__ = ("http", "logger", "query_ok")

    def __init__(self, logger: logging.Logger, http: httpx.AsyncClient) -> None:
        self.logger = logger
        self.http = http
        self.query_ok: Any = None  # the calls histogram's (handler, query, ok) child, once used


class Vendor:
    """Runs one handler call of a claimed task and saves what came of it."""

    def __init__(
        self,
        store: Store,
        batcher: Batcher,
        config: Config,
        metrics: Metrics,
        inflight: InFlight,
        claimer: Claimer,
        saver: Saver,
        *,
        worker_id: str,
        lease_ms: int,
        http: httpx.AsyncClient,
        handler_http: dict[str, httpx.AsyncClient],
        rng: random.Random,
    ) -> None:
        self.store = store
        self.batcher = batcher
        self.config = config
        self.metrics = metrics
        self.crashes = Crashes(metrics)
        self.inflight = inflight
        self.claimer = claimer
        self.saver = saver
        self.outcomes = Outcomes(config.retry, rng)
        self.poll_interval = float(config.retry.poll_interval)
        self.id = worker_id
        self.lease_ms = lease_ms
        self.http = http
        self.handler_http = handler_http  # handlers with a proxy or size limit of their own
        # Per handler (by task.handler): its logger, client and metric children.
        self._handlers: dict[str, _Handler] = {}
        self.spans = vendor_spans(config.telemetry.otel)
        # Start tokens: unique to each start of this worker, and across workers and restarts.
        self._token_prefix = f"{secrets.token_hex(6)}-"
        self._token_serial = itertools.count(1)

    def ctx(self, entry: HandlerEntry, task: Task, lease: Lease) -> HandlerContext:
        handler = task.handler
        mine = self._handlers.get(handler)
        if mine is None:
            mine = self._handler(handler)
        return HandlerContext(
            task_id=task.id,
            idempotency_key=task.id,
            handler=handler,
            tenant=task.tenant,
            account=task.account,
            provider=entry.provider if task.provider == handler else task.provider,
            submit_attempt=task.submit_attempts,
            poll_count=task.poll_count,
            deadline_at=task.deadline_at,
            cancel_requested=task.cancel_requested,
            http=mine.http,
            logger=logging.LoggerAdapter(
                mine.logger, {"task_id": task.id, "handler": handler, "fence": lease.fence}
            ),
            metadata=task.metadata,
        )

    def _handler(self, handler: str) -> _Handler:
        """What every call of `handler` shares, looked up once."""
        mine = self._handlers[handler] = _Handler(
            logging.getLogger(f"asynctaskd.handler.{handler}"),
            self.handler_http.get(handler, self.http),
        )
        return mine

    def _traced(self, what: str, task: Task, attempt: int, call: Awaitable[T]) -> Awaitable[T]:
        """`call` (a handler's coroutine), to be awaited inside a span when tracing is on.
        A plain function, not a coroutine: no layer is added between a call and the loop."""
        spans = self.spans
        return call if spans is None else spans.call(what, task, attempt, call)

    def _account(self, save: Save, task: Task, active: Call) -> None:
        """Report the failure a save records (a handler's bug, counted and logged at a
        rate) and log its note, before saving it."""
        if save.failure is not None:
            attempt = task.submit_attempts + 1 if active.phase == "submit" else task.poll_count + 1
            phase = "submit" if active.phase == "submit" else "query"
            self.crashes.report(task.handler, task.id, phase, attempt, save.failure)
        if save.note is not None:
            level, text = save.note
            extra = {"task_id": task.id, "handler": task.handler, "fence": active.lease.fence}
            logger.log(level, text, extra=extra)

    # --- submit phase -----------------------------------------------------------------------

    async def submit(self, entry: HandlerEntry, task: Task, active: Call) -> None:
        idem = entry.idempotent
        active.mark(f"{self._token_prefix}{next(self._token_serial)}")
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
            await self.saver.withdraw(active, "START_UNCONFIRMED", str(exc)[:MAX_TEXT], delay=0.5)
            return
        if self.batcher.gate is not None:
            self.metrics.durability_gate.labels("ok" if durable else "timeout").observe(
                self.batcher.gate_seconds
            )
        if result.code is Code.CANCEL_REQUESTED:
            active.lease = Lease(active.lease.task_id, active.lease.fence, result.version)
            await self.saver.save(active, Status.CANCELED)
            return
        if not result.ok:
            self.metrics.rejected_writes.labels("start", result.code.name.lower()).inc()
            if result.code is not Code.ILLEGAL:  # ILLEGAL: release it (withdraw the mark)
                active.refused()
            return
        active.lease = Lease(active.lease.task_id, active.lease.fence, result.version)
        if not durable:
            # The started mark might not survive a failover: do not call the vendor.
            await self.saver.withdraw(active, "DURABILITY_TIMEOUT", "", delay=0.5)
            return
        active.start()
        ctx = self.ctx(entry, task, active.lease)
        ctx.submit_attempt = task.submit_attempts + 1
        t0 = time.perf_counter()
        outcome = "ok"
        try:
            out = await self._traced(
                "submit", task, ctx.submit_attempt, entry.handler.submit(task.params, ctx)
            )
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:
            outcome = "error"
            save = self.outcomes.submit_failed(exc, task, idempotent=idem, now=time.time())
        else:
            poll = entry.poll_interval or self.poll_interval
            save = self.outcomes.submitted(out, task, poll=poll, idempotent=idem, now=time.time())
        finally:
            self.metrics.calls.labels(task.handler, "submit", outcome).observe(
                time.perf_counter() - t0
            )
        if save.failure is not None or save.note is not None:
            self._account(save, task, active)
        await self.saver.save(
            active, save.status, delay=save.delay, fields=save.fields, must_land=save.must_land
        )

    # --- lookups of parked tasks -----------------------------------------------------------

    async def find(self, entry: HandlerEntry, task: Task, active: Call) -> None:
        """Ask the vendor for the job of a parked task (handler.find) and let `reconcile`
        settle the task from the answer (lua/reconcile.lua holds the rules)."""
        find = entry.hook("find")
        assert find is not None  # lookup hands out tasks of handlers with find only
        ctx = self.ctx(entry, task, active.lease)
        t0 = time.perf_counter()
        found: Any = None
        failure: BaseException | None = None
        try:
            found = await self._traced("find", task, active.lookups, find(task.params, ctx))
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:
            failure = exc
        answer = self.outcomes.found(
            found, failure, lookups=active.lookups, max_lookups=entry.find_max_tries
        )
        self.metrics.calls.labels(
            task.handler, "find", "ok" if answer.failure is None else "error"
        ).observe(time.perf_counter() - t0)
        self.metrics.lookups.labels(task.handler, answer.result).inc()
        if answer.failure is not None:
            self.crashes.report(task.handler, task.id, "find", active.lookups, answer.failure)
        call = self.store.ops.reconcile(
            active.lease,
            answer.result,
            retry_ms=answer.retry_ms,
            max_lookups=answer.max_lookups,
            give_up_ms=entry.find_give_up_ms,
            external_id=answer.external_id,
            handle_json=answer.handle_json,
            message=answer.message,
        )
        active.save_begins()
        done: Reconciled | None = None
        try:
            done = (await self.batcher.call(call))[0]
        except StoreUnavailable as exc:
            self.metrics.store_errors.labels("reconcile").inc()
            logger.warning("reconcile failed; the lookup is given back and runs again: %s", exc,
                           extra={"task_id": task.id})  # fmt: skip
            return
        finally:
            active.save_ends(landed=done is not None)
        self.inflight.forget(active)
        if not done.ok:
            self.metrics.rejected_writes.labels("reconcile", done.code.name.lower()).inc()
            return
        if done.what in ("found", "resubmitted", "gave_up"):
            self.metrics.reconciled.labels(active.handler, done.what).inc()
            log = logger.warning if done.what == "gave_up" else logger.info
            log("parked task reconciled: %s -> %s", done.what, done.status,
                extra={"task_id": task.id, "handler": task.handler})  # fmt: skip
        if done.status is not None and not done.status.is_settled:
            self.claimer.scheduled(0.0)

    # --- query phase ------------------------------------------------------------------------

    async def query(self, entry: HandlerEntry, task: Task, active: Call) -> None:
        # Every poll runs this: what it needs of its handler is looked up once (`_Handler`).
        handler = task.handler
        mine = self._handlers.get(handler)
        if mine is None:
            mine = self._handler(handler)
        ctx = self.ctx(entry, task, active.lease)
        query_handle = _query_handle(task)
        if task.cancel_requested:
            await self._cancel_remote(entry, task, query_handle, ctx)
            await self.saver.save(active, canceled().status)
            return
        t0 = time.perf_counter()
        outcome = "ok"
        # The call's timeout cuts the query at the task's deadline (Worker._run_call then
        # saves); it is lifted before any save, so only the vendor call is cut.
        budget = max(0.0, task.deadline_at - time.time()) + 0.05
        now = (active.loop or asyncio.get_running_loop()).time()  # (a getpid on 3.11)
        active.set_deadline(now + budget, now + self.lease_ms / 1000)  # see set_deadline
        failure: BaseException | None = None
        spans = self.spans
        try:
            call = entry.handler.query(query_handle, ctx)
            if spans is not None:
                call = spans.call("query", task, task.poll_count + 1, call)
            out = await call
        except anyio.get_cancelled_exc_class():
            if active.cut.expired() and active.state is CALLING:  # not LOST: the deadline
                outcome = "deadline"
            raise
        except BaseException as exc:
            outcome = "error"
            failure = exc
        finally:
            active.set_deadline(None)
            took = time.perf_counter() - t0
            if outcome == "ok":
                ok = mine.query_ok
                if ok is None:  # the series appears with its first observation, as before
                    ok = mine.query_ok = self.metrics.calls.labels(handler, "query", "ok")
                ok.observe(took)
            else:
                self.metrics.calls.labels(handler, "query", outcome).observe(took)
        outcomes = self.outcomes
        if failure is not None:
            save = outcomes.query_failed(failure, task, now=time.time())
        else:
            poll = entry.poll_interval or self.poll_interval
            mapped = outcomes.queried(out, task, poll=poll, now=time.time())
            if isinstance(mapped, Succeeded):
                save = await self._finalized(entry, task, ctx, mapped.result)
            else:
                save = mapped
        if save.failure is not None or save.note is not None:
            self._account(save, task, active)
        await self.saver.save(active, save.status, delay=save.delay, fields=save.fields)

    async def _finalized(
        self, entry: HandlerEntry, task: Task, ctx: HandlerContext, result: Any
    ) -> Save:
        """A job's result through the handler's finalize hook, if it has one."""
        finalize = entry.hook("finalize")
        if finalize is not None:
            try:
                result = await self._traced(
                    "finalize", task, task.poll_count + 1, finalize(result, ctx)
                )
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as exc:
                return self.outcomes.query_failed(exc, task, now=time.time())
        return self.outcomes.succeeded(result, task)

    async def _cancel_remote(
        self, entry: HandlerEntry, task: Task, query_handle: dict[str, Any], ctx: HandlerContext
    ) -> None:
        cancel = entry.hook("cancel")
        if cancel is None:
            return
        with anyio.move_on_after(max(1.0, self.lease_ms / 2000)):
            try:
                await self._traced("cancel", task, task.poll_count + 1, cancel(query_handle, ctx))
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as exc:
                logger.warning("remote cancel failed: %s", exc, extra={"task_id": task.id})

    async def unknown_handler(self, active: Call, task: Task) -> None:
        save = self.outcomes.unknown_handler(task, active.phase, self.id, now=time.time())
        if save.failure is not None or save.note is not None:
            self._account(save, task, active)
        await self.saver.save(active, save.status, delay=save.delay, fields=save.fields)


def _query_handle(task: Task) -> dict[str, Any]:
    """What query() and cancel() receive: the stored query fields plus the external id."""
    handle = task.handle or {}
    query = dict(handle.get("query") or {})
    query.setdefault("external_id", handle.get("external_id") or task.external_id)
    return query
