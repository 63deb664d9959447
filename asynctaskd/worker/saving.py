"""Saving: every outcome goes through `Store.save` (or `withdraw`), which enforces fence
and version; a save that must land (a vendor handle in hand) outlives its call."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import anyio

from asynctaskd.config import Config
from asynctaskd.errors import StoreUnavailable
from asynctaskd.metrics import Metrics
from asynctaskd.model import Status
from asynctaskd.retry import delay_ms
from asynctaskd.store import Batcher, Result, Store

from .call import Call, InFlight
from .claiming import Claimer

logger = logging.getLogger(__package__)


class Saver:
    def __init__(
        self,
        store: Store,
        batcher: Batcher,
        config: Config,
        metrics: Metrics,
        inflight: InFlight,
        claimer: Claimer,
        lease_ms: int,
    ) -> None:
        self.store = store
        self.batcher = batcher
        self.config = config
        self.metrics = metrics
        self.inflight = inflight
        self.claimer = claimer
        self.lease_ms = lease_ms
        # Saves that must land run here, outside the calls' group (set by Worker.run).
        self.landing: asyncio.TaskGroup | None = None

    async def save(
        self,
        active: Call,
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
        active.save_begins()
        result = None
        try:
            result = await self._save_once(active, status, delay=delay, fields=fields)
            return result
        finally:
            active.save_ends(result is not None)

    async def save_started(
        self,
        active: Call,
        status: Status,
        *,
        delay: float = 0.0,
        fields: dict[str, Any] | None = None,
    ) -> Result | None:
        """The outcome of a submit whose vendor call started: a fact the task must not lose
        (given up, the task would be parked in SUBMIT_UNKNOWN for an operator)."""
        return await self.save(active, status, delay=delay, fields=fields, must_land=True)

    async def withdraw(
        self, active: Call, code: str, message: str, *, delay: float = 0.0
    ) -> Result | None:
        """The submit's vendor call did not happen: take back its start mark, if it is in
        Redis and its own (its token; a fence can be handed out twice across a failover),
        with the lease. Retried as a vendor handle is, across a failover too."""
        fields = {"error_code": code, "error_message": message}
        return await self.save(
            active, Status.PENDING_SUBMIT, delay=delay, fields=fields, must_land=True, withdraw=True
        )

    async def _save_landing(
        self,
        active: Call,
        status: Status,
        *,
        delay: float,
        fields: dict[str, Any] | None,
        withdraw: bool = False,
    ) -> Result | None:
        """Save a vendor handle from a task of its own in the landing group: if this call
        is cancelled meanwhile (drain, lost lease), the save still runs to the end. The
        call waits for it, so it keeps its slot and its lease stays renewed."""
        if self.landing is None:  # not running under run(): nothing to outlive
            active.save_begins()
            result = None
            try:
                result = await self._save_once(
                    active, status, delay=delay, fields=fields, must_land=True, withdraw=withdraw
                )
                return result
            finally:
                active.save_ends(result is not None)
        landed: asyncio.Future[Result | None] = asyncio.get_running_loop().create_future()

        async def land() -> None:
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
                over = landed.done()  # a cancelled wait cancels the future: the call ended
                active.save_ends(landed=result is not None, call_over=over)
                if not over:
                    landed.set_result(result)

        active.save_begins(landing=True)
        self.landing.create_task(land())
        return await landed

    async def _save_once(
        self,
        active: Call,
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
            if result.ok:  # the call moves to DONE when this returns
                self.inflight.forget(active)
                final = result.status or status
                # `_value_`, not `.value` (a descriptor in Python code): once per poll.
                self.metrics.transitions.labels(active.handler, final._value_).inc()
                if final is Status.RUNNING or final is Status.SUBMITTED or not final.is_settled:
                    self.claimer.scheduled(delay if final is status else 0.0)
                elif final is Status.SUBMIT_UNKNOWN and active.handler in self.claimer.finders:
                    self.claimer.look_now()  # parked due for a lookup: look at once
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
            return result  # nothing more to do with this lease: DONE
