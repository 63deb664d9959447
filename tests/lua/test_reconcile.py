"""lookup.lua and reconcile.lua: parked tasks settled by asking the vendor.

A task is parked here as the daemons park it: claimed, its start marked (with
`find_visible_ms` for a handler that can look its job up), then released after the
vendor call started (release.lua answers STARTED and parks it).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import redis.asyncio

from asynctaskd.errors import ScriptError
from asynctaskd.keys import Keys
from asynctaskd.model import Status
from asynctaskd.store import Claimed, Code, Lease, Store
from tests.lua.helpers import cancel, check_invariants, claim_one, create, status_of

pytestmark = pytest.mark.anyio

HANDLE = b'{"external_id": "job-1", "query": {}}'
GIVE_UP = {"max_lookups": 10, "give_up_ms": 3_600_000}


async def park(store: Store, *, visible_ms: int | None = 0, handler: str = "h", **kw: Any) -> Lease:
    """A task parked in SUBMIT_UNKNOWN after a started submit; the submitter's lease."""
    await create(store, handler=handler, **kw)
    claimed = await claim_one(store)
    started = await store.run(store.ops.start(claimed.lease, False, "tok", visible_ms))
    assert started.code is Code.OK
    lease = Lease(claimed.lease.task_id, claimed.lease.fence, started.version)
    assert (await store.release([lease]))[lease.task_id] is Code.STARTED
    return lease


async def look(store: Store, n: int = 10, lease_ms: int = 10_000, handlers=("h",)) -> list[Claimed]:
    return (await store.lookup(0, n, lease_ms, "w1", list(handlers))).claimed


def settle(store: Store, lease: Lease, outcome: str, **kw: Any) -> Any:
    args = {"retry_ms": 1000, **GIVE_UP, **kw}
    return store.run(store.ops.reconcile(lease, outcome, **args))


async def events(r: redis.asyncio.Redis, keys: Keys, task_id: str) -> list[dict[bytes, bytes]]:
    return [f for _, f in await r.xrange(keys.events(0)) if f[b"task"] == task_id.encode()]


async def test_parking_schedules_a_lookup_only_for_a_handler_that_can_find(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    findable = await park(store, visible_ms=5000)
    plain = await park(store, visible_ms=None)
    due = await redis_client.zrange(keys.lookups(0), 0, -1)
    assert due == [findable.task_id.encode()]
    assert await redis_client.hget(keys.task(0, plain.task_id), "find") is None
    assert await store.parked() == {"lookup": 1, "operator": 1}
    await check_invariants(redis_client, keys)


async def test_a_found_job_is_tracked_as_if_submitted(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    parked = await park(store, visible_ms=60_000)
    (claimed,) = await look(store)
    assert claimed.lease.fence == parked.fence + 1
    assert claimed.task.params == {"n": 1}  # the lookup gets what the submit sent
    await check_invariants(redis_client, keys)
    done = await settle(store, claimed.lease, "found", external_id="job-1", handle_json=HANDLE)
    assert (done.code, done.status, done.what) == (Code.OK, Status.SUBMITTED, "found")
    task = await store.get(parked.task_id)
    assert task is not None and task.external_id == "job-1" and task.error is None
    assert task.submit_attempts == 1
    assert await redis_client.zcard(keys.lookups(0)) == 0
    (query,) = (await store.claim(0, "query", 10, 10_000, "w2")).claimed
    assert query.task.handle == {"external_id": "job-1", "query": {}}
    last = (await events(redis_client, keys, parked.task_id))[-1]
    assert last[b"status"] == b"SUBMITTED" and last[b"reconciled"] == b"found"
    await check_invariants(redis_client, keys)


async def test_none_too_early_asks_again_when_the_job_would_be_listed(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    parked = await park(store, visible_ms=60_000)
    mark = int((await redis_client.hget(keys.task(0, parked.task_id), "find")).split(b":")[1])
    (claimed,) = await look(store)
    done = await settle(store, claimed.lease, "none", retry_ms=10)
    assert (done.status, done.what) == (Status.SUBMIT_UNKNOWN, "again")
    # not resubmitted, and not asked again before the job is sure to be listed
    assert await redis_client.zscore(keys.lookups(0), parked.task_id) == mark + 60_000
    assert await redis_client.zcard(keys.scheduled(0, "submit")) == 0
    task = await store.get(parked.task_id)
    assert task is not None and task.message is not None and "60000 ms" in task.message
    assert await look(store) == []
    await check_invariants(redis_client, keys)


async def test_none_after_the_visibility_window_resubmits_with_the_reason_in_the_stream(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    parked = await park(store, visible_ms=0)
    (claimed,) = await look(store)
    done = await settle(store, claimed.lease, "none")
    assert (done.status, done.what) == (Status.PENDING_SUBMIT, "resubmitted")
    last = (await events(redis_client, keys, parked.task_id))[-1]
    assert last[b"reconciled"] == b"resubmitted" and last[b"reason"] == b"no_job"
    # a normal submit follows; the attempts keep counting
    again = await claim_one(store)
    assert again.task.submit_attempts == 1 and again.lease.fence == claimed.lease.fence + 1
    assert again.task.error is not None and again.task.error.code == "LOOKUP_FOUND_NO_JOB"
    started = await store.run(store.ops.start(again.lease, False, "tok2", 0))
    assert started.code is Code.OK
    assert (await store.get(parked.task_id)).submit_attempts == 2  # type: ignore[union-attr]
    await check_invariants(redis_client, keys)


async def test_errors_and_early_nones_give_up_to_an_operator_with_the_reason(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    parked = await park(store, visible_ms=60_000)
    (claimed,) = await look(store)
    first = await settle(store, claimed.lease, "error", retry_ms=0, max_lookups=2,
                         message="HTTP_500: boom")  # fmt: skip
    assert first.what == "again"
    (claimed,) = await look(store)
    done = await settle(store, claimed.lease, "none", max_lookups=2)
    assert (done.status, done.what) == (Status.SUBMIT_UNKNOWN, "gave_up")
    task = await store.get(parked.task_id)
    assert task is not None and task.error is not None
    assert task.error.code == "LOOKUP_GAVE_UP"
    assert "2 lookups" in task.error.message and "INTERRUPTED_IN_SUBMIT" in task.error.message
    assert await redis_client.zcard(keys.lookups(0)) == 0
    assert await store.parked() == {"lookup": 0, "operator": 1}
    last = (await events(redis_client, keys, parked.task_id))[-1]
    assert last[b"status"] == b"SUBMIT_UNKNOWN" and last[b"reconciled"] == b"gave_up"
    await check_invariants(redis_client, keys)


async def test_give_up_after_a_time_since_the_mark(store: Store) -> None:
    await park(store, visible_ms=60_000)
    (claimed,) = await look(store)
    done = await settle(store, claimed.lease, "error", give_up_ms=0, message="x")
    assert done.what == "gave_up"


async def test_a_stale_fence_is_refused_and_changes_nothing(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    parked = await park(store, visible_ms=0)
    (first,) = await look(store, lease_ms=1)
    await anyio.sleep(0.005)
    await store.reap(0, 100, 3)  # the first lookup's daemon is presumed dead
    (second,) = await look(store)
    before = await redis_client.hgetall(keys.task(0, parked.task_id))
    stale = await settle(store, first.lease, "none")
    assert stale.code is Code.STALE_FENCE
    assert await redis_client.hgetall(keys.task(0, parked.task_id)) == before
    assert (await settle(store, second.lease, "none")).what == "resubmitted"


async def test_a_wrong_version_is_refused(store: Store) -> None:
    await park(store, visible_ms=0)
    (claimed,) = await look(store)
    lease = claimed.lease
    wrong = Lease(lease.task_id, lease.fence, lease.version - 1)
    assert (await settle(store, wrong, "none")).code is Code.WRONG_VERSION


async def test_an_expired_lookup_lease_comes_back_due_and_its_write_is_refused(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    parked = await park(store, visible_ms=0)
    (claimed,) = await look(store, lease_ms=1)
    await anyio.sleep(0.005)
    await store.reap(0, 100, 3)
    assert await redis_client.hget(keys.task(0, parked.task_id), "owner") is None
    assert (await settle(store, claimed.lease, "none")).code is Code.NO_LEASE
    assert await status_of(redis_client, keys, parked.task_id) is Status.SUBMIT_UNKNOWN
    await check_invariants(redis_client, keys)
    (again,) = await look(store)  # due again by itself
    assert again.lease.fence == claimed.lease.fence + 1


async def test_a_cancel_during_a_lookup_wins(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    parked = await park(store, visible_ms=0)
    (claimed,) = await look(store)
    assert await cancel(store, parked.task_id) is Code.ACCEPTED
    assert await status_of(redis_client, keys, parked.task_id) is Status.CANCELED
    done = await settle(store, claimed.lease, "found", external_id="j", handle_json=HANDLE)
    assert done.code is Code.NO_LEASE
    assert await status_of(redis_client, keys, parked.task_id) is Status.CANCELED
    assert await redis_client.zcard(keys.lookups(0)) == 0
    await check_invariants(redis_client, keys)


async def test_a_cancel_flag_carried_into_the_park_is_merged(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await create(store)
    claimed = await claim_one(store)
    started = await store.run(store.ops.start(claimed.lease, False, "tok", 0))
    lease = Lease(claimed.lease.task_id, claimed.lease.fence, started.version)
    await cancel(store, lease.task_id)  # a flag for the holder
    assert (await store.release([lease]))[lease.task_id] is Code.STARTED
    (found,) = await look(store)
    assert found.task.cancel_requested
    done = await settle(store, found.lease, "none")
    assert done.status is Status.CANCELED  # nothing at the vendor, and a cancel was asked
    await check_invariants(redis_client, keys)


async def test_the_original_submitters_late_save_wins_over_a_lookup_in_flight(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    parked = await park(store, visible_ms=0)
    (claimed,) = await look(store)
    late = await store.save(parked, Status.SUBMITTED,
                            fields={"external_id": "job-9", "handle": HANDLE})  # fmt: skip
    assert late.code is Code.OK
    await check_invariants(redis_client, keys)
    assert (await settle(store, claimed.lease, "none")).code is Code.NO_LEASE
    task = await store.get(parked.task_id)
    assert task is not None and task.status is Status.SUBMITTED and task.external_id == "job-9"
    assert await redis_client.zcard(keys.lookups(0)) == 0


async def test_a_found_job_past_the_deadline_times_out_keeping_the_handle(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    parked = await park(store, visible_ms=0, timeout_ms=50)
    await anyio.sleep(0.06)
    (claimed,) = await look(store)
    done = await settle(store, claimed.lease, "found", external_id="job-1", handle_json=HANDLE)
    assert done.status is Status.TRACKING_TIMED_OUT
    task = await store.get(parked.task_id)
    assert task is not None and task.external_id == "job-1"
    await check_invariants(redis_client, keys)


async def test_lookup_leaves_other_handlers_and_is_bounded(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    other = await park(store, visible_ms=0, handler="other")
    mine = [await park(store, visible_ms=0) for _ in range(3)]
    batch = await store.lookup(0, 2, 10_000, "w1", ["h"])
    assert len(batch.claimed) == 2 and batch.due_left == 2
    assert {c.lease.task_id for c in batch.claimed} <= {m.task_id for m in mine}
    batch = await store.lookup(0, 10, 10_000, "w1", ["other"])
    assert [c.lease.task_id for c in batch.claimed] == [other.task_id]
    await check_invariants(redis_client, keys)


async def test_a_settled_or_vanished_entry_is_dropped(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    parked = await park(store, visible_ms=0)
    await redis_client.zadd(keys.lookups(0), {"no-such-task": 0})
    await store.resolve(parked.task_id, Status.FAILED, message="by hand")
    batch = await store.lookup(0, 10, 10_000, "w1", ["h"])
    assert batch.claimed == [] and batch.dropped == 1
    assert await redis_client.zcard(keys.lookups(0)) == 0


async def test_reconcile_refuses_malformed_argv_before_writing(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await park(store, visible_ms=0)
    (claimed,) = await look(store)
    before = await redis_client.hgetall(keys.task(0, claimed.lease.task_id))
    for bad in ({"outcome": "maybe"}, {"retry_ms": -1}, {"max_lookups": 0},
                {"outcome": "found"}):  # fmt: skip
        outcome = bad.pop("outcome", "none")
        with pytest.raises(ScriptError, match="asynctaskd:"):
            await settle(store, claimed.lease, outcome, **bad)
    assert await redis_client.hgetall(keys.task(0, claimed.lease.task_id)) == before


async def test_stats_tell_parked_tasks_a_lookup_will_settle_from_those_left_to_an_operator(
    store: Store, redis_url: str
) -> None:
    from asynctaskd.client import AsyncClient
    from tests.test_cli import cli

    lookup = await park(store, visible_ms=60_000)
    await park(store, visible_ms=None)
    await park(store, visible_ms=None)
    async with AsyncClient.from_url(redis_url) as client:
        stats = await client.stats()
    assert stats.by_status[Status.SUBMIT_UNKNOWN] == 3
    assert (stats.parked_for_lookup, stats.parked_for_operator) == (1, 2)
    # a lookup in flight still counts as waiting for one; a settled task no longer does
    (claimed,) = await look(store)
    async with AsyncClient.from_url(redis_url) as client:
        assert (await client.stats()).parked_for_lookup == 1
        looked_up = await client.get(lookup.task_id)
    assert looked_up is not None and looked_up.lookups == 1  # `get` shows the count
    await settle(store, claimed.lease, "found", external_id="job-1", handle_json=HANDLE)
    async with AsyncClient.from_url(redis_url) as client:
        stats = await client.stats()
    assert (stats.parked_for_lookup, stats.parked_for_operator) == (0, 2)
    shown = (await anyio.to_thread.run_sync(lambda: cli("stats", url=redis_url))).stdout
    assert "SUBMIT_UNKNOWN            2  (0 waiting for a vendor lookup, 2 for an operator" in shown
