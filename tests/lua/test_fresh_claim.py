"""A submit claim that takes new tasks in straight to SUBMITTING (lua/_intake.lua, fresh).

When nothing waits in the ready set, a claim takes a new task's request in and claims it in
one step instead of writing it as PENDING_SUBMIT, popping it and reading it back. These
tests hold that shortcut to the same end state, order and events as the long way round
(`take_in=True`: a claim of no task takes the request in first), and to the cases where it
must not be taken: a cancel or a dedup entry in the same intake, a deadline already past,
older tasks waiting.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import redis.asyncio

from asynctaskd.keys import Keys
from asynctaskd.model import Status
from asynctaskd.store import Store
from tests.conftest import wait_until
from tests.lua.helpers import INDEXES, check_invariants, create, snapshot, status_of

# Fields whose values differ between two tasks made the same way at different times.
_TIMES = {b"id", b"created_ms", b"updated_ms", b"deadline_ms", b"due_ms"}


def _shape(snap: dict[str, Any]) -> dict[str, Any]:
    """A snapshot with times and ids left out: what two equivalent paths must share."""
    out: dict[str, Any] = {"hash": {k: v for k, v in snap["hash"].items() if k not in _TIMES}}
    for name, score in snap.items():
        if name not in ("hash", "counts"):
            out[name] = score is not None
    return out


def _task_shape(task: Any) -> dict[str, Any]:
    return {
        k: v
        for k, v in msgspec.structs.asdict(task).items()
        if k not in {"id", "created_at", "updated_at", "deadline_at", "due_at"}
    }


async def _events(r: redis.asyncio.Redis, keys: Keys, task_id: str) -> list[tuple[str, str]]:
    out = []
    for _, fields in await r.xrange(keys.events(0)):
        if fields[b"task"].decode() == task_id:
            out.append((fields[b"status"].decode(), fields[b"version"].decode()))
    return out


async def test_a_new_task_claimed_at_intake_ends_as_one_claimed_the_long_way(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    long_way = await create(store, take_in=True)
    [a] = (await store.claim(0, "submit", 1, 10_000, "w")).claimed
    shortcut = await create(store, take_in=False)
    batch = await store.claim(0, "submit", 1, 10_000, "w")
    [b] = batch.claimed
    assert batch.taken == 1 and b.lease.task_id == shortcut.task_id
    assert (b.lease.fence, b.lease.version) == (a.lease.fence, a.lease.version) == (1, 2)
    # the task the worker gets is the one stored, and looks like the long way's
    assert b.task.status is Status.SUBMITTING and b.task.version == 2
    assert _task_shape(b.task) == _task_shape(a.task)
    snap_a = await snapshot(redis_client, keys, long_way.task_id)
    snap_b = await snapshot(redis_client, keys, shortcut.task_id)
    assert _shape(snap_b) == _shape(snap_a)
    stored = await store.get(shortcut.task_id)
    assert stored is not None and _task_shape(stored) == _task_shape(b.task)
    counts = snap_b["counts"]
    assert counts[b"SUBMITTING@h"] == b"2" and counts[b"PENDING_SUBMIT@h"] == b"0"
    # both versions have their event, as on the long way
    expected = [("PENDING_SUBMIT", "1"), ("SUBMITTING", "2")]
    assert await _events(redis_client, keys, long_way.task_id) == expected
    assert await _events(redis_client, keys, shortcut.task_id) == expected
    await check_invariants(redis_client, keys)


async def _mixed_priorities(store: Store) -> list[Any]:
    """Four requests, not taken in: priority 0, 9, 0, -3, in that order."""
    return [await create(store, priority=p, take_in=False) for p in (0, 9, 0, -3)]


async def test_new_tasks_are_claimed_in_ready_order_and_the_rest_wait_ready(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    low1, high, low2, neg = await _mixed_priorities(store)
    first = await store.claim(0, "submit", 2, 10_000, "w")
    assert first.taken == 4
    assert [c.lease.task_id for c in first.claimed] == [high.task_id, low1.task_id]
    for left in (low2, neg):
        assert await status_of(redis_client, keys, left.task_id) is Status.PENDING_SUBMIT
        assert await redis_client.zscore(keys.ready(0, "submit"), left.task_id) is not None
        assert await _events(redis_client, keys, left.task_id) == [("PENDING_SUBMIT", "1")]
    await check_invariants(redis_client, keys)
    rest = await store.claim(0, "submit", 10, 10_000, "w")
    assert [c.lease.task_id for c in rest.claimed] == [low2.task_id, neg.task_id]
    await check_invariants(redis_client, keys)


async def test_tasks_already_ready_go_before_new_ones_of_their_priority(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    waiting = await create(store, take_in=True)  # ready before the others arrive
    newer = await create(store, take_in=False)
    urgent = await create(store, priority=5, take_in=False)
    batch = await store.claim(0, "submit", 2, 10_000, "w")
    assert [c.lease.task_id for c in batch.claimed] == [urgent.task_id, waiting.task_id]
    assert await status_of(redis_client, keys, newer.task_id) is Status.PENDING_SUBMIT
    await check_invariants(redis_client, keys)


async def test_a_cancel_taken_in_with_its_create_wins(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    created = await create(store, take_in=False)
    await store.cancel(created.task_id, None)  # a request behind the create in the intake
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    assert batch.taken == 2 and batch.claimed == []
    assert await status_of(redis_client, keys, created.task_id) is Status.CANCELED
    assert await _events(redis_client, keys, created.task_id) == [
        ("PENDING_SUBMIT", "1"),
        ("CANCELED", "2"),
    ]
    await check_invariants(redis_client, keys)


async def test_a_dedup_entry_in_the_same_intake_keeps_a_new_tasks_key(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    created = await create(store, dedup_key="k", take_in=False)
    dedup = f"{keys.tag(0)}:dedup:0::k"
    assert await redis_client.get(dedup) == created.task_id.encode()
    # what a producer pushes when it finds the key's task gone (here: not written yet)
    await redis_client.rpush(keys.intake(0), "d:0::k")
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    assert [c.lease.task_id for c in batch.claimed] == [created.task_id]
    assert await redis_client.get(dedup) == created.task_id.encode()
    await check_invariants(redis_client, keys)


async def test_a_request_taken_in_past_its_deadline_times_out_unclaimed(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    created = await create(store, timeout_ms=20, take_in=False)

    async def past() -> bool:
        return (await store.server_time()) * 1000 > created.created_ms + 20

    await wait_until(past, "the deadline to pass")
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    assert batch.claimed == []
    assert await status_of(redis_client, keys, created.task_id) is Status.TRACKING_TIMED_OUT
    for name in INDEXES:
        assert await redis_client.zscore(f"{keys.tag(0)}:{name}", created.task_id) is None
    await check_invariants(redis_client, keys)


async def test_a_claim_of_no_task_claims_nothing_it_takes_in(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    created = await create(store, take_in=False)
    batch = await store.claim(0, "submit", 0, 10_000, "w")
    assert batch.taken == 1 and batch.claimed == []
    assert await status_of(redis_client, keys, created.task_id) is Status.PENDING_SUBMIT
    await check_invariants(redis_client, keys)


@pytest.mark.parametrize(
    "suffixes",
    [
        "ZQB0M9",  # digits and capitals, as the clients make them: compared as they are
        "ZaB0m9",  # lower case too (a locale's collation puts "a" before "B"): keyed in hex
    ],
)
async def test_ties_go_by_id_in_byte_order_as_in_the_ready_set(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys, suffixes: str
) -> None:
    # one create_many call: one server time, so one ready score for all; ids out of order
    ids = [f"01KBTIE{c}" for c in suffixes]
    calls = [store.ops.create(i, "h", b"{}", timeout_ms=60_000) for i in ids]
    created = await store.run_many(calls)
    assert len({c.created_ms for c in created}) == 1
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    assert [c.lease.task_id for c in batch.claimed] == sorted(ids, key=str.encode)
    assert await redis_client.zcard(keys.ready(0, "submit")) == 0  # none went the long way
    await check_invariants(redis_client, keys)


async def test_new_tasks_claimed_together_come_in_priority_order(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    low1, high, low2, neg = await _mixed_priorities(store)
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    order = [c.lease.task_id for c in batch.claimed]
    assert order == [high.task_id, low1.task_id, low2.task_id, neg.task_id]
    await check_invariants(redis_client, keys)


async def test_a_task_that_falls_due_in_the_same_claim_goes_before_new_ones(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    delayed = await create(store, delay_ms=30, take_in=True)  # in due:submit, not ready

    async def due() -> bool:
        return (await store.server_time()) * 1000 >= delayed.due_ms

    await wait_until(due, "the delayed task to fall due")
    newer = await create(store, take_in=False)
    batch = await store.claim(0, "submit", 1, 10_000, "w")  # promotes it, then claims
    assert [c.lease.task_id for c in batch.claimed] == [delayed.task_id]
    assert await status_of(redis_client, keys, newer.task_id) is Status.PENDING_SUBMIT
    await check_invariants(redis_client, keys)


async def test_a_claim_with_grants_takes_tasks_waiting_in_a_lane_first(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    # limits just removed: a task still waits in a rate lane, the worker still has a grant
    waiting = await create(store, take_in=True)
    lane = "submit|h|"
    tag = keys.tag(0)
    await redis_client.zrem(keys.ready(0, "submit"), waiting.task_id)
    score = 100 * 2**42 + waiting.due_ms
    await redis_client.zadd(f"{tag}:held:rate:{lane}", {waiting.task_id: score})
    await redis_client.hset(keys.task(0, waiting.task_id), "held", f"rate:{lane}")
    await redis_client.sadd(f"{tag}:lanes", lane)
    newer = await create(store, take_in=False)
    batch = await store.claim(0, "submit", 1, 10_000, "w", grants={lane: 1})
    assert [c.lease.task_id for c in batch.claimed] == [waiting.task_id]
    assert await status_of(redis_client, keys, newer.task_id) is Status.PENDING_SUBMIT
    await check_invariants(redis_client, keys)


async def test_a_claim_with_room_takes_in_only_what_it_takes_so_a_backlog_goes_straight(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """With room for 32 or more, a claim takes in at most n requests: each goes straight to
    SUBMITTING, nothing is left in the ready set, and the next claim goes straight too.
    Priority orders the n taken in (the last request, urgent, is claimed first)."""
    ids = [(await create(store, take_in=False)).task_id for _ in range(49)]
    ids.append((await create(store, take_in=False, priority=5)).task_id)
    ready = f"{keys.tag(0)}:ready:submit"
    first = await store.claim(0, "submit", 40, 10_000, "w")
    assert first.taken == 40 and len(first.claimed) == 40
    assert [c.lease.task_id for c in first.claimed] == ids[:40]  # the urgent one is not in
    assert await redis_client.llen(keys.intake(0)) == 10 and first.ready_left == 10
    assert await redis_client.zcard(ready) == 0  # nothing went the long way
    second = await store.claim(0, "submit", 40, 10_000, "w")
    assert second.taken == 10
    assert [c.lease.task_id for c in second.claimed] == [ids[-1], *ids[40:49]]  # by priority
    for c in (*first.claimed, *second.claimed):
        assert (c.lease.fence, c.lease.version, c.task.status) == (1, 2, Status.SUBMITTING)
    assert await _events(redis_client, keys, ids[-1]) == [("PENDING_SUBMIT", "1"),
                                                          ("SUBMITTING", "2")]  # fmt: skip
    await check_invariants(redis_client, keys)


async def test_a_claim_with_little_room_takes_in_256_and_orders_them_all(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """A busy daemon (room for fewer than 32) takes in up to 256 requests first, so priority
    orders all of them: the urgent request behind 49 others is claimed first."""
    ids = [(await create(store, take_in=False)).task_id for _ in range(49)]
    urgent = (await create(store, take_in=False, priority=5)).task_id
    batch = await store.claim(0, "submit", 31, 10_000, "w")
    assert batch.taken == 50 and batch.claimed[0].lease.task_id == urgent
    assert [c.lease.task_id for c in batch.claimed[1:]] == ids[:30]
    assert await redis_client.llen(keys.intake(0)) == 0
    assert await redis_client.zcard(f"{keys.tag(0)}:ready:submit") == 19  # the long way
    await check_invariants(redis_client, keys)
