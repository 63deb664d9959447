"""The three ACL users of docs/security.md, each tested as that user on both servers.

A producer can create, read, watch and ask for cancels, and write nothing else: every
command its user is allowed is tried on every key, and only the add-only writes of its
requests change anything. Daemon scripts refuse producers; operator scripts refuse
producers and daemons; each refusal is NOPERM with nothing written.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
import redis.exceptions
from redis import Redis as SyncRedis

from asynctaskd import AsyncClient, NotPermitted, QuotaExceeded, Status, StoreUnavailable
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.scripts import SCRIPT_NAMES, load_scripts
from asynctaskd.store import Call, Lease, Store
from asynctaskd.store import runner as store_runner
from tests.acl import USERS, acl_rules, create_user, create_user_sync, user_url
from tests.conftest import wait_until, wait_until_sync

pytestmark = pytest.mark.anyio

# Refused at the call, or inside the script (Redis and Valkey word it differently).
DENIED = r"(?i)NOPERM|no permissions|The user executing the script can.t|ACL failure in script"
PASSWORD = {name: f"{name}-pw" for name in USERS}

CLI = (sys.executable, "-m", "asynctaskd")
PRODUCER_SCRIPTS = {"create", "create_many", "cancel", "quota"}
OPERATOR_SCRIPTS = {"resolve", "purge", "pause", "resume"}  # and `limits` in mode set
DAEMON_SCRIPTS = set(SCRIPT_NAMES) - PRODUCER_SCRIPTS - OPERATOR_SCRIPTS


@pytest.fixture
async def users(redis_client: redis.asyncio.Redis, redis_url: str) -> AsyncIterator[dict[str, str]]:
    """The three users, as docs/security.md gives them; name -> URL that logs in as it."""
    for name in USERS:
        await create_user(redis_client, name, PASSWORD[name])
    try:
        yield {name: user_url(redis_url, name, PASSWORD[name]) for name in USERS}
    finally:
        for name in USERS:
            await redis_client.execute_command("ACL", "DELUSER", name)


@pytest.fixture
async def as_user(users: dict[str, str]) -> AsyncIterator[dict[str, redis.asyncio.Redis]]:
    conns = {name: redis.asyncio.Redis.from_url(url) for name, url in users.items()}
    try:
        yield conns
    finally:
        for conn in conns.values():
            await conn.aclose()


async def state(admin: redis.asyncio.Redis) -> dict[bytes, Any]:
    """Every key and its serialized value: equal before and after means nothing written."""
    out: dict[bytes, Any] = {}
    async for key in admin.scan_iter(count=1000):
        out[key] = await admin.dump(key)
    return out


async def error_of(call: Any) -> Exception | None:
    """What an awaited call raised, or None."""
    try:
        await call
    except Exception as exc:
        return exc
    return None


async def ingest(store: Store) -> None:
    """What a daemon's claim does first: take the producers' requests in."""
    await store.claim(0, "submit", 0, 60_000, "take-in", 0)


async def test_every_script_has_a_role_and_asks_for_it_first() -> None:
    """A new script must be put in a role (and its guard in the script) before it ships."""
    assert set(SCRIPT_NAMES) == DAEMON_SCRIPTS | PRODUCER_SCRIPTS | OPERATOR_SCRIPTS
    for name, script in load_scripts().items():
        body = script.body
        code = "\n".join(line for line in body.splitlines() if not line.startswith("--"))
        if name in PRODUCER_SCRIPTS:
            assert "daemon_only()" not in code and "operator_only()" not in code, name
        elif name == "limits":
            assert "if mode == 'set' then operator_only() else daemon_only() end" in code
        elif name in OPERATOR_SCRIPTS:
            assert "operator_only()" in code, name
        else:
            assert "daemon_only()" in code, name


async def test_a_producer_submits_reads_watches_and_cancels(
    as_user: dict[str, redis.asyncio.Redis],
) -> None:
    operator = AsyncClient(as_user["asynctaskd-operator"])
    await operator.set_limit(tenant="t", quota=100)
    await operator.set_limit(tenant="t", quota=100, max_in_flight=5)  # caps: inflight:* sets
    await operator.set_group("ocr", "round_robin", ["ocr:a", "ocr:b"])
    daemon = Store(as_user["asynctaskd"], Keys())
    client = AsyncClient(as_user["asynctaskd-producer"])

    task = await client.submit("h", {"n": 1}, tracking_timeout=60, tenant="t", strict=False)
    assert (await client.get(task.id, "t")).status is Status.PENDING_SUBMIT  # type: ignore[union-attr]
    pending = await client.submit("h", {}, tracking_timeout=60, tenant="t", dedup_key="d",
                                  strict=False)  # fmt: skip
    assert (await client.submit("h", {}, tracking_timeout=60, tenant="t", dedup_key="d",
                                strict=False)).id == pending.id  # fmt: skip
    routed = await asyncio.gather(
        *(client.submit("ocr", {"i": i}, tracking_timeout=60, strict=False) for i in range(4))
    )  # one create_many, and the group's round-robin counter
    assert sorted(t.handler for t in routed) == ["ocr:a", "ocr:a", "ocr:b", "ocr:b"]

    # a daemon takes the requests in and takes the first task to SUBMITTED
    claimed = (await daemon.claim(0, "submit", 1, 60_000, "w")).claimed[0]
    assert claimed.lease.task_id == task.id
    started = await daemon.start(claimed.lease, False)
    lease = Lease(task.id, claimed.lease.fence, started.version)
    await daemon.save(lease, Status.SUBMITTED, fields={"external_id": "x", "handle": b"{}"},
                      delay_ms=60_000)  # fmt: skip
    assert (await client.get(task.id, "t")).status is Status.SUBMITTED  # type: ignore[union-attr]
    listed = (await client.list(status="PENDING_SUBMIT", tenant="t")).tasks
    assert [t.id for t in listed] == [pending.id]
    first = await client.list(tenant="t", limit=1)  # a page that goes on: a sealed cursor
    rest = await client.list(tenant="t", limit=1, cursor=first.cursor)
    assert {t.id for t in first.tasks + rest.tasks} == {task.id, pending.id}
    stats = await client.stats()
    assert stats.by_status[Status.SUBMITTED] == 1 and stats.requests == 0
    with pytest.raises(NotPermitted, match=r"docs/security\.md"):
        await client.limits()  # the stored limits are the operators' business

    # cancels are requests: a daemon carries them out
    assert await client.cancel(task.id, "t")
    assert await client.cancel(pending.id, "t")
    assert (await client.stats()).requests == 2
    await ingest(daemon)
    assert (await client.get(pending.id, "t")).status is Status.CANCELED  # type: ignore[union-attr]
    again = (await daemon.claim(0, "query", 1, 60_000, "w")).claimed[0]
    assert again.task.cancel_requested
    await daemon.save(again.lease, Status.CANCELED)
    assert (await client.wait(task.id, timeout=5, tenant="t")).status is Status.CANCELED

    # the quota holds for the producer: it can only count up
    await operator.set_limit(tenant="q", quota=2, quota_period="1h")
    fresh = AsyncClient(as_user["asynctaskd-producer"])  # no cached list of quota tenants
    for _ in range(2):
        await fresh.submit("h", {}, tracking_timeout=60, tenant="q", strict=False)
    with pytest.raises(QuotaExceeded):
        await fresh.submit("h", {}, tracking_timeout=60, tenant="q", strict=False)


def _allowed_commands(rules: list[str]) -> list[str]:
    """Every command the rules allow, selectors included ('script|exists' as written)."""
    return [r.strip("()")[1:] for r in rules if r.strip("()").startswith("+")]


# For each command a producer may run: the form that would change the most if it could.
_TRY: dict[str, list[tuple[Any, ...]]] = {
    "setnx": [("{key}", "overwritten")],
    "rpush": [("{key}", "x:" + "0" * 26)],
    "lpush": [("{key}", "1")],
    "incr": [("{key}",)],
    "sadd": [("{key}", "garbage")],
    "get": [("{key}",)],
    "mget": [("{key}",)],
    "exists": [("{key}",)],
    "hget": [("{key}", "status")],
    "hmget": [("{key}", "status")],
    "hgetall": [("{key}",)],
    "hkeys": [("{key}",)],
    "llen": [("{key}",)],
    "zcard": [("{key}",)],
    "zrevrangebyscore": [("{key}", "+inf", "-inf")],
    "xread": [("STREAMS", "{key}", "0-0")],
    "xrevrange": [("{key}", "+", "-")],
}
# Commands with no key: what each may be asked, none of which writes.
_KEYLESS: dict[str, tuple[Any, ...]] = {
    "ping": (),
    "time": (),
    "select": ("0",),
    "client|setinfo": ("LIB-NAME", "acl-test"),
    "script|exists": ("0" * 40,),
}


async def _seed_every_kind_of_key(
    admin: redis.asyncio.Redis, daemon: Store, operator: AsyncClient, producer: AsyncClient
) -> None:
    """A namespace with a key of every name asynctaskd uses, in its real state."""
    # a slow refill: the bucket key lives until the bucket is full again (~1000 s)
    await operator.set_limit(provider="p", submit_rate=0.001, submit_burst=5)
    await operator.set_limit(tenant="t", quota=10, max_in_flight=5)
    await operator.set_group("g", "round_robin", ["a", "b"])
    for i in range(4):
        await producer.submit("h", {"i": i}, tracking_timeout=60, tenant="t", dedup_key=f"d{i}",
                              strict=False)  # fmt: skip
    await producer.submit("p", {}, tracking_timeout=60, strict=False)  # its rate lane
    await producer.submit("g", {}, tracking_timeout=60, strict=False)
    await operator.pause(tenant="paused")
    await producer.submit("h", {}, tracking_timeout=60, tenant="paused", strict=False)
    c = (await daemon.claim(0, "submit", 2, 60_000, "w")).claimed
    r = await daemon.start(c[0].lease, False)
    await daemon.save(Lease(c[0].lease.task_id, c[0].lease.fence, r.version), Status.SUCCEEDED,
                      fields={"result": b"1"})  # fmt: skip
    await daemon.run(daemon.ops.take("take", {"submit|p|": 1}))  # a bucket
    await admin.hset(Keys().tag(0) + ":settings", "retention_ms", "604800000")
    await admin.hset(Keys().handlers(), "h", "9999999999999")
    await admin.hset(Keys().daemons(), "d1", b"{}")
    await admin.zadd(Keys().tag(0) + ":quarantine", {new_task_id(): 1})
    # and one create request not taken in yet, with its intake entry
    await producer.submit("h", {}, tracking_timeout=60, strict=False)


async def test_a_producer_can_write_nothing_but_its_requests(
    as_user: dict[str, redis.asyncio.Redis], redis_client: redis.asyncio.Redis
) -> None:
    producer = as_user["asynctaskd-producer"]
    daemon = Store(as_user["asynctaskd"], Keys())
    await _seed_every_kind_of_key(
        redis_client, daemon, AsyncClient(as_user["asynctaskd-operator"]), AsyncClient(producer)
    )
    before = await state(redis_client)
    kinds = {re.sub(r"[0-9A-Z]{26}(-\d+)?|\d+", "N", k.decode()) for k in before}
    for name in ("task:N", "ready:submit", "admission", "settings", "paused", "leases",
                 "new:N", "intake", "wake", "events", "counts", "deadlines"):  # fmt: skip
        assert f"atd:{{sN}}:{name}" in kinds, f"the seed made no {name} key: {sorted(kinds)}"
    assert any(k.startswith(b"atd:{adm}:bucket:") for k in before)
    assert any(k.startswith(b"atd:{adm}:quota:") for k in before)

    # The writes the review found possible, by name: all refused now.
    task_key = next(k for k in before if b":task:" in k)
    for command in (
        ("HSET", task_key, "status", "PENDING_SUBMIT"),
        ("ZADD", "atd:{s0}:ready:submit", "0", task_key.rsplit(b":", 1)[1]),
        ("DEL", "atd:{s0}:admission"),
        ("HSET", "atd:{s0}:settings", "events_maxlen", "x"),
        ("HDEL", "atd:{s0}:paused", "tenant:paused"),
        ("DEL", next(k for k in before if k.startswith(b"atd:{adm}:bucket:"))),
        ("SCRIPT", "LOAD", "return 1"),
        ("EVAL", "return 1", "0"),
        ("FUNCTION", "LOAD", "#!lua name=x\nredis.register_function('x', function() end)"),
    ):
        with pytest.raises(redis.exceptions.ResponseError, match=DENIED):
            await producer.execute_command(*command)
    # Lua that somebody else loaded runs with the producer's rights, not theirs.
    evil = await redis_client.script_load(
        "redis.call('HSET', KEYS[1], 'status', 'PENDING_SUBMIT') return 1"
    )
    with pytest.raises(redis.exceptions.ResponseError, match=DENIED):
        await producer.evalsha(evil, 1, task_key)

    # Every command the user may run, on every key there is.
    commands = _allowed_commands(acl_rules("asynctaskd-producer", "x"))
    assert set(commands) - {"evalsha"} == set(_TRY) | set(_KEYLESS), "an untried command"
    for command in commands:
        if command in _KEYLESS:
            words = (*command.upper().split("|"), *_KEYLESS[command])
            exc = await error_of(producer.execute_command(*words))
            # Redis 7.0 has no CLIENT SETINFO
            assert exc is None or re.search(DENIED + "|unknown subcommand", str(exc)), exc
            continue
        for key in before:
            for template in _TRY.get(command, []):
                args = [key if a == "{key}" else a for a in template]
                exc = await error_of(producer.execute_command(command.upper(), *args))
                assert exc is None or re.search(DENIED + "|WRONGTYPE|not an integer", str(exc))

    after = await state(redis_client)
    assert set(after) == set(before), "a key was created or deleted"
    added_to = set()
    for key, dumped in before.items():
        if after[key] == dumped:
            continue
        added_to.add(re.sub(rb"[0-9A-Z]{26}(-\d+)?", b"N", key))
        kind = await redis_client.type(key)
        if kind == b"list":  # appended to, nothing removed: the old list is its head
            await redis_client.restore(b"old:" + key, 0, dumped)
            old = await redis_client.lrange(b"old:" + key, 0, -1)
            new = await redis_client.lrange(key, 0, -1)
            assert new[-len(old) :] == old or new[: len(old)] == old, key
        elif kind == b"set":
            await redis_client.restore(b"old:" + key, 0, dumped)
            assert await redis_client.sdiff(b"old:" + key, key) == set(), key
        else:  # a counter: larger
            await redis_client.restore(b"old:" + key, 0, dumped)
            assert int(await redis_client.get(key)) > int(await redis_client.get(b"old:" + key))
    assert added_to <= {
        b"atd:{s0}:intake",
        b"atd:{s0}:wake",
        b"atd:{adm}:quota_windows",
        b"atd:group:g:rr",
    } | {k for k in added_to if k.startswith(b"atd:{adm}:quota:")}, added_to
    assert b"atd:{s0}:intake" in added_to and b"atd:group:g:rr" in added_to


def _daemon_calls(store: Store, lease: Lease, task_id: str) -> list[Call[Any]]:
    ops = store.ops
    return [
        ops.claim(0, "submit", 10, 60_000, "intruder", 100),
        ops.claim(0, "query", 10, 60_000, "intruder", 100),
        ops.start(lease, False),
        ops.save(lease, Status.SUBMITTED, fields={"external_id": "x", "handle": b"{}"}),
        ops.start_many([ops.start(lease, False), ops.start(lease, True)]),
        ops.save_many([ops.save(lease, Status.FAILED), ops.save(lease, Status.FAILED)]),
        ops.renew(0, 60_000, [lease]),
        ops.release(0, [lease]),
        ops.withdraw(lease, "t"),
        ops.lookup(0, 10, 60_000, "intruder", ["h"]),
        ops.reconcile(lease, "none", retry_ms=0, max_lookups=1, give_up_ms=0),
        ops.reap(0, 100, 3),
        ops.time_out(0, 100),
        ops.expire(0, 0, 100),
        ops.quarantine(task_id, "no"),
        ops.take("take", {"submit|p|": 1}),
        ops.limits("config", []),
        ops.stage_limits(0, 99, "intruder", 60_000, True, [("cap:tenant:t", "1")]),
        ops.sync_limits(0, 99, 1000, "intruder", 0),
    ]


def _operator_calls(store: Store, task_id: str) -> list[Call[Any]]:
    ops = store.ops
    return [
        ops.resolve(task_id, Status.FAILED, message="no"),
        ops.purge(0, 0, 100),
        ops.pause(0, "tenant:t"),
        ops.resume(0, "handler:h"),
        ops.limits("set", [("tenant:t", "")]),
    ]


async def test_daemon_scripts_refuse_producers_and_operator_scripts_refuse_daemons(
    as_user: dict[str, redis.asyncio.Redis], redis_client: redis.asyncio.Redis
) -> None:
    admin = Store(redis_client, Keys())
    await admin.prepare()
    operator = AsyncClient(as_user["asynctaskd-operator"])
    await operator.set_limit(provider="p", submit_rate=5)
    producer = AsyncClient(as_user["asynctaskd-producer"])
    ready = await producer.submit("h", {}, tracking_timeout=60, strict=False)
    await producer.submit("p", {}, tracking_timeout=60, strict=False)  # waits in its lane
    await producer.submit("h", {}, tracking_timeout=60, strict=False)
    c = (await Store(as_user["asynctaskd"], Keys()).claim(0, "submit", 1, 60_000, "w")).claimed[0]
    assert c.lease.task_id == ready.id
    await producer.submit("h", {}, tracking_timeout=60, strict=False)  # a request, not taken in
    daemon_calls = _daemon_calls(admin, c.lease, ready.id)
    operator_calls = _operator_calls(admin, ready.id)
    assert {call.script for call in daemon_calls + operator_calls} >= (
        DAEMON_SCRIPTS | OPERATOR_SCRIPTS
    ) - {"sync_limits"} | {"sync_limits"}
    before = await state(redis_client)
    refused = [("asynctaskd-producer", call) for call in daemon_calls + operator_calls]
    refused += [("asynctaskd", call) for call in operator_calls]
    for user, call in refused:
        script = admin.scripts[call.script]
        with pytest.raises(redis.exceptions.ResponseError, match=DENIED):
            await as_user[user].evalsha(script.sha, len(call.keys), *call.keys, *call.args)
    assert await state(redis_client) == before, "a refused script wrote something"
    # and they run for those whose role they are
    daemon = Store(as_user["asynctaskd"], Keys())
    for call in daemon_calls:  # a stale lease is refused by the script, not the ACL
        exc = await error_of(daemon.run(call))
        assert not isinstance(exc, NotPermitted), (call.script, exc)
    op_store = Store(as_user["asynctaskd-operator"], Keys())
    for call in operator_calls:
        exc = await error_of(op_store.run(call))
        assert not isinstance(exc, NotPermitted), (call.script, exc)


async def test_a_producer_waits_for_a_daemon_to_load_the_scripts(
    as_user: dict[str, redis.asyncio.Redis],
    redis_client: redis.asyncio.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    producer = AsyncClient(as_user["asynctaskd-producer"])
    await redis_client.script_flush()  # as after a restart
    before = int((await redis_client.info("commandstats")).get(
        "cmdstat_script|exists", {}).get("calls", 0))  # fmt: skip
    submit = asyncio.ensure_future(producer.submit("h", {}, tracking_timeout=60, strict=False))

    async def asked() -> bool:
        stats = await redis_client.info("commandstats")
        return int(stats.get("cmdstat_script|exists", {}).get("calls", 0)) > before

    await wait_until(asked, "the producer to look for its script")
    assert not submit.done()
    daemon = Store(as_user["asynctaskd"], Keys())
    assert not await daemon.scripts_loaded()
    await daemon.prepare()  # what a daemon's heartbeat does when it finds them gone
    task = await asyncio.wait_for(submit, 5)
    assert (await producer.get(task.id)) is not None
    # with no daemon at all, the producer says what to do
    monkeypatch.setattr(store_runner, "SCRIPT_WAIT_S", 0.2)
    await redis_client.script_flush()
    with pytest.raises(StoreUnavailable, match="asynctaskd scripts load"):
        await producer.submit("h", {}, tracking_timeout=60, strict=False)


@pytest.fixture
def vendor() -> Iterator[FakeVendorProcess]:
    with FakeVendorProcess.start(Behaviour(polls_to_done=2)) as v:
        yield v


@pytest.mark.slow
def test_three_users_run_a_real_daemon_through_a_lost_script_cache(
    tmp_path: Path, redis_url: str, sync_redis: SyncRedis, vendor: FakeVendorProcess
) -> None:
    """A daemon as the daemon user, producers and the operator CLI as theirs."""
    from asynctaskd.client import Client
    from tests.test_daemon import start_daemon, write_config
    from tests.test_ops import _stop

    for name in USERS:
        create_user_sync(sync_redis, name, PASSWORD[name])
    daemon_url = user_url(redis_url, "asynctaskd", PASSWORD["asynctaskd"])
    config = write_config(tmp_path, daemon_url, vendor.url, metrics_port=0)
    proc = start_daemon(config)
    producer = Client.from_url(user_url(redis_url, "asynctaskd-producer",
                                        PASSWORD["asynctaskd-producer"]))  # fmt: skip
    operator_url = user_url(redis_url, "asynctaskd-operator", PASSWORD["asynctaskd-operator"])
    try:
        wait_until_sync(lambda: sync_redis.hlen(Keys().daemons()) > 0, "the daemon", timeout=15)
        ids = [producer.submit("demo", {"i": i}, tracking_timeout=120).id for i in range(10)]
        where = ["--url", operator_url, "--handler", "demo"]
        subprocess.run([*CLI, "pause", *where], check=True, capture_output=True)  # an operator
        held = producer.submit("demo", {"held": True}, tracking_timeout=120)
        subprocess.run([*CLI, "resume", *where], check=True, capture_output=True)
        sync_redis.script_flush()  # the cache is lost; the daemon loads it back
        late = producer.submit("demo", {"late": True}, tracking_timeout=120)
        everything = [*ids, held.id, late.id]

        def done() -> bool:
            return all(
                (t := producer.get(i)) is not None and t.status is Status.SUCCEEDED
                for i in everything
            )

        wait_until_sync(done, "every task to succeed", timeout=60)
        loaded = subprocess.run([*CLI, "scripts", "load", "--url", operator_url],
                                check=True, capture_output=True, text=True)  # fmt: skip
        assert loaded.stdout.startswith("loaded ")
        refused = subprocess.run(
            [*CLI, "scripts", "load", "--url",
             user_url(redis_url, "asynctaskd-producer", PASSWORD["asynctaskd-producer"])],
            capture_output=True, text=True,
        )  # fmt: skip
        assert refused.returncode != 0 and "may not" in refused.stderr
    finally:
        producer.close()
        assert _stop(proc) == 0
        for name in USERS:
            sync_redis.execute_command("ACL", "DELUSER", name)
