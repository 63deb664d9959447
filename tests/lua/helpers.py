"""Seeding and after-state helpers for the script tests."""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import redis.asyncio
from redis import Redis as SyncRedis

from asynctaskd.codec import encode_json
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.plans import Pause, Reads, advance
from asynctaskd.store import Call, Claimed, Code, Created, Lease, Store, read_many

INDEXES = (
    "due:submit",
    "due:query",
    "ready:submit",
    "ready:query",
    "leases",
    "deadlines",
    "quarantine",
    "due:find",
)


async def create(
    store: Store,
    *,
    handler: str = "h",
    timeout_ms: int = 60_000,
    priority: int = 0,
    delay_ms: int = 0,
    tenant: str = "",
    account: str = "",
    provider: str = "",
    dedup_key: str = "",
    params: Any = None,
    task_id: str = "",
    take_in: bool = True,
) -> Created:
    """Create a task as a producer does and, with `take_in`, let a daemon take the
    request in at once (the task then exists as a hash with its indexes)."""
    task_id = task_id or new_task_id()
    created = await store.run(
        store.ops.create(
            task_id,
            handler,
            encode_json(params if params is not None else {"n": 1}),
            timeout_ms=timeout_ms,
            priority=priority,
            delay_ms=delay_ms,
            tenant=tenant,
            account=account,
            provider=provider,
            dedup_key=dedup_key,
        )
    )
    if take_in:
        await ingest(store)
    return created


async def ingest(store: Store, shard: int = 0) -> int:
    """What a daemon's claim does first: take in producers' requests (a submit claim of
    no task, promoting nothing). Returns how many requests it took in."""
    batch = await store.claim(shard, "submit", 0, 1000, "ingest", 0)
    return batch.taken


async def cancel(store: Store, task_id: str, tenant: str | None = None) -> Code:
    """A producer's cancel, then a daemon taking it in; the cancel script's code."""
    result = await store.cancel(task_id, tenant)
    await ingest(store, int(task_id.rpartition("-")[2]) if "-" in task_id else 0)
    return result.code


async def claim_one(store: Store, phase: str = "submit", lease_ms: int = 10_000) -> Claimed:
    batch = await store.claim(0, phase, 1, lease_ms, "w1")  # type: ignore[arg-type]
    assert len(batch.claimed) == 1, f"expected one {phase} task, got {batch}"
    return batch.claimed[0]


async def submitted(store: Store, lease_ms: int = 10_000, **kw: Any) -> Lease:
    """Create a task and drive it to SUBMITTED (due at once); return the spent lease."""
    await create(store, **kw)
    c = await claim_one(store, "submit", lease_ms)
    r = await store.start(c.lease, False)
    assert r.code is Code.OK
    lease = Lease(c.lease.task_id, c.lease.fence, r.version)
    r = await store.save(
        lease, Status.SUBMITTED, fields={"external_id": "x1", "handle": b'{"external_id":"x1"}'}
    )
    assert r.code is Code.OK, r
    return lease


async def snapshot(r: redis.asyncio.Redis, keys: Keys, task_id: str) -> dict[str, Any]:
    """Everything the scripts may touch about one task: hash, index memberships, counts."""
    tag = keys.tag(0)
    out: dict[str, Any] = {"hash": await r.hgetall(keys.task(0, task_id))}
    for name in INDEXES:
        out[name] = await r.zscore(f"{tag}:{name}", task_id)
    for s in Status:
        out[f"idx:{s.value}"] = await r.zscore(keys.index(0, s), task_id)
    out["counts"] = await r.hgetall(keys.counts(0))
    return out


async def status_of(r: redis.asyncio.Redis, keys: Keys, task_id: str) -> Status:
    return Status((await r.hget(keys.task(0, task_id), "status")).decode())


async def lease_expired(r: redis.asyncio.Redis, keys: Keys, task_id: str) -> bool:
    score = await r.zscore(keys.leases(0), task_id)
    sec, usec = await r.time()
    return score is not None and score < sec * 1000 + usec // 1000


_Batch = list[tuple[str, tuple[Any, ...]]]


def _invariants(keys: Keys) -> Generator[_Batch, list[Any], None]:
    """The invariants, as a generator: it yields the reads it needs next, a list of (client
    method name, arguments), and is sent their replies in order, so that one body of checks
    serves the asyncio client of the script tests and the blocking one of the state machine
    (tests/property), each sending a batch as one pipeline."""
    tag = keys.tag(0)
    phases = ("due:submit", "due:query", "ready:submit", "ready:query", "due:find")
    first: _Batch = [
        ("lrange", (keys.intake(0), 0, -1)),
        ("keys", (f"{tag}:new:*",)),
        ("keys", (f"{tag}:task:*",)),
        ("keys", (f"{tag}:inflight:*",)),
        ("hgetall", (keys.counts(0),)),
        ("zrange", (keys.leases(0), 0, -1)),
        ("zrange", (keys.deadlines(0), 0, -1)),
        *[("zrange", (f"{tag}:{name}", 0, -1)) for name in phases],
        *[("zrange", (keys.index(0, s), 0, -1)) for s in Status],
    ]
    intake, new_keys, task_keys, inflight_keys, raw_counts, *zsets = yield first
    leased = {m.decode() for m in zsets[0]}
    deadlines = {m.decode() for m in zsets[1]}
    sets = {name: {m.decode() for m in zsets[2 + i]} for i, name in enumerate(phases)}
    indexes = {s: {m.decode() for m in zsets[2 + len(phases) + i]} for i, s in enumerate(Status)}
    queued = {e.decode() for e in intake}
    requests = [k.decode().rsplit(":", 1)[1] for k in new_keys]
    task_ids = [k.decode().rsplit(":", 1)[1] for k in task_keys]
    scopes = [k.decode()[len(f"{tag}:inflight:") :] for k in inflight_keys]
    second: _Batch = [
        *[("exists", (keys.task(0, tid),)) for tid in requests],
        *[("hgetall", (k,)) for k in task_keys],
        *[("smembers", (k,)) for k in inflight_keys],
    ]
    replies = yield second
    exists = replies[: len(requests)]
    tasks: dict[str, dict[bytes, bytes]] = dict(
        zip(task_ids, replies[len(requests) : len(requests) + len(task_ids)], strict=True)
    )
    members_of = replies[len(requests) + len(task_ids) :]
    for tid, there in zip(requests, exists, strict=True):
        assert f"c:{tid}" in queued, f"create request {tid} is not in the intake"
        assert not there, f"{tid} is both a request and a task"
    # one counter per status and handler, exact; a status's total is its index's size
    real: dict[str, int] = {}
    for h in tasks.values():
        field = f"{h[b'status'].decode()}@{h[b'handler'].decode()}"
        real[field] = real.get(field, 0) + 1
    counts = {k.decode(): int(v) for k, v in raw_counts.items() if int(v)}
    assert counts == real, f"counters {counts} vs the tasks {real}"
    for s in Status:
        expected = {tid for tid, h in tasks.items() if h[b"status"].decode() == s.value}
        assert indexes[s] == expected, f"index {s} disagrees"
    held_in: list[tuple[str, bytes]] = []
    for tid, h in tasks.items():
        s = Status(h[b"status"].decode())
        places = [n for n, members in sets.items() if tid in members]
        if tid in leased:
            places.append("leases")
        held = h.get(b"held")
        if held is not None:
            phase_ok = s is Status.PENDING_SUBMIT or held.startswith(b"rate:query|")
            assert phase_ok and tid not in leased, f"{tid} {s} is held in {held!r}"
            held_in.append((tid, held))
            places.append("held")
        if s is Status.SUBMIT_UNKNOWN:
            # parked: waiting for an operator (nowhere), or for a lookup (due:find), or
            # being looked up (due:find and leased)
            assert places in ([], ["due:find"], ["due:find", "leases"]), f"{tid} {s} {places}"
            if places:
                assert b"find" in h, f"{tid} is due for a lookup without a find record"
        elif s.is_terminal:
            assert places == [], f"{tid} {s} still in {places}"
        else:
            assert len(places) == 1, f"{tid} {s} in {places}"
            if s is Status.SUBMITTING:
                assert places == ["leases"]
            elif "leases" not in places and "held" not in places:
                assert places[0].endswith(s.phase or "?"), f"{tid} {s} in {places}"
            # a worker holds a task only between a claim and its save: never a pending one
            assert not (s is Status.PENDING_SUBMIT and "leases" in places), f"{tid} {s} leased"
        # an owner is the holder of a lease: written by the claim, removed with the lease
        assert (b"owner" in h) == (tid in leased), f"{tid} {s} owner {h.get(b'owner')!r}"
        # the deadline index follows the tasks a sweep may still time out: those of a phase
        assert (tid in deadlines) == (s.phase is not None), f"{tid} {s} deadline index"
        # a start mark lives from the start to the end of that submit attempt (a parked
        # task keeps it, so that its submitter's late save can land)
        if b"started_fence" in h:
            assert s in (Status.SUBMITTING, Status.SUBMIT_UNKNOWN), f"{tid} {s} started"
    if held_in:
        scores = yield [("zscore", (f"{tag}:held:{held.decode()}", tid)) for tid, held in held_in]
        for (tid, held), score in zip(held_in, scores, strict=True):
            assert score is not None, f"{tid} is not in held:{held.decode()}"
    # In-flight caps: a task holds a slot exactly when its `slots` field names the cap,
    # and only while it is in flight (SUBMITTING..RUNNING or SUBMIT_UNKNOWN).
    in_flight = {"SUBMITTING", "SUBMITTED", "RUNNING", "SUBMIT_UNKNOWN"}
    expected_sets: dict[str, set[str]] = {}
    for tid, h in tasks.items():
        slots = h.get(b"slots")
        if slots:
            assert h[b"status"].decode() in in_flight, f"{tid} holds slots while {h[b'status']!r}"
            for scope in slots.decode().split():
                expected_sets.setdefault(scope, set()).add(tid)
    actual_sets = {
        scope: {m.decode() for m in members}
        for scope, members in zip(scopes, members_of, strict=True)
    }
    assert actual_sets == expected_sets, f"in-flight sets {actual_sets} vs {expected_sets}"


async def check_invariants(r: redis.asyncio.Redis, keys: Keys) -> None:
    """Counters equal real counts; each live task is in exactly one due set or leased;
    every create request not yet taken in is queued for the daemons; the lease, owner,
    deadline index and start mark agree with the status (see _invariants)."""
    checks = _invariants(keys)
    replies: Any = None
    try:
        while True:
            reads = checks.send(replies)
            async with r.pipeline(transaction=False) as pipe:
                for name, args in reads:
                    getattr(pipe, name)(*args)
                replies = await pipe.execute()
    except StopIteration:
        return


def check_invariants_sync(r: SyncRedis, keys: Keys) -> None:
    """check_invariants through a blocking client (the state machine's)."""
    checks = _invariants(keys)
    replies: Any = None
    try:
        while True:
            reads = checks.send(replies)
            with r.pipeline(transaction=False) as pipe:
                for name, args in reads:
                    getattr(pipe, name)(*args)
                replies = pipe.execute()
    except StopIteration:
        return


async def evalsha_calls(r: redis.asyncio.Redis) -> int:
    """EVALSHA calls the server has run so far (INFO commandstats)."""
    stats = await r.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


class Stepper:
    """Runs a plan one step at a time, so a test decides how two plans interleave."""

    def __init__(self, store: Store, plan: Any) -> None:
        self.store = store
        self.plan = plan
        more, self.pending = advance(plan, None, None)
        assert more
        self.result: Any = None

    @property
    def script(self) -> str:
        if isinstance(self.pending, Call):
            return self.pending.script
        return "read" if isinstance(self.pending, Reads) else "pause"

    async def step(self) -> None:
        reply: Any = None
        if isinstance(self.pending, Call):
            reply = await self.store.run(self.pending)
        elif isinstance(self.pending, Reads):
            reply = await read_many(self.store, self.pending.cmds)
        else:  # a Pause: the test decides what happens meanwhile, so no time passes
            assert isinstance(self.pending, Pause)
        more, step = advance(self.plan, reply, None)
        self.pending, self.result = (step, None) if more else (None, step)

    async def finish(self) -> Any:
        while self.pending is not None:
            await self.step()
        return self.result


def next_server_ms(r: SyncRedis) -> None:
    """Return once the server's clock (what the scripts read with TIME) is a later
    millisecond than at the call: what a script runs next sees a later time."""

    def now_ms() -> int:
        s, us = r.time()
        return int(s) * 1000 + int(us) // 1000

    start, deadline = now_ms(), time.monotonic() + 1
    while now_ms() <= start:
        assert time.monotonic() < deadline, "the server's clock did not move for 1 s"
