"""One call in flight (`Call`), and the calls a worker holds (`InFlight`)."""

from __future__ import annotations

import asyncio
import math
from typing import Literal

import anyio

from asynctaskd.model import Phase
from asynctaskd.store import Lease

CallPhase = Phase | Literal["find"]  # "find": a vendor lookup of a parked task


class Call:
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


class InFlight:
    """The calls that hold a lease, by task id, and the event a freed slot sets."""

    __slots__ = ("active", "max", "slot_freed")

    def __init__(self, max_inflight: int) -> None:
        self.active: dict[str, Call] = {}
        self.max = max_inflight
        self.slot_freed = anyio.Event()

    @property
    def free(self) -> int:
        return self.max - len(self.active)

    def forget(self, call: Call) -> None:
        """The call no longer holds its lease: free its slot (once)."""
        task_id = call.lease.task_id
        if self.active.get(task_id) is call:
            del self.active[task_id]
            self.slot_freed.set()

    async def wait_slot(self, timeout: float) -> None:
        self.slot_freed = anyio.Event()
        with anyio.move_on_after(timeout):
            await self.slot_freed.wait()
