"""A claim that takes newly due tasks straight from the due set, and what a lifecycle costs.

When the ready set of a phase is empty, nothing can hold a task back and the claim can take
every task that fell due, it claims them from the due set in ready order instead of writing
each to the ready set and popping it back (lua/claim.lua). These tests hold that shortcut to
the order, end state and events of the long way, and to the cases where it must not be
taken. The last test counts the Redis commands of each step of a lifecycle, inside the
scripts: what keeps the commands a task costs from creeping back.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio

from asynctaskd.keys import Keys
from asynctaskd.model import Status
from asynctaskd.store import Code, Lease, Store
from tests.conftest import wait_until
from tests.lua.helpers import check_invariants, claim_one, create, snapshot
from tests.lua.test_fresh_claim import _events, _shape, _task_shape

HANDLE = {"external_id": "x1", "handle": b'{"external_id":"x1"}'}


async def _due_later(store: Store, *, priority: int = 0, delay_ms: int = 30) -> Lease:
    """A task driven to SUBMITTED, due for its first poll `delay_ms` from now (due:query)."""
    await create(store, priority=priority)
    c = await claim_one(store, "submit")
    r = await store.start(c.lease, False)
    assert r.code is Code.OK
    lease = Lease(c.lease.task_id, c.lease.fence, r.version)
    saved = await store.save(lease, Status.SUBMITTED, delay_ms=delay_ms, fields=HANDLE)
    assert saved.code is Code.OK
    return Lease(lease.task_id, lease.fence, saved.version)


async def _all_due(store: Store, redis_client: redis.asyncio.Redis, keys: Keys) -> None:
    async def due() -> bool:
        last = await redis_client.zrange(keys.scheduled(0, "query"), -1, -1, withscores=True)
        return not last or (await store.server_time()) * 1000 >= last[0][1]

    await wait_until(due, "every task of due:query to fall due")


async def _zadds(redis_client: redis.asyncio.Redis) -> int:
    stats = await redis_client.info("commandstats")
    return int(stats.get("cmdstat_zadd", {}).get("calls", 0))


async def test_a_task_claimed_straight_from_the_due_set_ends_as_one_claimed_the_long_way(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    # the long way: two fall due, a claim of one cannot take both
    first, second = await _due_later(store), await _due_later(store)
    await _all_due(store, redis_client, keys)
    [a] = (await store.claim(0, "query", 1, 10_000, "w")).claimed
    assert a.lease.task_id == first.task_id
    assert await redis_client.zscore(keys.ready(0, "query"), second.task_id) is not None
    [b] = (await store.claim(0, "query", 1, 10_000, "w")).claimed  # the one left ready
    assert b.lease.task_id == second.task_id
    # straight: one falls due, nothing is ready, the claim can take it
    third = await _due_later(store)
    await _all_due(store, redis_client, keys)
    zadds = await _zadds(redis_client)
    [c] = (await store.claim(0, "query", 5, 10_000, "w")).claimed
    assert c.lease.task_id == third.task_id
    assert await _zadds(redis_client) - zadds == 1  # its lease; never the ready set
    assert (c.lease.fence, c.lease.version) == (a.lease.fence, a.lease.version)
    assert _task_shape(c.task) == _task_shape(a.task)
    snap_a = await snapshot(redis_client, keys, first.task_id)
    snap_c = await snapshot(redis_client, keys, third.task_id)
    assert _shape(snap_c) == _shape(snap_a)
    assert await _events(redis_client, keys, third.task_id) == await _events(
        redis_client, keys, first.task_id
    )
    stored = await store.get(third.task_id)
    assert stored is not None  # the reply is the hash but the params (a poll needs none)
    assert _task_shape(stored) == {**_task_shape(c.task), "params": {"n": 1}}
    await check_invariants(redis_client, keys)


async def test_due_tasks_claimed_straight_come_in_ready_order(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    low = await _due_later(store, priority=-5)
    mid1 = await _due_later(store)
    high = await _due_later(store, priority=10)
    mid2 = await _due_later(store)
    await _all_due(store, redis_client, keys)
    zadds = await _zadds(redis_client)
    batch = await store.claim(0, "query", 10, 10_000, "w")
    order = [c.lease.task_id for c in batch.claimed]
    assert order == [high.task_id, mid1.task_id, mid2.task_id, low.task_id]
    assert await _zadds(redis_client) - zadds == 1  # the four leases, in one ZADD
    assert batch.ready_left == 0 and batch.dropped == 0
    await check_invariants(redis_client, keys)


async def test_a_claim_that_cannot_take_every_due_task_goes_the_long_way(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    low = await _due_later(store, priority=-5)
    high = await _due_later(store, priority=10)
    mid = await _due_later(store)
    await _all_due(store, redis_client, keys)
    batch = await store.claim(0, "query", 2, 10_000, "w")
    assert [c.lease.task_id for c in batch.claimed] == [high.task_id, mid.task_id]
    assert batch.ready_left == 1
    assert await redis_client.zscore(keys.ready(0, "query"), low.task_id) is not None
    await check_invariants(redis_client, keys)


async def test_tasks_already_ready_go_first_by_priority(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    low = await _due_later(store, priority=-5)
    await _all_due(store, redis_client, keys)
    # a task of higher priority due at once: saved with no delay, it waits in ready:query
    high = await _due_later(store, priority=10, delay_ms=0)
    assert await redis_client.zscore(keys.ready(0, "query"), high.task_id) is not None
    batch = await store.claim(0, "query", 5, 10_000, "w")
    assert [c.lease.task_id for c in batch.claimed] == [high.task_id, low.task_id]
    await check_invariants(redis_client, keys)


async def test_a_task_past_its_deadline_in_the_due_set_times_out_unclaimed(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await create(store, timeout_ms=80)
    c = await claim_one(store, "submit")
    r = await store.start(c.lease, False)
    lease = Lease(c.lease.task_id, c.lease.fence, r.version)
    assert (await store.save(lease, Status.SUBMITTED, delay_ms=100, fields=HANDLE)).code is Code.OK
    live = await _due_later(store)
    await _all_due(store, redis_client, keys)
    batch = await store.claim(0, "query", 5, 10_000, "w")
    assert [x.lease.task_id for x in batch.claimed] == [live.task_id]
    assert batch.dropped == 1
    task = await store.get(lease.task_id)
    assert task is not None and task.status is Status.TRACKING_TIMED_OUT
    await check_invariants(redis_client, keys)


# --- what a lifecycle costs Redis --------------------------------------------------------


async def _commands(redis_client: redis.asyncio.Redis) -> dict[str, int]:
    stats = await redis_client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


async def _cost(redis_client: redis.asyncio.Redis, step: Any) -> dict[str, int]:
    """The commands one awaited step ran, inside its scripts too, without EVALSHA and
    TIME (one each per script call, whatever the step), the INFO of the count, and a
    connection's handshake (the store's lane, opened by the first step: CLIENT SETINFO)."""
    before = await _commands(redis_client)
    await step
    after = await _commands(redis_client)
    out = {}
    for name, calls in after.items():
        if name in ("evalsha", "time", "info") or name.startswith("client|"):
            continue
        if calls != before.get(name, 0):
            out[name] = calls - before.get(name, 0)
    return out


async def test_each_step_of_a_lifecycle_costs_the_commands_it_needs_and_no_more(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """A lifecycle that a keeping-up daemon runs: the create, the claim that takes the
    request in straight to SUBMITTING, the start, the save SUBMITTED (due for its poll),
    a claim straight from the due set, a save that stays RUNNING, another poll's claim, and
    the save SUCCEEDED. Each count is what the step's scripts need; a change that adds one
    must say why here."""
    created: list[Any] = []

    async def create_one() -> None:
        created.append(await create(store, take_in=False))

    costs = {"create": await _cost(redis_client, create_one())}
    claimed: list[Any] = []

    async def claim(phase: str) -> None:
        batch = await store.claim(0, phase, 10, 10_000, "w")  # type: ignore[arg-type]
        assert len(batch.claimed) == 1
        claimed.append(batch.claimed[0])

    costs["claim submit (straight from the request)"] = await _cost(redis_client, claim("submit"))
    started: list[Any] = []

    async def start() -> None:
        started.append(await store.start(claimed[-1].lease, False))

    costs["start"] = await _cost(redis_client, start())
    lease = Lease(claimed[-1].lease.task_id, claimed[-1].lease.fence, started[-1].version)

    async def save(status: Status, delay_ms: int, fields: dict[str, Any]) -> None:
        r = await store.save(lease, status, delay_ms=delay_ms, fields=fields)
        assert r.code is Code.OK, r

    costs["save SUBMITTED"] = await _cost(redis_client, save(Status.SUBMITTED, 20, HANDLE))
    await _all_due(store, redis_client, keys)
    costs["claim query (straight from the due set)"] = await _cost(redis_client, claim("query"))
    lease = claimed[-1].lease
    costs["save RUNNING (status changes)"] = await _cost(
        redis_client, save(Status.RUNNING, 20, {"progress": "0.5"})
    )
    await _all_due(store, redis_client, keys)
    await claim("query")
    lease = claimed[-1].lease
    costs["save RUNNING (same status)"] = await _cost(
        redis_client, save(Status.RUNNING, 20, {"progress": "0.6"})
    )
    await _all_due(store, redis_client, keys)
    await claim("query")
    lease = claimed[-1].lease
    costs["save SUCCEEDED"] = await _cost(
        redis_client, save(Status.SUCCEEDED, 0, {"result": b'{"ok":true}'})
    )
    # Every daemon script call also runs a no-op HDEL (its role, lua/_roles.lua) and reads
    # its settings (an HMGET, or an HGET of events_maxlen alone): a call's share, not a
    # task's, when the daemon batches. Those are the first two counts of each daemon step.
    expected = {
        # the request: is the id free, as a request and as a task; stored, queued, and a wake
        "create": {"get": 1, "exists": 1, "setnx": 1, "rpush": 1, "llen": 1, "lpush": 1},
        # what may hold tasks back (admission, paused) and the ready set, once; the intake;
        # the task: is its id free, written, counted, indexed, its deadline, its lease, the
        # events of its two versions; the due set (promotion and its head); requests left
        "claim submit (straight from the request)": {
            "hdel": 1, "hmget": 1, "exists": 3, "zcard": 1, "lpop": 1, "getdel": 1,
            "hset": 1, "hincrby": 1, "zadd": 3, "xadd": 2, "zrangebyscore": 1, "zrange": 1,
            "llen": 1,
        },
        "start": {"hdel": 1, "hmget": 1, "hset": 1},
        # read; written; fields deleted (owner among them: HDEL 2 with the role's); the
        # lease, the old index and counter out; the new index and counter; due for its
        # poll; its event
        "save SUBMITTED": {
            "hdel": 2, "hget": 1, "hmget": 1, "hset": 1, "zrem": 2, "hincrby": 2, "zadd": 2,
            "xadd": 1,
        },
        # admission; the due set read and the task taken out; the ready set (empty); the
        # task read whole, written, leased; the due set's head
        "claim query (straight from the due set)": {
            "hdel": 1, "hmget": 1, "exists": 1, "zrangebyscore": 1, "zrem": 1, "zcard": 1,
            "hgetall": 1, "hset": 1, "zadd": 1, "zrange": 1,
        },
        "save RUNNING (status changes)": {
            "hdel": 2, "hget": 1, "hmget": 1, "hset": 1, "zrem": 2, "hincrby": 2, "zadd": 2,
            "xadd": 1,
        },
        "save RUNNING (same status)": {
            "hdel": 2, "hget": 1, "hmget": 1, "hset": 1, "zrem": 1, "zadd": 1, "xadd": 1,
        },
        # the settings (HMGET) and the task (owner, slots and dedup among its fields:
        # nothing is read twice); the lease, old index, counter and deadline out; the new
        # index and counter; the expiry; its event. A leased task waits in no due, ready
        # or held set, so none is looked at.
        "save SUCCEEDED": {
            "hdel": 2, "hmget": 2, "hset": 1, "zrem": 3, "hincrby": 2, "zadd": 1,
            "pexpire": 1, "xadd": 1,
        },
    }  # fmt: skip
    assert costs == expected, costs


async def test_a_due_tasks_priority_rides_in_its_score_so_promoting_it_reads_nothing(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    low = await _due_later(store, priority=-100)
    high = await _due_later(store, priority=100)
    mid = await _due_later(store, priority=7)
    due = dict(await redis_client.zrange(keys.scheduled(0, "query"), 0, -1, withscores=True))
    # the due time, then (101 - priority) / 256 in the fraction
    task = await store.get(high.task_id)
    assert task is not None and task.due_at is not None
    assert due[high.task_id.encode()] == round(task.due_at * 1000) + 1 / 256
    assert due[low.task_id.encode()] % 1 == 201 / 256 and due[mid.task_id.encode()] % 1 == 94 / 256
    await _all_due(store, redis_client, keys)
    before = await _commands(redis_client)
    batch = await store.claim(0, "query", 2, 10_000, "w")  # the long way: 3 due, room for 2
    after = await _commands(redis_client)
    assert [c.lease.task_id for c in batch.claimed] == [high.task_id, mid.task_id]
    assert after.get("hget", 0) == before.get("hget", 0)  # no priority read back
    assert await redis_client.zscore(keys.ready(0, "query"), low.task_id) is not None
    await check_invariants(redis_client, keys)


async def test_a_due_entry_of_an_earlier_release_is_promoted_by_the_tasks_priority(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """Before the priority rode in the score, a due entry's score was its due time alone:
    such an entry (left from before an upgrade) is promoted by the task's own priority."""
    plain = await _due_later(store)
    old = await _due_later(store, priority=50)
    due_key = keys.scheduled(0, "query")
    score = await redis_client.zscore(due_key, old.task_id)
    await redis_client.zadd(due_key, {old.task_id: int(score)})  # as an earlier release wrote
    await _all_due(store, redis_client, keys)
    batch = await store.claim(0, "query", 1, 10_000, "w")
    assert [c.lease.task_id for c in batch.claimed] == [old.task_id]
    assert await redis_client.zscore(keys.ready(0, "query"), plain.task_id) is not None
    await check_invariants(redis_client, keys)
