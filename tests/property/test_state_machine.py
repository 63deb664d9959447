"""Random interleavings of the lifecycle scripts against a model that predicts each reply.

Runs through the blocking redis client (same Lua, no event loop). Before each script runs,
the model says what it must reply (code, version, status, fence) and what the task must
look like afterwards; the test then runs it and compares. The model never copies a reply
into itself: a wrong prediction is a failure.

Time passing is injected per task, not faked globally: a lease "expires" by moving its
score into the past, a deadline "passes" by moving deadline_ms and its index entry into
the past.

After each step the model is compared with every task hash (status, version, fence, start
mark, cancel flag and version, lease, reclaims), and the invariants the script tests check
(tests/lua/helpers.check_invariants) are checked too. A rejected write never changes the
task.

Besides rules of one script call, a few rules walk a path on purpose, each step still
predicted: a submit attempt (claim, start, save), a started submit whose lease is lost
(reaped: parked or requeued, then the submitter's late save), a cancel merged into a
holder's save, query outcomes, requeues. Hypothesis turns some rules off in each example,
so chance alone left a transition unreached in about one run in three: a tour rule (once
per example, from whatever state the others left) walks every legal transition and every
reply code. The run counts what it reached, prints the counts (`pytest -s`; those outside
the tour apart), and fails when a legal transition of asynctaskd.model or a reply code
was never reached.

A create may leave its request in the intake (no daemon takes it in yet): the model keeps
the requests in order and predicts what takes them in. The next submit claim, when
nothing waits in ready:submit, takes up to n new tasks due now straight to SUBMITTING
(lua/_intake.lua, "Fresh tasks"), in ready order, after a cancel in the same intake has
settled its task; the rest, and everything when a task was ready, go the long way
(PENDING_SUBMIT in the ready set, then the claim's pop). A deadline sweep and a cancel
taken in at once take every request in the long way. After each step the counters and
the number of requests waiting (what `stats()` reads) must be the model's. The run counts
the claims that met requests and fails when none took a task straight, settled one by a
cancel, wrote one the long way or claimed from both requests and the ready set.
tests/property/test_fresh_differential.py holds the two ways to the same end state.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine as hypothesis_engine
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from redis import Redis as SyncRedis

from asynctaskd.codec import encode_json
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import LEGAL_TRANSITIONS, Actor, Status, is_legal
from asynctaskd.store import Call, Code, Lease, Result, SyncStore
from tests.lua.helpers import check_invariants_sync, next_server_ms

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEYS = Keys()
LEASE_MS = 60_000
TIMEOUT_MS = 600_000
LATER_MS = 600_000  # a save's delay that no step of an example outlasts
MAX_RECLAIMS = 1  # a query-phase task reaped twice fails (RECLAIM_LIMIT)
MAX_LIVE = 6  # unfinished tasks per example: enough to interleave, few enough to revisit
MAX_TASKS = 20  # and all tasks

S = Status
ALL_STATUSES = list(Status)
SUBMIT_OUTCOMES = [S.SUBMITTED, S.FAILED, S.PENDING_SUBMIT, S.SUBMIT_UNKNOWN, S.CANCELED]
QUERY_OUTCOMES = [S.RUNNING, S.SUCCEEDED, S.FAILED, S.CANCELED, S.SUBMITTED, S.PENDING_SUBMIT]
LATE_OUTCOMES = [S.SUBMITTED, S.FAILED, S.PENDING_SUBMIT]
NEVER_MS = 316224000000  # a find window no test outlives (10 years): a "none" is too early
FINDS = [None, None, 0, NEVER_MS]  # a start without find, or with a window of 0 or NEVER_MS
RESOLVE_TARGETS = [S.SUBMITTED, S.PENDING_SUBMIT, S.FAILED, S.CANCELED]

# What one run reached, per server: (source, target) -> how often, (script, code) -> how often.
TRANSITIONS: collections.Counter[tuple[Status | None, Status]] = collections.Counter()
ACTORS: collections.Counter[tuple[Status | None, Status, str]] = collections.Counter()
CODES: collections.Counter[tuple[str, Code]] = collections.Counter()
# The same, counted outside the tour (the other rules' reach).
ROAMING: collections.Counter[Any] = collections.Counter()
# Requests a submit claim met (lua/_intake.lua, "Fresh tasks"), counted as "claims" (that
# took some straight to SUBMITTING), "taken" (tasks so taken), "canceled" (fresh tasks a
# cancel in the same intake settled), "settled" (fresh tasks written the long way because
# more requests than the claim wanted, or a ready task, came with them), "mixed" (claims
# that took tasks both from requests and from what was ready before); and (kind,
# "roaming") outside the tour.
FRESH: collections.Counter[Any] = collections.Counter()
PRIO_SPAN = 2**42  # lua/_schedule.lua: ready score = (100 - priority) * 2^42 + due_ms


@dataclass
class Task:
    """What the model expects of one task's hash and of the workers that held it."""

    priority: int
    dedup: str = ""
    intake: bool = False  # created, its request not yet taken in (no hash yet)
    due_ms: int = 0  # as create answered: with the priority, its first ready score
    status: Status = Status.PENDING_SUBMIT
    version: int = 1
    fence: int = 0  # the current fence: every claim adds one
    holder: int | None = None  # the fence of the worker holding a live lease, if any
    started: int | None = None  # started_fence: the fence whose submit call was marked
    idempotent: bool | None = None  # as the last start wrote it
    cancel: bool = False  # cancel_requested
    cancel_version: int | None = None
    late: bool = False  # its deadline has passed
    later: bool = False  # a save made it due later: it waits in due:<phase>, not ready
    reclaims: int = 0
    attempts: int = 0  # submit_attempts: one per start
    find: int | None = None  # the fence of the start that recorded `find`, while recorded
    visible: int = 0  # find_visible_ms that start recorded
    lookup: bool = False  # in due:find: a vendor lookup will settle the parked task
    lookup_due: bool = False  # and that lookup is due now
    # each worker's lease as that worker knows it (its fence, the version it last read)
    leases: dict[int, Lease] = field(default_factory=dict)

    def version_holds(self, read: int) -> bool:
        """The fence-and-version check: the version read still holds, or a cancel bumped
        it once since (the merge)."""
        if self.version == read:
            return True
        return self.cancel_version == self.version and self.version == read + 1


def small_id() -> str:
    """A task id before every id new_task_id makes (its time part is the smallest), so
    that the id order of tasks of one priority need not be the order of their due times."""
    return "00" + new_task_id()[2:]


def raw(call: Call[Any]) -> Call[Any]:
    """The same script call, its reply undecoded."""
    return Call(call.script, call.keys, call.args, lambda reply: reply)


class Lifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.r: SyncRedis = SYNC_REDIS
        self.store = SyncStore(self.r, KEYS)
        self.tasks: dict[str, Task] = {}
        self.dedup: dict[str, str] = {}  # dedup key -> the live task it names
        self.intake: list[tuple[str, str]] = []  # requests not taken in: ("c"|"x", id)
        self.lost_once = False
        self.touring = False  # inside the tour (its counts are reported apart)
        self.toured = False

    @initialize()
    def clean(self) -> None:
        self.r.flushdb()  # a private server of the test session

    # --- bookkeeping ----------------------------------------------------------------------

    def _code(self, script: str, code: Code) -> None:
        CODES[(script, code)] += 1
        if not self.touring:
            ROAMING[code] += 1

    def _count(self, old: Status | None, new: Status, actor: str) -> None:
        TRANSITIONS[(old, new)] += 1
        ACTORS[(old, new, actor)] += 1
        if not self.touring:
            ROAMING[(old, new)] += 1

    def _move(self, tid: str, new: Status, actor: Actor) -> None:
        """The model's task moves to `new`: a legal transition for `actor`, counted."""
        t = self.tasks[tid]
        old = t.status
        assert is_legal(old, new, actor), f"the model moved {tid} {old} -> {new} as {actor}"
        self._count(old, new, actor)
        t.status = new
        if new is not S.SUBMIT_UNKNOWN:
            t.lookup = t.lookup_due = False  # due:find holds parked tasks only
        if new.phase is None:
            t.later = False
        if new.is_terminal:
            t.started = None  # finishing deletes the start mark
            if t.dedup and self.dedup.get(t.dedup) == tid:
                del self.dedup[t.dedup]  # and frees the dedup key

    def _snap(self, tid: str) -> tuple[Any, ...]:
        """Everything a rejected write must leave as it was."""
        tag = KEYS.tag(0)
        with self.r.pipeline(transaction=False) as pipe:
            pipe.hgetall(KEYS.task(0, tid))
            pipe.zscore(KEYS.leases(0), tid)
            pipe.zscore(KEYS.deadlines(0), tid)
            pipe.zscore(f"{tag}:ready:submit", tid)
            pipe.zscore(f"{tag}:ready:query", tid)
            pipe.zscore(KEYS.lookups(0), tid)
            return tuple(pipe.execute())

    def _check(self, script: str, tid: str, got: Result, want: Result, before: Any) -> None:
        self._code(script, got.code)
        assert got == want, f"{script} {tid}: got {got}, the model said {want}"
        if got.code is not Code.OK and got.code is not Code.ACCEPTED:
            assert self._snap(tid) == before, f"a rejected {script} changed {tid}"

    def _held(self, phase: str) -> list[str]:
        want = (S.SUBMITTING,) if phase == "submit" else (S.SUBMITTED, S.RUNNING)
        return sorted(
            tid for tid, t in self.tasks.items() if t.holder is not None and t.status in want
        )

    def room(self) -> bool:
        """Whether a rule may create a task."""
        live = sum(not t.status.is_terminal for t in self.tasks.values())
        return live < MAX_LIVE and len(self.tasks) < MAX_TASKS

    def _fresh(self, kind: str, count: int = 1) -> None:
        FRESH[kind] += count
        if not self.touring:
            FRESH[(kind, "roaming")] += count

    def _ingest(self) -> None:
        """What every submit claim does first: take in the producers' requests (a claim of
        no task takes every one the long way)."""
        self.store.run(self.store.ops.claim(0, "submit", 0, LEASE_MS, "take-in", 0))
        self._take_in(0)

    def _written(self, tid: str) -> None:
        """A request taken in the long way: the task is PENDING_SUBMIT, version 1."""
        t = self.tasks[tid]
        assert t.intake
        t.intake = False
        self._count(None, S.PENDING_SUBMIT, "C")

    def _take_in(self, most: int) -> list[str]:
        """The model of ingest(): every request in order. A create due now is one of the
        `most` fresh tasks while there is room, else written at once; a cancel of a fresh
        task writes it first, then cancels it. Returns the tasks still fresh."""
        fresh: list[str] = []
        entries, self.intake = self.intake, []
        for kind, tid in entries:
            if kind == "c":
                if len(fresh) < most and not self.tasks[tid].later:
                    fresh.append(tid)
                else:
                    self._written(tid)
            else:
                if tid in fresh:
                    fresh.remove(tid)
                    self._written(tid)
                    self._fresh("canceled")
                self.cancel_taken_in(tid)
        return fresh

    def _ready_score(self, tid: str) -> int:
        t = self.tasks[tid]
        return (100 - t.priority) * PRIO_SPAN + t.due_ms

    # --- one script call each, predicted ------------------------------------------------

    def do_create(
        self,
        priority: int,
        dedup: str = "",
        *,
        take_in: bool = True,
        delay_ms: int = 0,
        small: bool = False,
    ) -> str | None:
        """A producer's create; with `take_in`, a daemon takes the requests in at once (a
        claim of no task), else the request waits for the next claim or sweep."""
        tid = small_id() if small else new_task_id()
        named = self.dedup.get(dedup) if dedup else None
        call = self.store.ops.create(
            tid, "h", encode_json({"p": priority}), timeout_ms=TIMEOUT_MS, priority=priority,
            dedup_key=dedup, delay_ms=delay_ms,
        )  # fmt: skip
        reply = self.store.run(raw(call))
        if named is not None:
            # a live task holds the dedup key: the create is answered with it
            assert reply == [Code.ACCEPTED, named.encode()], reply
            self._code("create", Code.ACCEPTED)
            return None
        assert reply[:2] == [Code.OK, 1], reply
        self._code("create", Code.OK)
        self.tasks[tid] = Task(priority, dedup, intake=True, due_ms=int(reply[3]))
        self.tasks[tid].later = delay_ms > 0
        self.intake.append(("c", tid))
        if dedup:
            self.dedup[dedup] = tid  # a request not taken in holds its key too
        if take_in:
            self._ingest()
        return tid

    def do_claim(self, phase: str, n: int) -> list[str]:
        tag = KEYS.tag(0)
        ready = self.r.zrange(f"{tag}:ready:{phase}", 0, -1, withscores=True)
        score = {m.decode(): int(sc) for m, sc in ready}  # type: ignore[union-attr]
        want = (S.PENDING_SUBMIT,) if phase == "submit" else (S.SUBMITTED, S.RUNNING)

        def waiting() -> set[str]:
            return {
                tid for tid, t in self.tasks.items()
                if t.holder is None and t.status in want and not t.later and not t.intake
            }  # fmt: skip

        assert set(score) == waiting(), f"ready:{phase} {sorted(score)}, the model {waiting()}"
        # A submit claim takes the requests in first. With nothing ready, up to n new tasks
        # due now are fresh; if then nothing is ready (more requests than n came, or none
        # was fresh), the fresh ones are claimed straight, in ready order, else written.
        requested = {tid for kind, tid in self.intake if kind == "c"}
        straight: list[str] = []
        if phase == "submit":
            fresh = self._take_in(n if not score else 0)
            for tid in waiting() - set(score):
                score[tid] = self._ready_score(tid)  # written the long way: joins the set
            if fresh and n > 0 and not score:
                straight = sorted(fresh, key=lambda i: (self._ready_score(i), i.encode()))[:n]
            for tid in fresh:
                if tid not in straight:
                    self._written(tid)
                    self._fresh("settled")
                    score[tid] = self._ready_score(tid)
        order = sorted(score, key=lambda i: (score[i], i.encode()))
        due_later = any(t.later and t.status in want for t in self.tasks.values())
        # Then in ready order: a late task times out, a canceled pending one ends, the rest
        # are claimed under a new fence, until n are.
        claimed = [(tid, 1, 2) for tid in straight]
        dropped, seen = 0, 0
        outcome: list[tuple[str, Status]] = []
        for tid in order:
            if len(claimed) == n:
                break
            seen += 1
            t = self.tasks[tid]
            if t.late:
                outcome.append((tid, S.TRACKING_TIMED_OUT))
                dropped += 1
            elif phase == "submit" and t.cancel:
                outcome.append((tid, S.CANCELED))
                dropped += 1
            else:
                claimed.append((tid, t.fence + 1, t.version + 1))
        batch = self.store.run(self.store.ops.claim(0, phase, n, LEASE_MS, "w", 100))  # type: ignore[arg-type]
        got = [(c.lease.task_id, c.lease.fence, c.lease.version) for c in batch.claimed]
        assert got == claimed, f"claim {phase} {n}: got {got}, the model said {claimed}"
        assert (batch.dropped, batch.ready_left) == (dropped, len(order) - seen), batch
        assert (batch.next_due_ms is not None) == due_later, batch
        if straight:
            self._fresh("claims")
            self._fresh("taken", len(straight))
        ids = {tid for tid, _, _ in claimed}
        if ids & requested and ids - requested:
            self._fresh("mixed")
        for tid in straight:
            self.tasks[tid].intake = False
            self._count(None, S.PENDING_SUBMIT, "C")
        for c in batch.claimed:
            t = self.tasks[c.lease.task_id]
            assert c.task.status is (S.SUBMITTING if phase == "submit" else t.status)
            assert c.task.version == c.lease.version and c.task.fence == c.lease.fence
        for tid, new in outcome:
            self.tasks[tid].version += 1
            self._move(tid, new, "W")
        for tid, fence, version in claimed:
            t = self.tasks[tid]
            t.fence, t.version, t.holder = fence, version, fence
            t.leases[fence] = Lease(tid, fence, version)
            if phase == "submit":
                t.started = None
                self._move(tid, S.SUBMITTING, "W")
        return [tid for tid, _, _ in claimed]

    def do_start(self, lease: Lease, idempotent: bool, find: int | None = None) -> Result:
        tid, fence = lease.task_id, lease.fence
        t = self.tasks.get(tid)
        if t is None:
            want = Result(Code.NOT_FOUND)
        elif fence != t.fence:
            want = Result(Code.STALE_FENCE)
        elif t.holder is None:
            want = Result(Code.NO_LEASE)
        elif not t.version_holds(lease.version):
            want = Result(Code.WRONG_VERSION)
        elif t.status is not S.SUBMITTING or t.late:
            want = Result(Code.ILLEGAL)
        elif t.started == fence:
            want = Result(Code.STARTED)  # one vendor call per claim
        elif t.cancel:
            want = Result(Code.CANCEL_REQUESTED, t.version)
        else:
            want = Result(Code.OK, t.version + 1)
        before = self._snap(tid)
        got = self.store.run(self.store.ops.start(lease, idempotent, "", find))
        self._check("start", tid, got, want, before)
        if t is not None and got.code is Code.OK:
            t.version, t.started, t.idempotent = got.version, fence, idempotent
            if find is not None:
                t.find, t.visible = fence, find
            t.attempts += 1
            t.leases[fence] = Lease(tid, fence, got.version)
        return got

    def do_save(self, lease: Lease, target: Status, delay_ms: int = 0) -> Result:
        tid, fence = lease.task_id, lease.fence
        t = self.tasks.get(tid)
        final = target
        # the parked submitter's late save: its fence is the start mark's, even while a
        # lookup holds the task under a newer one
        late = (
            t is not None
            and t.status is S.SUBMIT_UNKNOWN
            and t.started == fence
            and target in LATE_OUTCOMES
        )
        if t is None:
            want = Result(Code.NOT_FOUND)
        elif fence != t.fence and not late:
            want = Result(Code.STALE_FENCE)
        elif not late and t.holder is None:
            want = Result(Code.NO_LEASE)
        elif not late and not t.version_holds(lease.version):
            want = Result(Code.WRONG_VERSION)
        elif not is_legal(t.status, target, "W") or (
            target is S.SUBMIT_UNKNOWN and t.status is not S.SUBMITTING
        ):
            want = Result(Code.ILLEGAL)
        else:
            if t.cancel and not target.is_terminal and target is S.PENDING_SUBMIT:
                final = S.CANCELED  # the merged cancel: nothing reached the vendor
            if not final.is_terminal and final is not S.SUBMIT_UNKNOWN and t.late:
                final = S.TRACKING_TIMED_OUT
            want = Result(Code.OK, t.version + 1, final)
        before = self._snap(tid)
        got = self.store.run(self.store.ops.save(lease, target, delay_ms=delay_ms))
        self._check("save", tid, got, want, before)
        if t is not None and got.code is Code.OK:
            old = t.status
            t.version, t.holder = got.version, None
            t.leases[fence] = Lease(tid, fence, got.version)
            if old in (S.SUBMITTING, S.SUBMIT_UNKNOWN):
                t.started = None
            if old is S.SUBMIT_UNKNOWN:
                t.find = None  # a record from a submit that was not parked stays
            self._move(tid, final, "W")
            if final is S.SUBMIT_UNKNOWN:  # parked: a lookup if its start recorded find
                t.lookup = t.lookup_due = t.find == fence
            # due later, unless a merged cancel makes a poll due now (to call the vendor's
            # cancel at once)
            merged = t.cancel and target in (S.SUBMITTED, S.RUNNING)
            t.later = final.phase is not None and delay_ms > 0 and not merged
        return got

    def do_reap(self, tid: str) -> Status:
        """The lease of `tid` expires (its holder is presumed dead) and the reaper acts."""
        t = self.tasks[tid]
        assert t.holder is not None
        self.r.zadd(KEYS.leases(0), {tid: 1})
        if t.status is S.SUBMIT_UNKNOWN:
            # a lookup's lease: removed; its due:find entry (at the lease's old expiry, not
            # moved here) brings the task back later
            assert self.store.run(self.store.ops.reap(0, 100, MAX_RECLAIMS)) == []
            t.holder = None
            t.lookup_due = False
            return t.status
        started = t.status is S.SUBMITTING and t.started == t.fence
        if started:
            new = S.PENDING_SUBMIT if t.idempotent and not t.late else S.SUBMIT_UNKNOWN
        elif t.late:
            new = S.TRACKING_TIMED_OUT
        elif t.status is S.SUBMITTING:
            new = S.CANCELED if t.cancel else S.PENDING_SUBMIT
        else:
            t.reclaims += 1
            new = S.FAILED if t.reclaims > MAX_RECLAIMS else t.status
        reaped = self.store.run(self.store.ops.reap(0, 100, MAX_RECLAIMS))
        assert reaped == [(tid, new)], f"reap: got {reaped}, the model said {new} ({t})"
        t.version += 1
        t.holder = None
        t.later = False  # due now
        if new is S.PENDING_SUBMIT:
            t.started = None  # requeued: the next claim's submit is a new attempt
        self._move(tid, new, "R")
        if new is S.SUBMIT_UNKNOWN:
            t.lookup = t.lookup_due = t.find == t.fence
        return new

    def do_deadline(self, tid: str) -> list[str]:
        """The deadline of `tid` passes, and the sweep runs (taking the requests in first,
        the long way)."""
        t = self.tasks[tid]
        assert not t.intake, "a request's deadline is not moved: it is checked as written"
        self.r.hset(KEYS.task(0, tid), "deadline_ms", 1)
        if t.status.phase is not None:
            self.r.zadd(KEYS.deadlines(0), {tid: 1})
        t.late = True
        self._take_in(0)
        # every task of a phase that nobody holds and whose deadline passed times out
        due = sorted(
            i for i, x in self.tasks.items()
            if x.late and x.holder is None and x.status.phase is not None
        )  # fmt: skip
        swept = self.store.run(self.store.ops.time_out(0, 100)).timed_out
        assert sorted(swept) == due, f"time_out: got {swept}, the model said {due}"
        for i in due:
            self.tasks[i].version += 1
            self._move(i, S.TRACKING_TIMED_OUT, "R")
        return swept

    def do_sweep(self) -> None:
        """The deadline sweep with no deadline passed: it takes the requests in."""
        self._take_in(0)
        swept = self.store.run(self.store.ops.time_out(0, 100)).timed_out
        due = sorted(
            i for i, x in self.tasks.items()
            if x.late and x.holder is None and x.status.phase is not None
        )  # fmt: skip
        assert sorted(swept) == due, f"time_out: got {swept}, the model said {due}"
        for i in due:
            self.tasks[i].version += 1
            self._move(i, S.TRACKING_TIMED_OUT, "R")

    def do_cancel(self, tid: str, take_in: bool = True) -> Result:
        """A producer's cancel; with `take_in`, a daemon takes the request in at once."""
        t = self.tasks.get(tid)
        if t is None:
            want = Result(Code.NOT_FOUND)
        elif t.status.is_terminal:
            want = Result(Code.TERMINAL, 0, t.status)
        else:
            want = Result(Code.ACCEPTED, t.version)
        before = self._snap(tid)
        got = self.store.run(self.store.ops.cancel(tid))
        self._check("cancel", tid, got, want, before)
        if t is not None and got.code is Code.ACCEPTED:
            # a request, unless the flag already waits for a holder
            if not t.cancel or t.status in (S.PENDING_SUBMIT, S.SUBMIT_UNKNOWN):
                self.intake.append(("x", tid))
            if take_in:
                self._ingest()
        return got

    def cancel_taken_in(self, tid: str) -> None:
        """What a daemon does with a cancel request, as the task is when it takes it in."""
        t = self.tasks[tid]
        if t.status.is_terminal:
            return  # finished meanwhile: it stays as it finished
        if t.status in (S.PENDING_SUBMIT, S.SUBMIT_UNKNOWN):
            # nobody holds it (a lookup's lease ends with it): canceled at once
            t.version += 1
            t.cancel = True
            t.holder = None
            self._move(tid, S.CANCELED, "C")
        elif not t.cancel:
            # its holder (or the next one) merges the request at its next write
            t.version += 1
            t.cancel, t.cancel_version = True, t.version
            if t.holder is None and t.status in (S.SUBMITTED, S.RUNNING):
                t.later = False  # an idle poll is due at once: the cancel does not wait

    def do_resolve(self, tid: str, target: Status) -> Result:
        t = self.tasks.get(tid)
        final = target
        if t is None:
            want = Result(Code.NOT_FOUND)
        elif not is_legal(t.status, target, "O"):
            want = Result(Code.ILLEGAL, 0, t.status)
        else:
            if target is S.PENDING_SUBMIT and t.status is S.SUBMIT_UNKNOWN and t.cancel:
                final = S.CANCELED  # a knowing resubmit of a task asked to stop
            want = Result(Code.OK, t.version + 1, final)
        before = self._snap(tid)
        got = self.store.run(
            self.store.ops.resolve(tid, target, external_id="x", handle_json=b'{"external_id":"x"}')
        )
        self._check("resolve", tid, got, want, before)
        if t is not None and got.code is Code.OK:
            assert t.holder is None or t.status is S.SUBMIT_UNKNOWN  # a lookup's: it ends
            t.holder, t.find = None, None
            if t.status.is_terminal:
                # a requeue: a new attempt with a fresh deadline, flags cleared
                t.cancel, t.cancel_version, t.late, t.reclaims = False, None, False, 0
            t.version = got.version
            t.started = None
            t.later = False  # due now
            self._move(tid, final, "O")
        return got

    def do_lookup(self) -> list[str]:
        """Lease every parked task whose lookup is due (their handler is "h")."""
        due = {
            (tid, t.fence + 1, t.version + 1)
            for tid, t in self.tasks.items()
            if t.status is S.SUBMIT_UNKNOWN and t.lookup and t.lookup_due and t.holder is None
        }
        batch = self.store.run(self.store.ops.lookup(0, 100, LEASE_MS, "w", ["h"]))
        got = {(c.lease.task_id, c.lease.fence, c.lease.version) for c in batch.claimed}
        assert got == due, f"lookup: got {got}, the model said {due}"
        for tid, fence, version in due:
            t = self.tasks[tid]
            t.fence, t.version, t.holder = fence, version, fence
            t.leases[fence] = Lease(tid, fence, version)
            t.lookup_due = False  # its entry waits at the lease's expiry
        return sorted(tid for tid, _, _ in due)

    def do_reconcile(self, lease: Lease, outcome: str) -> Result:
        """A lookup's answer: found, none or error (a new try due at once)."""
        tid, fence = lease.task_id, lease.fence
        t = self.tasks.get(tid)
        final = S.SUBMIT_UNKNOWN
        if t is None:
            want = Result(Code.NOT_FOUND)
        elif fence != t.fence:
            want = Result(Code.STALE_FENCE)
        elif t.holder is None:
            want = Result(Code.NO_LEASE)
        elif not t.version_holds(lease.version):
            want = Result(Code.WRONG_VERSION)
        elif t.status is not S.SUBMIT_UNKNOWN or t.find is None:
            want = Result(Code.ILLEGAL)
        else:
            if outcome == "found":
                final = S.TRACKING_TIMED_OUT if t.late else S.SUBMITTED
            elif outcome == "none" and t.visible == 0:
                final = S.PENDING_SUBMIT
                if t.cancel:
                    final = S.CANCELED
                elif t.late:
                    final = S.TRACKING_TIMED_OUT
            want = Result(Code.OK, t.version + 1, final)
        before = self._snap(tid)
        call = self.store.ops.reconcile(
            lease, outcome, retry_ms=0, max_lookups=1000, give_up_ms=NEVER_MS,
            external_id="x" if outcome == "found" else "",
            handle_json=b'{"external_id":"x"}' if outcome == "found" else b"",
            message="boom" if outcome == "error" else "",
        )  # fmt: skip
        done = self.store.run(call)
        self._check("reconcile", tid, Result(done.code, done.version, done.status), want, before)
        if t is not None and done.code is Code.OK:
            t.version, t.holder = done.version, None
            t.leases[fence] = Lease(tid, fence, done.version)
            if final is S.SUBMIT_UNKNOWN:
                # again: an error is due at once (retry 0), a "none" when the job would be
                # listed (NEVER_MS away)
                t.lookup_due = outcome == "error"
                self._count(S.SUBMIT_UNKNOWN, S.SUBMIT_UNKNOWN, "W")
            else:
                t.started = t.find = None
                t.later = False  # due now
                self._move(tid, final, "W")
        return want

    def do_renew(self, leases: list[Lease]) -> list[Code]:
        want = []
        for lease in leases:
            t = self.tasks.get(lease.task_id)
            if t is None:
                want.append(Code.NOT_FOUND)
            elif lease.fence != t.fence:
                want.append(Code.STALE_FENCE)
            elif t.holder is None:
                want.append(Code.NO_LEASE)
            else:
                want.append(Code.OK)
        got = self.store.run(self.store.ops.renew(0, LEASE_MS, leases))
        for code in got:
            self._code("renew", code)
        assert got == want, f"renew: got {got}, the model said {want}"
        return got

    # --- paths to a state: claim what there is, create what is missing -----------------

    def held_submit(self, data: st.DataObject, *, fresh: bool = False) -> str | None:
        """A task held in SUBMITTING (with `fresh`: not started under its fence)."""
        cands = [
            tid for tid in self._held("submit")
            if not fresh or self.tasks[tid].started != self.tasks[tid].fence
        ]  # fmt: skip
        if not cands:
            cands = self.do_claim("submit", 1)
        if not cands and self.room():
            self.do_create(data.draw(st.integers(-2, 2), label="priority"))
            cands = self.do_claim("submit", 1)
        return data.draw(st.sampled_from(cands), label="task") if cands else None

    def held_query(self, data: st.DataObject) -> str | None:
        """A task held in SUBMITTED or RUNNING."""
        cands = self._held("query") or self.do_claim("query", 1)
        if not cands:
            tid = self.held_submit(data, fresh=True)
            if tid is not None and self.do_start(self.tasks[tid].leases[self.tasks[tid].fence],
                                                 False).ok:  # fmt: skip
                self.do_save(self.tasks[tid].leases[self.tasks[tid].fence], S.SUBMITTED)
                cands = self.do_claim("query", 1)
        return data.draw(st.sampled_from(cands), label="task") if cands else None

    def written(self) -> list[str]:
        """The tasks taken in (they have a hash)."""
        return sorted(tid for tid, t in self.tasks.items() if not t.intake)

    def holder_lease(self, tid: str) -> Lease:
        t = self.tasks[tid]
        return t.leases[t.fence]

    # --- rules: one script call -----------------------------------------------------------

    @precondition(lambda self: self.room())
    @rule(
        priority=st.integers(-2, 2),
        dedup=st.sampled_from(["", "", "k1", "k2"]),
        take_in=st.sampled_from([True, True, False]),
    )
    def create(self, priority: int, dedup: str, take_in: bool) -> None:
        """A create, taken in at once or left for whatever takes requests in next."""
        self.do_create(priority, dedup, take_in=take_in)

    @precondition(lambda self: len(self.tasks) < MAX_TASKS)
    @rule(
        data=st.data(),
        priorities=st.lists(st.integers(-2, 2), min_size=1, max_size=4),
        then=st.sampled_from(["claim", "claim", "claim", "sweep", "nothing"]),
        n=st.integers(1, 3),
        drain=st.booleans(),
    )
    def create_requests(
        self, data: st.DataObject, priorities: list[int], then: str, n: int, drain: bool
    ) -> None:
        """Producers create tasks (maybe due later, maybe one with a dedup key, maybe
        canceled at once) and no daemon takes the requests in yet: then a submit claim, a
        deadline sweep, or a later rule (a claim, a create, a cancel) meets them. With
        `drain`, a busy daemon first claimed every task waiting: the claim finds none
        ready."""
        if drain:
            self.do_claim("submit", 1000)
        for priority in priorities:
            if len(self.tasks) >= MAX_TASKS:  # not room(): held tasks leave none so often
                break
            dedup = data.draw(st.sampled_from(["", "", "", "k1"]), label="dedup")
            delay = data.draw(st.sampled_from([0, 0, 0, 0, LATER_MS]), label="delay")
            small = data.draw(st.booleans(), label="small id")
            tid = self.do_create(priority, dedup, take_in=False, delay_ms=delay, small=small)
            if tid is not None and data.draw(st.integers(0, 3), label="cancel") == 0:
                self.do_cancel(tid, take_in=False)
        if then == "claim":
            self.do_claim("submit", n)
        elif then == "sweep":
            self.do_sweep()

    @rule(phase=st.sampled_from(["submit", "query"]), n=st.integers(1, 3))
    def claim(self, phase: str, n: int) -> None:
        self.do_claim(phase, n)

    @precondition(lambda self: any(t.leases for t in self.tasks.values()))
    @rule(data=st.data(), idempotent=st.booleans(), skew=st.sampled_from([0, 0, 0, -1, 1]),
          find=st.sampled_from(FINDS))  # fmt: skip
    def start(self, data: st.DataObject, idempotent: bool, skew: int, find: int | None) -> None:
        """A start by any worker that ever held a lease, the version it read maybe off."""
        leases = [lease for t in self.tasks.values() for lease in t.leases.values()]
        lease = data.draw(st.sampled_from(leases))
        self.do_start(Lease(lease.task_id, lease.fence, lease.version + skew), idempotent, find)

    @rule()
    def lookup(self) -> None:
        self.do_lookup()

    @precondition(lambda self: any(t.leases for t in self.tasks.values()))
    @rule(data=st.data(), outcome=st.sampled_from(["found", "none", "error"]),
          skew=st.sampled_from([0, 0, 0, -1, 1]))  # fmt: skip
    def reconcile(self, data: st.DataObject, outcome: str, skew: int) -> None:
        """A lookup's answer from any worker that ever held a lease (a lookup's, mostly)."""
        held = sorted(i for i, t in self.tasks.items()
                      if t.holder is not None and t.status is S.SUBMIT_UNKNOWN)  # fmt: skip
        if held:
            lease = self.holder_lease(data.draw(st.sampled_from(held)))
        else:
            leases = [lease for t in self.tasks.values() for lease in t.leases.values()]
            lease = data.draw(st.sampled_from(leases))
        self.do_reconcile(Lease(lease.task_id, lease.fence, lease.version + skew), outcome)

    @precondition(lambda self: any(t.holder is not None for t in self.tasks.values()))
    @rule(data=st.data(), skew=st.sampled_from([0, 0, 0, -1, 1]))
    def save(self, data: st.DataObject, skew: int) -> None:
        """The holder's save of any outcome, legal or not, the version it read maybe off."""
        tid = data.draw(
            st.sampled_from(sorted(i for i, t in self.tasks.items() if t.holder is not None))
        )
        t = self.tasks[tid]
        options = SUBMIT_OUTCOMES if t.status is S.SUBMITTING else QUERY_OUTCOMES
        target = data.draw(st.sampled_from(options) | st.sampled_from(ALL_STATUSES))
        lease = self.holder_lease(tid)
        self.do_save(
            Lease(tid, lease.fence, lease.version + skew),
            target,
            data.draw(st.sampled_from([0, 0, LATER_MS]), label="delay"),
        )

    @precondition(lambda self: any(t.leases for t in self.tasks.values()))
    @rule(data=st.data(), skew=st.sampled_from([0, 0, -1]))
    def stale_write(self, data: st.DataObject, skew: int) -> None:
        """A save by a worker that held the task once (maybe still does, or parked it)."""
        leases = [lease for t in self.tasks.values() for lease in t.leases.values()]
        lease = data.draw(st.sampled_from(leases))
        target = data.draw(st.sampled_from([*LATE_OUTCOMES, S.SUCCEEDED, S.RUNNING]))
        self.do_save(Lease(lease.task_id, lease.fence, lease.version + skew), target)

    @precondition(lambda self: any(t.leases for t in self.tasks.values()))
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        leases = [lease for t in self.tasks.values() for lease in t.leases.values()]
        self.do_renew(data.draw(st.lists(st.sampled_from(leases), min_size=1, max_size=4)))

    @precondition(lambda self: bool(self.tasks))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        self.do_cancel(data.draw(st.sampled_from(sorted(self.tasks))))

    @precondition(lambda self: any(t.holder is not None for t in self.tasks.values()))
    @rule(data=st.data())
    def lease_expires(self, data: st.DataObject) -> None:
        self.do_reap(
            data.draw(
                st.sampled_from(sorted(i for i, t in self.tasks.items() if t.holder is not None))
            )
        )

    @precondition(lambda self: any(not t.status.is_terminal for t in self.tasks.values()))
    @rule(data=st.data())
    def deadline_passes(self, data: st.DataObject) -> None:
        live = sorted(i for i, t in self.tasks.items() if not t.status.is_terminal and not t.intake)
        if not live:
            self.do_sweep()  # only requests: the sweep takes them in
            return
        self.do_deadline(data.draw(st.sampled_from(live)))

    @precondition(lambda self: bool(self.written()))
    @rule(data=st.data(), to=st.sampled_from(RESOLVE_TARGETS))
    def resolve(self, data: st.DataObject, to: Status) -> None:
        self.do_resolve(data.draw(st.sampled_from(self.written())), to)

    def do_unknown(self, op: str) -> None:
        """Every single-task script answers NOT_FOUND for a task that does not exist."""
        lease = Lease(new_task_id(), 1, 1)
        if op == "start":
            self.do_start(lease, False)
        elif op == "save":
            self.do_save(lease, S.SUBMITTED)
        elif op == "cancel":
            self.do_cancel(lease.task_id)
        elif op == "resolve":
            self.do_resolve(lease.task_id, S.FAILED)
        else:
            self.do_renew([lease])

    def do_create_again(self, tid: str) -> None:
        """A create with a task id that is taken, and other content: refused (EXISTS)."""
        call = self.store.ops.create(tid, "other", b"{}", timeout_ms=TIMEOUT_MS)
        assert self.store.run(raw(call)) == [Code.EXISTS]
        self._code("create", Code.EXISTS)
        t = self.tasks[tid]
        if not t.dedup:
            # the same create sent again (a lost reply): answered as the first one was
            p = t.priority
            call = self.store.ops.create(
                tid, "h", encode_json({"p": p}), timeout_ms=TIMEOUT_MS, priority=p
            )
            assert self.store.run(raw(call))[:2] == [Code.OK, 1]
            self._code("create", Code.OK)

    def do_lost_request(self) -> None:
        """A create request lost before a daemon took it in leaves its dedup key naming
        nothing: the next create with the key is told so (DEDUP_STALE), a daemon frees the
        key, and the create sent again makes the task."""
        lost = new_task_id()
        key = f"lost-{lost}"
        call = self.store.ops.create(lost, "h", b"{}", timeout_ms=TIMEOUT_MS, dedup_key=key)
        assert self.store.run(raw(call))[0] == Code.OK
        self.r.delete(f"{KEYS.tag(0)}:new:{lost}")
        again = self.store.ops.create(
            new_task_id(), "h", b"{}", timeout_ms=TIMEOUT_MS, dedup_key=key
        )
        assert self.store.run(raw(again)) == [Code.DEDUP_STALE, lost.encode()]
        self._code("create", Code.DEDUP_STALE)
        self._ingest()
        self.do_create(0, key)

    @rule(op=st.sampled_from(["start", "save", "cancel", "resolve", "renew"]))
    def unknown_task(self, op: str) -> None:
        self.do_unknown(op)

    @precondition(lambda self: bool(self.written()))
    @rule(data=st.data())
    def create_again(self, data: st.DataObject) -> None:
        self.do_create_again(data.draw(st.sampled_from(self.written())))

    @precondition(lambda self: self.room() and not self.lost_once)
    @rule()
    def lost_request(self) -> None:
        self.lost_once = True  # once per example is enough
        self.do_lost_request()

    # --- rules: a path walked on purpose --------------------------------------------------

    @rule(
        data=st.data(),
        idempotent=st.booleans(),
        twice=st.booleans(),
        late=st.sampled_from([False, False, False, True]),
    )
    def submit_attempt(
        self, data: st.DataObject, idempotent: bool, twice: bool, late: bool
    ) -> None:
        """Claim, start (maybe twice under one fence: the second is refused), save (maybe
        after the deadline passed)."""
        tid = self.held_submit(data, fresh=True)
        if tid is None:
            return
        self.do_start(self.holder_lease(tid), idempotent)
        if twice:
            self.do_start(self.holder_lease(tid), idempotent)
        if late:
            self.do_deadline(tid)
        self.do_save(self.holder_lease(tid), data.draw(st.sampled_from(SUBMIT_OUTCOMES)))

    @rule(
        data=st.data(),
        idempotent=st.sampled_from([False, False, True]),
        cancel=st.sampled_from([False, False, True]),
        late_before=st.sampled_from([False, False, True]),
        late_after=st.sampled_from([False, False, True]),
    )
    def lose_a_started_submit(
        self, data: st.DataObject, idempotent: bool, cancel: bool, late_before: bool,
        late_after: bool,
    ) -> None:  # fmt: skip
        """A submit is marked started, then its lease expires: the reaper parks it in
        SUBMIT_UNKNOWN (or requeues it, idempotent and in time), never resubmits it; then
        the submitter's late save under the same fence."""
        tid = self.held_submit(data, fresh=True)
        if tid is None:
            return
        if not self.do_start(self.holder_lease(tid), idempotent).ok:
            return
        lease = self.holder_lease(tid)
        if cancel:
            self.do_cancel(tid)  # a flag: the holder (or the parked task's save) merges it
        if late_before:
            self.do_deadline(tid)
        self.do_reap(tid)
        if late_after:
            self.do_deadline(tid)
        self.do_save(lease, data.draw(st.sampled_from(LATE_OUTCOMES)))

    @rule(data=st.data(), outcome=st.sampled_from(LATE_OUTCOMES))
    def late_save_lands(self, data: st.DataObject, outcome: Status) -> None:
        """The plain case of the above: parked, then the submitter's late save lands."""
        tid = self.held_submit(data, fresh=True)
        if tid is None or not self.do_start(self.holder_lease(tid), False).ok:
            return
        lease = self.holder_lease(tid)
        self.do_reap(tid)
        self.do_save(lease, outcome)

    @rule(
        data=st.data(),
        first=st.sampled_from([S.RUNNING, S.SUBMITTED]),
        then=st.sampled_from(QUERY_OUTCOMES),
        late=st.sampled_from([False, False, False, True]),
    )
    def query_outcome(self, data: st.DataObject, first: Status, then: Status, late: bool) -> None:
        """A poll saves `first`; the task is claimed again and its next poll saves
        `target` (maybe after the deadline)."""
        tid = self.held_query(data)
        if tid is None:
            return
        self.do_save(self.holder_lease(tid), first)
        if tid not in self.do_claim("query", 1000):
            return  # the save made it finish (a cancel was merged, or it was late)
        if late:
            self.do_deadline(tid)
        self.do_save(self.holder_lease(tid), then)

    @rule(data=st.data(), phase=st.sampled_from(["submit", "query"]))
    def cancel_races_the_finish(self, data: st.DataObject, phase: str) -> None:
        """A cancel is requested, and the holder finishes the task before a daemon takes
        the request in: the task stays as it finished."""
        tid = self.held_submit(data, fresh=True) if phase == "submit" else self.held_query(data)
        if tid is None:
            return
        self.do_cancel(tid, take_in=False)
        done = S.FAILED if phase == "submit" else S.SUCCEEDED
        assert self.do_save(self.holder_lease(tid), done).ok
        self._ingest()

    @rule(data=st.data(), phase=st.sampled_from(["submit", "submit", "query"]), start=st.booleans())
    def merge_a_cancel(self, data: st.DataObject, phase: str, start: bool) -> None:
        """A cancel arrives while a worker holds the task: the holder's next write, with the
        version it read before the cancel, lands and merges it."""
        tid = self.held_submit(data, fresh=True) if phase == "submit" else self.held_query(data)
        if tid is None:
            return
        self.do_cancel(tid)
        if phase == "submit" and start:
            self.do_start(self.holder_lease(tid), False)  # refused: CANCEL_REQUESTED
        options = SUBMIT_OUTCOMES if phase == "submit" else QUERY_OUTCOMES
        target = data.draw(st.sampled_from(options))
        self.do_save(
            self.holder_lease(tid),
            target,
            data.draw(st.sampled_from([0, 0, LATER_MS]), label="delay"),
        )

    @rule(
        data=st.data(),
        rounds=st.integers(1, 3),
        late=st.sampled_from([False, False, False, True]),
        skew=st.sampled_from([0, 0, 0, -1]),
    )
    def poll(self, data: st.DataObject, rounds: int, late: bool, skew: int) -> None:
        """Query-phase holders save what the vendor said, a few rounds (the last one maybe
        after the deadline, or with a version read before the last write)."""
        for last in [False] * (rounds - 1) + [True]:
            tid = self.held_query(data)
            if tid is None:
                return
            lease = self.holder_lease(tid)
            if not last:
                self.do_save(lease, data.draw(st.sampled_from([S.RUNNING, S.RUNNING, S.SUBMITTED])))
                continue
            if late:
                self.do_deadline(tid)
            target = data.draw(st.sampled_from(QUERY_OUTCOMES * 3 + ALL_STATUSES))
            self.do_save(
                Lease(tid, lease.fence, lease.version + skew),
                target,
                data.draw(st.sampled_from([0, 0, LATER_MS]), label="delay"),
            )

    @rule(data=st.data(), to=st.sampled_from(RESOLVE_TARGETS))
    def resolve_parked(self, data: st.DataObject, to: Status) -> None:
        """An operator settles a task parked in SUBMIT_UNKNOWN."""
        parked = sorted(i for i, t in self.tasks.items() if t.status is S.SUBMIT_UNKNOWN)
        if parked:
            self.do_resolve(data.draw(st.sampled_from(parked)), to)

    @rule(data=st.data(), to=st.sampled_from([S.FAILED, S.TRACKING_TIMED_OUT]))
    def requeue(self, data: st.DataObject, to: Status) -> None:
        """An operator requeues a task that failed or timed out: a new attempt."""
        done = sorted(i for i, t in self.tasks.items() if t.status is to)
        if not done:
            return
        self.do_resolve(data.draw(st.sampled_from(done)), S.PENDING_SUBMIT)

    # --- the tour: every legal transition and reply code, from whatever state ----------

    def fresh_held(self) -> str:
        """A new task, claimed (with every other task waiting for a submit)."""
        tid = self.do_create(0)
        assert tid is not None
        assert tid in self.do_claim("submit", 1000)
        return tid

    def fresh_query(self, status: Status) -> str:
        """A new task held in the query phase in `status` (SUBMITTED or RUNNING)."""
        tid = self.fresh_held()
        assert self.do_start(self.holder_lease(tid), False).ok
        assert self.do_save(self.holder_lease(tid), S.SUBMITTED).ok
        assert tid in self.do_claim("query", 1000)
        if status is S.RUNNING:
            assert self.do_save(self.holder_lease(tid), S.RUNNING).ok
            assert tid in self.do_claim("query", 1000)
        return tid

    def parked(self, find: int | None = None) -> tuple[str, Lease]:
        """A new task whose started submit lost its lease: parked; and its submitter's lease."""
        tid = self.fresh_held()
        assert self.do_start(self.holder_lease(tid), False, find).ok
        lease = self.holder_lease(tid)
        assert self.do_reap(tid) is S.SUBMIT_UNKNOWN
        return tid, lease

    def reached(self, tid: str, status: Status) -> None:
        got = self.tasks[tid].status
        assert got is status, f"the tour meant to reach {status}, the model has {got}"

    @precondition(lambda self: not self.toured)
    @rule()
    def tour(self) -> None:
        """Every legal transition and every reply code, each step predicted, starting from
        whatever state the other rules left (at most once per example). Its tasks are new;
        its claims take every task waiting in the phase, as a busy daemon's would."""
        self.toured = self.touring = True
        try:
            self._tour()
        finally:
            self.touring = False

    def _tour(self) -> None:
        # PENDING_SUBMIT -> CANCELED (a producer's cancel) and -> TRACKING_TIMED_OUT
        tid = self.do_create(0)
        assert tid is not None
        self.do_cancel(tid)
        self.reached(tid, S.CANCELED)
        assert self.do_cancel(tid).code is Code.TERMINAL
        tid = self.do_create(0)
        assert tid is not None
        self.do_deadline(tid)
        self.reached(tid, S.TRACKING_TIMED_OUT)
        self.do_resolve(tid, S.PENDING_SUBMIT)  # TRACKING_TIMED_OUT -> PENDING_SUBMIT
        self.reached(tid, S.PENDING_SUBMIT)
        # SUBMITTING -> each outcome of a submit; one fence starts once; rejected writes
        for outcome in (S.SUBMITTED, S.FAILED, S.PENDING_SUBMIT, S.SUBMIT_UNKNOWN):
            tid = self.fresh_held()
            if outcome is not S.PENDING_SUBMIT:
                assert self.do_start(self.holder_lease(tid), False).ok
                assert self.do_start(self.holder_lease(tid), False).code is Code.STARTED
            lease = self.holder_lease(tid)
            stale = Lease(tid, lease.fence, lease.version - 1)
            assert self.do_save(stale, outcome).code is Code.WRONG_VERSION
            assert self.do_save(lease, S.SUCCEEDED).code is Code.ILLEGAL
            assert self.do_save(lease, outcome).ok
            self.reached(tid, outcome)
            assert self.do_save(lease, S.RUNNING).code is Code.NO_LEASE
            if outcome is S.FAILED:
                self.do_resolve(tid, S.PENDING_SUBMIT)  # FAILED -> PENDING_SUBMIT
                self.reached(tid, S.PENDING_SUBMIT)
        # SUBMITTING -> CANCELED: a cancel merged into the holder's save; its start refused
        tid = self.fresh_held()
        lease = self.holder_lease(tid)
        self.do_cancel(tid)
        assert self.do_start(lease, False).code is Code.CANCEL_REQUESTED
        assert self.do_save(lease, S.PENDING_SUBMIT).ok
        self.reached(tid, S.CANCELED)
        # SUBMITTING -> PENDING_SUBMIT by the reaper; the old holder is then stale
        tid = self.fresh_held()
        lease = self.holder_lease(tid)
        self.do_reap(tid)
        self.reached(tid, S.PENDING_SUBMIT)
        assert tid in self.do_claim("submit", 1000)
        assert self.do_save(lease, S.FAILED).code is Code.STALE_FENCE
        # SUBMITTING -> TRACKING_TIMED_OUT: a save after the deadline
        tid = self.fresh_held()
        self.do_deadline(tid)
        assert self.do_start(self.holder_lease(tid), False).code is Code.ILLEGAL
        self.do_save(self.holder_lease(tid), S.SUBMITTED)
        self.reached(tid, S.TRACKING_TIMED_OUT)
        # SUBMIT_UNKNOWN -> each late save of the submitter, a cancel, a late save past the
        # deadline, and an operator's resolve
        for late in LATE_OUTCOMES:
            tid, lease = self.parked()
            assert self.do_save(lease, late).ok
            self.reached(tid, late)
        tid, lease = self.parked()
        self.do_cancel(tid)
        self.reached(tid, S.CANCELED)
        tid, lease = self.parked()
        self.do_deadline(tid)
        assert self.do_save(lease, S.SUBMITTED).ok
        self.reached(tid, S.TRACKING_TIMED_OUT)
        tid, lease = self.parked()
        assert self.do_resolve(tid, S.SUBMITTED).ok
        self.reached(tid, S.SUBMITTED)
        # SUBMIT_UNKNOWN settled by a vendor lookup: found, none (after the window: a
        # resubmit; before it: again), an error (again), and the late save winning
        for find, outcome, reached in ((0, "found", S.SUBMITTED), (0, "none", S.PENDING_SUBMIT),
                                       (NEVER_MS, "none", S.SUBMIT_UNKNOWN),
                                       (0, "error", S.SUBMIT_UNKNOWN)):  # fmt: skip
            tid, submitter = self.parked(find)
            assert tid in self.do_lookup()
            lease = self.holder_lease(tid)
            stale = Lease(tid, lease.fence, lease.version - 1)
            assert self.do_reconcile(stale, outcome).code is Code.WRONG_VERSION
            assert self.do_reconcile(submitter, outcome).code is Code.STALE_FENCE
            assert self.do_reconcile(lease, outcome).ok
            self.reached(tid, reached)
            assert self.do_reconcile(lease, outcome).code is Code.NO_LEASE
        tid, submitter = self.parked(0)
        assert tid in self.do_lookup()
        assert self.do_save(submitter, S.SUBMITTED).ok  # the late save wins over the lookup
        assert self.do_reconcile(self.holder_lease(tid), "none").code is Code.NO_LEASE
        self.reached(tid, S.SUBMITTED)
        tid, _ = self.parked(0)
        self.do_deadline(tid)
        assert tid in self.do_lookup()
        assert self.do_reconcile(self.holder_lease(tid), "found").ok
        self.reached(tid, S.TRACKING_TIMED_OUT)
        # SUBMITTED and RUNNING -> each outcome of a poll, and a poll after the deadline
        for status in (S.SUBMITTED, S.RUNNING):
            for outcome in QUERY_OUTCOMES:
                if status is S.RUNNING and outcome is S.SUBMITTED:
                    continue  # not a transition
                tid = self.fresh_query(status)
                assert self.do_save(self.holder_lease(tid), outcome).ok
                self.reached(tid, outcome)
            tid = self.fresh_query(status)
            self.do_deadline(tid)
            assert self.do_save(self.holder_lease(tid), S.RUNNING).ok
            self.reached(tid, S.TRACKING_TIMED_OUT)
        # a cancel makes an idle poll due at once, and a merged one a delayed poll
        tid = self.fresh_query(S.SUBMITTED)
        assert self.do_save(self.holder_lease(tid), S.SUBMITTED, LATER_MS).ok
        assert self.tasks[tid].later
        self.do_cancel(tid)
        assert tid in self.do_claim("query", 1000)
        tid = self.fresh_query(S.RUNNING)
        self.do_cancel(tid)
        assert self.do_save(self.holder_lease(tid), S.RUNNING, LATER_MS).ok
        assert tid in self.do_claim("query", 1000)
        assert self.do_save(self.holder_lease(tid), S.CANCELED).ok
        # a cancel that arrives after the finish
        tid = self.fresh_query(S.RUNNING)
        self.do_cancel(tid, take_in=False)
        assert self.do_save(self.holder_lease(tid), S.SUCCEEDED).ok
        self._ingest()
        # a dedup key names its live task
        key = f"tour-{tid}"
        assert self.do_create(0, key) is not None
        assert self.do_create(0, key) is None  # ACCEPTED, with the live task's id
        # create's other codes, and NOT_FOUND from each single-task script
        self.do_create_again(tid)
        self.do_lost_request()
        for op in ("start", "save", "cancel", "resolve", "renew"):
            self.do_unknown(op)
        self._tour_fresh()

    def _tour_fresh(self) -> None:
        """Requests a submit claim meets (lua/_intake.lua, "Fresh tasks"): with nothing
        ready, the first n due now go straight to SUBMITTING in ready order, a cancel in
        the same intake settling its task first; more requests than n all go the long way;
        with a task ready, so do they, and the claim takes from both."""
        self.do_claim("submit", 1000)  # nothing waits ready
        low = self.do_create(0, take_in=False)
        high = self.do_create(1, take_in=False)
        gone = self.do_create(2, take_in=False)
        assert low is not None and high is not None and gone is not None
        self.do_cancel(gone, take_in=False)
        assert self.do_claim("submit", 3) == [high, low]
        self.reached(gone, S.CANCELED)
        first = self.do_create(0, take_in=False)
        second = self.do_create(1, take_in=False)
        assert self.do_claim("submit", 1) == [second]  # both written: the first waits ready
        ready = self.do_create(0)
        newer = self.do_create(0, take_in=False)
        assert self.do_claim("submit", 3) == [first, ready, newer]
        # one priority: in due order, whatever the ids; one due time: ids in byte order
        self.do_claim("submit", 1000)
        early = self.do_create(0, take_in=False)
        next_server_ms(self.r)  # due a millisecond later at least
        late = self.do_create(0, take_in=False, small=True)  # and its id is the smaller
        assert self.do_claim("submit", 2) == [early, late]
        made, smaller = self.do_create_together([False, True])
        assert self.do_claim("submit", 2) == [smaller, made]
        # a new task due later is not fresh: it waits in due:submit
        later = self.do_create(0, take_in=False, delay_ms=LATER_MS)
        assert self.do_claim("submit", 1) == []
        assert later is not None and self.tasks[later].later

    def do_create_together(self, small: list[bool]) -> list[str]:
        """Creates of priority 0 in one create_many call (one server time: one ready score),
        their requests not taken in; `small` as for do_create."""
        ids = [small_id() if s else new_task_id() for s in small]
        calls = [
            self.store.ops.create(tid, "h", encode_json({"p": 0}), timeout_ms=TIMEOUT_MS)
            for tid in ids
        ]
        replies = self.store.run(self.store.ops.create_many(calls))
        for tid, reply in zip(ids, replies, strict=True):
            assert reply[:2] == [Code.OK, 1], reply
            self._code("create", Code.OK)
            self.tasks[tid] = Task(0, intake=True, due_ms=int(reply[3]))
            self.intake.append(("c", tid))
        return ids

    # --- after every step -----------------------------------------------------------------

    @invariant()
    def hashes_match_the_model(self) -> None:
        with self.r.pipeline(transaction=False) as pipe:
            pipe.zrange(KEYS.leases(0), 0, -1)
            pipe.zrange(f"{KEYS.tag(0)}:due:submit", 0, -1)
            pipe.zrange(f"{KEYS.tag(0)}:due:query", 0, -1)
            pipe.zrange(KEYS.lookups(0), 0, -1)
            for tid in self.tasks:
                pipe.hgetall(KEYS.task(0, tid))
            replies = pipe.execute()
        leased = {m.decode() for m in replies[0]}
        later = {m.decode() for m in replies[1] + replies[2]}
        lookups = {m.decode() for m in replies[3]}
        for (tid, t), h in zip(self.tasks.items(), replies[4:], strict=True):
            if t.intake:
                assert not h, f"{tid}: a request not taken in, yet its hash is {h}"
                continue

            def num(name: bytes, h: Any = h) -> int | None:
                return int(h[name]) if name in h else None

            seen = {
                "status": Status(h[b"status"].decode()),
                "version": num(b"version"),
                "fence": num(b"fence") or 0,
                "leased": tid in leased,
                "started": num(b"started_fence"),
                "cancel": h.get(b"cancel_requested") == b"1",
                "cancel_version": num(b"cancel_version"),
                "reclaims": num(b"reclaims") or 0,
                "attempts": num(b"submit_attempts") or 0,
                "later": tid in later,
                "lookup": tid in lookups,
            }
            if b"idempotent" in h:
                seen["idempotent"] = h[b"idempotent"] == b"1"
            model = {
                "status": t.status,
                "version": t.version,
                "fence": t.fence,
                "leased": t.holder is not None,
                "started": t.started,
                "cancel": t.cancel,
                "cancel_version": t.cancel_version,
                "reclaims": t.reclaims,
                "attempts": t.attempts,
                "later": t.later,
                "lookup": t.lookup,
            }
            if t.idempotent is not None:
                model["idempotent"] = t.idempotent
            assert seen == model, f"{tid}: the hash has {seen}, the model {model}"

    @invariant()
    def stats_match_the_model(self) -> None:
        """What `stats()` reads: the counters (of tasks taken in only) and the requests
        waiting in the intake."""
        raw = self.r.hgetall(KEYS.counts(0))
        requests = self.r.llen(KEYS.intake(0))
        seen: collections.Counter[str] = collections.Counter()
        for name, value in raw.items():  # type: ignore[union-attr]
            if int(value):
                seen[name.decode()] += int(value)
        model: collections.Counter[str] = collections.Counter()
        for t in self.tasks.values():
            if not t.intake:
                model[f"{t.status.value}@h"] += 1
        assert (seen, requests) == (model, len(self.intake)), (
            f"counters {dict(seen)} and {requests} requests, the model {dict(model)} and "
            f"{self.intake}"
        )

    @invariant()
    def invariants_hold(self) -> None:
        check_invariants_sync(self.r, KEYS)


SYNC_REDIS: Any = None

EVERY_TRANSITION = {(t.source, t.target) for t in LEGAL_TRANSITIONS}
EVERY_CODE = set(Code)
FRESH_KINDS = {
    "claims": "claims that took new tasks straight to SUBMITTING",
    "taken": "new tasks so taken",
    "canceled": "fresh tasks settled by a cancel in the same intake",
    "settled": "fresh tasks written the long way (more requests, or a task ready)",
    "mixed": "claims of both requests and tasks ready before",
}


def report() -> str:
    lines = ["transitions reached (source -> target: count, by actor; outside the tour):"]
    for t in LEGAL_TRANSITIONS:
        by = " ".join(
            f"{a}={ACTORS[(t.source, t.target, a)]}"
            for a in "CWRO"
            if ACTORS[(t.source, t.target, a)]
        )
        edge = (t.source, t.target)
        lines.append(
            f"  {t.source} -> {t.target}: {TRANSITIONS[edge]} ({by}; outside the tour "
            f"{ROAMING[edge]})"
        )
    lines.append("reply codes reached (code: count, by script; outside the tour):")
    for code in Code:
        scripts = " ".join(
            f"{s}={n}" for (s, c), n in sorted(CODES.items(), key=lambda kv: kv[0][0]) if c is code
        )
        total = sum(n for (_, c), n in CODES.items() if c is code)
        lines.append(f"  {code.name}: {total} ({scripts}; {ROAMING[code]})")
    lines.append("requests a submit claim met (count; outside the tour):")
    for kind, what in FRESH_KINDS.items():
        lines.append(f"  {what}: {FRESH[kind]} ({FRESH[(kind, 'roaming')]})")
    return "\n".join(lines)


def test_every_transition_and_reply_code_is_predicted(
    sync_redis: SyncRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A failing example replays a whole example per shrink step (some hundred script calls
    # and reads): hypothesis's five minutes of shrinking would outlast the test's timeout
    # and lose the report. A minute shrinks most failures to a few steps.
    monkeypatch.setattr(hypothesis_engine, "MAX_SHRINKING_SECONDS", 60, raising=False)
    global SYNC_REDIS
    SYNC_REDIS = sync_redis
    TRANSITIONS.clear()
    ACTORS.clear()
    CODES.clear()
    ROAMING.clear()
    FRESH.clear()
    run_state_machine_as_test(
        Lifecycle,
        settings=settings(
            max_examples=30,
            stateful_step_count=40,
            report_multiple_bugs=False,  # shrink one failure: a replay costs a whole example
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    print(report())  # noqa: T201 - the counts, for `pytest -s` and the CI log
    missed_transitions = EVERY_TRANSITION - {k for k, n in TRANSITIONS.items() if n}
    missed_codes = EVERY_CODE - {c for (_, c), n in CODES.items() if n}
    assert not missed_transitions and not missed_codes, (
        f"never reached: transitions {sorted(missed_transitions, key=str)}, "
        f"codes {sorted(c.name for c in missed_codes)}\n{report()}"
    )
    missed_fresh = [what for kind, what in FRESH_KINDS.items() if not FRESH[kind]]
    assert not missed_fresh, f"never reached: {missed_fresh}\n{report()}"
    unexpected = {k for k in TRANSITIONS if k not in EVERY_TRANSITION}
    assert not unexpected, unexpected
