"""Fresh claims and the long way end the same (lua/_intake.lua, "Fresh tasks").

A submit claim that finds nothing in ready:submit takes new requests due now straight to
SUBMITTING; taken in first (PENDING_SUBMIT in the ready set), the same claim pops them.
Hypothesis writes a short program (creates, maybe due later, with a dedup key, canceled;
claims; a holder's start and save; a deadline passed and the sweep) and runs it twice on
one server, in two namespaces with the same task ids: once with every request taken in
(a claim of no task) before each claim, once without. Every claim must answer the same
tasks in the same order, with the same fences and versions; at the end every task's hash
(times left out), its place in every index, the counters, and its events in order (stream
ids and times left out) must be the same. The invariants of the script tests hold after
every step of both runs.

Each step runs in a later millisecond than the one before (the runs wait for it), so both
runs give their tasks one ready order (by priority, then the step that made it due, then
id), whatever the ids: some ids are made smaller than all before, so that the id order is
not the order of due times, and two creates in one create_many call share a due time.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from redis import Redis as SyncRedis

from asynctaskd.codec import encode_json
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.store import Lease, SyncStore
from tests.lua.helpers import INDEXES, check_invariants_sync, next_server_ms

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LEASE_MS = 60_000
TIMEOUT_MS = 600_000
LATER_MS = 600_000  # a create due later: it waits in due:submit, never fresh
TIMES = {b"created_ms", b"updated_ms", b"deadline_ms", b"due_ms", b"finished_ms"}
# What the programs met, over the whole test, as the run without take-in saw it.
REACHED: collections.Counter[str] = collections.Counter()

Op = tuple[Any, ...]
CREATE = st.tuples(
    st.just("create"),
    st.integers(-2, 2),  # priority
    st.sampled_from([0, 0, 0, 0, LATER_MS]),  # delay
    st.sampled_from(["", "", "", "k"]),  # dedup key
    st.booleans(),  # an id smaller than every id made before (see small_id)
)
# two creates of one priority in one create_many call: one server time, one ready score;
# the second one's id maybe the smaller
TOGETHER = st.tuples(st.just("together"), st.integers(-2, 2), st.booleans())
OPS = st.one_of(
    CREATE,
    CREATE,
    CREATE,
    TOGETHER,
    st.tuples(st.just("cancel"), st.integers(0, 15)),
    st.tuples(st.just("claim"), st.integers(1, 4)),
    st.tuples(st.just("claim"), st.integers(1, 4)),
    st.tuples(
        st.just("save"),
        st.integers(0, 15),
        st.sampled_from([Status.SUBMITTED, Status.PENDING_SUBMIT, Status.FAILED]),
    ),
    st.tuples(st.just("deadline"), st.integers(0, 15)),
)


def small_id() -> str:
    """A task id before every id new_task_id makes (its time part is the smallest)."""
    return "00" + new_task_id()[2:]


class Run:
    """One namespace's run of a program; `take_in`: requests taken in before each claim."""

    def __init__(self, r: SyncRedis, namespace: str, take_in: bool) -> None:
        self.r = r
        self.keys = Keys(namespace)
        self.store = SyncStore(r, self.keys)
        self.take_in = take_in
        self.created: list[str] = []  # ids of the creates answered OK, in order
        self.leases: dict[str, Lease] = {}  # the worker's live leases
        self.replies: list[Any] = []  # what each step answered, to compare

    def step(self, op: Op, ids: tuple[str, str]) -> None:
        kind = op[0]
        if kind == "create":
            _, priority, delay, dedup, _ = op
            call = self.store.ops.create(
                ids[0], "h", encode_json({"p": priority}), timeout_ms=TIMEOUT_MS,
                priority=priority, delay_ms=delay, dedup_key=dedup,
            )  # fmt: skip
            created = self.store.run(call)
            if not created.deduped:
                self.created.append(ids[0])
            self.replies.append((kind, created.task_id, created.deduped))
        elif kind == "together":
            calls = [
                self.store.ops.create(
                    tid, "h", encode_json({"p": op[1]}), timeout_ms=TIMEOUT_MS, priority=op[1]
                )
                for tid in ids
            ]
            replies = self.store.run(self.store.ops.create_many(calls))
            assert [r[:2] for r in replies] == [[1, 1], [1, 1]], replies
            self.created += ids
            self.replies.append((kind, ids))
        elif kind == "cancel":
            tid = self.pick(op[1])
            got = self.store.run(self.store.ops.cancel(tid)) if tid else None
            self.replies.append((kind, tid, got))
        elif kind == "claim":
            if self.take_in:
                taken = self.store.run(self.store.ops.claim(0, "submit", 0, LEASE_MS, "in", 0))
                assert not taken.claimed
            batch = self.store.run(self.store.ops.claim(0, "submit", op[1], LEASE_MS, "w", 100))
            got = [(c.lease.task_id, c.lease.fence, c.lease.version) for c in batch.claimed]
            for c in batch.claimed:
                self.leases[c.lease.task_id] = c.lease
            self.replies.append((kind, got, batch.dropped, batch.ready_left))
        elif kind == "save":
            tid = self.pick(op[1])
            lease = self.leases.pop(tid, None) if tid else None
            if lease is None:
                self.replies.append((kind, None))
                return
            started = self.store.run(self.store.ops.start(lease, False, "", None))
            if started.ok:
                lease = Lease(tid, lease.fence, started.version)
            saved = self.store.run(self.store.ops.save(lease, op[2]))
            self.replies.append((kind, tid, started, saved))
        else:  # a deadline passes (of a task taken in), and the sweep runs
            tid = self.pick(op[1])
            if tid and self.r.exists(self.keys.task(0, tid)):
                self.r.hset(self.keys.task(0, tid), "deadline_ms", 1)
                self.r.zadd(self.keys.deadlines(0), {tid: 1})
            swept = self.store.run(self.store.ops.time_out(0, 100)).timed_out
            self.replies.append((kind, tid, sorted(swept)))
        check_invariants_sync(self.r, self.keys)
        # the next step's server time is a later millisecond: every ready score it makes
        # is above this step's, in both runs, whatever the ids
        next_server_ms(self.r)

    def pick(self, i: int) -> str | None:
        return self.created[i % len(self.created)] if self.created else None

    def requests(self) -> set[str]:
        """The tasks whose create request waits in the intake."""
        tag = self.keys.tag(0)
        return {e.decode()[2:] for e in self.r.lrange(f"{tag}:intake", 0, -1) if e[:2] == b"c:"}  # type: ignore[union-attr]

    def state(self) -> dict[str, Any]:
        """Every task's hash without times, its index memberships and its events; the
        counters; the requests left."""
        tag = self.keys.tag(0)
        events: dict[str, list[dict[bytes, bytes]]] = collections.defaultdict(list)
        for _, fields in self.r.xrange(self.keys.events(0)):  # type: ignore[union-attr]
            events[fields[b"task"].decode()].append(fields)
        out: dict[str, Any] = {
            # a counter the long way took up and back down to 0 is a field "0", one the
            # fresh way never touched is missing: both read as 0
            "counts": {
                k: v
                for k, v in self.r.hgetall(self.keys.counts(0)).items()  # type: ignore[union-attr]
                if v != b"0"
            },
            "intake": self.r.lrange(f"{tag}:intake", 0, -1),
        }
        for tid in self.created:
            h = self.r.hgetall(self.keys.task(0, tid))
            where = [
                name for name in INDEXES if self.r.zscore(f"{tag}:{name}", tid) is not None
            ] + [s.value for s in Status if self.r.zscore(self.keys.index(0, s), tid) is not None]
            out[tid] = (
                {k: v for k, v in h.items() if k not in TIMES},  # type: ignore[union-attr]
                where,
                events[tid],
            )
        return out


def run_twice(r: SyncRedis, program: list[Op]) -> None:
    r.flushdb()  # the session's private server
    # a step's ids, the same in both runs
    ids = [
        (small_id() if op[0] == "create" and op[4] else new_task_id(),
         small_id() if op[0] == "together" and op[2] else new_task_id())
        for op in program
    ]  # fmt: skip
    long_way = Run(r, "long", take_in=True)
    shortcut = Run(r, "fresh", take_in=False)
    for i, op in enumerate(program):
        met, nothing_ready = set(), False
        if op[0] == "claim":
            met = shortcut.requests()
            nothing_ready = r.zcard(f"{shortcut.keys.tag(0)}:ready:submit") == 0
        long_way.step(op, ids[i])
        shortcut.step(op, ids[i])
        assert shortcut.replies[i] == long_way.replies[i], f"step {i} {op} answered differently"
        claimed = {c[0] for c in shortcut.replies[i][1]} if op[0] == "claim" else set()
        if claimed & met:
            REACHED["claims that took requests in and claimed some"] += 1
            REACHED["... of them with nothing ready before (fresh)"] += nothing_ready
            REACHED["... of them also claiming tasks taken in before (mixed)"] += bool(
                claimed - met
            )
    assert shortcut.state() == long_way.state()


def test_fresh_claims_end_as_the_long_way(sync_redis: SyncRedis) -> None:
    REACHED.clear()
    # besides what hypothesis draws: a claim of more requests than it wants, then one of a
    # task left ready and new requests; a cancel in the intake with its create
    mixed = [
        ("create", 0, 0, "", False),
        ("create", 1, 0, "", True),
        ("claim", 1),
        ("create", 0, 0, "", False),
    ]
    canceled = [
        ("create", 0, 0, "k", False),
        ("create", 2, 0, "", False),
        ("cancel", 1),
        ("together", 0, True),
        ("claim", 3),
    ]
    test = given(program=st.lists(OPS, min_size=6, max_size=24))(
        settings(
            max_examples=120,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )(lambda program: run_twice(sync_redis, program))
    )
    example(program=[*mixed, ("claim", 2)])(example(program=canceled)(test))()
    print(dict(REACHED))  # noqa: T201 - what the programs met, for `pytest -s` and CI
    assert all(REACHED.values()) and len(REACHED) == 3, REACHED
