"""One call in flight (`Call`), the state it is in, and the calls a worker holds.

A call's state says what it still owes its lease: whether renewal may report it lost,
whether it gives the lease back when it ends (and how), and whether a cut means the
lease is gone or the task's deadline passed. Every move is checked against `MOVES`.

    CLAIMED ──begin──> CALLING ──mark──> MARKED ──start──> STARTED
       │                  │                │                  │  └─lose (NO_LEASE)─> LATE
       └──────────────────┴──── lose ──────┴──────────────────┴─────────> LOST
    CALLING | MARKED | STARTED | LATE | LOST ──save──> SAVING | LANDING
    SAVING | LANDING ──landed or refused──> DONE;  ──gave up──> back where it began
    MARKED | LOST ──start refused──> DONE
    CLAIMED | CALLING | MARKED | STARTED ──end──> RELEASING ──lose──> LOST

- CLAIMED: leased; the call has not begun (it has not entered its `cut`).
- CALLING: the call runs: a query or find, a submit before its start mark, a remote
  cancel. A cut now is the task's deadline (only a query arms one).
- MARKED: a submit sent its start mark with this call's token; the vendor was not
  called. Given back, the lease withdraws the mark (`withdraw`), not just the lease.
- STARTED: the vendor's submit began: cancelling it would make its outcome unknown, so
  the outcome must land (saves from here on are landing saves).
- LATE: a started submit whose lease is gone (NO_LEASE): it goes on, since the late-save
  rule may still accept its handle under the same fence; it gives nothing back.
- LOST: the lease is gone (renewal said so) and the call is cut at its next wait. Moves
  that only mark progress (`mark`, `start`) leave a lost call lost; it gives nothing back.
- SAVING: a save runs in the call's own task. Renewal ignores a NO_LEASE now (it may be
  this very save giving the lease back). A save that gives up returns to where it began.
- LANDING: a must-land save runs in the landing group and outlives the call: a call
  cancelled now ends without giving the lease back (the save still holds it). If the
  call ended meanwhile, a save that gives up ends in DONE (the lease is left to expire).
- DONE: an outcome landed, or there is nothing left to give back (a refused write).
- RELEASING: the call ended owing its lease: it is being given back (`Leases.release`).

Renewal renews every lease but DONE, LOST and LATE ones, and only CLAIMED, CALLING, MARKED,
STARTED and RELEASING calls can be found lost (`LOSABLE`).
"""

from __future__ import annotations

import asyncio
import enum
import math
from types import TracebackType
from typing import Any, Literal

import anyio

from asynctaskd.model import Phase
from asynctaskd.store import Lease

CallPhase = Phase | Literal["find"]  # "find": a vendor lookup of a parked task


class CallState(enum.Enum):
    # Hashed by identity (members are singletons): Enum's own __hash__ is Python code,
    # and each move looks its state up in MOVES (4x cheaper; a call moves ~5 times).
    __hash__ = object.__hash__

    CLAIMED = "claimed"
    CALLING = "calling"
    MARKED = "marked"
    STARTED = "started"
    LATE = "late"
    LOST = "lost"
    SAVING = "saving"
    LANDING = "landing"
    DONE = "done"
    RELEASING = "releasing"


CLAIMED = CallState.CLAIMED
CALLING = CallState.CALLING
MARKED = CallState.MARKED
STARTED = CallState.STARTED
LATE = CallState.LATE
LOST = CallState.LOST
SAVING = CallState.SAVING
LANDING = CallState.LANDING
DONE = CallState.DONE
RELEASING = CallState.RELEASING

MOVES: dict[CallState, frozenset[CallState]] = {
    CLAIMED: frozenset({CALLING, LOST, RELEASING}),
    CALLING: frozenset({MARKED, SAVING, LOST, RELEASING}),
    MARKED: frozenset({STARTED, SAVING, LANDING, DONE, LOST, RELEASING}),
    STARTED: frozenset({SAVING, LANDING, LATE, LOST, RELEASING}),
    LATE: frozenset({SAVING, LANDING}),
    LOST: frozenset({SAVING, LANDING, DONE}),
    SAVING: frozenset({DONE}),  # or back where it began (save_ends)
    LANDING: frozenset({DONE}),  # or back where it began (save_ends)
    DONE: frozenset(),
    RELEASING: frozenset({LOST}),
}
LOSABLE = frozenset({CLAIMED, CALLING, MARKED, STARTED, RELEASING})
_IN_CUT = frozenset({CALLING, MARKED, STARTED})  # states of a call inside its `cut`


class IllegalMove(RuntimeError):
    """A call state moved in a way the state diagram does not allow: a bug."""


# The states of a `Cut`, as asyncio.Timeout's: ints, compared without Enum lookups.
_CREATED, _ENTERED, _EXPIRING, _EXPIRED, _EXITED = range(5)


class Cut:
    """`asyncio.timeout(None)` as a call needs it, with the same rules: entered once, in a
    task; `reschedule(when)` (loop time, None: never) while entered; when it fires, the
    task is cancelled and the cancellation leaves the block as TimeoutError, unless the
    task was also cancelled by someone else (then it stays a cancellation).

    One per call, entered and left on every poll: asyncio's own class builds its timer
    state through an Enum and a helper per step, several times the work of this one
    (bench/daemon_cost.py). tests/test_call_state.py holds it to asyncio's semantics.
    """

    __slots__ = ("_cancelling", "_handle", "_loop", "_state", "_task", "_when")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        # `loop`, when given, is the loop it is entered on: asking asyncio for the current
        # task without it asks for the running loop, a getpid system call on Python 3.11.
        self._loop = loop
        self._state = _CREATED
        self._when: float | None = None
        self._handle: asyncio.Handle | None = None
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0

    def when(self) -> float | None:
        """The loop time it fires at (None: never)."""
        return self._when

    def expired(self) -> bool:
        """Whether it fired (the block is being, or was, cut)."""
        return self._state == _EXPIRING or self._state == _EXPIRED

    def reschedule(self, when: float | None) -> None:
        """Fire at loop time `when` (at once if it has passed; None: never)."""
        if self._state != _ENTERED:
            raise RuntimeError("the cut is not entered (or is over): it cannot be rescheduled")
        self._when = when
        handle = self._handle
        if handle is not None:
            handle.cancel()
        if when is None:
            self._handle = None
        else:
            loop = asyncio.get_running_loop()
            if when <= loop.time():
                self._handle = loop.call_soon(self._fire)
            else:
                self._handle = loop.call_at(when, self._fire)

    async def __aenter__(self) -> Cut:
        if self._state != _CREATED:
            raise RuntimeError("a cut is entered once")
        task = asyncio.current_task(self._loop)
        if task is None:
            raise RuntimeError("a cut is entered inside a task")
        self._state = _ENTERED
        self._task = task
        self._cancelling = task.cancelling()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        handle = self._handle
        if handle is not None:
            handle.cancel()
            self._handle = None
        state = self._state
        if state == _EXPIRING:
            self._state = _EXPIRED
            task = self._task
            assert task is not None
            if task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc  # ours, and no one else's: the cut
        elif state == _ENTERED:
            self._state = _EXITED

    def _fire(self) -> None:
        task = self._task
        assert task is not None
        task.cancel()
        self._state = _EXPIRING
        self._handle = None


class Call:
    """A call in flight: the lease it holds, its state, and the timeout that cuts it short.

    The call runs inside `cut` (a `Cut`: asyncio's timeout, slimmed), which has no
    deadline except while a query runs (the task's deadline). The renewal loop makes it
    expire at once when the lease is gone. One such timeout per call instead of an anyio
    cancel scope (plus `fail_after` per query): this runs thousands of times a second,
    and the anyio scope cost several times the asyncio timeout when measured.
    """

    __slots__ = (
        "_resume",
        "cut",
        "deadline",
        "handler",
        "lease",
        "lookups",
        "loop",
        "phase",
        "state",
        "token",
    )

    def __init__(
        self,
        lease: Lease,
        phase: CallPhase,
        handler: str,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.lease = lease
        self.phase = phase
        self.handler = handler  # metric label: a registered key, or "other"
        self.state = CLAIMED
        self._resume = CLAIMED  # where a save that gives up returns to
        self.loop = loop  # the loop the call runs on, if the caller knows it (else None)
        self.cut = Cut(loop)
        self.deadline: float | None = None  # loop time the running query is cut at
        self.token = ""  # this call's start token (withdraw takes back only its own mark)
        self.lookups = 0  # a lookup: the parked task's lookups so far, this one included

    def _illegal(self, to: CallState | str) -> IllegalMove:
        name = to if isinstance(to, str) else to.name
        return IllegalMove(f"call of {self.lease.task_id}: {self.state.name} -> {name}")

    # --- the moves ------------------------------------------------------------------------
    # Each checks its move against MOVES inline: a call moves ~5 times, and a helper call
    # per move measured ~0.5% of the daemon's instructions per task (bench/daemon_cost.py).

    def begin(self) -> None:
        """The call entered its `cut`; one lost before it began is cut at once."""
        state = self.state
        if state is LOST:
            self.cut.reschedule(0.0)
        elif CALLING in MOVES[state]:
            self.state = CALLING
        else:
            raise self._illegal(CALLING)

    def mark(self, token: str) -> None:
        """A submit sends its start mark with `token`."""
        self.token = token
        state = self.state
        if state is not LOST:
            if MARKED not in MOVES[state]:
                raise self._illegal(MARKED)
            self.state = MARKED

    def start(self) -> None:
        """The vendor's submit begins."""
        state = self.state
        if state is not LOST:
            if STARTED not in MOVES[state]:
                raise self._illegal(STARTED)
            self.state = STARTED

    def refused(self) -> None:
        """The start mark was refused for good: nothing is left to give back."""
        if DONE not in MOVES[self.state]:
            raise self._illegal(DONE)
        self.state = DONE

    def lose(self, no_lease: bool) -> None:
        """Renewal found the lease gone (`no_lease`: NO_LEASE, not a newer fence): stop the
        call as soon as it next waits, unless a started submit may still land late."""
        was = self.state
        to = LATE if was is STARTED and no_lease else LOST
        if to not in MOVES[was]:
            raise self._illegal(to)
        self.state = to
        if to is LOST and was in _IN_CUT and not self.cut.expired():
            self.cut.reschedule(0.0)  # in the past: fires on the next loop iteration

    def save_begins(self, landing: bool = False) -> None:
        state = self.state
        to = LANDING if landing else SAVING
        if to not in MOVES[state]:
            raise self._illegal(to)
        self._resume = state
        self.state = to

    def save_ends(self, landed: bool, call_over: bool = False) -> None:
        """A save ended: `landed` (or refused: either way its lease is settled), or gave
        up; `call_over`: a landing save whose call has ended (it owes nothing more)."""
        state = self.state
        if state is not SAVING and state is not LANDING:
            raise self._illegal("the end of a save")
        # DONE, or back to where the save began (a legal state: save_begins left it)
        self.state = DONE if landed or call_over else self._resume

    def end(self) -> bool | None:
        """The call is over: None if it owes its lease nothing, else it moves to RELEASING
        and says whether giving the lease back withdraws a start mark (MARKED)."""
        was = self.state
        if RELEASING not in MOVES[was]:
            return None  # LATE, LOST, SAVING, LANDING, DONE, RELEASING: nothing to give
        self.state = RELEASING
        return was is MARKED

    # --- the deadline ---------------------------------------------------------------------

    def set_deadline(self, when: float | None, arm_by: float = math.inf) -> None:
        """Cut the call at loop time `when` (None: no deadline), unless it is being cut.

        A deadline later than `arm_by` is only noted, and armed by `arm_near` once it
        comes near: most queries end long before their task's deadline, and arming and
        disarming the timeout for each showed in every poll's profile.
        """
        self.deadline = when
        # The cut's state and time read here, not through expired() and when(): this runs
        # twice per poll, and those calls were most of its cost.
        cut = self.cut
        state = cut._state
        if self.state is LOST or state in (_EXPIRING, _EXPIRED):
            return
        if when is None:
            if cut._when is not None:
                cut.reschedule(None)
        elif when <= arm_by:
            cut.reschedule(when)

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
