"""Each script against a real server: seed, call once, assert the reply and the after-state."""

from __future__ import annotations

import re
import time
from typing import Any

import anyio
import msgspec
import pytest
import redis.asyncio

from asynctaskd import AsyncClient
from asynctaskd.codec import pairs_to_dict
from asynctaskd.errors import ScriptError
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status, is_legal
from asynctaskd.store import Call, Code, Lease, Store
from tests.conftest import wait_until
from tests.lua.helpers import (
    cancel,
    check_invariants,
    claim_one,
    create,
    ingest,
    lease_expired,
    snapshot,
    status_of,
    submitted,
)

pytestmark = pytest.mark.anyio


# --- create -------------------------------------------------------------------------------


async def test_create_writes_the_whole_task(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    created = await create(store, priority=5, tenant="t1", params={"url": "u"})
    assert not created.deduped and created.version == 1
    task = await store.get(created.task_id)
    assert task is not None
    assert task.status is Status.PENDING_SUBMIT
    assert task.params == {"url": "u"} and task.tenant == "t1" and task.priority == 5
    assert task.deadline_at == pytest.approx(task.created_at + 60, abs=0.01)
    snap = await snapshot(redis_client, keys, created.task_id)
    assert snap["ready:submit"] is not None and snap["due:submit"] is None
    assert snap["deadlines"] == task.deadline_at * 1000
    assert snap["idx:PENDING_SUBMIT"] is not None
    assert snap["counts"] == {b"PENDING_SUBMIT@h": b"1"}
    assert await redis_client.llen(keys.wake(0)) == 1
    events = await redis_client.xrange(keys.events(0))
    assert events[-1][1][b"status"] == b"PENDING_SUBMIT"
    await check_invariants(redis_client, keys)


async def test_create_dedup_returns_the_live_task(store: Store) -> None:
    a = await create(store, tenant="t1", dedup_key="order-42")
    b = await create(store, tenant="t1", dedup_key="order-42")
    c = await create(store, tenant="t2", dedup_key="order-42")
    assert b.deduped and not b.stale and b.task_id == a.task_id
    assert not c.deduped and c.task_id != a.task_id
    # once the first is terminal, the key is free again
    assert await cancel(store, a.task_id) is Code.ACCEPTED
    assert (await store.get(a.task_id)).status is Status.CANCELED  # type: ignore[union-attr]
    d = await create(store, tenant="t1", dedup_key="order-42")
    assert not d.deduped and d.task_id != a.task_id


# A request rewritten after create wrote it (by anyone who may write requests): each
# must be dropped whole, leaving no task, index, count or dedup key behind.
FORGE = """
local f = cmsgpack.unpack(redis.call('GET', KEYS[1]))
local found = false
for i = 1, #f, 2 do
  if f[i] == ARGV[1] then f[i + 1] = ARGV[2]; found = true end
end
if not found then f[#f + 1] = ARGV[1]; f[#f + 1] = ARGV[2] end
redis.call('SET', KEYS[1], cmsgpack.pack(f))
return 1
"""


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("status", "SUCCEEDED"),
        ("version", "7"),
        ("id", "01J0000000000000000000000X-0"),
        ("handler", "bad handler!"),
        ("priority", "500"),
        ("deadline_ms", "1"),
        ("due_ms", "0"),
        ("timeout_ms", "x"),
        ("fence", "3"),
        ("dedup", "1:t:other"),
        ("trace", "not-a-traceparent"),
        ("trace", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01 k=\n"),
        ("trace", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01 " + "k" * 600),
    ],
)
async def test_a_forged_create_request_is_dropped_whole(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys, field: str, value: str
) -> None:
    created = await create(store, tenant="t", dedup_key="k", take_in=False)
    tag = keys.tag(0)
    request = f"{tag}:new:{created.task_id}"
    before = await keyspace(redis_client)
    await redis_client.eval(FORGE, 1, request, field, value)
    batch = await store.claim(0, "submit", 0, 1000, "ingest", 0)
    assert batch.taken == 1 and [i for i, _ in batch.refused] == [created.task_id]
    assert await store.get(created.task_id) is None
    after = await keyspace(redis_client)
    gone = {k for k in before if k not in after}
    expected = {request, f"{tag}:intake", f"{tag}:dedup:1:t:k"}
    if field == "dedup":  # the request names another key: the daemon frees its own later
        expected.remove(f"{tag}:dedup:1:t:k")  # (a create that finds it gets DEDUP_STALE)
    assert gone == {k.encode() for k in expected}, gone
    assert {k for k in after if k not in before} <= {f"{tag}:events".encode()}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("priority", 101),
        ("priority", "high"),
        ("timeout_ms", 0),
        ("delay_ms", -5),
        ("trace", "00-xyz"),
        ("trace", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\x00"),
    ],
)
async def test_create_refuses_malformed_argv_and_writes_nothing(
    store: Store, redis_client: redis.asyncio.Redis, field: str, value: object
) -> None:
    kw: dict[str, object] = {"timeout_ms": 1000, field: value}
    call = store.ops.create(new_task_id(), "h", b"{}", **kw)  # type: ignore[arg-type]
    with pytest.raises(ScriptError, match=field):
        await store.run(call)
    assert await redis_client.dbsize() == 0  # prepare() wrote nothing either (no settings)


# --- claim --------------------------------------------------------------------------------


async def _claim_raw(store: Store, phase: str, grants: dict[str, int] | None = None) -> list[Any]:
    """A claim's raw reply items: [task_id, fence, version, flat hash]."""
    call = store.ops.claim(0, phase, 100, 10_000, "w1", 100, grants)  # type: ignore[arg-type]
    sha = store.scripts["claim"].sha
    reply = await store.redis.evalsha(sha, len(call.keys), *call.keys, *call.args)
    return list(reply[5:])


async def test_a_claim_that_spends_its_hold_budget_puts_the_rest_back_as_it_was(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """A claim pops the ready set many at a time and sets aside at most 1000 tasks: when the
    budget runs out mid-pop, every entry it did not get to goes back with its score."""
    big = [new_task_id() for _ in range(1050)]
    calls = [store.ops.create(t, "h", b"{}", timeout_ms=600_000, tenant="big") for t in big]
    await store.run_many(calls)
    small = [(await create(store, tenant="small")).task_id for _ in range(20)]
    ready_key = f"{keys.tag(0)}:ready:submit"
    scores = dict(await redis_client.zrange(ready_key, 0, -1, withscores=True))
    await AsyncClient(redis_client).pause(tenant="big")  # they are all ready: claims set aside
    batch = await store.claim(0, "submit", 100, 10_000, "w")
    assert batch.claimed == [] and batch.dropped == 1000 and batch.ready_left == 70
    left = dict(await redis_client.zrange(ready_key, 0, -1, withscores=True))
    assert left == {k: v for k, v in scores.items() if k.decode() in big[1000:] + small}
    batch = await store.claim(0, "submit", 100, 10_000, "w")
    assert [c.lease.task_id for c in batch.claimed] == small  # in their order
    assert await redis_client.zcard(f"{keys.tag(0)}:held:tenant:big") == 1050
    await check_invariants(redis_client, keys)


async def test_a_claimed_task_comes_back_as_its_hash_after_the_claim(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """The claim builds each reply hash from its one read and its own writes: it must be
    what HGETALL says after the claim (without params in the query phase)."""
    client = AsyncClient(redis_client)
    await client.set_limit(tenant="t", max_in_flight=5)  # slots written at the submit claim
    await client.set_limit(provider="p", submit_rate=1)  # held in a lane, claimed on a grant
    plain = await create(store, priority=5, tenant="u", account="a", dedup_key="d1",
                         params={"prompt": "x" * 300})  # fmt: skip
    capped = await create(store, tenant="t")
    laned = await create(store, handler="p")
    stale = await create(store)  # a started_fence left over: the claim deletes it
    await redis_client.hset(keys.task(0, stale.task_id), "started_fence", "7")
    before = {c.task_id: await redis_client.hgetall(keys.task(0, c.task_id))
              for c in (plain, capped, laned, stale)}  # fmt: skip
    assert b"held" in before[laned.task_id] and b"fence" not in before[plain.task_id]
    items = await _claim_raw(store, "submit", {"submit|p|": 1})
    assert {i[0].decode() for i in items} == set(before)
    for task_id, fence, version, flat in items:
        after = await redis_client.hgetall(keys.task(0, task_id.decode()))
        assert pairs_to_dict(flat) == after
        assert len(flat) == 2 * len(after)  # no field twice
        assert after[b"fence"] == b"%d" % fence and after[b"version"] == b"%d" % version
        assert b"held" not in after and b"started_fence" not in after
    replies = {i[0].decode(): pairs_to_dict(i[3]) for i in items}
    assert replies[capped.task_id][b"slots"] == b"tenant:t"
    # the query phase: handle, progress and a cancel request on the hash; no params back
    for task_id, fence, version, _ in items:
        lease = Lease(task_id.decode(), fence, version)
        r = await store.start(lease, False)
        lease = Lease(lease.task_id, fence, r.version)
        fields = {"external_id": "x", "handle": b'{"external_id":"x"}', "progress": "0.5"}
        assert (await store.save(lease, Status.SUBMITTED, fields=fields)).code is Code.OK
    await store.cancel(stale.task_id)
    items = await _claim_raw(store, "query")
    assert len(items) == 4
    for task_id, _, _, flat in items:
        after = await redis_client.hgetall(keys.task(0, task_id.decode()))
        assert b"params" in after
        del after[b"params"]
        assert pairs_to_dict(flat) == after and len(flat) == 2 * len(after)
    await check_invariants(redis_client, keys)


async def test_claim_leases_with_a_new_fence(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    created = await create(store)
    c = await claim_one(store)
    assert c.task.status is Status.SUBMITTING and c.lease.fence == 1
    assert c.task.owner == "w1" and c.lease.version == 2
    snap = await snapshot(redis_client, keys, created.task_id)
    assert snap["leases"] is not None and snap["ready:submit"] is None
    again = await store.claim(0, "submit", 10, 10_000, "w2")
    assert again.claimed == []
    await check_invariants(redis_client, keys)


async def test_a_query_claim_leaves_the_params_behind(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    params = {"prompt": "x" * 5000, "n": 1}
    await create(store, params=params)
    assert (await claim_one(store)).task.params == params  # the submit call gets them
    tid = (await submitted(store, params=params)).task_id
    c = await claim_one(store, "query")
    assert c.task.id == tid and c.task.params is None  # a poll does not carry them
    stored = await store.get(tid)
    assert stored is not None and stored.params == params  # nor are they gone
    assert msgspec.structs.replace(stored, params=None) == c.task
    await check_invariants(redis_client, keys)


async def test_claim_orders_by_priority_then_fifo(store: Store) -> None:
    low1 = await create(store, priority=0)
    high = await create(store, priority=9)
    low2 = await create(store, priority=0)
    neg = await create(store, priority=-3)
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    order = [c.lease.task_id for c in batch.claimed]
    assert order == [high.task_id, low1.task_id, low2.task_id, neg.task_id]


async def test_delayed_task_is_not_claimed_early(store: Store) -> None:
    created = await create(store, delay_ms=300)
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    assert batch.claimed == [] and batch.next_due_ms == created.due_ms

    async def due() -> bool:
        b = await store.claim(0, "submit", 10, 10_000, "w")
        return bool(b.claimed)

    await wait_until(due, "the delayed task to become claimable")
    assert (await store.server_time()) * 1000 >= created.due_ms


async def test_concurrent_claimers_claim_each_task_once(store: Store) -> None:
    total = 2000
    pipe_calls = [
        store.ops.create(new_task_id(), "h", b"{}", timeout_ms=60_000) for _ in range(total)
    ]
    for i in range(0, total, 500):
        await store.run_many(pipe_calls[i : i + 500])
    seen: list[str] = []

    async def claimer(name: str) -> None:
        while True:
            batch = await store.claim(0, "submit", 7, 30_000, name)
            if not batch.claimed and not batch.ready_left:
                return
            seen.extend(c.lease.task_id for c in batch.claimed)

    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(claimer, f"w{i}")
    assert len(seen) == total and len(set(seen)) == total


async def test_claim_times_out_a_task_past_its_deadline(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    created = await create(store, timeout_ms=100, delay_ms=150)

    async def due_now() -> bool:
        return (await store.server_time()) * 1000 >= created.due_ms

    await wait_until(due_now, "due time")
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    assert batch.claimed == [] and batch.dropped == 1
    assert await status_of(redis_client, keys, created.task_id) is Status.TRACKING_TIMED_OUT
    await check_invariants(redis_client, keys)


async def test_corrupt_task_is_quarantined_and_does_not_block_others(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    bad = await create(store)
    good = await create(store)
    await redis_client.hset(keys.task(0, bad.task_id), "params", b"{not json")
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    assert [c.lease.task_id for c in batch.claimed] == [good.task_id]
    assert [c.task_id for c in batch.corrupt] == [bad.task_id]
    assert await redis_client.zscore(keys.quarantine(0), bad.task_id) is not None
    assert await redis_client.zscore(keys.leases(0), bad.task_id) is None
    # claimed, then quarantined: its lease went with its owner, so no write of the claim
    # lands on it
    raw = await redis_client.hgetall(keys.task(0, bad.task_id))
    assert b"owner" not in raw and raw[b"quarantined"]
    lost = Lease(bad.task_id, int(raw[b"fence"]), int(raw[b"version"]))
    assert (await store.start(lost, False)).code is Code.NO_LEASE
    # garbage status: the script itself sets the entry aside
    worse = await create(store)
    await redis_client.hset(keys.task(0, worse.task_id), "status", "BANANA")
    again = await store.claim(0, "submit", 10, 10_000, "w")
    assert again.claimed == [] and again.dropped == 1
    assert await redis_client.zscore(keys.quarantine(0), worse.task_id) is not None


# --- start / save: the full happy path ---------------------------------------------------


async def test_full_lifecycle_and_terminal_bookkeeping(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    lease = await submitted(store)
    tid = lease.task_id
    task = await store.get(tid)
    assert task is not None and task.status is Status.SUBMITTED and task.external_id == "x1"
    assert task.submit_attempts == 1 and task.started_fence == 0
    c = await claim_one(store, "query")
    assert c.lease.fence == 2 and c.task.handle == {"external_id": "x1"}
    r = await store.save(
        c.lease,
        Status.RUNNING,
        delay_ms=5_000,
        fields={"progress": "0.5", "stage": "ocr", "poll_count": 1},
    )
    assert r.code is Code.OK and r.status is Status.RUNNING
    snap = await snapshot(redis_client, keys, tid)
    assert snap["due:query"] is not None and snap["leases"] is None
    events = await redis_client.xrange(keys.events(0))
    assert events[-1][1][b"progress"] == b"0.5"
    # nothing due now: the next claim finds nothing but reports the due time
    batch = await store.claim(0, "query", 10, 10_000, "w")
    assert batch.claimed == [] and batch.next_due_ms == int(snap["due:query"])
    await check_invariants(redis_client, keys)


async def test_succeeded_is_terminal_with_expiry_and_no_indexes(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await submitted(store)
    c = await claim_one(store, "query")
    r = await store.save(c.lease, Status.SUCCEEDED, fields={"result": b'{"text":"hi"}'})
    assert r.code is Code.OK
    snap = await snapshot(redis_client, keys, c.lease.task_id)
    assert snap["idx:SUCCEEDED"] is not None and snap["deadlines"] is None
    assert all(snap[n] is None for n in ("due:query", "ready:query", "leases"))
    assert await redis_client.pttl(keys.task(0, c.lease.task_id)) > 0
    task = await store.get(c.lease.task_id)
    assert task is not None and task.result == {"text": "hi"} and task.finished_at
    await check_invariants(redis_client, keys)


@pytest.mark.parametrize("path", ["submit", "query", "late"])
async def test_a_finishing_save_leaves_exactly_a_finished_hash(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys, path: str
) -> None:
    """The save writes what finish() would (finished_ms; no owner, due_ms, started_fence,
    started_by, lease) in its own HSET and HDEL: out of SUBMITTING (started_fence set), out
    of RUNNING (due_ms set by the previous save), and the late save of a parked task (no
    lease)."""
    if path == "query":
        await submitted(store)
        c = await claim_one(store, "query")
        lease, target = c.lease, Status.SUCCEEDED
    else:
        await create(store)
        c = await claim_one(store, lease_ms=100 if path == "late" else 10_000)
        started = await store.start(c.lease, False)
        lease, target = Lease(c.lease.task_id, c.lease.fence, started.version), Status.FAILED
        if path == "late":
            await wait_until(lambda: lease_expired(redis_client, keys, lease.task_id), "expiry")
            assert await store.reap(0, 10, 2) == [(lease.task_id, Status.SUBMIT_UNKNOWN)]
    key = keys.task(0, lease.task_id)
    before = await redis_client.hgetall(key)
    assert (b"started_fence" in before) is (path != "query")
    assert (b"due_ms" in before) is (path != "late")  # parking deleted it
    r = await store.save(lease, target, fields={"error_code": "E"})
    assert r.code is Code.OK and r.status is target
    after = await redis_client.hgetall(key)
    gone = {b"owner", b"due_ms", b"started_fence", b"started_by"}
    assert set(after) == set(before) - gone | {
        b"finished_ms",
        b"error_code",
        b"version",
        b"updated_ms",
        b"status",
    }
    assert after[b"finished_ms"] == after[b"updated_ms"]
    assert await redis_client.zscore(keys.leases(0), lease.task_id) is None
    assert await redis_client.pttl(key) > 0
    await check_invariants(redis_client, keys)


# --- rejections: stale fence, wrong version, no lease ------------------------------------


async def test_stale_fence_after_reclaim_changes_nothing(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await submitted(store)
    old = (await claim_one(store, "query", lease_ms=100)).lease
    await wait_until(lambda: lease_expired(redis_client, keys, old.task_id), "lease expiry")
    assert await store.reap(0, 100, 5) == [(old.task_id, Status.SUBMITTED)]
    new = (await claim_one(store, "query")).lease
    assert new.fence == old.fence + 1
    before = await snapshot(redis_client, keys, old.task_id)
    r = await store.save(old, Status.SUCCEEDED, fields={"result": b"1"})
    assert r.code is Code.STALE_FENCE
    assert (await store.renew(10_000, [old]))[old.task_id] is Code.STALE_FENCE
    assert (await store.release([old]))[old.task_id] is Code.STALE_FENCE
    assert (await store.start(old, False)).code is Code.STALE_FENCE
    after = await snapshot(redis_client, keys, old.task_id)
    before["counts"] = after["counts"] = None
    assert before == after
    # the current holder is unaffected
    assert (await store.save(new, Status.SUCCEEDED)).code is Code.OK


async def test_forged_fence_is_refused(store: Store) -> None:
    await create(store)
    c = await claim_one(store)
    forged = Lease(c.lease.task_id, c.lease.fence + 7, c.lease.version)
    assert (await store.start(forged, False)).code is Code.STALE_FENCE
    assert (await store.save(forged, Status.FAILED)).code is Code.STALE_FENCE


async def test_wrong_version_is_refused(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await create(store)
    c = await claim_one(store)
    stale = Lease(c.lease.task_id, c.lease.fence, c.lease.version - 1)
    before = await snapshot(redis_client, keys, c.lease.task_id)
    assert (await store.start(stale, False)).code is Code.WRONG_VERSION
    assert (await store.save(stale, Status.FAILED)).code is Code.WRONG_VERSION
    assert before == await snapshot(redis_client, keys, c.lease.task_id)


async def test_no_lease_after_reap_in_query_phase(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await submitted(store)
    c = await claim_one(store, "query", lease_ms=100)
    await wait_until(lambda: lease_expired(redis_client, keys, c.lease.task_id), "lease expiry")
    await store.reap(0, 100, 5)
    before = await snapshot(redis_client, keys, c.lease.task_id)
    assert (await store.save(c.lease, Status.SUCCEEDED)).code is Code.NO_LEASE
    assert (await store.renew(1000, [c.lease]))[c.lease.task_id] is Code.NO_LEASE
    assert before == await snapshot(redis_client, keys, c.lease.task_id)


async def test_illegal_worker_transitions_are_refused(store: Store) -> None:
    await create(store)
    c = await claim_one(store)
    for target in (Status.RUNNING, Status.SUCCEEDED, Status.SUBMITTING):
        assert (await store.save(c.lease, target)).code is Code.ILLEGAL, target
    q = await submitted(store)
    c2 = await claim_one(store, "query")
    assert c2.lease.task_id == q.task_id
    # (PENDING_SUBMIT is legal from here: a vendor job that ended having done nothing)
    for target in (Status.SUBMITTING, Status.SUBMIT_UNKNOWN):
        assert (await store.save(c2.lease, target)).code is Code.ILLEGAL, target


async def test_one_save_many_judges_each_transition_on_its_own(store: Store) -> None:
    # saves of one batch from one status to different targets each get the model's answer
    targets = [Status.RUNNING, Status.SUBMITTED, Status.SUBMITTING, Status.SUBMITTED,
               Status.SUCCEEDED, Status.RUNNING, Status.PENDING_SUBMIT, Status.FAILED]  # fmt: skip
    for _ in targets:
        await create(store)
    batch = await store.claim(0, "submit", len(targets), 10_000, "w1")
    assert len(batch.claimed) == len(targets)
    calls = [store.ops.save(c.lease, t) for c, t in zip(batch.claimed, targets, strict=True)]
    results, _, _ = await store.pipeline(calls)  # one save_many: all are of shard 0
    for target, result in zip(targets, results, strict=True):
        want = Code.OK if is_legal(Status.SUBMITTING, target, "W") else Code.ILLEGAL
        assert result.code is want, target
    assert {r.code for r in results} == {Code.OK, Code.ILLEGAL}


async def test_save_writes_and_deletes_fields_together(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await submitted(store)
    c = await claim_one(store, "query")
    first = await store.save(c.lease, Status.RUNNING,
                             fields={"stage": "a", "message": "m", "progress": "0.5"})  # fmt: skip
    assert first.code is Code.OK
    task_key = keys.task(0, c.lease.task_id)
    raw = await redis_client.hgetall(task_key)
    assert raw[b"stage"] == b"a" and b"owner" not in raw
    assert raw[b"due_ms"] == raw[b"updated_ms"]  # delay 0: due at once
    # next poll: one field replaced, one emptied, one given twice (the last value wins)
    c = await claim_one(store, "query")
    assert (await redis_client.hget(task_key, "owner")) == b"w1"
    prefix, _ = store.ops._task(c.lease.task_id)
    args = [c.lease.task_id, c.lease.fence, c.lease.version, "RUNNING", 5000,
            "stage", "b", "message", "", "poll_count", "1", "poll_count", "2"]  # fmt: skip
    reply = await redis_client.evalsha(store.scripts["save"].sha, 2, prefix, task_key, *args)
    assert reply[0] == 1 and int(reply[1]) == c.lease.version + 1
    raw = await redis_client.hgetall(task_key)
    assert raw[b"stage"] == b"b" and b"message" not in raw and raw[b"poll_count"] == b"2"
    assert raw[b"progress"] == b"0.5" and raw[b"version"] == str(c.lease.version + 1).encode()
    assert b"owner" not in raw and int(raw[b"due_ms"]) == int(raw[b"updated_ms"]) + 5000
    # the event carries the hash as it is now: stage as written, progress as it was
    events = await redis_client.xrange(keys.events(0))
    assert events[-1][1][b"stage"] == b"b" and b"message" not in events[-1][1]
    assert events[-1][1][b"progress"] == b"0.5"
    assert events[-1][1][b"version"] == str(c.lease.version + 1).encode()
    await check_invariants(redis_client, keys)


async def test_claim_and_save_count_exactly_at_fifteen_digits(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    # claim and save add 1 to fence and version in Lua (doubles), not with HINCRBY: exact
    # for the 15 digits the prelude's int_field admits, and written as plain integers
    task_key = keys.task(0, (await submitted(store)).task_id)  # due at once
    top = 10**15 - 2
    await redis_client.hset(task_key, mapping={"fence": top, "version": top})
    c = await claim_one(store, "query")
    assert (c.lease.fence, c.lease.version) == (top + 1, top + 1)
    assert await redis_client.hmget(task_key, "fence", "version") == [str(top + 1).encode()] * 2
    assert c.task.version == top + 1 and c.task.fence == top + 1
    r = await store.save(c.lease, Status.RUNNING, delay_ms=0)
    assert r.code is Code.OK and r.version == top + 2
    assert await redis_client.hget(task_key, "version") == str(top + 2).encode()
    await check_invariants(redis_client, keys)


async def test_prelude_writes_times_and_integers_as_plain_text(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    # Redis 7.0 formats Lua numbers with "%.17g" (slow), so the scripts pass integers as
    # text: NOW_S from TIME's two parts, int_s() for the rest
    body = """
    local out = {}
    for _, us in ipairs({'0', '7', '999', '1000', '12345', '999999'}) do
      out[#out + 1] = ms_text('1764500000', us)
    end
    out[#out + 1] = NOW_S == string.format('%d', NOW) and 'same' or NOW_S
    out[#out + 1] = int_s(10^15 - 1)
    out[#out + 1] = int_s(-3)
    out[#out + 1] = type(int_s(1.5))
    out[#out + 1] = type(int_s(2^53))
    out[#out + 1] = type(int_s(0/0))
    out[#out + 1] = type(int_s(1/0))
    out[#out + 1] = type(int_s(-1/0))
    out[#out + 1] = int_s(-(2^53 - 1))
    return out
    """
    source = store.scripts["renew"].source.split("-- script: ")[0] + body
    for _ in range(20):  # each call reads TIME anew
        reply = await redis_client.eval(source, 1, keys.tag(0) + ":")
        assert [x.decode() for x in reply] == [
            "1764500000000",
            "1764500000000",
            "1764500000000",
            "1764500000001",
            "1764500000012",
            "1764500000999",
            "same",
            "999999999999999",
            "-3",
            "number",
            "number",
            "number",
            "number",
            "number",
            "-9007199254740991",
        ]


async def test_a_due_score_carries_the_priority_due_fraction_reads_back(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    # due:<phase> scores are the due time with (101 - priority) / 256 in the fraction,
    # eight decimals (priority 0 has a constant of its own); due_fraction reads both back
    body = """
    local out = {}
    for p = -100, 100 do
      local s = due_score(1764000000123, p)
      local due, pr = due_fraction(s + 0)
      out[#out + 1] = s .. ' ' .. int_s(due) .. ' ' .. int_s(pr)
    end
    return out
    """
    source = store.scripts["save"].source.split("-- script: ")[0] + body
    reply = await redis_client.eval(source, 1, keys.tag(0) + ":")
    assert [r.decode() for r in reply] == [
        f"1764000000123{f'{(101 - p) / 256:.8f}'[1:]} 1764000000123 {p}" for p in range(-100, 101)
    ]


async def test_int_field_takes_exactly_the_counters_redis_writes(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    # int_field checks short counters by their bytes and the rest with a pattern: both
    # must take exactly an integer without leading zeros or "-0", of at most 15 digits
    values = ["", "-", "0", "-0", "00", "01", "1", "9", "10", "99", "-1", "-9", "-10", "+1",
              " 1", "1 ", "a", "1a", "a1", "/", ":", "0/", "1:", "-/", "-:", "--", "1.5", "1e3",
              "0x1", "100", "123456789012345", "-123456789012345", "1234567890123456",
              "\x00", "\xff", "1\x00", "\xd9\xa0"]  # fmt: skip
    values += [chr(a) + chr(b) for a in range(40, 60) for b in range(40, 60)]
    body = """
    local out = {}
    for i = 1, #ARGV do out[i] = int_field(ARGV[i]) and 1 or 0 end
    out[#ARGV + 1] = int_field(false) and 1 or 0
    return out
    """
    source = store.scripts["start"].source.split("-- script: ")[0] + body
    reply = await redis_client.eval(source, 1, keys.tag(0) + ":", *values)
    expected = [int(re.fullmatch(r"0|-?[1-9][0-9]{0,14}", v) is not None) for v in values]
    assert reply == [*expected, 1]


MAX_DELAY_MS = 10 * 366 * 86_400_000  # what save takes at most: the client's 10 years


@pytest.mark.parametrize(
    "delay_ms", [10**17, MAX_DELAY_MS + 1, "1e400", "nan", -1, "0.5"],
    ids=["1e17", "past-the-maximum", "infinite", "nan", "negative", "fraction"],
)  # fmt: skip
async def test_save_refuses_a_due_time_that_is_no_sane_integer(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys, delay_ms: object
) -> None:
    # A due time past 2^53 ms was written as a float ("1e+17"): the task could no longer
    # be read (CorruptTask) nor listed. The save refuses it before it writes anything.
    lease = await submitted(store)
    c = await claim_one(store, "query")
    before = await snapshot(redis_client, keys, lease.task_id)
    events = await redis_client.xlen(keys.events(0))
    with pytest.raises(ScriptError, match="delay_ms"):
        await store.save(c.lease, Status.RUNNING, delay_ms=delay_ms)  # type: ignore[arg-type]
    assert await snapshot(redis_client, keys, lease.task_id) == before
    assert await redis_client.xlen(keys.events(0)) == events
    # The longest delay it takes is stored as an integer, and the task reads back.
    r = await store.save(c.lease, Status.RUNNING, delay_ms=MAX_DELAY_MS)
    assert r.code is Code.OK
    task = await store.get(lease.task_id)
    assert task is not None and task.due_at is not None
    assert task.due_at == pytest.approx(time.time() + MAX_DELAY_MS / 1000, abs=5)
    await check_invariants(redis_client, keys)


async def test_save_refuses_fields_it_does_not_own(store: Store) -> None:
    await create(store)
    c = await claim_one(store)
    with pytest.raises(ScriptError, match="may not write field fence"):
        await store.save(c.lease, Status.FAILED, fields={"fence": "99"})


# --- cancel -------------------------------------------------------------------------------


async def test_cancel_of_a_pending_task_is_carried_out_when_a_daemon_takes_it_in(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    created = await create(store, tenant="t1")
    assert (await store.cancel(created.task_id, tenant="t2")).code is Code.NOT_FOUND
    r = await store.cancel(created.task_id, tenant="t1")
    assert r.code is Code.ACCEPTED and r.version == 1
    # a request, not a write: the task is unchanged until a daemon takes the request in
    assert await status_of(redis_client, keys, created.task_id) is Status.PENDING_SUBMIT
    assert await redis_client.lrange(keys.intake(0), 0, -1) == [f"x:{created.task_id}".encode()]
    assert await ingest(store) == 1
    assert await status_of(redis_client, keys, created.task_id) is Status.CANCELED
    r2 = await store.cancel(created.task_id)
    assert r2.code is Code.TERMINAL and r2.status is Status.CANCELED
    assert await redis_client.llen(keys.intake(0)) == 0  # nothing asked of a finished task
    await check_invariants(redis_client, keys)


async def test_cancel_of_a_task_not_taken_in_yet_cancels_it_as_it_is_taken_in(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    created = await create(store, tenant="t1", dedup_key="k", take_in=False)
    assert (await store.cancel(created.task_id, tenant="t2")).code is Code.NOT_FOUND
    assert (await store.cancel(created.task_id, tenant="t1")).code is Code.ACCEPTED
    assert await ingest(store) == 2  # the create, then the cancel, in order
    assert await status_of(redis_client, keys, created.task_id) is Status.CANCELED
    assert not await redis_client.exists(keys.request(0, created.task_id))
    # ending freed the dedup key
    again = await create(store, tenant="t1", dedup_key="k")
    assert not again.deduped and again.task_id != created.task_id
    await check_invariants(redis_client, keys)


async def test_cancel_during_submit_lease_stops_the_vendor_call(store: Store) -> None:
    created = await create(store)
    c = await claim_one(store)
    assert await cancel(store, created.task_id) is Code.ACCEPTED
    r = await store.start(c.lease, False)
    assert r.code is Code.CANCEL_REQUESTED
    lease = Lease(c.lease.task_id, c.lease.fence, r.version)
    saved = await store.save(lease, Status.CANCELED)
    assert saved.code is Code.OK and saved.status is Status.CANCELED


async def test_cancel_during_query_lease_is_merged_at_next_save(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await submitted(store)
    c = await claim_one(store, "query")
    assert await cancel(store, c.lease.task_id) is Code.ACCEPTED
    r = await store.save(c.lease, Status.RUNNING, delay_ms=60_000, fields={"progress": "0.2"})
    assert r.code is Code.OK and r.status is Status.RUNNING
    # due at once despite the long poll interval, so a worker cancels at the vendor
    c2 = await claim_one(store, "query")
    assert c2.task.cancel_requested
    assert (await store.save(c2.lease, Status.CANCELED)).status is Status.CANCELED
    await check_invariants(redis_client, keys)


async def test_terminal_outcome_wins_over_cancel(store: Store) -> None:
    await submitted(store)
    c = await claim_one(store, "query")
    await cancel(store, c.lease.task_id)
    r = await store.save(c.lease, Status.SUCCEEDED, fields={"result": b"42"})
    assert r.code is Code.OK and r.status is Status.SUCCEEDED


async def keyspace(r: redis.asyncio.Redis) -> dict[bytes, bytes | None]:
    return {k: await r.dump(k) async for k in r.scan_iter(count=1000)}


async def test_a_cancel_that_arrives_after_the_task_finished_changes_nothing(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """The request was accepted while the task ran; a daemon takes it in after the
    finishing save: the finished task, its version, counts and events stay as they were."""
    await submitted(store)
    c = await claim_one(store, "query")
    assert (await store.cancel(c.lease.task_id)).code is Code.ACCEPTED  # not taken in yet
    r = await store.save(c.lease, Status.SUCCEEDED, fields={"result": b"42"})
    assert r.code is Code.OK and r.status is Status.SUCCEEDED
    before = await keyspace(redis_client)
    before.pop(keys.tag(0).encode() + b":intake")
    assert await ingest(store) == 1
    after = await keyspace(redis_client)
    assert after == before


async def test_cancel_of_a_parked_task_with_an_old_flag_cancels_it(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await create(store)
    c = await claim_one(store, lease_ms=100)
    await store.start(c.lease, False)
    assert await cancel(store, c.lease.task_id) is Code.ACCEPTED
    await _expire(store, redis_client, keys, c.lease.task_id)
    assert await status_of(redis_client, keys, c.lease.task_id) is Status.SUBMIT_UNKNOWN
    # the old flag does not swallow a new request: the parked task is canceled
    assert await cancel(store, c.lease.task_id) is Code.ACCEPTED
    assert await status_of(redis_client, keys, c.lease.task_id) is Status.CANCELED


async def test_cancel_idle_submitted_task_makes_it_due_now(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await submitted(store)
    c = await claim_one(store, "query")
    await store.save(c.lease, Status.RUNNING, delay_ms=3_600_000)
    assert (await store.claim(0, "query", 1, 1000, "w")).claimed == []
    assert await cancel(store, c.lease.task_id) is Code.ACCEPTED
    c2 = await claim_one(store, "query")
    assert c2.task.cancel_requested
    await check_invariants(redis_client, keys)


# --- reap and the late save --------------------------------------------------------------


async def _expire(
    store: Store, r: redis.asyncio.Redis, keys: Keys, task_id: str
) -> list[tuple[str, Status]]:
    await wait_until(lambda: lease_expired(r, keys, task_id), "lease expiry")
    return await store.reap(0, 100, 2)


async def test_reap_started_submit_parks_in_submit_unknown(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await create(store)
    c = await claim_one(store, lease_ms=100)
    started = await store.start(c.lease, False)
    assert await _expire(store, redis_client, keys, c.lease.task_id) == [
        (c.lease.task_id, Status.SUBMIT_UNKNOWN)
    ]
    task = await store.get(c.lease.task_id)
    assert task is not None and task.error is not None
    assert task.error.code == "LEASE_EXPIRED_IN_SUBMIT"
    # parked: never claimed again
    assert (await store.claim(0, "submit", 10, 1000, "w")).claimed == []
    # the original submitter comes back late with the handle: accepted, same fence
    late = Lease(c.lease.task_id, c.lease.fence, started.version)
    r = await store.save(late, Status.SUBMITTED, fields={"external_id": "v-9"})
    assert r.code is Code.OK and r.status is Status.SUBMITTED
    await check_invariants(redis_client, keys)


async def test_reap_unstarted_submit_goes_back_to_pending(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await create(store)
    c = await claim_one(store, lease_ms=100)
    assert await _expire(store, redis_client, keys, c.lease.task_id) == [
        (c.lease.task_id, Status.PENDING_SUBMIT)
    ]
    c2 = await claim_one(store)
    assert c2.lease.fence == c.lease.fence + 1
    assert (await store.save(c.lease, Status.SUBMITTED)).code is Code.STALE_FENCE
    await check_invariants(redis_client, keys)


async def test_reap_idempotent_started_submit_is_requeued(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await create(store)
    c = await claim_one(store, lease_ms=100)
    await store.start(c.lease, True)
    assert await _expire(store, redis_client, keys, c.lease.task_id) == [
        (c.lease.task_id, Status.PENDING_SUBMIT)
    ]


async def test_late_save_after_knowing_resubmit_is_stale(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await create(store)
    c = await claim_one(store, lease_ms=100)
    started = await store.start(c.lease, False)
    await _expire(store, redis_client, keys, c.lease.task_id)
    assert (await store.resolve(c.lease.task_id, Status.PENDING_SUBMIT)).code is Code.OK
    await claim_one(store)
    late = Lease(c.lease.task_id, c.lease.fence, started.version)
    assert (await store.save(late, Status.SUBMITTED)).code is Code.STALE_FENCE


async def test_reap_query_lease_makes_task_due_and_counts_reclaims(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await submitted(store)
    for expected in (Status.SUBMITTED, Status.SUBMITTED, Status.FAILED):
        c = await claim_one(store, "query", lease_ms=100)
        assert await _expire(store, redis_client, keys, c.lease.task_id) == [
            (c.lease.task_id, expected)
        ]
    task = await store.get(c.lease.task_id)
    assert task is not None and task.error is not None and task.error.code == "RECLAIM_LIMIT"
    await check_invariants(redis_client, keys)


async def test_two_reapers_never_both_act(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    for _ in range(50):
        await create(store)
    batch = await store.claim(0, "submit", 50, 100, "w")
    assert len(batch.claimed) == 50
    last = batch.claimed[-1].lease.task_id
    await wait_until(lambda: lease_expired(redis_client, keys, last), "lease expiry")
    results: list[list[tuple[str, Status]]] = []

    async def reaper() -> None:
        results.append(await store.reap(0, 30, 5))

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(reaper)
    reaped = [tid for r in results for tid, _ in r]
    assert len(reaped) == 50 and len(set(reaped)) == 50
    await check_invariants(redis_client, keys)


# --- renew and release ----------------------------------------------------------------------


async def test_renew_many_in_one_call(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    for _ in range(3):
        await create(store)
    batch = await store.claim(0, "submit", 3, 200, "w")
    leases = [c.lease for c in batch.claimed]
    before = await redis_client.zscore(keys.leases(0), leases[0].task_id)
    codes = await store.renew(60_000, leases)
    assert set(codes.values()) == {Code.OK}
    after = await redis_client.zscore(keys.leases(0), leases[0].task_id)
    assert after is not None and before is not None and after > before + 50_000
    # renew does not change the version: the holder's next save still matches
    assert (await store.start(leases[0], False)).code is Code.OK


async def test_release_returns_unstarted_work_and_parks_started(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await create(store)
    await create(store)
    a, b = (await store.claim(0, "submit", 2, 10_000, "w")).claimed
    started = await store.start(b.lease, False)
    codes = await store.release([a.lease, Lease(b.lease.task_id, b.lease.fence, started.version)])
    assert codes == {a.lease.task_id: Code.OK, b.lease.task_id: Code.STARTED}
    assert await status_of(redis_client, keys, a.lease.task_id) is Status.PENDING_SUBMIT
    # the vendor call may have gone out: parked for an operator, never resubmitted
    assert await status_of(redis_client, keys, b.lease.task_id) is Status.SUBMIT_UNKNOWN
    await check_invariants(redis_client, keys)


# --- withdraw -------------------------------------------------------------------------------

DURABILITY_TIMEOUT = {"error_code": "DURABILITY_TIMEOUT", "error_message": ""}


async def test_withdraw_takes_back_its_own_mark_and_the_lease(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await create(store)
    c = await claim_one(store)
    assert (await store.run(store.ops.start(c.lease, False, "w-1"))).code is Code.OK
    # No version: the reply that carried it may be the one that was lost.
    r = await store.run(store.ops.withdraw(c.lease, "w-1", fields=DURABILITY_TIMEOUT))
    assert r.code is Code.OK and r.status is Status.PENDING_SUBMIT
    after = await snapshot(redis_client, keys, c.lease.task_id)
    assert after["leases"] is None and after["ready:submit"] is not None
    assert b"started_fence" not in after["hash"]
    assert after["hash"][b"error_code"] == b"DURABILITY_TIMEOUT"
    assert (await claim_one(store)).lease.fence == c.lease.fence + 1
    await check_invariants(redis_client, keys)


async def test_withdraw_after_the_reaper_parked_the_task(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await create(store)
    c = await claim_one(store, lease_ms=100)
    await store.run(store.ops.start(c.lease, False, "w-1"))
    assert await _expire(store, redis_client, keys, c.lease.task_id) == [
        (c.lease.task_id, Status.SUBMIT_UNKNOWN)
    ]
    r = await store.run(store.ops.withdraw(c.lease, "w-1", delay_ms=500))
    assert r.code is Code.OK and r.status is Status.PENDING_SUBMIT
    after = await snapshot(redis_client, keys, c.lease.task_id)
    assert after["due:submit"] is not None and after["deadlines"] is not None
    await check_invariants(redis_client, keys)


async def test_withdraw_of_a_start_that_never_ran_gives_the_lease_back(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await create(store)
    c = await claim_one(store)
    r = await store.run(store.ops.withdraw(c.lease, "w-1"))
    assert r.code is Code.OK and r.status is Status.PENDING_SUBMIT
    await check_invariants(redis_client, keys)


async def test_withdraw_never_takes_back_another_starts_mark(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    # After a failover a fence can be handed out twice: a claim the old master acknowledged
    # and lost, then the same task claimed on the new one, with the same fence and version.
    # The second holder's start (its vendor call may be on its way) is not the first's to
    # take back; a version-checked save of PENDING_SUBMIT could not tell them apart.
    await create(store)
    c = await claim_one(store)
    assert (await store.run(store.ops.start(c.lease, False, "second"))).code is Code.OK
    before = await snapshot(redis_client, keys, c.lease.task_id)
    r = await store.run(store.ops.withdraw(c.lease, "first", fields=DURABILITY_TIMEOUT))
    assert r.code is Code.STARTED
    assert await snapshot(redis_client, keys, c.lease.task_id) == before
    # nor the mark of a start that carried no token
    await create(store)
    d = await claim_one(store)
    assert (await store.start(d.lease, False)).code is Code.OK
    assert (await store.run(store.ops.withdraw(d.lease, "first"))).code is Code.STARTED


async def test_withdraw_refuses_a_task_that_moved_on(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await create(store)
    c = await claim_one(store)
    started = await store.run(store.ops.start(c.lease, False, "w-1"))
    lease = Lease(c.lease.task_id, c.lease.fence, started.version)
    assert (await store.save(lease, Status.SUBMITTED, fields={"external_id": "j"})).ok
    assert (await store.run(store.ops.withdraw(c.lease, "w-1"))).code is Code.ILLEGAL
    stale = Lease(c.lease.task_id, c.lease.fence - 1, c.lease.version)
    assert (await store.run(store.ops.withdraw(stale, "w-1"))).code is Code.STALE_FENCE
    with pytest.raises(ScriptError, match="token"):
        await store.run(store.ops.withdraw(c.lease, ""))
    await check_invariants(redis_client, keys)


# --- deadlines ----------------------------------------------------------------------------


async def test_time_out_sweep_covers_never_claimed_tasks(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    created = await create(store, timeout_ms=100)
    leased = await create(store, timeout_ms=100)
    c = await claim_one(store)
    assert c.lease.task_id in (created.task_id, leased.task_id)
    other = leased.task_id if c.lease.task_id == created.task_id else created.task_id

    async def swept() -> list[str]:
        return (await store.time_out(0, 100)).timed_out

    assert await wait_until(swept, "the deadline sweep") == [other]
    # the leased one is left to its holder, whose save clamps to the deadline
    assert await status_of(redis_client, keys, c.lease.task_id) is Status.SUBMITTING
    r = await store.save(c.lease, Status.PENDING_SUBMIT, delay_ms=10)
    assert r.status is Status.TRACKING_TIMED_OUT
    await check_invariants(redis_client, keys)


async def test_one_fence_starts_the_vendor_submit_once(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """A second start by the same holder (a retried call, a bug) is refused whichever
    version it carries, and counts no second submit attempt."""
    await create(store)
    c = await claim_one(store)
    first = await store.start(c.lease, False)
    assert first.code is Code.OK
    before = await snapshot(redis_client, keys, c.lease.task_id)
    assert (await store.start(c.lease, False)).code is Code.WRONG_VERSION
    again = Lease(c.lease.task_id, c.lease.fence, first.version)
    assert (await store.start(again, False)).code is Code.STARTED
    assert (await store.start(again, True)).code is Code.STARTED
    assert await snapshot(redis_client, keys, c.lease.task_id) == before
    task = await store.get(c.lease.task_id)
    assert task is not None and task.submit_attempts == 1


async def test_start_refused_after_deadline(store: Store) -> None:
    created = await create(store, timeout_ms=400)
    c = await claim_one(store)

    async def past() -> bool:
        task = await store.get(created.task_id)
        return task is not None and await store.server_time() >= task.deadline_at

    await wait_until(past, "the deadline")
    assert (await store.start(c.lease, False)).code is Code.ILLEGAL


# --- resolve and purge --------------------------------------------------------------------


async def _parked(store: Store, r: redis.asyncio.Redis, keys: Keys) -> str:
    await create(store)
    c = await claim_one(store)
    started = await store.start(c.lease, False)
    lease = Lease(c.lease.task_id, c.lease.fence, started.version)
    assert (await store.save(lease, Status.SUBMIT_UNKNOWN)).status is Status.SUBMIT_UNKNOWN
    return c.lease.task_id


@pytest.mark.parametrize(
    "target", [Status.SUBMITTED, Status.PENDING_SUBMIT, Status.FAILED, Status.CANCELED]
)
async def test_resolve_submit_unknown(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys, target: Status
) -> None:
    tid = await _parked(store, redis_client, keys)
    r = await store.resolve(tid, target, external_id="v-1", handle_json=b'{"external_id":"v-1"}')
    assert r.code is Code.OK
    task = await store.get(tid)
    assert task is not None and task.status is target
    if target is Status.SUBMITTED:
        assert task.external_id == "v-1"
        assert (await claim_one(store, "query")).task.handle == {"external_id": "v-1"}
    await check_invariants(redis_client, keys)


async def test_resolve_refuses_other_statuses(store: Store) -> None:
    await submitted(store)
    c = await claim_one(store, "query")
    r = await store.resolve(c.lease.task_id, Status.FAILED)
    assert r.code is Code.ILLEGAL and r.status is Status.SUBMITTED
    assert (await store.resolve("01NOPE", Status.FAILED)).code is Code.NOT_FOUND


async def test_requeue_failed_task(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    await create(store)
    c = await claim_one(store)
    await store.save(c.lease, Status.FAILED, fields={"error_code": "x", "error_message": "y"})
    assert (await store.resolve(c.lease.task_id, Status.PENDING_SUBMIT)).code is Code.OK
    assert await redis_client.pttl(keys.task(0, c.lease.task_id)) == -1
    again = await claim_one(store)
    assert again.task.error is None and again.lease.fence == c.lease.fence + 1
    await check_invariants(redis_client, keys)


async def test_purge_deletes_old_terminal_tasks_with_exact_counts(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    done = await create(store)
    live = await create(store)
    await cancel(store, done.task_id)
    assert await store.purge(0, 60_000, 100) == []
    assert await store.purge(0, 0, 100) == [done.task_id]
    assert await redis_client.exists(keys.task(0, done.task_id)) == 0
    assert await store.get(live.task_id) is not None
    counts = await store.counts()
    assert counts.get("CANCELED", 0) == 0 and counts["PENDING_SUBMIT"] == 1
    await check_invariants(redis_client, keys)


# --- pause and resume ---------------------------------------------------------------------


async def test_pause_holds_a_tenant_back_without_blocking_others(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    held = [await create(store, tenant="t1") for _ in range(5)]
    other = await create(store, tenant="t2")
    assert await store.pause("tenant:t1", "vendor asked us to slow down")
    assert not await store.pause("tenant:t1")
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    # the paused tenant's older tasks did not stand in the way of the other tenant's
    assert [c.lease.task_id for c in batch.claimed] == [other.task_id]
    for c in held:
        assert await redis_client.zscore(f"{keys.tag(0)}:held:tenant:t1", c.task_id) is not None
    assert list(await store.paused()) == ["tenant:t1"]
    await check_invariants(redis_client, keys)
    # a held task can still be canceled, and it leaves the held set
    assert await cancel(store, held[0].task_id) is Code.ACCEPTED
    await check_invariants(redis_client, keys)
    assert await store.resume("tenant:t1") == 4
    again = await store.claim(0, "submit", 10, 10_000, "w")
    assert [c.lease.task_id for c in again.claimed] == [c.task_id for c in held[1:]]
    assert await store.paused() == {}
    await check_invariants(redis_client, keys)


async def test_paused_tasks_still_time_out(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    created = await create(store, handler="slow", timeout_ms=150)
    await store.pause("handler:slow")
    assert (await store.claim(0, "submit", 10, 10_000, "w")).claimed == []

    async def swept() -> list[str]:
        return (await store.time_out(0, 100)).timed_out

    assert await wait_until(swept, "the deadline sweep") == [created.task_id]
    assert await status_of(redis_client, keys, created.task_id) is Status.TRACKING_TIMED_OUT
    await check_invariants(redis_client, keys)


async def test_pause_refuses_a_malformed_dimension(store: Store) -> None:
    with pytest.raises(ValueError, match="cannot pause"):
        await store.pause("galaxy:far-away")
    # the script checks too, for producers in other languages
    raw = Call("pause", [store.keys.tag(0) + ":"], ["bad", ""], lambda reply: reply)
    with pytest.raises(ScriptError, match="dimension"):
        await store.run(raw)
