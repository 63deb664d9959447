"""create_many, start_many and save_many: several creates, starts or saves in one script
call, each exactly as the single script alone.

The main tests build the same tasks, with the same ids, in two namespaces, run the calls
one by one with `create` (`start`, `save`) in the first and in one `create_many`
(`start_many`, `save_many`) in the second (through the store's pipeline, which coalesces
them), and require the same replies and the same data after.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio

from asynctaskd.codec import decode_request
from asynctaskd.errors import ScriptError
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.store import Call, Code, Created, Lease, Result, Store
from tests.conftest import wait_until

from .helpers import (
    INDEXES,
    check_invariants,
    claim_one,
    create,
    evalsha_calls,
    ingest,
    lease_expired,
    submitted,
)


async def _submitting(
    store: Store, tid: str, *, started: bool = True, lease_ms: int = 10_000, **kw: Any
) -> Lease:
    await create(store, task_id=tid, **kw)
    c = await claim_one(store, "submit", lease_ms)
    assert c.lease.task_id == tid
    if not started:
        return c.lease
    r = await store.start(c.lease, False)
    assert r.code is Code.OK, r
    return Lease(tid, c.lease.fence, r.version)


async def _querying(store: Store, tid: str, **kw: Any) -> Lease:
    await submitted(store, task_id=tid, **kw)
    c = await claim_one(store, "query")
    assert c.lease.task_id == tid
    return c.lease


async def _server_ms(store: Store) -> int:
    sec, usec = await store.redis.time()
    return int(sec) * 1000 + int(usec) // 1000


Build = Callable[[Store, str, redis.asyncio.Redis], Awaitable[list[Call[Result]]]]


async def _handle(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _submitting(s, tid)
    fields = {"external_id": "v-1", "handle": b'{"external_id":"v-1"}'}
    return [s.ops.save(lease, Status.SUBMITTED, delay_ms=200, fields=fields)]


async def _retry(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _submitting(s, tid, started=False)
    return [s.ops.save(lease, Status.PENDING_SUBMIT, fields={"error_code": "x"})]


async def _progress(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _querying(s, tid)
    fields: dict[str, Any] = {"progress": "0.5", "stage": "ocr", "poll_count": 1}
    return [s.ops.save(lease, Status.RUNNING, delay_ms=60_000, fields=fields)]


async def _done(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _querying(s, tid, dedup_key=f"d-{tid}")
    return [s.ops.save(lease, Status.SUCCEEDED, fields={"result": b'{"text":"hi"}'})]


async def _failed(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _querying(s, tid)
    fields = {"error_code": "E", "error_message": "no"}
    return [s.ops.save(lease, Status.FAILED, fields=fields)]


async def _cancel_in_query(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _querying(s, tid)
    assert (await s.cancel(tid)).code is Code.ACCEPTED
    return [s.ops.save(lease, Status.RUNNING, delay_ms=60_000)]  # due at once instead


async def _cancel_in_submit(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _submitting(s, tid, started=False)
    assert (await s.cancel(tid)).code is Code.ACCEPTED
    return [s.ops.save(lease, Status.PENDING_SUBMIT)]  # becomes CANCELED


async def _stale(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _querying(s, tid)
    return [s.ops.save(Lease(tid, lease.fence + 1, lease.version), Status.FAILED)]


async def _wrong_version(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _querying(s, tid)
    return [s.ops.save(Lease(tid, lease.fence, lease.version + 5), Status.FAILED)]


async def _missing(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    return [s.ops.save(Lease(tid, 1, 1), Status.FAILED)]


async def _illegal(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _submitting(s, tid)
    return [s.ops.save(lease, Status.SUCCEEDED)]


async def _bad_field(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _querying(s, tid)
    return [s.ops.save(lease, Status.FAILED, fields={"error_code": "E", "fence": "9"})]


async def _bad_status(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    call = s.ops.save(await _querying(s, tid), Status.FAILED)
    call.args[3] = "NOT_A_STATUS"
    return [call]


async def _huge_delay(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    # past 2^53 ms: it would be stored as a float ("1e+17") no reader takes
    return [s.ops.save(await _querying(s, tid), Status.RUNNING, delay_ms=10**17)]


async def _corrupt(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    await r.set(s.ops._task(tid)[1], "not a hash")
    return [s.ops.save(Lease(tid, 1, 1), Status.FAILED)]


async def _parked(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _submitting(s, tid, started=False, lease_ms=100)
    started = await s.start(lease, False)
    assert started.code is Code.OK
    await wait_until(lambda: lease_expired(r, s.keys, tid), "lease expiry")
    assert await s.reap(0, 10, 2) == [(tid, Status.SUBMIT_UNKNOWN)]
    late = Lease(tid, lease.fence, started.version)  # the original submitter's late save
    return [s.ops.save(late, Status.SUBMITTED, fields={"external_id": "v-late"})]


async def _unknown(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    return [s.ops.save(await _submitting(s, tid), Status.SUBMIT_UNKNOWN)]


async def _deadline_passed(s: Store, tid: str, r: redis.asyncio.Redis) -> None:
    """Move the task's deadline to just before the server's now (the scripts compare the
    hash's deadline_ms with TIME): what waiting it out would do, without the wait."""
    await r.hset(s.ops._task(tid)[1], "deadline_ms", await _server_ms(s) - 1)


async def _past_deadline(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _querying(s, tid)
    await _deadline_passed(s, tid, r)
    return [s.ops.save(lease, Status.RUNNING, delay_ms=1_000, fields={"progress": "0.9"})]


async def _twice(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _querying(s, tid)
    # the second sees the first: the lease is gone
    return [s.ops.save(lease, Status.RUNNING, delay_ms=5), s.ops.save(lease, Status.FAILED)]


async def _clears(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _querying(s, tid)
    fields: dict[str, Any] = {"error_code": "", "consecutive_errors": "", "message": "m"}
    fields["poll_count"] = 3
    return [s.ops.save(lease, Status.SUBMITTED, delay_ms=0, fields=fields)]


SAVES: list[Build] = [
    _handle, _retry, _progress, _done, _failed, _cancel_in_query, _cancel_in_submit,
    _stale, _wrong_version, _missing, _illegal, _bad_field, _bad_status, _huge_delay,
    _corrupt, _parked, _unknown, _past_deadline, _twice, _clears,
]  # fmt: skip


async def _start(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    return [s.ops.start(await _submitting(s, tid, started=False), False)]


async def _start_idempotent(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    return [s.ops.start(await _submitting(s, tid, started=False), True)]


async def _start_stale(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _submitting(s, tid, started=False)
    return [s.ops.start(Lease(tid, lease.fence + 1, lease.version), False)]


async def _start_wrong_version(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _submitting(s, tid, started=False)
    return [s.ops.start(Lease(tid, lease.fence, lease.version + 5), False)]


async def _start_no_lease(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _submitting(s, tid, started=False, lease_ms=100)
    await wait_until(lambda: lease_expired(r, s.keys, tid), "lease expiry")
    assert await s.reap(0, 10, 2) == [(tid, Status.PENDING_SUBMIT)]
    return [s.ops.start(lease, False)]


async def _start_missing(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    return [s.ops.start(Lease(tid, 1, 1), False)]


async def _start_in_query(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    return [s.ops.start(await _querying(s, tid), False)]  # not SUBMITTING: ILLEGAL


async def _start_canceled(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _submitting(s, tid, started=False)
    assert (await s.cancel(tid)).code is Code.ACCEPTED
    return [s.ops.start(lease, False)]


async def _start_again(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    return [s.ops.start(await _submitting(s, tid), False)]  # STARTED: one call per claim


async def _start_twice(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _submitting(s, tid, started=False)
    return [s.ops.start(lease, False), s.ops.start(lease, False)]  # the second: stale version


async def _start_late(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _submitting(s, tid, started=False)
    await _deadline_passed(s, tid, r)
    return [s.ops.start(lease, False)]


async def _start_corrupt(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    await r.set(s.ops._task(tid)[1], "not a hash")
    return [s.ops.start(Lease(tid, 1, 1), False)]


async def _start_bad_count(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Result]]:
    lease = await _submitting(s, tid, started=False)
    await r.hset(s.ops._task(tid)[1], "submit_attempts", "many")
    return [s.ops.start(lease, False)]


STARTS: list[Build] = [
    _start, _start_idempotent, _start_stale, _start_wrong_version, _start_missing,
    _start_in_query, _start_canceled, _start_again, _start_twice, _start_late,
    _start_corrupt, _start_bad_count,
    _start_no_lease,  # last: it leaves its task ready, where a later claim would take it
]  # fmt: skip


def _creating(s: Store, tid: str, **kw: Any) -> Call[Any]:
    args: dict[str, Any] = {"timeout_ms": 60_000} | kw
    return s.ops.create(tid, args.pop("handler", "h"), b'{"n":1}', **args)


_TWINS: dict[str, str] = {}


def _twin(tid: str) -> str:
    """A second id for a scenario, the same in both namespaces."""
    return _TWINS.setdefault(tid, new_task_id())


async def _create(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Any]]:
    return [_creating(s, tid, priority=7, tenant="t", account="a", provider="p",
                      metadata_json=b'{"m":1}')]  # fmt: skip


async def _create_delayed(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Any]]:
    return [_creating(s, tid, delay_ms=60_000), _creating(s, _twin(tid), not_before_ms=1)]


async def _create_paused(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Any]]:
    await s.pause("tenant:quiet")  # held, not ready
    return [_creating(s, tid, tenant="quiet")]


async def _create_deduped(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Any]]:
    await s.run(_creating(s, _twin(tid), tenant="t", dedup_key="k1"))  # a live duplicate
    return [_creating(s, tid, tenant="t", dedup_key="k1")]


async def _create_dedup_twice(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Any]]:
    # the second sees the first, created in the same call: ACCEPTED with the first's id
    return [_creating(s, tid, dedup_key="k2"), _creating(s, _twin(tid), dedup_key="k2")]


async def _create_taken(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Any]]:
    await s.run(_creating(s, tid))
    return [_creating(s, tid, priority=8)]  # another create with its id: EXISTS, raised


async def _create_resent(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Any]]:
    await s.run(_creating(s, tid, delay_ms=5_000))
    return [_creating(s, tid, delay_ms=5_000)]  # the same create again: answered as the first


async def _create_bad(s: Store, tid: str, r: redis.asyncio.Redis) -> list[Call[Any]]:
    bad_priority = _creating(s, tid, priority=7)
    bad_priority.args[5] = 500
    no_handler = _creating(s, _twin(tid), handler="")
    return [bad_priority, no_handler]


CREATES: list[Build] = [
    _create, _create_delayed, _create_paused, _create_deduped, _create_dedup_twice,
    _create_taken, _create_resent, _create_bad,
]  # fmt: skip


async def _state(r: redis.asyncio.Redis, keys: Keys, ids: list[str]) -> dict[str, Any]:
    """Everything the saves may have touched, with times reduced to 'set'."""
    tag = keys.tag(0)
    out: dict[str, Any] = {}
    for tid in ids:
        key = keys.task(0, tid)
        if await r.type(key) != b"hash":
            out[tid] = await r.type(key)
            continue
        fields = await r.hgetall(key)
        out[tid] = {k: ("set" if k.endswith(b"_ms") else v) for k, v in sorted(fields.items())}
        out[tid + " expires"] = await r.pttl(key) > 0
        for name in (*INDEXES, "held:x"):
            out[f"{tid} in {name}"] = await r.zscore(f"{tag}:{name}", tid) is not None
        for status in Status:
            out[f"{tid} idx {status}"] = await r.zscore(keys.index(0, status), tid) is not None
    out["counts"] = await r.hgetall(keys.counts(0))
    out["events"] = [fields for _, fields in await r.xrange(keys.events(0))]
    out["wake"] = await r.lrange(f"{tag}:wake", 0, -1)
    out["intake"] = await r.lrange(keys.intake(0), 0, -1)
    for tid in ids:
        packed = await r.get(keys.request(0, tid))
        fields = decode_request(packed, tid) if packed else {}
        out[tid + " request"] = {k: ("set" if k.endswith(b"_ms") else v)
                                 for k, v in sorted(fields.items())}  # fmt: skip
    dedup = sorted(await r.keys(f"{tag}:dedup:*"))  # private server: safe
    out["dedup"] = {k[len(tag) :]: await r.get(k) for k in dedup}
    return out


def _reply(result: Any) -> Any:
    """A result as comparable across namespaces: errors by their Lua message (or the
    decoder's, which names no namespace)."""
    if isinstance(result, Exception):
        text = str(result)
        if "asynctaskd:" in text:
            text = text[text.index("asynctaskd:") :]
        elif "WRONGTYPE" in text:
            text = "WRONGTYPE"
        return type(result).__name__, text.split(" script:")[0]
    if isinstance(result, Created):  # its times: how long after its creation it is due
        return result.task_id, result.deduped, result.version, result.due_ms - result.created_ms
    return result


MANY = Keys("many", 1)  # the namespace where the calls go in one script call


async def _checked(r: redis.asyncio.Redis, corrupt: str | None = None) -> None:
    """The invariants of the MANY namespace, once a corrupt task key is out of the way."""
    if corrupt is not None:
        await r.delete(MANY.task(0, corrupt))
    await check_invariants(r, MANY)


async def _alone_and_many(
    r: redis.asyncio.Redis, scenarios: list[Build]
) -> tuple[list[Any], list[Any], list[str], dict[str, Any]]:
    """Each scenario's calls run one by one in one namespace, and in one pipeline in
    another; returns both replies, the task ids and the state before the pipeline."""
    alone, many = Store(r, Keys("one", 1)), Store(r, MANY)
    await alone.prepare()
    await many.prepare()
    ids = [new_task_id() for _ in scenarios]
    calls: dict[str, list[Call[Result]]] = {"one": [], "many": []}
    for build, tid in zip(scenarios, ids, strict=True):
        for store in (alone, many):
            calls[store.keys.namespace] += await build(store, tid, r)
    before = await _state(r, many.keys, ids)
    replies_alone: list[Any] = []
    for call in calls["one"]:
        try:
            replies_alone.append(await alone.run(call))
        except ScriptError as exc:
            replies_alone.append(exc)
    evalsha_before = await evalsha_calls(r)
    replies_many, rerun, _ = await many.pipeline(calls["many"])
    assert await evalsha_calls(r) == evalsha_before + 1, "not one script call"
    assert rerun == [False] * len(calls["many"])
    assert [_reply(x) for x in replies_many] == [_reply(x) for x in replies_alone]
    assert await _state(r, many.keys, ids) == await _state(r, alone.keys, ids)
    return replies_alone, replies_many, ids, before


async def test_save_many_replies_and_writes_exactly_what_each_save_would(
    redis_client: redis.asyncio.Redis,
) -> None:
    _, replies, ids, before = await _alone_and_many(redis_client, SAVES)
    codes = [x.code if isinstance(x, Result) else "error" for x in replies]
    assert codes.count(Code.OK) == 12 and codes.count("error") == 4, codes
    assert {Code.STALE_FENCE, Code.WRONG_VERSION, Code.NOT_FOUND, Code.ILLEGAL} <= set(codes)
    assert Code.NO_LEASE in codes
    finals = {x.status for x in replies if isinstance(x, Result) and x.status}
    assert {Status.CANCELED, Status.TRACKING_TIMED_OUT, Status.SUBMIT_UNKNOWN} <= finals
    after = await _state(redis_client, MANY, ids)
    assert after != before
    for tid, build in zip(ids, SAVES, strict=True):
        if build in (_bad_field, _bad_status, _huge_delay):  # failed alone, wrote nothing
            assert after[tid] == before[tid]
    await _checked(redis_client, ids[SAVES.index(_corrupt)])


async def test_start_many_replies_and_writes_exactly_what_each_start_would(
    redis_client: redis.asyncio.Redis,
) -> None:
    _, replies, ids, before = await _alone_and_many(redis_client, STARTS)
    codes = [x.code if isinstance(x, Result) else "error" for x in replies]
    assert codes.count(Code.OK) == 3 and codes.count("error") == 2, codes
    assert {
        Code.STALE_FENCE, Code.WRONG_VERSION, Code.NO_LEASE, Code.NOT_FOUND, Code.ILLEGAL,
        Code.CANCEL_REQUESTED, Code.STARTED,
    } <= set(codes)  # fmt: skip
    after = await _state(redis_client, MANY, ids)
    started = after[ids[STARTS.index(_start)]]
    assert started[b"started_fence"] == b"1" and started[b"submit_attempts"] == b"1"
    assert after[ids[STARTS.index(_start_idempotent)]][b"idempotent"] == b"1"
    bad = ids[STARTS.index(_start_bad_count)]
    assert after[bad] == before[bad]  # failed alone, and wrote nothing
    await _checked(redis_client, ids[STARTS.index(_start_corrupt)])


async def test_create_many_replies_and_writes_exactly_what_each_create_would(
    redis_client: redis.asyncio.Redis,
) -> None:
    _, replies, ids, _ = await _alone_and_many(redis_client, CREATES)
    kinds = [type(x).__name__ for x in replies]
    assert kinds.count("Created") == 8 and kinds.count("ScriptError") == 3, replies
    # taken in by a daemon, the requests of both namespaces become the same tasks
    for keys in (Keys("one", 1), MANY):
        await ingest(Store(redis_client, keys))
    assert await _state(redis_client, MANY, ids) == await _state(redis_client, Keys("one", 1), ids)
    deduped = [x for x in replies if getattr(x, "deduped", False)]
    assert [x.task_id for x in deduped] == [
        _twin(ids[CREATES.index(_create_deduped)]),
        ids[CREATES.index(_create_dedup_twice)],
    ]
    held = await redis_client.zrange(f"{MANY.tag(0)}:held:tenant:quiet", 0, -1)
    assert held == [ids[CREATES.index(_create_paused)].encode()]
    await _checked(redis_client)


async def test_saves_to_one_shard_go_in_calls_of_at_most_32_in_their_order(
    store: Store, redis_client: redis.asyncio.Redis
) -> None:
    leases = [await _querying(store, new_task_id()) for _ in range(70)]
    other = await create(store)
    c = await claim_one(store, "submit")
    assert c.lease.task_id == other.task_id
    calls: list[Call[Any]] = [
        store.ops.save(lease, Status.RUNNING, delay_ms=60_000, fields={"poll_count": i})
        for i, lease in enumerate(leases)
    ]
    calls.insert(40, store.ops.start(c.lease, False))
    wire, carried = store._coalesced(calls)
    assert [w.script for w in wire] == ["save_many", "save_many", "start", "save_many"]
    assert [len(g) for g in carried or []] == [32, 32, 1, 6]
    before = await evalsha_calls(redis_client)
    results, _, _ = await store.pipeline(calls)
    assert await evalsha_calls(redis_client) == before + 4
    assert results[40] == Result(Code.OK, results[40].version)
    saved = results[:40] + results[41:]
    assert all(r.code is Code.OK and r.status is Status.RUNNING for r in saved)
    for i, lease in enumerate(leases):
        task = await store.get(lease.task_id)
        assert task is not None and task.poll_count == i and task.version == saved[i].version


async def test_starts_and_saves_to_one_shard_go_as_one_call_of_each(store: Store) -> None:
    leases = [Lease(new_task_id(), 1, 1) for _ in range(4)]
    calls = [
        store.ops.save(leases[0], Status.FAILED),
        store.ops.start(leases[1], False),
        store.ops.save(leases[2], Status.FAILED),
        store.ops.start(leases[3], True),
    ]
    wire, carried = store._coalesced(calls)
    assert [w.script for w in wire] == ["save_many", "start_many"]
    assert carried == [[0, 2], [1, 3]]
    results, _, _ = await store.pipeline(calls)
    assert [r.code for r in results] == [Code.NOT_FOUND] * 4


async def test_one_save_alone_goes_as_save(store: Store) -> None:
    lease = await _querying(store, new_task_id())
    call = store.ops.save(lease, Status.SUCCEEDED)
    wire, carried = store._coalesced([call, store.ops.cancel(new_task_id())])
    assert wire[0] is call and carried is None


async def test_a_flushed_script_cache_reloads_save_many_and_runs_it_again(
    store: Store, redis_client: redis.asyncio.Redis
) -> None:
    leases = [await _querying(store, new_task_id()) for _ in range(3)]
    await redis_client.script_flush()
    calls = [store.ops.save(lease, Status.SUCCEEDED) for lease in leases]
    results, rerun, _ = await store.pipeline(calls)
    assert [r.status for r in results] == [Status.SUCCEEDED] * 3
    assert rerun == [True] * 3


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(lambda args: [len(args), *args, 5, *args], id="more-saves-than-keys"),
        pytest.param(lambda args: [len(args) + 1, *args], id="count-past-the-end"),
        pytest.param(lambda args: ["five", *args], id="count-not-a-number"),
        pytest.param(lambda args: [len(args), *args, "extra"], id="arguments-left-over"),
    ],
)
async def test_a_malformed_layout_fails_the_whole_call_before_any_write(
    store: Store, redis_client: redis.asyncio.Redis, layout: Callable[[list[Any]], list[Any]]
) -> None:
    lease = await _querying(store, new_task_id())
    good = store.ops.save(lease, Status.SUCCEEDED)
    keys = store.keys
    before = await _state(redis_client, keys, [lease.task_id])
    with pytest.raises(redis.ResponseError, match="asynctaskd: save_many"):
        await redis_client.evalsha(
            store.scripts["save_many"].sha, 2, *good.keys, *layout(list(good.args))
        )
    assert await _state(redis_client, keys, [lease.task_id]) == before


async def test_ops_refuse_to_mix_shards_or_scripts(store: Store) -> None:
    ops = Store(store.redis, Keys("atd", 2)).ops
    saves = [ops.save(Lease(new_task_id(shard), 1, 1), Status.FAILED) for shard in (0, 1)]
    with pytest.raises(ValueError, match="one shard"):
        ops.save_many(saves)
    start = ops.start(Lease(new_task_id(0), 1, 1), False)
    with pytest.raises(ValueError, match="one shard"):
        ops.save_many([saves[0], start])


async def test_saves_to_two_shards_go_as_one_save_many_each(
    redis_client: redis.asyncio.Redis,
) -> None:
    store = Store(redis_client, Keys("two", 2))
    await store.prepare()
    calls = [
        store.ops.save(Lease(new_task_id(shard), 1, 1), Status.FAILED) for shard in (0, 1, 0, 1)
    ]
    wire, carried = store._coalesced(calls)
    assert [(w.script, w.keys[0]) for w in wire] == [
        ("save_many", "two:{s0}:"),
        ("save_many", "two:{s1}:"),
    ]
    assert carried == [[0, 2], [1, 3]]
    results, _, _ = await store.pipeline(calls)
    assert [r.code for r in results] == [Code.NOT_FOUND] * 4
