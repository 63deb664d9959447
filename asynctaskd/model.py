"""The task model: statuses, the legal transitions between them, and the Task snapshot.

The transition table below is the single written source of the lifecycle (docs/protocol.md,
section 5).
The Lua `LEGAL` string is generated from it, the store checks against it, and the tests walk it.
"""

from __future__ import annotations

import enum
from typing import Any, Final, Literal

import msgspec

__all__ = [
    "LEGAL_TRANSITIONS",
    "Actor",
    "Phase",
    "Status",
    "Task",
    "TaskError",
    "Transition",
]


class Status(str, enum.Enum):
    """Where a task is in its lifecycle. The names are part of the Redis protocol."""

    PENDING_SUBMIT = "PENDING_SUBMIT"
    SUBMITTING = "SUBMITTING"
    SUBMITTED = "SUBMITTED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELED = "CANCELED"
    TRACKING_TIMED_OUT = "TRACKING_TIMED_OUT"
    SUBMIT_UNKNOWN = "SUBMIT_UNKNOWN"

    def __str__(self) -> str:
        return self.value

    @property
    def is_terminal(self) -> bool:
        """True once nothing will ever change the task again (until it is purged)."""
        return self in _TERMINAL

    @property
    def is_parked(self) -> bool:
        """True for SUBMIT_UNKNOWN: no submit or query touches it; a lookup at the vendor
        (a handler with `find`) or an operator settles it."""
        return self is Status.SUBMIT_UNKNOWN

    @property
    def is_settled(self) -> bool:
        """Terminal or parked: what `wait()` returns on."""
        return self in _TERMINAL or self is Status.SUBMIT_UNKNOWN

    @property
    def phase(self) -> Phase | None:
        """The worker phase that acts on this status, or None if no worker does."""
        if self in (Status.PENDING_SUBMIT, Status.SUBMITTING):
            return "submit"
        if self in (Status.SUBMITTED, Status.RUNNING):
            return "query"
        return None


_TERMINAL: Final = frozenset(
    {Status.SUCCEEDED, Status.FAILED, Status.CANCELED, Status.TRACKING_TIMED_OUT}
)

Phase = Literal["submit", "query"]

# Who makes a transition: C client, W worker, R reaper or sweeper, O operator.
Actor = Literal["C", "W", "R", "O"]


class Transition(msgspec.Struct, frozen=True):
    """One legal edge of the lifecycle graph and who may take it."""

    source: Status | None  # None: the task does not exist yet
    target: Status
    actors: str  # a subset of "CWRO"
    why: str


_S = Status

LEGAL_TRANSITIONS: Final[tuple[Transition, ...]] = (
    Transition(None, _S.PENDING_SUBMIT, "C", "create"),
    # Submit phase.
    Transition(_S.PENDING_SUBMIT, _S.SUBMITTING, "W", "claim for submit"),
    Transition(_S.PENDING_SUBMIT, _S.CANCELED, "CWO", "cancel before any vendor call"),
    Transition(_S.PENDING_SUBMIT, _S.TRACKING_TIMED_OUT, "WR", "deadline before submit"),
    Transition(_S.SUBMITTING, _S.SUBMITTED, "W", "vendor returned a handle"),
    Transition(_S.SUBMITTING, _S.FAILED, "W", "vendor refused for good"),
    Transition(_S.SUBMITTING, _S.PENDING_SUBMIT, "WR", "never sent, idempotent, or not started"),
    Transition(_S.SUBMITTING, _S.SUBMIT_UNKNOWN, "WR", "ambiguous submit or lease lost mid-call"),
    Transition(_S.SUBMITTING, _S.CANCELED, "WR", "cancel merged, nothing reached the vendor"),
    Transition(_S.SUBMITTING, _S.TRACKING_TIMED_OUT, "WR", "deadline during submit"),
    # Late save of the original submitter, same fence (docs/protocol.md, section 5), a
    # lookup at the vendor (reconcile, section 7), and the operator.
    Transition(_S.SUBMIT_UNKNOWN, _S.SUBMITTED, "WO", "late handle, lookup found it, or resolved"),
    Transition(_S.SUBMIT_UNKNOWN, _S.FAILED, "WO", "late refusal, or resolved as failed"),
    Transition(
        _S.SUBMIT_UNKNOWN, _S.PENDING_SUBMIT, "WO", "late never-sent, no job listed, or resubmit"
    ),
    Transition(_S.SUBMIT_UNKNOWN, _S.CANCELED, "CWO", "canceled, or late save merging a cancel"),
    Transition(_S.SUBMIT_UNKNOWN, _S.TRACKING_TIMED_OUT, "W", "late save or lookup after deadline"),
    Transition(_S.SUBMIT_UNKNOWN, _S.SUBMIT_UNKNOWN, "W", "lookup settled nothing, or gave up"),
    # Query phase.
    Transition(_S.SUBMITTED, _S.RUNNING, "W", "vendor says running"),
    Transition(_S.SUBMITTED, _S.SUCCEEDED, "W", "vendor says done"),
    Transition(_S.SUBMITTED, _S.FAILED, "WR", "vendor failed, error budget, reclaim budget"),
    Transition(_S.SUBMITTED, _S.CANCELED, "W", "cancel merged"),
    Transition(_S.SUBMITTED, _S.TRACKING_TIMED_OUT, "WR", "deadline"),
    Transition(_S.SUBMITTED, _S.PENDING_SUBMIT, "W", "vendor job ended, did nothing: resubmit"),
    Transition(_S.SUBMITTED, _S.SUBMITTED, "WR", "query error, or lease expired: due again"),
    Transition(_S.RUNNING, _S.RUNNING, "WR", "progress, query error, or lease expired"),
    Transition(_S.RUNNING, _S.SUCCEEDED, "W", "vendor says done"),
    Transition(_S.RUNNING, _S.FAILED, "WR", "vendor failed, error budget, reclaim budget"),
    Transition(_S.RUNNING, _S.CANCELED, "W", "cancel merged"),
    Transition(_S.RUNNING, _S.TRACKING_TIMED_OUT, "WR", "deadline"),
    Transition(_S.RUNNING, _S.PENDING_SUBMIT, "W", "vendor job ended, did nothing: resubmit"),
    # Operator requeue of a finished-but-unsuccessful task as a new attempt.
    Transition(_S.FAILED, _S.PENDING_SUBMIT, "O", "requeue"),
    Transition(_S.TRACKING_TIMED_OUT, _S.PENDING_SUBMIT, "O", "requeue"),
)


def is_legal(source: Status | None, target: Status, actor: Actor) -> bool:
    """True if `actor` may move a task from `source` to `target`."""
    return any(
        t.source is source and t.target is target and actor in t.actors for t in LEGAL_TRANSITIONS
    )


class TaskError(msgspec.Struct, frozen=True):
    """Why a task failed: a short machine code and a human message."""

    code: str
    message: str


class Task(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one task as stored in Redis.

    Times are epoch seconds (floats). `params`, `metadata`, `result` and `handle`
    are whatever JSON-like data was stored. Fields after `cancel_requested` are the
    worker's view; a producer's `get()` leaves them at their defaults.
    """

    id: str
    handler: str
    status: Status
    params: Any = None
    metadata: Any = None
    tenant: str = ""
    account: str = ""
    provider: str = ""
    priority: int = 0
    external_id: str | None = None
    handle: dict[str, Any] | None = None
    result: Any = None
    error: TaskError | None = None
    progress: float | None = None
    stage: str | None = None
    message: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    deadline_at: float = 0.0
    due_at: float | None = None
    finished_at: float | None = None
    version: int = 0
    submit_attempts: int = 0
    poll_count: int = 0
    consecutive_errors: int = 0
    throttles: int = 0  # vendor throttles in a row (429s): the next wait doubles with each
    lookups: int = 0  # vendor lookups while parked (SUBMIT_UNKNOWN, a handler with find)
    cancel_requested: bool = False
    dedup_key: str | None = None
    # The producer's W3C trace context (traceparent, then a space and its tracestate, if
    # any): what the worker's vendor call spans are children of (asynctaskd.tracing).
    trace: str | None = None
    # Internals, for workers and operators.
    fence: int = 0
    owner: str | None = None
    started_fence: int = 0
    reclaims: int = 0
    idempotent: bool = False

    @property
    def shard(self) -> int:
        """The shard the task lives on, read from its id."""
        return shard_of(self.id)


def shard_of(task_id: str) -> int:
    """Shard number encoded in a task id: `<ulid>` is shard 0, `<ulid>-<n>` is shard n."""
    _, sep, tail = task_id.rpartition("-")
    if not sep:
        return 0
    if not tail.isdigit():
        raise ValueError(f"task id {task_id!r} has a malformed shard suffix")
    return int(tail)
