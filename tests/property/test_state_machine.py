"""Random interleavings of every script against a reference model of the lifecycle.

Runs through the sync redis client (same Lua, no event loop). Time passing is injected
per task, not faked globally: a lease "expires" by moving its score into the past, a
deadline "passes" by moving deadline_ms and its index entry into the past. After each
step the invariants are checked: counters equal real counts, every status index agrees
with the hashes, every live task is either leased or in exactly one due set of its phase,
and a rejected write never changes the hash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)
from redis import Redis as SyncRedis

from asynctaskd.codec import encode_json
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.store import Code, Lease, SyncStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEYS = Keys()
OUTCOMES_SUBMIT = [
    Status.SUBMITTED,
    Status.FAILED,
    Status.PENDING_SUBMIT,
    Status.SUBMIT_UNKNOWN,
    Status.RUNNING,
    Status.SUCCEEDED,
]
OUTCOMES_QUERY = [
    Status.RUNNING,
    Status.SUCCEEDED,
    Status.FAILED,
    Status.CANCELED,
    Status.SUBMITTED,
    Status.PENDING_SUBMIT,
]


@dataclass
class Model:
    """What we expect of one task."""

    status: Status = Status.PENDING_SUBMIT
    leases: list[Lease] = field(default_factory=list)  # every lease ever handed out
    held: Lease | None = None  # the current holder, if any
    started: bool = False
    late: bool = False  # its deadline has passed
    cancel: bool = False  # a cancel was requested from its holder


class Lifecycle(RuleBasedStateMachine):
    tasks = Bundle("tasks")

    def __init__(self) -> None:
        super().__init__()
        self.r: SyncRedis = SYNC_REDIS
        self.store = SyncStore(self.r, KEYS)
        self.model: dict[str, Model] = {}

    @initialize()
    def clean(self) -> None:
        self.r.flushdb()

    def _hash(self, tid: str) -> dict[bytes, bytes]:
        return self.r.hgetall(KEYS.task(0, tid))  # type: ignore[return-value]

    def _status(self, tid: str) -> Status:
        return Status(self.r.hget(KEYS.task(0, tid), "status").decode())  # type: ignore[union-attr]

    @rule(target=tasks, priority=st.integers(-3, 3))
    def create(self, priority: int) -> str:
        tid = new_task_id()
        call = self.store.ops.create(
            tid, "h", encode_json({"p": priority}), timeout_ms=600_000, priority=priority
        )
        assert not self.store.run(call).deduped
        self._take_in()
        self.model[tid] = Model()
        return tid

    def _take_in(self) -> None:
        """A daemon takes the producers' requests in (what every submit claim does first)."""
        self.store.run(self.store.ops.claim(0, "submit", 0, 60_000, "take-in", 0))

    @rule(phase=st.sampled_from(["submit", "query"]), n=st.integers(1, 3))
    def claim(self, phase: str, n: int) -> None:
        batch = self.store.run(self.store.ops.claim(0, phase, n, 60_000, "w", 100))  # type: ignore[arg-type]
        for c in batch.claimed:
            m = self.model[c.lease.task_id]
            assert m.held is None, "claimed a task that is already leased"
            assert m.status.phase == phase, f"{m.status} claimed in {phase}"
            if phase == "submit":
                assert m.status is Status.PENDING_SUBMIT
                m.status = Status.SUBMITTING
                m.started = False
            m.held = c.lease
            m.leases.append(c.lease)

    @rule(tid=tasks, idempotent=st.booleans())
    def start(self, tid: str, idempotent: bool) -> None:
        m = self.model[tid]
        if m.held is None:
            return
        r = self.store.run(self.store.ops.start(m.held, idempotent))
        if r.code is Code.OK:
            assert m.status is Status.SUBMITTING and not m.started and not m.cancel
            m.held = Lease(tid, m.held.fence, r.version)
            m.started = True
        elif r.code is Code.STARTED:
            assert m.started
        else:
            assert r.code in (Code.ILLEGAL, Code.CANCEL_REQUESTED), r

    @rule(tid=tasks, data=st.data())
    def save(self, tid: str, data: st.DataObject) -> None:
        m = self.model[tid]
        if m.held is None:
            return
        options = OUTCOMES_SUBMIT if m.status is Status.SUBMITTING else OUTCOMES_QUERY
        target = data.draw(st.sampled_from(options))
        before = self._hash(tid)
        r = self.store.run(self.store.ops.save(m.held, target, delay_ms=0))
        if r.code is Code.OK:
            assert r.status is not None
            m.status = r.status
            m.held = None
        else:
            assert r.code is Code.ILLEGAL, r
            assert self._hash(tid) == before, "a rejected save changed the task"

    @rule(tid=tasks, data=st.data())
    def stale_write(self, tid: str, data: st.DataObject) -> None:
        m = self.model[tid]
        old = [lease for lease in m.leases if m.held is None or lease.fence < m.held.fence]
        if not old:
            return
        lease = data.draw(st.sampled_from(old))
        before = self._hash(tid)
        r = self.store.run(self.store.ops.save(lease, Status.FAILED))
        if r.code is Code.OK:
            # only the late save of a parked, started submit under the same fence may land
            assert m.status is Status.SUBMIT_UNKNOWN and m.started, r
            m.status = r.status or Status.FAILED
            return
        assert r.code in (Code.STALE_FENCE, Code.NO_LEASE, Code.WRONG_VERSION, Code.ILLEGAL)
        assert self._hash(tid) == before, "a stale write changed the task"

    @rule()
    def renew(self) -> None:
        held = [m.held for m in self.model.values() if m.held is not None]
        if held:
            codes = self.store.run(self.store.ops.renew(0, 60_000, held))
            assert set(codes) == {Code.OK}

    @rule(tid=tasks)
    def cancel(self, tid: str) -> None:
        m = self.model[tid]
        r = self.store.run(self.store.ops.cancel(tid))
        if m.status.is_terminal:
            assert r.code is Code.TERMINAL
            return
        assert r.code is Code.ACCEPTED  # a request: a daemon carries it out
        self._take_in()
        if m.status in (Status.PENDING_SUBMIT, Status.SUBMIT_UNKNOWN):
            m.status = Status.CANCELED
        else:
            # the holder keeps the version it read: its next write merges the cancel
            m.cancel = True

    @rule(tid=tasks)
    def lease_expires(self, tid: str) -> None:
        m = self.model[tid]
        if m.held is None:
            return
        self.r.zadd(KEYS.leases(0), {tid: 1})  # time passes for this lease only
        reaped = dict(self.store.run(self.store.ops.reap(0, 100, 1_000)))
        assert tid in reaped
        new = reaped[tid]
        idempotent = self.r.hget(KEYS.task(0, tid), "idempotent") == b"1"
        if m.status is Status.SUBMITTING and m.started:
            # a started submit is parked (or requeued if idempotent and still in time)
            expected = Status.PENDING_SUBMIT if idempotent and not m.late else Status.SUBMIT_UNKNOWN
        elif m.late:
            expected = Status.TRACKING_TIMED_OUT
        elif m.status is Status.SUBMITTING:
            expected = Status.CANCELED if m.cancel else Status.PENDING_SUBMIT
        else:
            expected = m.status
        assert new is expected, (m, new)
        m.status = new
        m.held = None

    @rule(tid=tasks)
    def deadline_passes(self, tid: str) -> None:
        m = self.model[tid]
        if m.status.is_settled:
            return
        self.r.hset(KEYS.task(0, tid), "deadline_ms", 1)
        self.r.zadd(KEYS.deadlines(0), {tid: 1})
        swept = self.store.run(self.store.ops.time_out(0, 100))
        m.late = True
        if m.held is None:
            assert tid in swept
            m.status = Status.TRACKING_TIMED_OUT
        else:
            assert tid not in swept  # its holder's next save clamps to the deadline

    @rule(
        tid=tasks,
        to=st.sampled_from(
            [Status.SUBMITTED, Status.PENDING_SUBMIT, Status.FAILED, Status.CANCELED]
        ),
    )
    def resolve(self, tid: str, to: Status) -> None:
        target = to
        m = self.model[tid]
        r = self.store.run(
            self.store.ops.resolve(tid, target, external_id="x", handle_json=b'{"external_id":"x"}')
        )
        allowed = (
            m.status is Status.SUBMIT_UNKNOWN
            or (
                m.status in (Status.FAILED, Status.TRACKING_TIMED_OUT)
                and target is Status.PENDING_SUBMIT
            )
            or (m.status is Status.PENDING_SUBMIT and target is Status.CANCELED)
        )
        assert (r.code is Code.OK) == allowed, (m.status, target, r)
        if allowed:
            if m.status.is_terminal:
                m.cancel = False  # a requeue starts over, with a fresh deadline
                m.late = False
            if target is Status.PENDING_SUBMIT and m.cancel:
                target = Status.CANCELED  # a knowing resubmit of a canceled task
            assert r.status is target
            m.status = target
            m.started = False
            if m.late and not target.is_terminal:
                # back in circulation with its deadline gone: the sweep times it out
                assert tid in self.store.run(self.store.ops.time_out(0, 100))
                m.status = Status.TRACKING_TIMED_OUT

    @invariant()
    def statuses_match(self) -> None:
        for tid, m in self.model.items():
            assert self._status(tid) is m.status, tid

    @invariant()
    def indexes_and_counters_agree(self) -> None:
        check(self.r, set(self.model))


def check(r: SyncRedis, ids: set[str]) -> None:
    tag = KEYS.tag(0)
    statuses = {tid: Status(r.hget(KEYS.task(0, tid), "status").decode()) for tid in ids}  # type: ignore[union-attr]
    counts = {k.decode(): int(v) for k, v in r.hgetall(KEYS.counts(0)).items()}  # type: ignore[union-attr]
    for s in Status:
        real = {tid for tid, st_ in statuses.items() if st_ is s}
        assert counts.get(s.value, 0) == len(real), f"counter {s}"
        members = {m.decode() for m in r.zrange(KEYS.index(0, s), 0, -1)}  # type: ignore[union-attr]
        assert members == real, f"index {s}"
    leased = {m.decode() for m in r.zrange(KEYS.leases(0), 0, -1)}  # type: ignore[union-attr]
    sets: dict[str, set[str]] = {}
    for name in ("due:submit", "due:query", "ready:submit", "ready:query"):
        sets[name] = {m.decode() for m in r.zrange(f"{tag}:{name}", 0, -1)}  # type: ignore[union-attr]
    for tid, s in statuses.items():
        places = [n for n, members in sets.items() if tid in members]
        if tid in leased:
            places.append("leases")
        if s.is_settled:
            assert places == [], f"{tid} {s} still in {places}"
        else:
            assert len(places) == 1, f"{tid} {s} in {places}"
            if places[0] != "leases":
                assert places[0].endswith(s.phase or "?"), f"{tid} {s} in {places}"
            else:
                assert s is not Status.PENDING_SUBMIT


SYNC_REDIS: Any = None


def test_random_interleavings_keep_every_invariant(sync_redis: SyncRedis) -> None:
    global SYNC_REDIS
    SYNC_REDIS = sync_redis
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        Lifecycle,
        settings=settings(
            max_examples=20,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
