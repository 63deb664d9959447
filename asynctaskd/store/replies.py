"""Script calls and their replies: `Call` (one script invocation), the reply types every
caller sees (`Code`, `Result`, `Created`, `Lease`, `Claimed`, `ClaimBatch`, ...) and the
decoders that read the scripts' replies into them. Pure: no I/O."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Final, Generic, TypeVar

import msgspec

from asynctaskd.codec import decode_request, decode_task
from asynctaskd.errors import CorruptTask, ScriptError
from asynctaskd.model import Status, Task, shard_of

T = TypeVar("T")


class Code(enum.IntEnum):
    """Reply codes shared by every script (docs/protocol.md lists the same table)."""

    OK = 1
    ACCEPTED = 2  # create: deduped to a live task; cancel: requested from the holder
    NOT_FOUND = -1
    STALE_FENCE = -2
    WRONG_VERSION = -3
    NO_LEASE = -4
    EXISTS = -5
    CANCEL_REQUESTED = -6
    ILLEGAL = -7
    STARTED = -8
    TERMINAL = -9
    DEDUP_STALE = -12  # create: the dedup key names a task that is gone; a daemon frees it


class Result(msgspec.Struct, frozen=True):
    """Outcome of a single-task write. Rejections are values, not exceptions."""

    code: Code
    version: int = 0
    status: Status | None = None

    @property
    def ok(self) -> bool:
        return self.code is Code.OK


class Created(msgspec.Struct, frozen=True):
    task_id: str
    deduped: bool
    version: int = 1
    created_ms: int = 0
    due_ms: int = 0
    # deduped to a task that no longer exists (task_id): a daemon frees the dedup key when it
    # next takes in requests, so the create can be sent again (Code.DEDUP_STALE)
    stale: bool = False


class Lease(msgspec.Struct, frozen=True):
    """What a worker holds while it works on a task: the fence and the version it read."""

    task_id: str
    fence: int
    version: int

    @property
    def shard(self) -> int:
        return shard_of(self.task_id)


class Claimed(msgspec.Struct, frozen=True):
    lease: Lease
    task: Task


class ClaimBatch(msgspec.Struct, frozen=True):
    claimed: list[Claimed]
    next_due_ms: int | None  # earliest due time still waiting in the phase, None if none
    ready_left: int  # due tasks still waiting to be claimed
    dropped: int  # entries found unclaimable (gone, timed out, canceled, quarantined, held)
    corrupt: list[CorruptTask] = []
    lanes: dict[str, tuple[int, int]] = {}  # rate lane -> (tokens used, tasks waiting)
    taken: int = 0  # producer requests taken in (submit phase; lua/_intake.lua)
    refused: list[tuple[str, str]] = []  # (task id, why) of create requests dropped


class Sweep(msgspec.Struct, frozen=True):
    """What a deadline sweep (`time_out`) did: the tasks it timed out, and the producer
    requests it took in first, with the creates it dropped (as a claim reports them)."""

    timed_out: list[str]
    taken: int = 0
    refused: list[tuple[str, str]] = []  # (task id, why)


class LookupBatch(msgspec.Struct, frozen=True):
    """What `lookup` claimed: parked tasks leased for a vendor lookup (lua/lookup.lua)."""

    claimed: list[Claimed]
    next_due_ms: int | None  # earliest lookup still scheduled in the shard, None if none
    due_left: int  # due lookups left (of handlers this daemon does not serve, or beyond n)
    dropped: int  # entries that were no lookups to do (gone, settled, unreadable, leased)
    corrupt: list[CorruptTask] = []
    lookups: list[int] = []  # per claimed task: its lookups so far, this one included


class Reconciled(msgspec.Struct, frozen=True):
    """Outcome of a `reconcile`: a Result, and what the lookup settled."""

    code: Code
    version: int = 0
    status: Status | None = None
    what: str = ""  # found, resubmitted, again, gave_up

    @property
    def ok(self) -> bool:
        return self.code is Code.OK


class Call(msgspec.Struct, Generic[T], eq=False):
    """One script invocation: everything needed to run it and read its reply.

    Compared and hashed by identity, as a plain object. A msgspec Struct for its C
    constructor: every save and claim builds one."""

    script: str
    keys: list[str]
    args: list[Any]
    decode: Callable[[Any], T]


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# Every write's reply goes through _result: the usual values are looked up (less than
# half the cost of parsing them), anything else is parsed, and refused with the same error.
_CODES: Final = {code.value: code for code in Code}
_STATUS_OF: Final = {status.value.encode(): status for status in Status}
_WITH_VERSION: Final = frozenset((Code.OK, Code.ACCEPTED, Code.CANCEL_REQUESTED))


def _status_of(value: Any) -> Status:
    return _STATUS_OF.get(value) or Status(_s(value))


def _result(reply: Any) -> Result:
    try:
        code = _CODES.get(reply[0]) or Code(int(reply[0]))
        if code in _WITH_VERSION and len(reply) > 1:
            status = _status_of(reply[2]) if len(reply) > 2 else None
            return Result(code, int(reply[1]), status)
        if code in (Code.ILLEGAL, Code.TERMINAL) and len(reply) > 1:
            return Result(code, 0, _status_of(reply[1]))
        return Result(code)
    except (ValueError, TypeError, IndexError) as exc:
        raise ScriptError(f"unexpected reply {reply!r}: {exc}") from None


def _codes(reply: Any) -> list[Code]:
    try:
        return [Code(int(c)) for c in reply]
    except (ValueError, TypeError) as exc:
        raise ScriptError(f"unexpected reply {reply!r}: {exc}") from None


def _id_list(reply: Any) -> list[str]:
    count = int(reply[0])
    ids = [_s(x) for x in reply[1:]]
    if len(ids) != count:
        raise ScriptError(f"reply says {count} ids but has {len(ids)}")
    return ids


def _intake(reply: Any) -> tuple[int, list[tuple[str, str]]]:
    """A script's intake report {taken, task_id, why, ...}: (taken, [(task_id, why), ...])."""
    refused = [(_s(reply[i]), _s(reply[i + 1])) for i in range(1, len(reply) - 1, 2)]
    return int(reply[0]), refused


def _sweep(reply: Any) -> Sweep:
    try:
        taken, refused = _intake(reply[-1])
        return Sweep(_id_list(reply[:-1]), taken, refused)
    except (ValueError, TypeError, IndexError) as exc:
        raise ScriptError(f"unexpected reply {reply!r}: {exc}") from None


def _pairs(reply: Any) -> list[tuple[str, Status]]:
    count = int(reply[0])
    flat = reply[1:]
    out = [(_s(flat[i]), Status(_s(flat[i + 1]))) for i in range(0, len(flat), 2)]
    if len(out) != count:
        raise ScriptError(f"reply says {count} tasks but has {len(out)}")
    return out


def task_or_request(raw: Any, request: Any, task_id: str) -> Any:
    """The task hash as read, or, while it does not exist yet, the fields of its create
    request (lua/_intake.lua): a task reads as PENDING_SUBMIT from the moment it is
    submitted. Read the request first, then the hash (one pipeline): a daemon that takes
    the request in between leaves the hash to be read. Raises CorruptTask if the request
    cannot be read."""
    if raw or not request:
        return raw
    return decode_request(request, task_id)


def _task_reply(raw: Any, task_id: str) -> Task | None:
    if not raw:
        return None
    return decode_task(raw, task_id)
