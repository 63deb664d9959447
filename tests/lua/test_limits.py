"""The limits script in bounded calls: at most 1000 scopes each, a config file's list
written then pruned, and the token-bucket table kept in step scope by scope."""

from __future__ import annotations

import msgspec
import pytest
import redis.asyncio
import redis.exceptions

from asynctaskd import AsyncClient, admission
from asynctaskd.config import LimitConfig
from asynctaskd.store import Store
from tests.lua.helpers import Stepper

pytestmark = pytest.mark.anyio

TAG = "atd:{s0}:"
ADM = "atd:{adm}:"


@pytest.fixture
async def client(redis_client: redis.asyncio.Redis) -> AsyncClient:
    return AsyncClient(redis_client)


async def rates_match_limits(r: redis.asyncio.Redis) -> None:
    """`rates` holds exactly the buckets of the stored entries."""
    expected: dict[bytes, bytes] = {}
    for raw in (await r.hgetall(f"{ADM}limits")).values():
        for name, spec in msgspec.json.decode(raw)["buckets"].items():
            expected[name.encode()] = spec.encode()
    assert await r.hgetall(f"{ADM}rates") == expected


async def test_a_config_file_of_thousands_is_written_in_chunks_then_pruned(
    store: Store, client: AsyncClient
) -> None:
    r = store.redis
    limits = [LimitConfig(tenant=f"t{i}", max_in_flight=2, quota=10) for i in range(2500)] + [
        LimitConfig(provider="p", submit_rate=5)
    ]
    await client.set_limit(tenant="t7", max_in_flight=9)  # runtime wins over the file
    assert await client.apply_config_limits(limits) == ("tenant:t7",)
    assert await r.hlen(f"{ADM}limits") == 2501
    await rates_match_limits(r)
    # the file shrinks: what it no longer lists goes, the runtime entry stays
    assert await client.apply_config_limits(limits[:1200]) == ("tenant:t7",)
    assert await r.hlen(f"{ADM}limits") == 1200
    assert (await client.limits())["tenant:t7"].source == "runtime"
    await rates_match_limits(r)
    assert await r.hlen(f"{TAG}admission") == 1200  # and the shard follows
    # unchanged: nothing moves
    version = await r.get(f"{ADM}version")
    await client.apply_config_limits(limits[:1200])
    assert await r.get(f"{ADM}version") == version


async def test_a_changed_scope_replaces_its_own_buckets_only(
    store: Store, client: AsyncClient
) -> None:
    await client.set_limit(provider="p", submit_rate=5, query_rate=2)
    await client.set_limit(provider="q", submit_rate=1)
    await client.set_limit(provider="p", submit_rate=7)  # its query bucket goes
    await rates_match_limits(store.redis)
    assert await store.redis.hgetall(f"{ADM}rates") == {
        b"submit:provider:p": b"7 7",
        b"submit:provider:q": b"1 1",
    }
    await client.clear_limit("provider:q")
    await rates_match_limits(store.redis)


async def test_a_limit_both_config_files_keep_is_never_missing_in_between(
    store: Store, client: AsyncClient
) -> None:
    old = [LimitConfig(tenant=f"t{i}", max_in_flight=2) for i in range(2500)]
    new = [LimitConfig(tenant=f"t{i}", max_in_flight=3) for i in range(1000, 3500)]
    await client.apply_config_limits(old)
    kept = {f"tenant:t{i}".encode() for i in range(1000, 2500)}
    plan = Stepper(store, admission.write(store.ops, "config", admission.config_entries(new, [])))
    scripts = []
    while plan.pending is not None:
        scripts.append(plan.script)
        await plan.step()
        assert kept <= set(await store.redis.hkeys(f"{ADM}limits"))
    assert scripts[:5] == ["limits", "limits", "limits", "read", "limits"]  # write, then prune
    assert set(await store.redis.hkeys(f"{ADM}limits")) == {
        f"tenant:t{i}".encode() for i in range(1000, 3500)
    }
    await rates_match_limits(store.redis)


def _limits_args(pairs: int) -> list[str]:
    args = ["set"]
    for i in range(pairs):
        args += [f"tenant:t{i}", '{"source":"runtime","buckets":{}}']
    return args


@pytest.mark.parametrize(
    "args",
    [
        _limits_args(1001),  # over the bound of one call
        ["prune", "tenant:a", '{"source":"config","buckets":{}}'],  # prune only deletes
        ["set", "tenant:a", '{"source":"runtime","buckets":{"submit:tenant:b":"1 1"}}'],
        ["set", "tenant:a", '{"source":"runtime","buckets":{"other:tenant:a":"1 1"}}'],
        ["set", "tenant:a", '{"source":"runtime","buckets":{"quota:tenant:a":1}}'],
        ["drop", "tenant:a", ""],
    ],
)
async def test_a_malformed_limits_call_writes_nothing(store: Store, args: list[str]) -> None:
    sha = store.scripts["limits"].sha
    with pytest.raises(redis.exceptions.ResponseError, match="asynctaskd: "):
        await store.redis.evalsha(sha, 1, ADM, *args)
    assert await store.redis.dbsize() == 0


async def test_the_client_writes_more_than_one_call_holds(
    store: Store, client: AsyncClient
) -> None:
    await client.apply_config_limits([LimitConfig(tenant=f"t{i}", quota=1) for i in range(1001)])
    assert await store.redis.hlen(f"{ADM}limits") == 1001
