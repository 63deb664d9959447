"""Leases: the renewal loop (one call per shard for every held lease, cancelling a call
whose lease is gone) and giving a lease back without an outcome."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio

from asynctaskd.metrics import Metrics
from asynctaskd.store import Code, Store

from .call import DONE, LATE, LOSABLE, LOST, Call, InFlight

# Calls whose lease renewal cannot help: settled (DONE), or found gone before (LOST, LATE:
# a lease that is gone never comes back, and asking again costs Redis a renew per pass).
_NOT_RENEWED = frozenset({DONE, LOST, LATE})

logger = logging.getLogger(__package__)


class Leases:
    def __init__(self, store: Store, metrics: Metrics, inflight: InFlight, lease_ms: int) -> None:
        self.store = store
        self.metrics = metrics
        self.inflight = inflight
        self.lease_ms = lease_ms

    async def renew_loop(self) -> None:
        interval = self.lease_ms / 3000
        active = self.inflight.active
        while True:
            await anyio.sleep(interval)
            if not active:
                continue
            # Query deadlines within a lease are armed: at least two passes before them.
            arm_by = asyncio.get_running_loop().time() + self.lease_ms / 1000
            for call in active.values():
                call.arm_near(arm_by)
            held = [c for c in active.values() if c.state not in _NOT_RENEWED]
            try:
                codes = await self.store.renew(self.lease_ms, [c.lease for c in held])
            except Exception as exc:  # the renewal loop must outlive any one failure
                self.metrics.store_errors.labels("renew").inc()
                logger.warning("lease renewal failed: %s", exc)
                continue
            for call in held:
                code = codes.get(call.lease.task_id, Code.OK)
                # Skip calls that saved (and gave the lease back) while renew was in flight,
                # that are saving (a NO_LEASE may be that save), or were found lost before.
                if code is Code.OK or call.state not in LOSABLE:
                    continue
                task_id = call.lease.task_id
                self.metrics.leases_lost.inc()
                logger.warning(
                    "lease lost (%s), cancelling the call",
                    code.name,
                    extra={"task_id": task_id, "fence": call.lease.fence},
                )
                # A started submit may still return a handle that the late-save rule
                # accepts (same fence); only a newer fence makes it pointless.
                call.lose(no_lease=code is Code.NO_LEASE)

    async def release(self, call: Call, *, withdraw: bool) -> None:
        """Give back a lease without an outcome (shielded, capped): peers take it at once.
        A submit cut off after its vendor call started is parked by the script itself; one
        cut off before (`withdraw`: its start sent, the vendor not called) takes its mark
        back."""
        with anyio.move_on_after(2.0, shield=True):
            try:
                if withdraw:
                    fields: dict[str, Any] = {
                        "error_code": "INTERRUPTED_BEFORE_SUBMIT",
                        "error_message": "",
                    }
                    await self.store.run(
                        self.store.ops.withdraw(call.lease, call.token, fields=fields)
                    )
                    return
                codes = await self.store.release([call.lease])
                code = codes.get(call.lease.task_id)
                if code is Code.STARTED:
                    logger.warning(
                        "submit interrupted after the vendor call started: SUBMIT_UNKNOWN",
                        extra={"task_id": call.lease.task_id},
                    )
            except Exception as exc:  # cleanup must never kill the worker
                logger.warning("release failed; the lease will expire: %s", exc)
