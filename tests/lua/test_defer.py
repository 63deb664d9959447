"""Deferred index and counter writes (lua/_defer.lua): the same keyspace, fewer commands.

A claim and a save_many note their writes to leases, deadlines, status indexes, counters
and due sets, and send one command per key. The first test holds the helpers to the
writes they stand for: random sequences of adds, removes and increments, run once
deferred and once written at once, must leave byte-identical keys. The others count what
a batch of tasks costs: each key once per call, whatever the number of tasks.
"""

from __future__ import annotations

import json
import random
from typing import Any

import redis.asyncio

from asynctaskd.keys import Keys
from asynctaskd.model import Status
from asynctaskd.scripts import _read, load_scripts
from asynctaskd.store import Code, Lease, Store
from tests.lua.helpers import check_invariants, claim_one, create
from tests.lua.test_straight_claim import HANDLE, _all_due, _cost

# The ops a test script runs: ('a', key, score, member), ('r', key, member),
# ('i', key, field, by); then, deferred, one flush (or two, half-way).
_BODY = """
local defer, half = ARGV[1] == '1', tonumber(ARGV[2])
if defer then defer_on() end
for i = 3, #ARGV do
  local op = cjson.decode(ARGV[i])
  if op[1] == 'a' then z_add(P .. op[2], op[3], op[4])
  elseif op[1] == 'r' then z_rem(P .. op[2], op[3])
  else h_incr(P .. op[2], op[3], op[4]) end
  if i - 2 == half then flush() end
end
flush()
return 1
"""


def _script() -> str:
    core = load_scripts()["quota"].source.split("-- script: ")[0]
    return core + "\n-- include: _defer\n" + _read("_defer") + _BODY


def _ops(rng: random.Random, n: int) -> list[list[Any]]:
    ops: list[list[Any]] = []
    for _ in range(n):
        key, member = rng.choice(["z1", "z2"]), rng.choice("abcdef")
        kind = rng.choice("arri" if rng.random() < 0.5 else "aai")
        if kind == "a":
            ops.append(["a", key, str(rng.randint(0, 9)), member])
        elif kind == "r":
            ops.append(["r", key, member])
        else:
            ops.append(["i", "c", rng.choice("xyz"), rng.randint(-3, 3)])
    return ops


async def _dump(r: redis.asyncio.Redis, prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("z1", "z2"):
        out[name] = await r.zrange(prefix + name, 0, -1, withscores=True)
    out["c"] = await r.hgetall(prefix + "c")
    return out


async def test_deferred_writes_leave_the_keyspace_the_writes_in_order_leave(
    redis_client: redis.asyncio.Redis,
) -> None:
    sha = await redis_client.script_load(_script())
    rng = random.Random(7)
    for case in range(200):
        ops = _ops(rng, rng.randint(1, 30))
        # what the keys held before: some members and counters already there
        seed = _ops(rng, 8)
        half = rng.choice([0, len(ops) // 2])
        encoded = [json.dumps(op) for op in ops]
        seeded = [json.dumps(op) for op in seed]
        got = []
        for defer, prefix in (("0", f"now{case}:"), ("1", f"deferred{case}:")):
            await redis_client.evalsha(sha, 1, prefix, "0", "0", *seeded)
            await redis_client.evalsha(sha, 1, prefix, defer, str(half), *encoded)
            got.append(await _dump(redis_client, prefix))
        assert got[0] == got[1], (ops, seed, half)


async def test_deferred_writes_send_one_command_per_key(
    redis_client: redis.asyncio.Redis,
) -> None:
    sha = await redis_client.script_load(_script())
    ops = [["a", "z1", str(i), f"m{i}"] for i in range(50)]
    ops += [["r", "z2", f"m{i}"] for i in range(50)]
    ops += [["i", "c", "x", 1] for _ in range(50)]
    args = [json.dumps(op) for op in ops]
    cost = await _cost(redis_client, redis_client.evalsha(sha, 1, "p:", "1", "0", *args))
    assert cost == {"zadd": 1, "zrem": 1, "hincrby": 1}
    assert await redis_client.zcard("p:z1") == 50
    assert await redis_client.hget("p:c", "x") == b"50"


async def _submitted(store: Store, n: int) -> None:
    """n tasks driven to SUBMITTED, due for their first poll soon."""
    for _ in range(n):
        await create(store)
        c = await claim_one(store, "submit")
        r = await store.start(c.lease, False)
        assert r.code is Code.OK
        lease = Lease(c.lease.task_id, c.lease.fence, r.version)
        saved = await store.save(lease, Status.SUBMITTED, delay_ms=30, fields=HANDLE)
        assert saved.code is Code.OK


async def test_a_batch_of_polls_writes_each_index_once(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """Ten tasks claimed in one call and saved in one save_many, twice: the first saves
    change the status (SUBMITTED -> RUNNING), the last finish the tasks. Every index and
    counter is written once per call; what each task needs alone (its hash read and
    written, its event, its expiry) is all that grows with the batch."""
    n = 10
    await _submitted(store, n)

    async def claim_all() -> list[Any]:
        await _all_due(store, redis_client, keys)
        got: list[Any] = []

        async def claim() -> None:
            batch = await store.claim(0, "query", n, 10_000, "w")
            got.extend(batch.claimed)

        costs.append(await _cost(redis_client, claim()))
        assert len(got) == n
        return got

    async def save_all(claimed: list[Any], status: Status) -> None:
        calls = [store.ops.save(c.lease, status, delay_ms=20, fields={"progress": "0.5"})
                 for c in claimed]  # fmt: skip

        async def saves() -> None:
            results, _, _ = await store.pipeline(calls)
            assert all(r.code is Code.OK for r in results), results

        costs.append(await _cost(redis_client, saves()))

    costs: list[dict[str, int]] = []
    await save_all(await claim_all(), Status.RUNNING)
    await save_all(await claim_all(), Status.SUCCEEDED)
    claim_query = {"hdel": 1, "hmget": 1, "exists": 1, "zrangebyscore": 1, "zrem": 1,
                   "zcard": 1, "hgetall": n, "hset": n, "zadd": 1, "zrange": 1}  # fmt: skip
    assert costs == [
        claim_query,
        # the role and the settings; per task its read, write, owner deleted, event; the
        # lease, old index out (one ZREM each), the new index, due set (one ZADD each),
        # both counters
        {"hdel": 1 + n, "hget": 1, "hmget": n, "hset": n, "xadd": n, "zrem": 2, "zadd": 2,
         "hincrby": 2},
        claim_query,
        # and finishing: the deadlines index, the expiry of each hash
        {"hdel": 1 + n, "hmget": 1 + n, "hset": n, "xadd": n, "zrem": 3, "zadd": 1,
         "hincrby": 2, "pexpire": n},
    ], costs  # fmt: skip
    await check_invariants(redis_client, keys)
