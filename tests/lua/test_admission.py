"""Admission in the scripts: token buckets (take), limits, shard tables (sync_limits), and
what claim and every terminal path do with rate lanes, in-flight caps and holds."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import redis.asyncio
import redis.exceptions

from asynctaskd import AsyncClient, Status
from asynctaskd.config import LimitConfig
from asynctaskd.keys import Keys
from asynctaskd.store import Code, Lease, Store
from tests.conftest import wait_until
from tests.lua.helpers import cancel, check_invariants, create, status_of

pytestmark = pytest.mark.anyio

TAG = "atd:{s0}:"


@pytest.fixture
async def client(redis_client: redis.asyncio.Redis) -> AsyncClient:
    return AsyncClient(redis_client)


async def take(store: Store, lanes: dict[str, int], mode: str = "take") -> dict[str, Any]:
    return await store.run(store.ops.take(mode, lanes))


async def held(r: redis.asyncio.Redis, dim: str) -> list[str]:
    return [m.decode() for m in await r.zrange(f"{TAG}held:{dim}", 0, -1)]


async def ready(r: redis.asyncio.Redis) -> list[str]:
    return [m.decode() for m in await r.zrange(f"{TAG}ready:submit", 0, -1)]


# --- take: token buckets ---------------------------------------------------------------


async def test_take_grants_the_burst_then_says_when_the_next_token_comes(
    store: Store, client: AsyncClient
) -> None:
    await client.set_limit(provider="p", submit_rate=0.01, submit_burst=5)
    got = await take(store, {"submit|p|": 3})
    assert got == {"submit|p|": (3, 0)}
    granted, wait_ms = (await take(store, {"submit|p|": 10}))["submit|p|"]
    assert granted == 2  # 5 - 3: a token takes 100 s to refill at 0.01/s
    assert 90_000 <= wait_ms <= 100_000  # the next one: 100 s after the first take
    assert (await take(store, {"submit|p|": 1}))["submit|p|"][0] == 0


async def test_tokens_refill_at_the_rate_and_never_above_the_burst(
    store: Store, client: AsyncClient
) -> None:
    await client.set_limit(provider="p", submit_rate=200, submit_burst=4)
    assert (await take(store, {"submit|p|": 4}))["submit|p|"][0] == 4

    async def refilled() -> bool:
        return (await take(store, {"submit|p|": 0}))["submit|p|"] == (0, 0) and (
            await store.redis.hget("atd:{adm}:bucket:submit:provider:p", "tokens")
        ) == b"4.000000"

    await wait_until(refilled, "the bucket to refill to its burst")
    assert (await take(store, {"submit|p|": 100}))["submit|p|"][0] == 4


async def test_refund_gives_tokens_back_but_not_above_the_burst(
    store: Store, client: AsyncClient
) -> None:
    await client.set_limit(provider="p", submit_rate=0.001, submit_burst=3)
    assert (await take(store, {"submit|p|": 3}))["submit|p|"][0] == 3
    await take(store, {"submit|p|": 2}, "refund")
    assert (await take(store, {"submit|p|": 5}))["submit|p|"][0] == 2
    await take(store, {"submit|p|": 50}, "refund")  # more than was ever taken
    assert (await take(store, {"submit|p|": 5}))["submit|p|"][0] == 3


async def server_ms(r: redis.asyncio.Redis) -> int:
    sec, usec = await r.time()
    return sec * 1000 + usec // 1000


BUCKET = "atd:{adm}:bucket:submit:provider:p"


async def test_a_bucket_idle_longer_than_its_burst_needs_holds_only_its_burst(
    store: Store, client: AsyncClient
) -> None:
    """The over-burst state itself: empty 700 ms ago at 10/s would be 7 tokens uncapped."""
    await client.set_limit(provider="p", submit_rate=10, submit_burst=2)
    assert (await take(store, {"submit|p|": 0}))["submit|p|"] == (0, 0)  # the bucket exists
    past = await server_ms(store.redis) - 700
    await store.redis.hset(BUCKET, mapping={"tokens": "0.000000", "ms": past})
    assert (await take(store, {"submit|p|": 100}))["submit|p|"][0] == 2
    tokens = float(await store.redis.hget(BUCKET, "tokens") or b"nan")
    assert 0 <= tokens < 1


async def test_a_fraction_of_a_token_grants_nothing_and_says_when_the_rest_comes(
    store: Store, client: AsyncClient
) -> None:
    await client.set_limit(provider="p", submit_rate=10, submit_burst=2)
    assert (await take(store, {"submit|p|": 0}))["submit|p|"] == (0, 0)
    now = await server_ms(store.redis)
    await store.redis.hset(BUCKET, mapping={"tokens": "0.500000", "ms": now})
    granted, wait_ms = (await take(store, {"submit|p|": 1}))["submit|p|"]
    assert granted == 0
    assert 1 <= wait_ms <= 50  # half a token at 10/s: at most 50 ms away


async def test_grants_over_time_follow_rate_times_elapsed_plus_burst(
    store: Store, client: AsyncClient
) -> None:
    """Taken as fast as possible, a bucket grants its burst, then `rate` per second: never
    more than burst + rate * t, never less than that minus the one token in progress, with
    t measured on the server's own clock around the calls."""
    rate, burst = 40, 3
    await client.set_limit(provider="p", submit_rate=rate, submit_burst=burst)
    before_first = await server_ms(store.redis)
    first = await take(store, {"submit|p|": 1000})
    after_first = await server_ms(store.redis)
    total = first["submit|p|"][0]
    assert total == burst
    before_last = after_first
    while before_last - after_first < 400:
        before_last = await server_ms(store.redis)
        total += (await take(store, {"submit|p|": 1000}))["submit|p|"][0]
    after_last = await server_ms(store.redis)
    # The refill runs from the first take's clock, in [before_first, after_first], to the
    # last one's, in [before_last, after_last].
    assert total <= burst + rate * (after_last - before_first) / 1000
    assert total >= burst + rate * (before_last - after_first) / 1000 - 1


async def test_an_account_lane_takes_from_the_provider_and_the_account_bucket(
    store: Store, client: AsyncClient
) -> None:
    await client.set_limit(provider="p", submit_rate=0.001, submit_burst=10)
    await client.set_limit(provider="p", account="a", submit_rate=0.001, submit_burst=3)
    assert (await take(store, {"submit|p|a": 5}))["submit|p|a"][0] == 3  # the account's 3
    assert (await take(store, {"submit|p|b": 20}))["submit|p|b"][0] == 7  # the provider's rest
    assert (await take(store, {"submit|p|": 1}))["submit|p|"][0] == 0


async def test_a_lane_without_a_rate_is_unlimited(store: Store) -> None:
    assert await take(store, {"submit|free|": 1000, "query|free|x": 7}) == {
        "submit|free|": (1000, 0),
        "query|free|x": (7, 0),
    }


async def test_quota_falls_back_to_the_default_tenant_entry(
    store: Store, client: AsyncClient
) -> None:
    await client.set_limit(tenant="*", quota=2, quota_period="1d")
    await client.set_limit(tenant="big", quota=5)
    assert (await take(store, {"quota|t1": 3}))["quota|t1"][0] == 2
    assert (await take(store, {"quota|t2": 3}))["quota|t2"][0] == 2  # its own bucket
    assert (await take(store, {"quota|big": 9}))["quota|big"][0] == 5
    wait_ms = (await take(store, {"quota|t1": 1}))["quota|t1"][1]
    assert 43_000_000 <= wait_ms <= 43_201_000  # half a day for one of two per day


@pytest.mark.parametrize(
    "args",
    [
        ["borrow", "submit|p|", 1],
        ["take", "submit|p|"],
        ["take", "nonsense", 1],
        ["take", "submit|p|", -1],
        ["take", "submit|p|", "x"],
    ],
)
async def test_take_refuses_malformed_argv(store: Store, args: list[Any]) -> None:
    script = store.scripts["take"]
    with pytest.raises(redis.exceptions.ResponseError, match=r"asynctaskd: .*ARGV"):
        await store.redis.evalsha(script.sha, 1, "atd:{adm}:", *args)


# --- limits and sync_limits --------------------------------------------------------------


async def test_runtime_limits_win_over_the_config_file_until_cleared(
    store: Store, client: AsyncClient, redis_client: redis.asyncio.Redis
) -> None:
    from asynctaskd.config import LimitConfig

    config = [LimitConfig(provider="p", submit_rate=5), LimitConfig(tenant="t", quota=9)]
    assert await client.apply_config_limits(config) == ()
    await client.set_limit(provider="p", submit_rate=50)
    kept = await client.apply_config_limits(config[:1])  # tenant t left the file
    assert kept == ("provider:p",)
    limits = await client.limits()
    assert set(limits) == {"provider:p"}
    assert limits["provider:p"].source == "runtime"
    assert limits["provider:p"].limit.submit_rate == 50
    assert await redis_client.hgetall("atd:{adm}:rates") == {b"submit:provider:p": b"50 50"}
    assert await client.clear_limit("provider:p")
    assert not await client.clear_limit("provider:p")
    await client.apply_config_limits(config[:1])
    assert (await client.limits())["provider:p"].source == "config"
    assert await redis_client.hgetall("atd:{adm}:rates") == {b"submit:provider:p": b"5 5"}


async def test_sync_gives_each_shard_its_share_of_a_cap(
    redis_client: redis.asyncio.Redis,
) -> None:
    client = AsyncClient(redis_client, shards=3)
    await client.set_limit(tenant="t", max_in_flight=7)
    await client.set_limit(provider="p", max_in_flight=2, submit_rate=1)
    shares = []
    for shard in range(3):
        table = await redis_client.hgetall(f"atd:{{s{shard}}}:admission")
        shares.append(int(table[b"cap:tenant:t"]))
        assert table[b"rate:submit:provider:p"] == b"1"
    assert shares == [3, 2, 2]  # adds up to the cap
    p_shares = [
        int(await redis_client.hget(f"atd:{{s{s}}}:admission", "cap:provider:p")) for s in range(3)
    ]
    assert p_shares == [1, 1, 1]  # at least one each: documented
    version = int(await redis_client.get("atd:{adm}:version"))
    versions = [int(await redis_client.get(f"atd:{{s{s}}}:admission_version")) for s in range(3)]
    assert versions == [version] * 3


async def test_sync_ignores_an_older_version(store: Store, client: AsyncClient) -> None:
    await client.set_limit(tenant="t", max_in_flight=3)  # the shard is at version 1
    ops = store.ops
    assert (
        await store.run(ops.stage_limits(0, 1, "old", 60_000, True, [("cap:tenant:t", "99")])) == 0
    )
    assert not await store.redis.exists(f"{TAG}admission_next", f"{TAG}admission_sync")
    assert (
        await store.run(ops.stage_limits(0, 2, "new", 60_000, True, [("cap:tenant:t", "99")])) == 1
    )
    applied, _, _ = await store.run(ops.sync_limits(0, 1, 1000, "new", 1))
    assert applied == 0  # its version is not newer: dropped, not swapped in
    assert not await store.redis.exists(f"{TAG}admission_next", f"{TAG}admission_sync")
    assert await store.redis.hgetall(f"{TAG}admission") == {b"cap:tenant:t": b"3"}


async def test_a_shard_keeps_its_caps_when_thousands_of_limits_are_synced(
    store: Store, client: AsyncClient
) -> None:
    """A table past what one script call can unpack (~8,000 arguments) once deleted the
    shard's limits and then failed (a ScriptError, logged by the daemon's sync loop every
    second), so every claim ran uncapped: here 5 tasks of a tenant capped at 2."""
    await client.set_limit(tenant="t", max_in_flight=2)
    many = [LimitConfig(tenant=f"t{i}", max_in_flight=2) for i in range(4100)]
    await client.apply_config_limits(many)
    ids = [(await create(store, handler="h", tenant="t")).task_id for _ in range(5)]
    assert await claim_ids(store) == ids[:2]
    assert await held(store.redis, "cap:tenant:t") == ids[2:]
    # and the sync did complete: every cap is in the shard's table, at the stored version
    assert await store.redis.hlen(f"{TAG}admission") == 4101
    version = await store.redis.get("atd:{adm}:version")
    assert await store.redis.get(f"{TAG}admission_version") == version
    await check_invariants(store.redis, store.keys)


# --- claim with rate lanes -----------------------------------------------------------------


async def test_rate_limited_tasks_wait_in_their_lane_and_go_against_grants(
    store: Store, client: AsyncClient
) -> None:
    await client.set_limit(provider="p", submit_rate=1)
    ids = [(await create(store, handler="p", priority=pr)).task_id for pr in (0, 5, 0)]
    free = (await create(store, handler="other")).task_id
    assert await held(store.redis, "rate:submit|p|") == [ids[1], ids[0], ids[2]]
    assert await ready(store.redis) == [free]

    batch = await store.claim(0, "submit", 10, 10_000, "w")
    assert [c.lease.task_id for c in batch.claimed] == [free]
    assert batch.lanes == {"submit|p|": (0, 3)}

    batch = await store.claim(0, "submit", 10, 10_000, "w", grants={"submit|p|": 2})
    assert [c.lease.task_id for c in batch.claimed] == [ids[1], ids[0]]  # priority, then FIFO
    assert batch.lanes == {"submit|p|": (2, 1)}
    await check_invariants(store.redis, store.keys)


async def test_unused_grants_are_reported_so_the_worker_refunds_them(
    store: Store, client: AsyncClient
) -> None:
    await client.set_limit(provider="p", submit_rate=1)
    await create(store, handler="p")
    batch = await store.claim(0, "submit", 10, 10_000, "w", grants={"submit|p|": 5})
    assert len(batch.claimed) == 1
    assert batch.lanes == {"submit|p|": (1, 0)}


async def test_query_rate_holds_polls_but_not_submits(store: Store, client: AsyncClient) -> None:
    await client.set_limit(provider="p", query_rate=1)
    await create(store, handler="p")
    c = (await store.claim(0, "submit", 1, 10_000, "w")).claimed[0]  # submit: not limited
    await store.start(c.lease, False)
    await store.save(Lease(c.lease.task_id, c.lease.fence, c.lease.version + 1),
                     Status.SUBMITTED, fields={"external_id": "x"})  # fmt: skip
    assert await held(store.redis, "rate:query|p|") == [c.lease.task_id]
    assert not (await store.claim(0, "query", 10, 10_000, "w")).claimed
    batch = await store.claim(0, "query", 10, 10_000, "w", grants={"query|p|": 1})
    assert [x.lease.task_id for x in batch.claimed] == [c.lease.task_id]
    await check_invariants(store.redis, store.keys)


async def test_a_handler_counts_against_the_provider_its_config_names(
    store: Store, client: AsyncClient
) -> None:
    from asynctaskd.config import HandlerConfig

    await client.apply_config_limits(
        [], [HandlerConfig(key="gpt", factory="m:f", provider="openai")]
    )
    await client.set_limit(provider="openai", submit_rate=1)
    task = await create(store, handler="gpt")
    assert await held(store.redis, "rate:submit|openai|") == [task.task_id]


async def test_claim_refuses_a_grant_of_the_other_phase(store: Store) -> None:
    script = store.scripts["claim"]
    with pytest.raises(redis.exceptions.ResponseError, match="ARGV lane must start with submit"):
        await store.redis.evalsha(script.sha, 1, TAG, "submit", 1, 1000, "w", 0, "query|p|", 1)


async def test_removing_a_rate_limit_lets_the_waiting_tasks_go(
    store: Store, client: AsyncClient
) -> None:
    await client.set_limit(provider="p", submit_rate=1)
    ids = [(await create(store, handler="p")).task_id for _ in range(3)]
    await client.clear_limit("provider:p")
    assert await held(store.redis, "rate:submit|p|") == []
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    assert [c.lease.task_id for c in batch.claimed] == ids
    await check_invariants(store.redis, store.keys)


# --- in-flight caps --------------------------------------------------------------------------


async def claim_ids(store: Store, n: int = 10) -> list[str]:
    return [c.lease.task_id for c in (await store.claim(0, "submit", n, 10_000, "w")).claimed]


async def test_a_full_cap_holds_tasks_and_a_finish_lets_the_next_one_in(
    store: Store, client: AsyncClient
) -> None:
    await client.set_limit(tenant="t", max_in_flight=2)
    ids = [(await create(store, handler="h", tenant="t")).task_id for _ in range(4)]
    other = (await create(store, handler="h", tenant="u")).task_id
    assert await claim_ids(store) == [*ids[:2], other]
    assert await held(store.redis, "cap:tenant:t") == ids[2:]
    first = await store.get(ids[0])
    assert first is not None
    r = await store.save(Lease(ids[0], first.fence, first.version), Status.FAILED,
                         fields={"error_code": "X", "error_message": "m"})  # fmt: skip
    assert r.code is Code.OK
    assert await ready(store.redis) == [ids[2]]
    assert await claim_ids(store) == [ids[2]]
    assert await claim_ids(store) == []
    await check_invariants(store.redis, store.keys)


async def test_the_default_tenant_cap_applies_per_tenant(store: Store, client: AsyncClient) -> None:
    await client.set_limit(tenant="*", max_in_flight=1)
    a = [(await create(store, handler="h", tenant="a")).task_id for _ in range(2)]
    b = [(await create(store, handler="h", tenant="b")).task_id for _ in range(2)]
    assert sorted(await claim_ids(store)) == sorted([a[0], b[0]])
    await check_invariants(store.redis, store.keys)


async def test_account_and_provider_caps(store: Store, client: AsyncClient) -> None:
    await client.set_limit(provider="p", max_in_flight=3)
    await client.set_limit(provider="p", account="a", max_in_flight=1)
    a = [(await create(store, handler="p", account="a")).task_id for _ in range(2)]
    b = [(await create(store, handler="p", account="b")).task_id for _ in range(3)]
    assert await claim_ids(store) == [a[0], b[0], b[1]]
    assert await held(store.redis, "cap:account:p/a") == [a[1]]
    assert await held(store.redis, "cap:provider:p") == [b[2]]
    await check_invariants(store.redis, store.keys)


async def _in_flight(store: Store, scope: str = "tenant:t") -> set[str]:
    return {m.decode() for m in await store.redis.smembers(f"{TAG}inflight:{scope}")}


async def _claimed_capped(store: Store, client: AsyncClient) -> Any:
    await client.set_limit(tenant="t", max_in_flight=5)
    await create(store, handler="h", tenant="t")
    c = (await store.claim(0, "submit", 1, 10_000, "w")).claimed[0]
    assert await _in_flight(store) == {c.lease.task_id}
    return c


async def test_slot_released_when_a_not_started_submit_is_released(
    store: Store, client: AsyncClient
) -> None:
    c = await _claimed_capped(store, client)
    assert (await store.release([c.lease]))[c.lease.task_id] is Code.OK
    assert await _in_flight(store) == set()
    await check_invariants(store.redis, store.keys)


async def test_slot_kept_while_submit_unknown_and_released_by_resolve(
    store: Store, client: AsyncClient
) -> None:
    c = await _claimed_capped(store, client)
    await store.start(c.lease, False)
    tid = c.lease.task_id
    assert (await store.release([c.lease]))[tid] is Code.STARTED
    assert await status_of(store.redis, store.keys, tid) is Status.SUBMIT_UNKNOWN
    assert await _in_flight(store) == {tid}  # the vendor job may be running
    await client.resolve(tid, Status.FAILED, message="checked: never created")
    assert await _in_flight(store) == set()
    await check_invariants(store.redis, store.keys)


async def test_slot_released_by_a_retry_and_by_the_deadline(
    store: Store, client: AsyncClient
) -> None:
    c = await _claimed_capped(store, client)
    await store.start(c.lease, True)
    r = await store.save(Lease(c.lease.task_id, c.lease.fence, c.lease.version + 1),
                         Status.PENDING_SUBMIT, delay_ms=60_000)  # fmt: skip
    assert r.code is Code.OK
    assert await _in_flight(store) == set()  # waiting for a retry is not in flight
    await create(store, handler="h", tenant="t", timeout_ms=200)
    d = (await store.claim(0, "submit", 1, 10_000, "w")).claimed[0]
    assert await _in_flight(store) == {d.lease.task_id}
    await store.start(d.lease, False)

    async def past_deadline() -> bool:
        return await store.server_time() * 1000 > d.task.deadline_at * 1000 + 1

    await wait_until(past_deadline, "the deadline to pass")
    r = await store.save(Lease(d.lease.task_id, d.lease.fence, d.lease.version + 1),
                         Status.SUBMITTED, fields={"external_id": "late"})  # fmt: skip
    assert r.status is Status.TRACKING_TIMED_OUT  # the save clamps to the deadline
    assert await _in_flight(store) == set()
    await check_invariants(store.redis, store.keys)


async def test_slot_released_by_cancel_and_by_reap(store: Store, client: AsyncClient) -> None:
    await client.set_limit(tenant="t", max_in_flight=5)
    await create(store, handler="h", tenant="t")
    c = (await store.claim(0, "submit", 1, 100, "w")).claimed[0]  # 100 ms lease

    async def reaped() -> bool:
        await store.reap(0, 100, 3)
        return await _in_flight(store) == set()

    await wait_until(reaped, "the reaper to give the slot back")
    assert await status_of(store.redis, store.keys, c.lease.task_id) is Status.PENDING_SUBMIT
    d = (await store.claim(0, "submit", 1, 10_000, "w")).claimed[0]
    await cancel(store, d.lease.task_id)  # leased: the holder's save makes it CANCELED
    r = await store.save(Lease(d.lease.task_id, d.lease.fence, d.lease.version),
                         Status.PENDING_SUBMIT)  # fmt: skip
    assert r.code is Code.OK and r.status is Status.CANCELED
    assert await _in_flight(store) == set()
    await check_invariants(store.redis, store.keys)


async def test_a_cap_heals_ids_of_tasks_that_are_gone(store: Store, client: AsyncClient) -> None:
    await client.set_limit(tenant="t", max_in_flight=1)
    await store.redis.sadd(f"{TAG}inflight:tenant:t", "01GHOST0000000000000000000")
    task = (await create(store, handler="h", tenant="t")).task_id
    # the cap looked full; its first look dropped the id whose task does not exist
    assert await _in_flight(store) == set()
    assert await claim_ids(store) == [task]
    await check_invariants(store.redis, store.keys)


async def test_raising_a_cap_lets_held_tasks_go(store: Store, client: AsyncClient) -> None:
    await client.set_limit(tenant="t", max_in_flight=1)
    ids = [(await create(store, handler="h", tenant="t")).task_id for _ in range(4)]
    assert await claim_ids(store) == ids[:1]
    await client.set_limit(tenant="t", max_in_flight=3)
    assert await claim_ids(store) == ids[1:3]
    await client.clear_limit("tenant:t")
    assert await claim_ids(store) == ids[3:]
    await check_invariants(store.redis, store.keys)


async def test_held_tasks_still_time_out_and_can_be_canceled(
    store: Store, client: AsyncClient
) -> None:
    await client.set_limit(tenant="t", max_in_flight=1)
    await client.set_limit(provider="slow", submit_rate=0.001, submit_burst=1)
    await create(store, handler="h", tenant="t")
    assert len(await claim_ids(store)) == 1
    capped = (await create(store, handler="h", tenant="t", timeout_ms=100)).task_id
    throttled = (await create(store, handler="slow")).task_id
    assert await cancel(store, throttled) is Code.ACCEPTED
    assert await status_of(store.redis, store.keys, throttled) is Status.CANCELED

    async def timed_out() -> bool:
        await store.time_out(0, 100)
        return await status_of(store.redis, store.keys, capped) is Status.TRACKING_TIMED_OUT

    await wait_until(timed_out, "the held task to time out")
    assert await held(store.redis, "cap:tenant:t") == []
    await check_invariants(store.redis, store.keys)


async def test_a_paused_tenants_new_tasks_are_held_at_create(
    store: Store, client: AsyncClient
) -> None:
    await client.pause(tenant="t")
    task = (await create(store, handler="h", tenant="t")).task_id
    assert await held(store.redis, "tenant:t") == [task]
    assert await ready(store.redis) == []
    await client.resume(tenant="t")
    assert await claim_ids(store) == [task]


async def test_many_claimers_never_exceed_a_cap(store: Store, client: AsyncClient) -> None:
    await client.set_limit(tenant="t", max_in_flight=7)
    for _ in range(60):
        await create(store, handler="h", tenant="t")
    claimed: list[str] = []

    async def claimer() -> None:
        for _ in range(5):
            claimed.extend(await claim_ids(store, 3))

    async with anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(claimer)
    assert len(claimed) == 7
    await check_invariants(store.redis, store.keys)


async def test_keys_helper_names_the_admission_slot() -> None:
    assert Keys("ns", 4).admission() == "ns:{adm}:"


async def test_a_malformed_take_or_limits_call_writes_nothing(store: Store) -> None:
    await store.redis.hset("atd:{adm}:rates", "submit:provider:p", "1 5")
    take_sha, limits_sha = store.scripts["take"].sha, store.scripts["limits"].sha
    with pytest.raises(redis.exceptions.ResponseError):
        await store.redis.evalsha(take_sha, 1, "atd:{adm}:", "take", "submit|p|", 2, "bad", 1)
    assert not await store.redis.exists("atd:{adm}:bucket:submit:provider:p")
    args = ["set", "tenant:a", '{"buckets": {}}', "tenant:b", "{not json"]
    with pytest.raises(redis.exceptions.ResponseError):
        await store.redis.evalsha(limits_sha, 1, "atd:{adm}:", *args)
    assert not await store.redis.exists("atd:{adm}:limits")
