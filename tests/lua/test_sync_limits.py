"""Each shard's admission table staged in bounded chunks (stage_limits) and swapped in
whole (sync_limits), so admission never fails open: not with 100,000 limits, not with two
daemons syncing at once, not when a daemon dies mid-sync."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator

import anyio
import pytest
import redis.asyncio
import redis.exceptions

from asynctaskd import AsyncClient, ScriptError, admission
from asynctaskd.admission import SyncReport
from asynctaskd.config import LimitConfig
from asynctaskd.keys import Keys
from asynctaskd.metrics import Metrics
from asynctaskd.store import Store
from tests.conftest import wait_until
from tests.lua.helpers import Stepper, check_invariants, create, evalsha_calls

pytestmark = pytest.mark.anyio

TAG = "atd:{s0}:"
ADM = "atd:{adm}:"


@pytest.fixture
async def client(redis_client: redis.asyncio.Redis) -> AsyncClient:
    return AsyncClient(redis_client)


def caps(names: Iterator[str] | list[str], cap: int = 2) -> list[LimitConfig]:
    return [LimitConfig(tenant=name, max_in_flight=cap) for name in names]


def tenants(n: int, prefix: str = "t") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


async def claim_ids(store: Store, n: int = 10) -> list[str]:
    return [c.lease.task_id for c in (await store.claim(0, "submit", n, 10_000, "w")).claimed]


async def table(r: redis.asyncio.Redis) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (await r.hgetall(f"{TAG}admission")).items()}


async def lease_gone(r: redis.asyncio.Redis) -> bool:
    return await r.exists(f"{TAG}admission_sync") == 0


async def no_build_left(r: redis.asyncio.Redis) -> bool:
    return not await r.exists(f"{TAG}admission_next", f"{TAG}admission_sync")


async def store_only(store: Store, limits: list[LimitConfig]) -> None:
    """Store config limits (in calls of 1000) without syncing any shard."""
    entries = admission.config_entries(limits, [])
    for start in range(0, len(entries), 1000):
        await store.run(store.ops.limits("config", entries[start : start + 1000]))


def runtime(tenant: str, cap: int) -> tuple[str, bytes]:
    return f"tenant:{tenant}", admission.encode_limit(
        LimitConfig(tenant=tenant, max_in_flight=cap), "runtime"
    )


# --- the 100,000-limit proof ----------------------------------------------------------------


@pytest.mark.slow
async def test_a_hundred_thousand_limits_sync_whole_and_a_dead_build_is_never_used(
    store: Store, client: AsyncClient
) -> None:
    n = 100_000
    r = store.redis
    await client.set_limit(tenant="t", max_in_flight=3)
    before = await evalsha_calls(r)
    await client.apply_config_limits(caps(tenants(n)))
    # bounded calls: 100 limits chunks, 100 staged chunks, the swap
    assert await evalsha_calls(r) - before >= 2 * n // 1000 + 1
    assert await r.hlen(f"{TAG}admission") == n + 1
    assert await r.get(f"{TAG}admission_version") == await r.get(f"{ADM}version")
    assert await no_build_left(r)

    # The next change is stored; a daemon stages half its table and dies.
    await store.run(store.ops.limits("set", [runtime("t", 1)]))
    dying = Stepper(store, admission.sync(store.ops))
    while dying.script != "stage_limits":
        await dying.step()
    for _ in range(50):
        await dying.step()
    assert dying.script == "stage_limits"
    assert await r.hlen(f"{TAG}admission_next") == 50_000
    # claims see the whole previous table: the cap of 3 holds
    ids = [(await create(store, handler="h", tenant="t")).task_id for _ in range(5)]
    assert await claim_ids(store) == ids[:3]
    assert await r.hlen(f"{TAG}admission") == n + 1
    # another daemon leaves the dead one's build alone while its lease runs...
    version = int(await r.get(f"{ADM}version"))
    other = store.ops.stage_limits(0, version, "other", 10_000, True, [("cap:tenant:t", "1")])
    assert await store.run(other) == -1
    # ...and once it ran out, builds the table afresh and swaps it in
    await r.pexpire(f"{TAG}admission_sync", 1)
    await wait_until(lambda: lease_gone(r), "the dead build's lease to run out")
    assert await client.sync_limits() == SyncReport()
    assert await r.hlen(f"{TAG}admission") == n + 1
    assert (await table(r))["cap:tenant:t"] == "1"
    assert await no_build_left(r)
    await check_invariants(r, store.keys)


# --- staging and the swap -----------------------------------------------------------------


async def test_a_half_built_table_is_refused_and_the_shard_keeps_its_own(
    store: Store, client: AsyncClient
) -> None:
    await client.set_limit(tenant="t", max_in_flight=2)  # version 1, synced
    ops = store.ops
    staged = await store.run(ops.stage_limits(0, 2, "a", 60_000, True, [("cap:tenant:t", "9")]))
    assert staged == 1
    # it claims two fields, has one: not whole
    assert await store.run(ops.sync_limits(0, 2, 1000, "a", 2)) == (-1, 0, 0)
    assert await table(store.redis) == {"cap:tenant:t": "2"}
    assert await store.redis.get(f"{TAG}admission_version") == b"1"
    assert await no_build_left(store.redis)  # its own build is dropped
    # nor is an empty table taken for one that has fields
    await store.run(ops.stage_limits(0, 2, "a", 60_000, True, [("cap:tenant:t", "9")]))
    assert await store.run(ops.sync_limits(0, 2, 1000, "a", 0)) == (-1, 0, 0)
    assert await table(store.redis) == {"cap:tenant:t": "2"}
    # a token that does not own the build is refused too, and leaves the build alone
    await store.run(ops.stage_limits(0, 2, "a", 60_000, True, [("cap:tenant:t", "9")]))
    assert await store.run(ops.sync_limits(0, 2, 1000, "b", 1)) == (-1, 0, 0)
    assert await store.redis.get(f"{TAG}admission_sync") == b"a"
    assert await store.run(ops.sync_limits(0, 2, 1000, "a", 1)) == (1, 0, 0)
    assert await table(store.redis) == {"cap:tenant:t": "9"}
    assert await store.redis.ttl(f"{TAG}admission") == -1  # the staged copy's expiry is gone
    assert await no_build_left(store.redis)


async def test_an_empty_table_replaces_the_shards_whole(store: Store, client: AsyncClient) -> None:
    await client.set_limit(tenant="t", max_in_flight=2)
    assert await client.clear_limit("tenant:t")
    assert not await store.redis.exists(f"{TAG}admission")
    assert await store.redis.get(f"{TAG}admission_version") == await store.redis.get(
        f"{ADM}version"
    )
    assert await no_build_left(store.redis)


async def test_a_build_whose_lease_ran_out_cannot_go_on(store: Store) -> None:
    ops = store.ops
    first = [("cap:tenant:ghost", "1")]
    assert await store.run(ops.stage_limits(0, 1, "a", 1, True, first)) == 1

    await wait_until(lambda: lease_gone(store.redis), "the 1 ms lease to run out")
    # another build starts afresh: the first one's fields are gone
    assert await store.run(ops.stage_limits(0, 1, "b", 60_000, True, [("cap:tenant:t", "2")])) == 1
    assert (
        await store.run(ops.stage_limits(0, 1, "a", 60_000, False, [("cap:tenant:u", "1")])) == -1
    )
    assert await store.run(ops.sync_limits(0, 1, 1000, "a", 2)) == (-1, 0, 0)
    assert await store.run(ops.sync_limits(0, 1, 1000, "b", 1)) == (1, 0, 0)
    assert await table(store.redis) == {"cap:tenant:t": "2"}


async def test_two_daemons_syncing_at_once_build_the_table_once(
    store: Store, client: AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    await client.set_limit(tenant="t", max_in_flight=2)
    await store_only(store, caps(tenants(2500)))
    a = Stepper(store, admission.sync(store.ops))
    b = Stepper(store, admission.sync(store.ops))
    for _ in range(2):  # both read the versions, then the limits
        await a.step()
        await b.step()
    assert a.script == b.script == "stage_limits"
    await a.step()  # a owns the build
    await b.step()  # b finds it busy, lifts holds only, and is done
    assert b.script == "sync_limits"
    assert await b.finish() == SyncReport(stale=1)
    assert await a.finish() == SyncReport()
    assert await store.redis.hlen(f"{TAG}admission") == 2501
    assert (await table(store.redis))["cap:tenant:t"] == "2"
    # the next pass of either finds the shard current
    assert await client.sync_limits() == SyncReport()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_limit_is_in_force_when_set_limit_returns_even_while_another_builds(
    store: Store, client: AsyncClient
) -> None:
    await client.set_limit(tenant="t", max_in_flight=2)
    # another daemon owns the shard's next build, for 300 ms, and never finishes it
    version = int(await store.redis.get(f"{ADM}version") or 0)
    other = store.ops.stage_limits(0, version + 1, "other", 300, True, [("cap:tenant:u", "1")])
    assert await store.run(other) == 1
    await client.set_limit(tenant="t", max_in_flight=1)
    assert await table(store.redis) == {"cap:tenant:t": "1"}
    assert await store.redis.get(f"{TAG}admission_version") == await store.redis.get(
        f"{ADM}version"
    )
    assert await no_build_left(store.redis)


async def test_a_daemon_that_overruns_its_lease_reports_it_and_changes_nothing(
    store: Store, client: AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    await client.set_limit(tenant="t", max_in_flight=2)
    await store_only(store, caps(tenants(1500)))
    slow = Stepper(store, admission.sync(store.ops))
    while slow.script != "stage_limits":
        await slow.step()
    await slow.step()  # its first chunk; then it stalls past its lease
    await store.redis.delete(f"{TAG}admission_sync")
    assert await client.sync_limits() == SyncReport()  # another daemon syncs the shard
    assert await slow.finish() == SyncReport(stale=1, failed={0: "incomplete"})
    assert await store.redis.hlen(f"{TAG}admission") == 1501
    assert await no_build_left(store.redis)
    [record] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "did not finish" in record.getMessage()
    assert "keeps enforcing its previous limits" in record.getMessage()
    assert record.shard == 0  # type: ignore[attr-defined]


async def test_sync_lifts_holds_with_only_the_fields_it_needs(
    store: Store, client: AsyncClient
) -> None:
    await client.set_limit(tenant="*", max_in_flight=1)
    await client.set_limit(provider="p", submit_rate=0.001, submit_burst=1)
    a = [(await create(store, handler="h", tenant="a")).task_id for _ in range(2)]
    throttled = (await create(store, handler="p")).task_id
    assert await claim_ids(store) == a[:1]
    assert await store.redis.zrange(f"{TAG}held:cap:tenant:a", 0, -1) == [a[1].encode()]
    await client.clear_limit("provider:p")  # the lane is no longer limited: all of it goes
    assert await claim_ids(store) == [throttled]
    await client.set_limit(tenant="*", max_in_flight=2)  # room for one more
    assert await claim_ids(store) == a[1:]
    await check_invariants(store.redis, store.keys)


# --- a sync that cannot complete: logs and metrics -----------------------------------------


@pytest.fixture
async def no_rename(
    redis_client: redis.asyncio.Redis, redis_url: str
) -> AsyncIterator[redis.asyncio.Redis]:
    """A Redis user that may do everything but RENAME: every swap is refused."""
    await redis_client.execute_command(
        "ACL", "SETUSER", "no-rename", "on", ">pw", "~*", "&*", "+@all", "-rename"
    )
    conn = redis.asyncio.Redis.from_url(redis_url.replace("redis://", "redis://no-rename:pw@"))
    try:
        yield conn
    finally:
        await conn.aclose()
        await redis_client.execute_command("ACL", "DELUSER", "no-rename")


async def test_a_refused_sync_keeps_the_old_limits_and_says_so(
    store: Store,
    client: AsyncClient,
    no_rename: redis.asyncio.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await client.set_limit(tenant="t", max_in_flight=2)
    await store.run(store.ops.limits("set", [runtime("t", 5)]))  # stored, not yet synced
    metrics = Metrics()

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    async def counted() -> bool:
        return (sample("asynctaskd_admission_sync_failures_total", kind="refused") or 0) >= 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(admission.run_sync, Store(no_rename, Keys()), metrics)
        await wait_until(counted, "a refused sync to be counted")
        tg.cancel_scope.cancel()
    assert sample("asynctaskd_admission_stale_shards") == 1
    assert sample("asynctaskd_admission_sync_failures_total", kind="incomplete") == 0
    assert await table(store.redis) == {"cap:tenant:t": "2"}
    ids = [(await create(store, handler="h", tenant="t")).task_id for _ in range(3)]
    assert await claim_ids(store) == ids[:2]
    record = next(r for r in caplog.records if r.levelno >= logging.ERROR)
    assert "admission sync of shard 0 failed, refused" in record.getMessage()
    assert "NOPERM" in record.getMessage()
    assert "keeps enforcing the limits it has" in record.getMessage()


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("stage_limits", ["1", "a b", "1000", "1", "cap:tenant:t", "1"]),  # token
        ("stage_limits", ["1", "", "1000", "1"]),  # empty token
        ("stage_limits", ["1", "a", "0", "1"]),  # lease_ms
        ("stage_limits", ["1", "a", "1000", "yes"]),  # first
        ("stage_limits", ["-1", "a", "1000", "1"]),  # version
        ("stage_limits", ["1", "a", "1000", "1", "cap:tenant:t"]),  # odd pairs
        ("stage_limits", ["1", "a", "1000", "1", "cap:tenant:t", "0"]),  # a cap below 1
        ("stage_limits", ["1", "a", "1000", "1", "cap:tenant:t", "two"]),
        ("stage_limits", ["1", "a", "1000", "1", "rate:submit:provider:p", "2"]),
        ("stage_limits", ["1", "a", "1000", "1", "provider:h", ""]),
        ("stage_limits", ["1", "a", "1000", "1", "tenant:t", "1"]),  # not a table field
        ("stage_limits", ["1", "a", "1000", "1", *["cap:tenant:t", "1"] * 1001]),  # too many
        ("sync_limits", ["1", "1000", "a b", "0"]),  # token
        ("sync_limits", ["1", "1000", "a", "-1"]),  # size
        ("sync_limits", ["1", "0", "", "0"]),  # limit
    ],
)
async def test_a_malformed_stage_or_sync_call_writes_nothing(
    store: Store, client: AsyncClient, script: str, args: list[str]
) -> None:
    await client.set_limit(tenant="t", max_in_flight=2)
    before = {k: await store.redis.dump(k) for k in await store.redis.keys("*")}
    with pytest.raises(redis.exceptions.ResponseError, match="asynctaskd: "):
        await store.redis.evalsha(store.scripts[script].sha, 1, TAG, *args)
    after = {k: await store.redis.dump(k) for k in await store.redis.keys("*")}
    assert after == before


async def test_store_errors_surface_as_script_errors(store: Store) -> None:
    with pytest.raises(ScriptError, match="at most 1000 pairs"):
        await store.run(
            store.ops.stage_limits(0, 1, "a", 1000, True, [("cap:tenant:t", "1")] * 1001)
        )
