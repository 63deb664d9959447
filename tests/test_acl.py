"""The producer ACL user of docs/deploy.md: it can submit, read, watch and cancel, and it
cannot claim, save or run any other worker or operator script (NOPERM, nothing written)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
import redis.exceptions

from asynctaskd import AsyncClient, NotPermitted, Status
from asynctaskd.keys import Keys
from asynctaskd.store import Lease, Store
from tests.lua.helpers import evalsha_calls

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "docs" / "deploy.md"
# Refused at the call, or inside the script (Redis and Valkey word it differently).
DENIED = r"NOPERM|The user executing the script can.t|ACL failure in script"
UNKNOWN_TO_7_0 = ("+client|setinfo", "+waitaof")

pytestmark = pytest.mark.anyio


async def create_user(admin: redis.asyncio.Redis, name: str, password: str) -> None:
    """The ACL user `name` exactly as docs/deploy.md gives it."""
    line = re.search(rf"^ACL SETUSER {re.escape(name)} (.+)$", DEPLOY.read_text(), re.M)
    assert line is not None, f"docs/deploy.md has no ACL SETUSER {name} line"
    rules = [f">{password}" if r.startswith(">") else r for r in line[1].split()]
    while True:
        try:
            await admin.execute_command("ACL", "SETUSER", name, *rules)
            return
        except redis.exceptions.ResponseError as exc:
            unknown = re.search(r"'(\+[a-z|]+)'", str(exc))
            if unknown is None or unknown[1] not in UNKNOWN_TO_7_0:
                raise
            rules.remove(unknown[1])


@pytest.fixture
async def producer(
    redis_client: redis.asyncio.Redis, redis_url: str
) -> AsyncIterator[redis.asyncio.Redis]:
    await create_user(redis_client, "asynctaskd-producer", "p-secret")
    conn = redis.asyncio.Redis.from_url(
        redis_url.replace("redis://", "redis://asynctaskd-producer:p-secret@")
    )
    try:
        yield conn
    finally:
        await conn.aclose()
        await redis_client.execute_command("ACL", "DELUSER", "asynctaskd-producer")


async def state(admin: redis.asyncio.Redis) -> dict[bytes, Any]:
    """Every key and its serialized value: equal before and after means nothing written."""
    out: dict[bytes, Any] = {}
    async for key in admin.scan_iter(count=1000):
        out[key] = await admin.dump(key)
    return out


async def test_a_producer_submits_reads_watches_and_cancels(
    producer: redis.asyncio.Redis, redis_client: redis.asyncio.Redis, store: Store
) -> None:
    admin = AsyncClient(redis_client)
    await admin.set_limit(tenant="t", quota=100)
    await admin.set_limit(tenant="t", quota=100, max_in_flight=5)  # caps: inflight:* sets
    client = AsyncClient(producer)
    task = await client.submit("h", {"n": 1}, tracking_timeout=60, tenant="t", strict=False)
    pending = await client.submit("h", {}, tracking_timeout=60, tenant="t", dedup_key="d",
                                  strict=False)  # fmt: skip
    assert (await client.submit("h", {}, tracking_timeout=60, tenant="t", dedup_key="d",
                                strict=False)).id == pending.id  # fmt: skip
    # a worker (the admin connection) takes the first task to SUBMITTED
    claimed = (await store.claim(0, "submit", 1, 60_000, "w")).claimed[0]
    assert claimed.lease.task_id == task.id
    started = await store.start(claimed.lease, False)
    lease = Lease(task.id, claimed.lease.fence, started.version)
    await store.save(lease, Status.SUBMITTED, fields={"external_id": "x", "handle": b"{}"},
                     delay_ms=60_000)  # fmt: skip
    assert (await client.get(task.id, "t")).status is Status.SUBMITTED  # type: ignore[union-attr]
    assert [t.id for t in (await client.list(status="PENDING_SUBMIT")).tasks] == [pending.id]
    assert (await client.stats()).by_status[Status.SUBMITTED] == 1
    with pytest.raises(NotPermitted, match=r"docs/deploy\.md"):
        await client.limits()  # the stored limits are the operators' business
    # cancel an unleased submitted task (made due for the worker) and a pending one
    assert await client.cancel(task.id, "t")
    assert await client.cancel(pending.id, "t")
    assert (await client.get(pending.id, "t")).status is Status.CANCELED  # type: ignore[union-attr]
    # the worker's save of the cancel, then the producer's wait sees the end
    again = (await store.claim(0, "query", 1, 60_000, "w")).claimed[0]
    await store.save(again.lease, Status.CANCELED)
    assert (await client.wait(task.id, timeout=5, tenant="t")).status is Status.CANCELED


async def test_a_producers_concurrent_submits_go_as_one_create_many(
    producer: redis.asyncio.Redis, redis_client: redis.asyncio.Redis
) -> None:
    client = AsyncClient(producer)
    before = await evalsha_calls(redis_client)
    tasks = await asyncio.gather(
        *(client.submit("h", {"i": i}, tracking_timeout=60, strict=False) for i in range(5))
    )
    # the five creates in one create_many, as the producer user
    assert await evalsha_calls(redis_client) == before + 1
    for task in tasks:
        got = await client.get(task.id)
        assert got is not None and got.status is Status.PENDING_SUBMIT


async def test_a_producer_cannot_run_worker_or_operator_scripts(
    producer: redis.asyncio.Redis, redis_client: redis.asyncio.Redis, store: Store
) -> None:
    admin = AsyncClient(redis_client)
    await admin.set_limit(provider="p", submit_rate=5)
    client = AsyncClient(producer)
    ready = await client.submit("h", {}, tracking_timeout=60, strict=False)
    await client.submit("p", {}, tracking_timeout=60, strict=False)  # waits in its rate lane
    leased = await client.submit("h", {}, tracking_timeout=60, strict=False)
    c = (await store.claim(0, "submit", 1, 60_000, "w")).claimed[0]
    assert c.lease.task_id == ready.id  # FIFO: `leased` stays ready for the producer to try
    lease = c.lease
    ops = store.ops
    attempts = [
        ops.claim(0, "submit", 10, 60_000, "intruder", 100),
        ops.claim(0, "query", 10, 60_000, "intruder", 100),
        ops.start(lease, False),
        ops.save(lease, Status.SUBMITTED, fields={"external_id": "x", "handle": b"{}"}),
        ops.start_many([ops.start(lease, False), ops.start(lease, True)]),
        ops.save_many([ops.save(lease, Status.FAILED), ops.save(lease, Status.FAILED)]),
        ops.renew(0, 60_000, [lease]),
        ops.release(0, [lease]),
        ops.withdraw(lease, "t"),
        ops.reap(0, 100, 3),
        ops.time_out(0, 100),
        ops.resolve(ready.id, Status.FAILED, message="no"),
        ops.purge(0, 0, 100),
        ops.quarantine(leased.id, "no"),
        ops.pause(0, "tenant:t"),
        ops.resume(0, "handler:h"),
        ops.limits("set", [("tenant:t", "")]),
        ops.sync_limits(0, 99, {"cap:tenant:t": "1"}),
    ]
    before = await state(redis_client)
    for call in attempts:
        script = store.scripts[call.script]
        await redis_client.script_load(script.source)
        with pytest.raises(redis.exceptions.ResponseError, match=DENIED):
            await producer.evalsha(script.sha, len(call.keys), *call.keys, *call.args)
    assert await state(redis_client) == before, "a refused script wrote something"
    assert Keys().leases(0).encode() in before  # the lease it could not touch is there


async def test_the_daemon_user_of_the_docs_still_runs_everything(
    redis_client: redis.asyncio.Redis, redis_url: str
) -> None:
    """The producer line must not have crowded out the daemon's: it comes first."""
    first = re.search(r"^ACL SETUSER (\S+) ", DEPLOY.read_text(), re.M)
    assert first is not None and first[1] == "asynctaskd"
