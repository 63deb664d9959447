"""Every script checks what it reads before its first write (docs/protocol.md section 6).

For each entry script a realistic keyspace is seeded and a baseline call built that
succeeds and writes. Then each ARGV position, each `settings` field and (where a script
depends on them) each task field is corrupted in turn, and the call must raise an
`asynctaskd:` error (or, for a `_many` script, reply that error in the task's place)
while every key stays byte-identical: DUMP and PEXPIRETIME of each key before and after.

Where a corrupt value is a fine value for a position (an opaque fence, a note, a handler
name that happens to be digits), the tables below say so: "unchanged" means the script
answers with a refusal code and writes nothing, "accepted" that it takes the value and
writes (run on a fresh keyspace, and it must not raise).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
import redis.asyncio
import redis.exceptions

from asynctaskd import AsyncClient
from asynctaskd.keys import SETTINGS as KEY_SETTINGS
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.scripts import SCRIPT_NAMES
from asynctaskd.store import Call, Code, Lease, Store
from tests.acl import USERS, create_user, user_url
from tests.lua.helpers import claim_one, create, ingest, submitted

pytestmark = pytest.mark.anyio

# What goes in place of a value: each is wrong for a number, a status, a mode or a key.
# (Other spellings of an integer, '1e3' or '0x10', are that integer to the scripts, as
# Lua's tonumber reads them: not a corruption. What they write is the number.)
CORRUPT: dict[str, str] = {
    "text": "x!y",
    "empty": "",
    "negative": "-1",
    "fraction": "1.5",
    "huge": "1" + "0" * 20,
    "inf": "inf",
    "nan": "nan",
}
# Settings also must not be 0 (retention_ms, events_maxlen: a 0 expiry deletes the hash).
SETTINGS: dict[str, str] = {"retention_ms": "86400000", "expiry_grace_ms": "3600000",
                            "events_maxlen": "1000"}  # fmt: skip
SETTINGS_CORRUPT: dict[str, dict[str, str]] = {
    "retention_ms": {**CORRUPT, "zero": "0", "over": "316224000001"},
    "expiry_grace_ms": {**CORRUPT, "over": "316224000001"},
    "events_maxlen": {**CORRUPT, "zero": "0", "over": "1000000001"},
}
# The settings each scenario's call uses: the scripts that can write an event or finish a
# task read and check them before writing (a save that only writes an event, as the
# withdraw here, reads events_maxlen alone; the saves here finish their task).
ALL_SETTINGS = frozenset(SETTINGS)
USES_SETTINGS: dict[str, frozenset[str]] = {
    **dict.fromkeys(("claim", "time_out", "reap", "release", "resolve", "save", "save_many"),
                    ALL_SETTINGS),
    "withdraw": frozenset({"events_maxlen"}),
    "reconcile": frozenset({"events_maxlen"}),  # a found job: SUBMITTED, an event
}  # fmt: skip

NAME_LIKE = {"negative", "fraction", "huge", "inf", "nan"}  # valid names and tokens


def _all(outcome: str, **but: str) -> dict[str, str]:
    out = dict.fromkeys(CORRUPT, outcome)
    out.update(but)
    return out


def _names(outcome: str, other: str = "raise") -> dict[str, str]:
    """A name or token position: the digit-like values are valid names."""
    return {k: (outcome if k in NAME_LIKE else other) for k in CORRUPT}


# script -> ARGV name -> kind -> outcome; a kind not listed must "raise".
ARGV_OUTCOMES: dict[str, dict[str, dict[str, str]]] = {
    "create": {
        "handler": _names("accepted"),
        "provider": _names("accepted", "raise") | {"empty": "accepted"},
        "account": _names("accepted", "raise") | {"empty": "accepted"},
        "priority": {"negative": "accepted"},
        "params": _all("accepted"),  # opaque JSON text, not parsed (docs/protocol.md)
        "metadata": _all("accepted"),
        "dedup_key": {"empty": "accepted"},  # no dedup key: KEYS[3] is not used
    },
    "claim": {"owner": _names("accepted", "raise") | {"text": "accepted"}},
    "start": {"fence": _all("unchanged"), "version": _all("unchanged"), "token": _all("accepted")},
    "save": {
        "fence": _all("unchanged"),
        "version": _all("unchanged"),
        "value": _all("accepted"),
    },
    "withdraw": {
        "fence": _all("unchanged"),
        "token": _all("unchanged", empty="raise"),
        "value": _all("accepted"),
    },
    "renew": {"task_id": _all("unchanged"), "fence": _all("unchanged")},
    "release": {
        "task_id": _all("unchanged", empty="raise"),
        "fence": _all("unchanged", empty="raise"),
        "version": _all("accepted", empty="raise"),  # release checks the fence, not the version
    },
    "cancel": {"tenant": _all("unchanged")},
    "resolve": {
        "external_id": _all("accepted"),
        "handle": _all("accepted"),
        "message": _all("accepted"),
    },
    "lookup": {
        "owner": _names("accepted", "raise") | {"text": "accepted"},
        "handler": _all("accepted", empty="raise"),
    },  # a handler with nothing due
    "reconcile": {
        "fence": _all("unchanged"),
        "version": _all("unchanged"),
        "external_id": _all("accepted", empty="raise"),
        "handle": _all("accepted", empty="raise"),
        "message": _all("accepted"),
    },
    "quarantine": {"reason": _all("accepted")},
    "pause": {"note": _all("accepted")},
    "quota": {"tenant": _names("unchanged")},  # another tenant, without a quota
    "limits": {"json": {"empty": "unchanged"}},  # '' deletes a scope that is not there
    "stage_limits": {"token": _names("accepted")},
    "sync_limits": {"token": _names("unchanged") | {"empty": "unchanged"}},
}
for _one, _many in (("create", "create_many"), ("start", "start_many"), ("save", "save_many")):
    ARGV_OUTCOMES[_many] = ARGV_OUTCOMES[_one]

# Task fields a script depends on: script -> (field, value or None to delete, how). The
# script must raise naming the task and the field, and write nothing. "matching": the
# call's ARGV of the same name carries the same value, so the version check passes and
# the script reaches the field's own check (a plain mismatch is WRONG_VERSION, also
# without a write: "unchanged").
TASK_FIELDS: dict[str, list[tuple[str, str | None, str]]] = {
    "start": [("version", "x", "unchanged"), ("version", "x", "matching"),
              ("version", "1.5", "matching"), ("submit_attempts", "x", "raise")],
    "save": [("version", "x", "unchanged"), ("version", "x", "matching"),
             ("handler", None, "raise"), ("deadline_ms", "x", "raise"),
             ("deadline_ms", "nan", "raise"), ("deadline_ms", None, "raise")],
    "withdraw": [("version", "x", "raise"), ("handler", None, "raise"),
                 ("deadline_ms", "soon", "raise")],
    "release": [("version", "x", "raise"), ("version", "99999999999999999", "raise"),
                ("handler", None, "raise")],
    "resolve": [("version", "x", "raise"), ("handler", None, "raise")],
    "reconcile": [("version", "x", "unchanged"), ("version", "x", "matching"),
                  ("handler", None, "raise"), ("deadline_ms", "x", "raise"),
                  ("find", "1:x:0", "raise"), ("find", "", "raise")],
}  # fmt: skip
for _one, _many in (("start", "start_many"), ("save", "save_many")):
    TASK_FIELDS[_many] = TASK_FIELDS[_one]


@dataclass
class Scenario:
    call: Call[Any]
    names: list[str]  # each ARGV position's name
    task_key: str = ""  # the task whose fields the script depends on


Seed = Callable[[Store, redis.asyncio.Redis, Keys], Awaitable[Scenario]]
SEEDS: dict[str, Seed] = {}


def seed(name: str) -> Callable[[Seed], Seed]:
    def register(fn: Seed) -> Seed:
        SEEDS[name] = fn
        return fn

    return register


CREATE_NAMES = ["task_id", "handler", "provider", "tenant", "account", "priority", "delay_ms",
                "not_before_ms", "timeout_ms", "params", "metadata", "dedup_key"]  # fmt: skip
START_NAMES = ["task_id", "fence", "version", "idempotent", "token"]
SAVE_NAMES = ["task_id", "fence", "version", "status", "delay_ms", "field", "value"]


async def _background(store: Store) -> None:
    """Something of every kind, so the keyspace is not just the script's own task."""
    await create(store, tenant="t1", dedup_key="bg")
    lease = await submitted(store)
    await store.run(store.ops.release(0, [lease]))


def _create_call(store: Store) -> Call[Any]:
    return store.ops.create(new_task_id(), "h", b'{"n": 1}', timeout_ms=60_000, tenant="t1",
                            dedup_key="d1", priority=1)  # fmt: skip


@seed("create")
async def _create(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    return Scenario(_create_call(store), CREATE_NAMES)


@seed("create_many")
async def _create_many(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    return Scenario(store.ops.create_many([_create_call(store)]), ["n", *CREATE_NAMES])


@seed("claim")
async def _claim(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    await create(store)
    await create(store, take_in=False)  # a request the claim takes in first
    call = store.ops.claim(0, "submit", 10, 10_000, "w1", 100, {"submit|p|": 1})
    return Scenario(call, ["phase", "n", "lease_ms", "owner", "promote_limit", "lane", "tokens"])


async def _started(store: Store) -> Lease:
    """A task claimed for its submit: SUBMITTING, leased."""
    await create(store)
    return (await claim_one(store)).lease


async def _start_call(store: Store, keys: Keys) -> tuple[Call[Any], str]:
    lease = await _started(store)
    return store.ops.start(lease, False, "tok"), keys.task(0, lease.task_id)


@seed("start")
async def _start(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    call, tk = await _start_call(store, keys)
    return Scenario(call, START_NAMES, tk)


@seed("start_many")
async def _start_many(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    call, tk = await _start_call(store, keys)
    return Scenario(store.ops.start_many([call]), ["n", *START_NAMES], tk)


async def _save_call(store: Store, keys: Keys) -> tuple[Call[Any], str]:
    lease = await _started(store)
    started = await store.run(store.ops.start(lease, False, "tok"))
    lease = Lease(lease.task_id, lease.fence, started.version)
    call = store.ops.save(lease, Status.FAILED, fields={"error_code": "E"})
    return call, keys.task(0, lease.task_id)


@seed("save")
async def _save(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    call, tk = await _save_call(store, keys)
    return Scenario(call, SAVE_NAMES, tk)


@seed("save_many")
async def _save_many(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    call, tk = await _save_call(store, keys)
    return Scenario(store.ops.save_many([call]), ["n", *SAVE_NAMES], tk)


@seed("withdraw")
async def _withdraw(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    lease = await _started(store)
    await store.run(store.ops.start(lease, False, "tok"))
    call = store.ops.withdraw(lease, "tok", delay_ms=0, fields={"error_code": "E"})
    names = ["task_id", "fence", "token", "delay_ms", "field", "value"]
    return Scenario(call, names, keys.task(0, lease.task_id))


@seed("renew")
async def _renew(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    lease = await _started(store)
    return Scenario(store.ops.renew(0, 20_000, [lease]), ["lease_ms", "task_id", "fence"])


@seed("release")
async def _release(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    lease = await _started(store)
    return Scenario(store.ops.release(0, [lease]), ["task_id", "fence", "version"],
                    keys.task(0, lease.task_id))  # fmt: skip


@seed("cancel")
async def _cancel(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    task = await create(store, tenant="t2")
    return Scenario(store.ops.cancel(task.task_id, "t2"), ["task_id", "check_tenant", "tenant"])


@seed("reap")
async def _reap(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    await create(store)
    await claim_one(store, lease_ms=1)
    await anyio.sleep(0.005)
    return Scenario(store.ops.reap(0, 100, 3), ["limit", "max_reclaims"])


@seed("time_out")
async def _time_out(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    await create(store, timeout_ms=1)
    await create(store, take_in=False)
    await anyio.sleep(0.005)
    return Scenario(store.ops.time_out(0, 100), ["limit"])


@seed("resolve")
async def _resolve(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    lease = await _started(store)
    started = await store.run(store.ops.start(lease, False, "tok"))
    await store.run(store.ops.release(0, [Lease(lease.task_id, lease.fence, started.version)]))
    call = store.ops.resolve(lease.task_id, Status.FAILED, message="gone")
    names = ["task_id", "target", "external_id", "handle", "message"]
    return Scenario(call, names, keys.task(0, lease.task_id))


async def _parked(store: Store) -> Lease:
    """A task parked in SUBMIT_UNKNOWN whose handler can look its job up (due:find)."""
    lease = await _started(store)
    started = await store.run(store.ops.start(lease, False, "tok", 0))
    await store.run(store.ops.release(0, [Lease(lease.task_id, lease.fence, started.version)]))
    return lease


@seed("lookup")
async def _lookup(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    await _parked(store)
    return Scenario(store.ops.lookup(0, 10, 10_000, "w1", ["h"]),
                    ["n", "lease_ms", "owner", "handler"])  # fmt: skip


@seed("reconcile")
async def _reconcile(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    await _parked(store)
    (claimed,) = (await store.lookup(0, 1, 10_000, "w1", ["h"])).claimed
    call = store.ops.reconcile(
        claimed.lease,
        "found",
        retry_ms=1000,
        max_lookups=5,
        give_up_ms=60_000,
        external_id="j1",
        handle_json=b'{"a": 1}',
    )
    names = [
        "task_id",
        "fence",
        "version",
        "outcome",
        "retry_ms",
        "max_lookups",
        "give_up_ms",
        "external_id",
        "handle",
        "message",
    ]
    return Scenario(call, names, keys.task(0, claimed.lease.task_id))  # fmt: skip


async def _finished(store: Store) -> None:
    task = await create(store)
    await store.cancel(task.task_id)
    await ingest(store)
    await anyio.sleep(0.002)


@seed("purge")
async def _purge(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    await _finished(store)
    return Scenario(store.ops.purge(0, 0, 10), ["older_than_ms", "limit"])


@seed("expire")
async def _expire(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    await _finished(store)
    return Scenario(store.ops.expire(0, 0, 10), ["older_than_ms", "limit"])


@seed("quarantine")
async def _quarantine(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    task = await create(store)
    return Scenario(store.ops.quarantine(task.task_id, "unreadable"), ["task_id", "reason"])


@seed("pause")
async def _pause(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    return Scenario(store.ops.pause(0, "tenant:t9", "why"), ["dimension", "note"])


@seed("resume")
async def _resume(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    await AsyncClient(r).pause(tenant="t3")
    await create(store, tenant="t3")
    await store.claim(0, "submit", 10, 10_000, "w")  # sets it aside in held:tenant:t3
    return Scenario(store.ops.resume(0, "tenant:t3", 10), ["dimension", "limit"])


@seed("take")
async def _take(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    await AsyncClient(r).set_limit(provider="p", submit_rate=5)
    return Scenario(store.ops.take("take", {"submit|p|": 1}), ["mode", "lane", "count"])


@seed("quota")
async def _quota(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    await AsyncClient(r).set_limit(tenant="t4", quota=10, quota_period="1d")
    return Scenario(store.ops.quota("t4"), ["tenant"])


@seed("limits")
async def _limits(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    await AsyncClient(r).set_limit(tenant="t5", max_in_flight=2)
    entry = '{"source": "runtime", "buckets": {"submit:tenant:t6": "1 1"}}'
    return Scenario(store.ops.limits("set", [("tenant:t6", entry)]), ["mode", "scope", "json"])


@seed("stage_limits")
async def _stage_limits(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    call = store.ops.stage_limits(0, 7, "tk", 10_000, True, [("cap:tenant:t1", "2")])
    return Scenario(call, ["version", "token", "lease_ms", "first", "field", "value"])


@seed("sync_limits")
async def _sync_limits(store: Store, r: redis.asyncio.Redis, keys: Keys) -> Scenario:
    await store.run(store.ops.stage_limits(0, 7, "tk", 10_000, True, [("cap:tenant:t1", "2")]))
    return Scenario(store.ops.sync_limits(0, 7, 10, "tk", 1), ["version", "limit", "token", "size"])


def test_every_entry_script_has_a_scenario() -> None:
    assert set(SEEDS) == set(SCRIPT_NAMES)


# --- the machinery -------------------------------------------------------------------------


async def keyspace(r: redis.asyncio.Redis) -> dict[bytes, tuple[bytes | None, int]]:
    """Every key: its DUMP and its absolute expiry (-1: none)."""
    out = {}
    async for k in r.scan_iter(count=1000):
        out[k] = (await r.dump(k), int(await r.execute_command("PEXPIRETIME", k)))
    return out


async def reseed(store: Store, r: redis.asyncio.Redis, keys: Keys, script: str) -> Scenario:
    await r.flushdb()
    for shard in range(keys.shards):
        await r.hset(keys.tag(shard) + ":settings", mapping=SETTINGS)
    await _background(store)
    return await SEEDS[script](store, r, keys)


async def call_raw(store: Store, r: redis.asyncio.Redis, call: Call[Any], args: list[Any]) -> Any:
    sha = store.scripts[call.script].sha
    return await r.evalsha(sha, len(call.keys), *call.keys, *args)


def refusal(script: str, reply: Any) -> str | None:
    """The `asynctaskd:` error a script raised or, for a `_many`, replied in its place."""
    if isinstance(reply, redis.exceptions.ResponseError):
        return str(reply) if "asynctaskd:" in str(reply) else None
    if script.endswith("_many") and isinstance(reply, list) and len(reply) == 1:
        return refusal(script, reply[0])
    return None


async def outcome(
    store: Store, r: redis.asyncio.Redis, call: Call[Any], args: list[Any],
    caller: redis.asyncio.Redis | None = None,
) -> Any:  # fmt: skip
    try:
        return await call_raw(store, caller or r, call, args)
    except redis.exceptions.ResponseError as exc:
        return exc


def wrote(before: dict[Any, Any], after: dict[Any, Any]) -> list[bytes]:
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


async def check_refused(
    store: Store, r: redis.asyncio.Redis, script: str, call: Call[Any], args: list[Any],
    expect: str, what: str, caller: redis.asyncio.Redis | None = None,
) -> None:  # fmt: skip
    before = await keyspace(r)
    reply = await outcome(store, r, call, args, caller)
    changed = wrote(before, await keyspace(r))
    assert changed == [], f"{script} {what}: replied {reply!r} and wrote {changed}"
    if expect == "raise":
        assert refusal(script, reply), f"{script} {what}: expected an error, got {reply!r}"
    else:
        assert not isinstance(reply, Exception) and refusal(script, reply) is None, (
            f"{script} {what}: expected a refusal code, got {reply!r}"
        )


async def baseline(
    store: Store, r: redis.asyncio.Redis, script: str, call: Call[Any], args: list[Any],
    caller: redis.asyncio.Redis | None = None,
) -> None:  # fmt: skip
    before = await keyspace(r)
    reply = await outcome(store, r, call, args, caller)
    assert not isinstance(reply, Exception) and refusal(script, reply) is None, (
        f"{script}: the baseline call failed: {reply!r}"
    )
    if script.endswith("_many"):
        assert not any(isinstance(x, Exception) for x in reply), reply
    assert wrote(before, await keyspace(r)), f"{script}: the baseline call wrote nothing"


def _args(call: Call[Any]) -> list[Any]:
    return [a if isinstance(a, (bytes, str)) else str(a) for a in call.args]


# --- the tests ----------------------------------------------------------------------------


PRODUCER_SCRIPTS = {"create", "create_many", "cancel", "quota"}
OPERATOR_SCRIPTS = {"resolve", "purge", "pause", "resume", "limits"}  # limits: mode set


@pytest.fixture
async def as_role(
    redis_client: redis.asyncio.Redis, redis_url: str
) -> AsyncIterator[dict[str, redis.asyncio.Redis]]:
    """A connection per ACL user of docs/security.md, by the scripts it runs."""
    for name in USERS:
        await create_user(redis_client, name, f"{name}-pw")
    conns = {name: redis.asyncio.Redis.from_url(user_url(redis_url, name, f"{name}-pw"))
             for name in USERS}  # fmt: skip
    try:
        yield conns
    finally:
        for conn in conns.values():
            await conn.aclose()
        for name in USERS:
            await redis_client.execute_command("ACL", "DELUSER", name)


def role(script: str) -> str:
    if script in PRODUCER_SCRIPTS:
        return "asynctaskd-producer"
    return "asynctaskd-operator" if script in OPERATOR_SCRIPTS else "asynctaskd"


@pytest.mark.parametrize("script", SCRIPT_NAMES)
async def test_a_corrupt_argv_writes_nothing(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys, script: str,
    as_role: dict[str, redis.asyncio.Redis],
) -> None:  # fmt: skip
    """Each call runs as the ACL user whose role the script is (docs/security.md)."""
    r = redis_client
    caller = as_role[role(script)]
    with pytest.raises(redis.exceptions.NoPermissionError):  # not the default user
        await caller.acl_whoami()
    scenario = await reseed(store, r, keys, script)
    call, names = scenario.call, scenario.names
    args = _args(call)
    assert len(names) == len(args), f"{script}: names {names} for ARGV {args}"
    table = ARGV_OUTCOMES.get(script, {})
    assert set(table) <= set(names), f"{script}: the table names unknown ARGV {set(table)}"
    accepted: list[tuple[int, str]] = []
    ran = 0
    for i, name in enumerate(names):
        for kind, value in CORRUPT.items():
            if args[i] == value:
                continue  # not a corruption of this position
            expect = table.get(name, {}).get(kind, "raise")
            if expect == "accepted":
                accepted.append((i, kind))
                continue
            bad = [*args[:i], value, *args[i + 1 :]]
            what = f"ARGV {name}={value!r}"
            await check_refused(store, r, script, call, bad, expect, what, caller)
            ran += 1
    assert ran > 0
    await baseline(store, r, script, call, args, caller)
    # what the table calls accepted is taken: the call does not raise
    for i, kind in accepted:
        scenario = await reseed(store, r, keys, script)
        bad = [*_args(scenario.call)[:i], CORRUPT[kind], *_args(scenario.call)[i + 1 :]]
        reply = await outcome(store, r, scenario.call, bad, caller)
        assert refusal(script, reply) is None and not isinstance(reply, Exception), (
            f"{script}: ARGV {names[i]}={CORRUPT[kind]!r} is listed as accepted, got {reply!r}"
        )


@pytest.mark.parametrize("script", SCRIPT_NAMES)
async def test_corrupt_settings_write_nothing(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys, script: str
) -> None:
    """A script raises on a bad setting it uses before writing; a setting it does not use
    it does not read, and its call still goes through."""
    r = redis_client
    ran = 0
    for field, values in SETTINGS_CORRUPT.items():
        for kind, value in values.items():
            scenario = await reseed(store, r, keys, script)
            await r.hset(keys.tag(0) + ":settings", field, value)
            args = _args(scenario.call)
            if field in USES_SETTINGS.get(script, ()):
                what = f"settings {field}={value!r} ({kind})"
                await check_refused(store, r, script, scenario.call, args, "raise", what)
            else:
                await baseline(store, r, script, scenario.call, args)
            ran += 1
    assert ran > 0
    scenario = await reseed(store, r, keys, script)
    await baseline(store, r, script, scenario.call, _args(scenario.call))


@pytest.mark.parametrize("script", sorted(TASK_FIELDS))
async def test_a_corrupt_task_field_writes_nothing(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys, script: str
) -> None:
    r = redis_client
    for field, value, how in TASK_FIELDS[script]:
        scenario = await reseed(store, r, keys, script)
        assert scenario.task_key
        if value is None:
            await r.hdel(scenario.task_key, field)
        else:
            await r.hset(scenario.task_key, field, value)
        args = _args(scenario.call)
        if how == "matching":
            args[scenario.names.index(field)] = value
        what = f"task {field}={value!r}"
        expect = "unchanged" if how == "unchanged" else "raise"
        await check_refused(store, r, script, scenario.call, args, expect, what)
        if expect == "raise":
            message = refusal(script, await outcome(store, r, scenario.call, args))
            task_id = scenario.task_key.rpartition(":")[2]
            assert message and f"task {task_id} field {field}" in message, (script, what, message)
    scenario = await reseed(store, r, keys, script)
    await baseline(store, r, script, scenario.call, _args(scenario.call))


# --- the findings, one by one -------------------------------------------------------------


async def _raises_and_writes_nothing(
    store: Store, r: redis.asyncio.Redis, call: Call[Any], match: str
) -> None:
    before = await keyspace(r)
    with pytest.raises(redis.exceptions.ResponseError, match=match):
        await call_raw(store, r, call, _args(call))
    assert wrote(before, await keyspace(r)) == []


async def test_a_create_taken_in_under_a_bad_events_maxlen_leaves_the_request_alone(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """The issue's `create`: the task, its dedup key, ready entry and counts were written,
    then emit() raised. Today a daemon's claim takes the request in: it raises first."""
    created = await create(store, tenant="t1", dedup_key="k", take_in=False)
    await redis_client.hset(keys.tag(0) + ":settings", "events_maxlen", "lots")
    call = store.ops.claim(0, "submit", 10, 10_000, "w1", 100)
    await _raises_and_writes_nothing(store, redis_client, call, "settings events_maxlen")
    assert not await redis_client.exists(keys.task(0, created.task_id))
    await redis_client.hdel(keys.tag(0) + ":settings", "events_maxlen")
    batch = await store.claim(0, "submit", 10, 10_000, "w1")
    assert [c.lease.task_id for c in batch.claimed] == [created.task_id]


async def test_a_cancel_carried_out_under_a_bad_retention_leaves_the_task_alone(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """The issue's `cancel`: the task became CANCELED with no event. Today the daemon's
    intake carries the cancel out (time_out here): it raises before anything."""
    created = await create(store)
    await store.cancel(created.task_id)
    for field, value in (("retention_ms", "7d"), ("expiry_grace_ms", "-1")):
        await redis_client.hset(keys.tag(0) + ":settings", field, value)
        call = store.ops.time_out(0, 100)
        await _raises_and_writes_nothing(store, redis_client, call, f"settings {field}")
        await redis_client.hdel(keys.tag(0) + ":settings", field)
    task = await store.get(created.task_id)
    assert task is not None and task.status is Status.PENDING_SUBMIT
    await store.time_out(0, 100)
    task = await store.get(created.task_id)
    assert task is not None and task.status is Status.CANCELED


async def test_release_checks_every_triple_before_releasing_any(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """The issue's `release`: an empty version in a later triple raised after the earlier
    triples were released."""
    await create(store)
    await create(store)
    batch = await store.claim(0, "submit", 2, 10_000, "w1")
    first, second = (c.lease for c in batch.claimed)
    call = store.ops.release(0, [first, second])
    call.args[5] = ""
    await _raises_and_writes_nothing(store, redis_client, call, "release needs")
    # a task it would release with a corrupt version: nothing is released either
    await redis_client.hset(keys.task(0, second.task_id), "version", "two")
    call = store.ops.release(0, [first, second])
    await _raises_and_writes_nothing(
        store, redis_client, call, f"task {second.task_id} field version"
    )
    await redis_client.hset(keys.task(0, second.task_id), "version", str(second.version))
    assert await store.run(store.ops.release(0, [first, second, first])) == [
        Code.OK, Code.OK, Code.NO_LEASE,
    ]  # fmt: skip


async def test_take_checks_every_rates_entry_before_storing_a_bucket(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """`take` stored the first lane's bucket, then raised on the second lane's entry."""
    client = AsyncClient(redis_client)
    await client.set_limit(provider="p", submit_rate=5)
    await client.set_limit(provider="q", submit_rate=5)
    await redis_client.hset(keys.admission() + "rates", "submit:provider:q", "fast")
    call = store.ops.take("take", {"submit|p|": 1, "submit|q|": 1})
    await _raises_and_writes_nothing(store, redis_client, call, "rates entry")


async def test_take_lanes_that_share_a_bucket_take_from_it_in_turn(
    store: Store, redis_client: redis.asyncio.Redis
) -> None:
    """Buckets are loaded before any is stored: two lanes of one provider still share
    the provider's tokens, as when each lane loaded what the one before stored."""
    await AsyncClient(redis_client).set_limit(provider="p", submit_rate=1, submit_burst=3)
    got = await store.run(store.ops.take("take", {"submit|p|a": 2, "submit|p|b": 2}))
    assert got["submit|p|a"] == (2, 0) and got["submit|p|b"][0] == 1


async def test_limits_checks_its_version_key_before_writing(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """`limits` wrote the entry, then INCR of a corrupt version key raised."""
    await redis_client.set(keys.admission() + "version", "v3")
    entry = '{"source": "runtime", "buckets": {"submit:tenant:t6": "1 1"}}'
    call = store.ops.limits("set", [("tenant:t6", entry)])
    await _raises_and_writes_nothing(store, redis_client, call, "version is not an integer")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"retention_ms": 0}, "setting retention_ms must be an integer from 1 to"),
        ({"expiry_grace_ms": -1}, "setting expiry_grace_ms must be an integer from 0 to"),
        ({"events_maxlen": 2.5}, "setting events_maxlen must be an integer"),
        ({"events_maxlen": "1000"}, "setting events_maxlen must be an integer"),
        ({"retention": 1000}, "unknown setting 'retention'"),
    ],
)
async def test_settings_are_checked_where_they_are_written(
    redis_client: redis.asyncio.Redis, keys: Keys, settings: dict[str, Any], message: str
) -> None:
    """A Store writes its settings to every shard (prepare()): one the scripts would
    refuse fails when the Store is made, and nothing is written."""
    with pytest.raises(ValueError, match=message):
        Store(redis_client, keys, settings)
    assert await redis_client.dbsize() == 0


@pytest.mark.parametrize("end", [0, 1])
async def test_the_scripts_take_every_setting_a_store_may_write(
    redis_client: redis.asyncio.Redis, keys: Keys, end: int
) -> None:
    """keys.SETTINGS and settings() in the prelude agree: each bound a Store writes, a
    script that finishes a task and writes its event takes."""
    store = Store(redis_client, keys, {name: r[end] for name, r in KEY_SETTINGS.items()})
    await store.prepare()
    created = await create(store)
    await store.cancel(created.task_id)
    await store.time_out(0, 10)  # carries the cancel out: finish() and emit()
    events = await redis_client.xrange(keys.events(0))
    assert events[-1][1][b"task"] == created.task_id.encode()
    assert events[-1][1][b"status"] == b"CANCELED"
    ttl = await redis_client.pttl(keys.task(0, created.task_id))  # -2: the 1 ms went by
    expiry = KEY_SETTINGS["retention_ms"][end] + KEY_SETTINGS["expiry_grace_ms"][end]
    assert expiry - 5000 < ttl <= expiry or (end == 0 and ttl in (-2, 0, 1))


async def test_a_save_that_finishes_nothing_reads_only_events_maxlen(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """Most saves write an event and finish nothing: they read events_maxlen alone (one
    HGET), so a bad retention does not stop them, and a bad events_maxlen does, before
    anything is written."""
    call, _ = await _save_call(store, keys)
    call = store.ops.save(Lease(*call.args[:3]), Status.SUBMITTED, fields={"external_id": "x"})
    settings_key = keys.tag(0) + ":settings"
    await redis_client.hset(settings_key, mapping={"retention_ms": "soon", "events_maxlen": "-1"})
    await _raises_and_writes_nothing(store, redis_client, call, "settings events_maxlen")
    await redis_client.hdel(settings_key, "events_maxlen")
    assert (await store.run(call)).code is Code.OK
