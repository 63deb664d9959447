"""The vendor calls: submit, query (cut at the task's deadline) and find, each with its
handler context; what each returns or raises becomes one save (see `Saver`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import secrets
import time
from typing import Any

import anyio
import httpx

from asynctaskd.codec import check_json_like, encode_json
from asynctaskd.config import Config
from asynctaskd.crashes import Crashes, describe
from asynctaskd.errors import HandlerError, InvalidTask, PermanentError, StoreUnavailable
from asynctaskd.handlers import (
    Failed,
    HandlerContext,
    HandlerEntry,
    Running,
    Submitted,
    Succeeded,
    valid_progress,
)
from asynctaskd.metrics import Metrics
from asynctaskd.model import Status, Task
from asynctaskd.retry import (
    SubmitFailure,
    backoff,
    clamp_delay,
    classify_submit_error,
    delay_ms,
    retry_after,
)
from asynctaskd.store import Batcher, Code, Lease, Reconciled, Store

from .call import CALLING, Call, InFlight
from .claiming import Claimer
from .saving import Saver

logger = logging.getLogger(__package__)

_MAX_TEXT = 1000  # stage/message stored at most this long


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
        self.id = worker_id
        self.lease_ms = lease_ms
        self.http = http
        self.handler_http = handler_http  # handlers with a proxy or size limit of their own
        self.rng = rng
        self.poll_jitter = config.retry.poll_jitter
        self._loggers: dict[str, logging.Logger] = {}
        # Start tokens: unique to each start of this worker, and across workers and restarts.
        self._token_prefix = f"{secrets.token_hex(6)}-"
        self._token_serial = itertools.count(1)

    def ctx(self, entry: HandlerEntry, task: Task, lease: Lease) -> HandlerContext:
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
            await self.saver.withdraw(active, "START_UNCONFIRMED", str(exc)[:_MAX_TEXT], delay=0.5)
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
        await self.saver.save(
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

    async def _submit_failed(
        self, entry: HandlerEntry, task: Task, active: Call, exc: BaseException
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
            await self.saver.save_started(
                active, Status.FAILED, fields={"error_code": code, "error_message": message}
            )
        elif kind is SubmitFailure.AMBIGUOUS:
            logger.warning("submit outcome unknown: %s", message, extra=log_extra)
            await self.saver.save_started(
                active, Status.SUBMIT_UNKNOWN, fields={"error_code": code, "error_message": message}
            )
        elif kind is SubmitFailure.THROTTLED:
            throttles = task.throttles + 1
            await self.saver.save_started(
                active,
                Status.PENDING_SUBMIT,
                delay=self._retry_delay(exc, throttles, task),
                fields={"error_code": code, "error_message": message, "throttles": throttles},
            )
        elif attempts > retry.max_submit_retries:
            await self.saver.save_started(
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
            await self.saver.save_started(
                active,
                Status.PENDING_SUBMIT,
                delay=delay,
                fields={"error_code": code, "error_message": message},
            )

    # --- lookups of parked tasks -----------------------------------------------------------

    async def find(self, entry: HandlerEntry, task: Task, active: Call) -> None:
        """Ask the vendor for the job of a parked task (handler.find) and let `reconcile`
        settle the task from the answer (lua/reconcile.lua holds the rules)."""
        find = entry.hook("find")
        assert find is not None  # lookup hands out tasks of handlers with find only
        ctx = self.ctx(entry, task, active.lease)
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
        active.save_begins()
        done: Reconciled | None = None
        try:
            done = (await self.batcher.call(call))[0]
        except StoreUnavailable as exc:
            self.metrics.store_errors.labels("reconcile").inc()
            logger.warning("reconcile failed; the lookup's lease will expire: %s", exc,
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
        ctx = self.ctx(entry, task, active.lease)
        query_handle = _query_handle(task)
        if task.cancel_requested:
            await self._cancel_remote(entry, task, query_handle, ctx)
            await self.saver.save(active, Status.CANCELED)
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
            if active.cut.expired() and active.state is CALLING:  # not LOST: the deadline
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
            await self.saver.save(
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
            await self.saver.save(active, Status.FAILED, fields=fields)
        else:
            await self._query_failed(
                task,
                active,
                InvalidTask(f"query() returned {type(out).__name__}, not Running/Succeeded/Failed"),
            )

    async def _succeeded(
        self, entry: HandlerEntry, task: Task, active: Call, ctx: HandlerContext, result: Any
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
            await self.saver.save(
                active,
                Status.FAILED,
                fields={"error_code": "INVALID_RESULT", "error_message": str(exc)[:_MAX_TEXT]},
            )
            return
        await self.saver.save(
            active,
            Status.SUCCEEDED,
            fields={
                "result": blob,
                "poll_count": task.poll_count + 1,
                "progress": "1.0",
                "throttles": "",
            },
        )

    async def _query_failed(self, task: Task, active: Call, exc: BaseException) -> None:
        retry = self.config.retry
        code, message = describe(exc)
        self.crashes.report(task.handler, task.id, "query", task.poll_count + 1, exc)
        if isinstance(exc, PermanentError):
            await self.saver.save(
                active, Status.FAILED, fields={"error_code": code, "error_message": message}
            )
            return
        if getattr(exc, "throttled", False):
            # No error budget spent, but each throttle in a row waits twice as long (with
            # jitter, up to max_error_delay), or what the vendor asked for if longer.
            throttles = task.throttles + 1
            await self.saver.save(
                active,
                task.status,
                delay=self._retry_delay(exc, throttles, task),
                fields={"error_code": code, "error_message": message, "throttles": throttles},
            )
            return
        errors = task.consecutive_errors + 1
        if errors >= retry.max_consecutive_errors:
            await self.saver.save(
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
        await self.saver.save(
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

    async def unknown_handler(self, active: Call, task: Task) -> None:
        message = f"no handler {task.handler!r} is registered in daemon {self.id}"
        if active.phase == "submit":
            # Nothing was sent: the task cannot run anywhere that lacks the handler.
            await self.saver.save(
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
