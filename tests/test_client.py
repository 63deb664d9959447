"""AsyncClient and Client against real servers: one test body per behaviour, both clients."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import io
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
import pytest
import redis.asyncio
from redis import Redis as SyncRedis

import asynctaskd.client.watch as client_watch
from asynctaskd.client import AsyncClient, Client, TaskEvent, TaskPage, content_dedup_key
from asynctaskd.errors import (
    CorruptTask,
    IllegalTransition,
    InvalidTask,
    PayloadTooLarge,
    StoreUnavailable,
    TaskNotFound,
    UnknownHandler,
)
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status, Task, TaskError
from asynctaskd.plans import Reads, read
from asynctaskd.store import Call, Code, Lease, Store, SyncStore
from asynctaskd.store.batcher import _Pending

from .clients import Api
from .conftest import wait_until
from .lua.helpers import ingest

pytestmark = pytest.mark.anyio

S = Status
T = TypeVar("T")
BASE: dict[str, Any] = {"tracking_timeout": 60, "strict": False}


# Driving tasks the way a worker does, with the store (one shard).


async def claim(store: Store, phase: str = "submit", n: int = 1) -> list[Lease]:
    batch = await store.claim(0, phase, n, 30_000, "w1")  # type: ignore[arg-type]
    assert len(batch.claimed) == n, batch
    return [c.lease for c in batch.claimed]


async def to_submitted(store: Store) -> None:
    (lease,) = await claim(store)
    r = await store.start(lease, False)
    lease = Lease(lease.task_id, lease.fence, r.version)
    fields = {"external_id": "job-1", "handle": b'{"external_id":"job-1"}'}
    assert (await store.save(lease, S.SUBMITTED, fields=fields)).ok


async def report(store: Store, progress: float) -> None:
    (lease,) = await claim(store, "query")
    fields = {"progress": str(progress), "stage": f"at {progress}"}
    assert (await store.save(lease, S.RUNNING, fields=fields)).ok


async def finish(store: Store, status: Status = S.SUCCEEDED) -> None:
    (lease,) = await claim(store, "query")
    assert (await store.save(lease, status, fields={"result": b'{"pages":3}'})).ok


async def park(store: Store) -> None:
    """Claim, start and leave the task in SUBMIT_UNKNOWN (an ambiguous submit)."""
    (lease,) = await claim(store)
    r = await store.start(lease, False)
    assert (await store.save(Lease(lease.task_id, lease.fence, r.version), S.SUBMIT_UNKNOWN)).ok


async def fail_submit(store: Store) -> None:
    (lease,) = await claim(store)
    fields = {"error_code": "BAD", "error_message": "refused"}
    assert (await store.save(lease, S.FAILED, fields=fields)).ok


async def until(condition: Callable[[], Any], what: str) -> Any:
    async def check() -> Any:
        return condition()

    return await wait_until(check, what)


async def blocked_readers(r: redis.asyncio.Redis) -> int:
    clients = await r.client_list()
    return sum(1 for c in clients if c.get("cmd") == "xread" and "b" in c.get("flags", ""))


async def server_ms(r: redis.asyncio.Redis) -> int:
    sec, usec = await r.time()
    return int(sec) * 1000 + int(usec) // 1000


# Submit and its validation.


async def test_submit_returns_the_stored_task_in_one_round_trip(
    api: Api, redis_client: redis.asyncio.Redis
) -> None:
    await redis_client.hset("atd:handlers", "ocr:demo", str(int(time.time() * 1000) + 60_000))
    not_before = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    params = {"url": "https://x", "pages": (1, 2)}
    t = await api.submit(
        "ocr:demo", params, tracking_timeout=dt.timedelta(minutes=30), tenant="t1",
        account="acct-1", provider="vendor", priority=5, metadata={"order": "42"},
        not_before=not_before, dedup_key="order-42",
    )  # fmt: skip
    assert t == await api.get(t.id)
    assert (t.status, t.priority, t.provider) == (S.PENDING_SUBMIT, 5, "vendor")
    assert (t.params, t.metadata) == ({"url": "https://x", "pages": [1, 2]}, {"order": "42"})
    assert t.deadline_at == pytest.approx(t.created_at + 1800)
    assert t.due_at == pytest.approx(not_before.timestamp(), abs=0.002)
    before = dict(api.client._store.round_trips)
    await api.submit("ocr:demo", {}, tracking_timeout=5)  # handler cache is warm: one call
    after = api.client._store.round_trips
    assert {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} == {
        "create": 1
    }


INVALID: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"handler": ""}, InvalidTask, "handler must be"),
    ({"handler": "has space"}, InvalidTask, "handler must be"),
    ({"handler": "x" * 65}, InvalidTask, "handler must be"),
    ({"handler": 7}, InvalidTask, "handler must be"),
    ({"tenant": "t/1"}, InvalidTask, "tenant must be"),
    ({"account": ""}, InvalidTask, "account must be"),
    ({"provider": "p@x"}, InvalidTask, "provider must be"),
    ({"params": b"raw"}, InvalidTask, "params is a bytes.*base64"),
    ({"params": {"tags": {"a"}}}, InvalidTask, r"params\.tags is a set.*use a list"),
    ({"params": object()}, InvalidTask, "params is a object"),
    ({"params": {"x": float("nan")}}, InvalidTask, "NaN"),
    ({"params": {1: "a"}}, InvalidTask, "keys must be strings"),
    ({"params": "x" * 300_000}, PayloadTooLarge, "over the limit of 262144"),
    ({"metadata": {"m": b"x"}}, InvalidTask, r"metadata\.m is a bytes"),
    ({"metadata": ["x" * 300_000]}, PayloadTooLarge, "metadata is"),
    ({"tracking_timeout": 0}, InvalidTask, "tracking_timeout must be more than 0"),
    ({"tracking_timeout": -5}, InvalidTask, "tracking_timeout must be more than 0"),
    ({"tracking_timeout": float("inf")}, InvalidTask, "tracking_timeout"),
    ({"tracking_timeout": "60"}, InvalidTask, "tracking_timeout must be a number"),
    ({"tracking_timeout": True}, InvalidTask, "tracking_timeout must be a number"),
    ({"tracking_timeout": 1e12}, InvalidTask, "at most 10 years"),
    ({"priority": 101}, InvalidTask, "priority must be an integer from -100 to 100"),
    ({"priority": -101}, InvalidTask, "priority"),
    ({"priority": 1.5}, InvalidTask, "priority"),
    ({"priority": True}, InvalidTask, "priority"),
    ({"not_before": dt.datetime(2030, 1, 1)}, InvalidTask, "timezone-aware"),
    ({"not_before": "2030-01-01"}, InvalidTask, "not_before must be an aware datetime"),
    ({"not_before": time.time() * 1000}, InvalidTask, "not milliseconds"),
    ({"not_before": -1}, InvalidTask, "not_before"),
    ({"not_before": time.time(), "delay": 5}, InvalidTask, "not both"),
    ({"delay": -1}, InvalidTask, "delay must be at least 0"),
    ({"delay": dt.timedelta(seconds=-1)}, InvalidTask, "delay"),
    ({"dedup_key": ""}, InvalidTask, "dedup_key must be a non-empty str"),
    ({"dedup_key": "k" * 201}, InvalidTask, "at most 200"),
    ({"dedup_key": 42}, InvalidTask, "dedup_key"),
]


@pytest.mark.parametrize(("override", "error", "message"), INVALID)
async def test_submit_refuses_bad_input_and_writes_nothing(
    api: Api,
    redis_client: redis.asyncio.Redis,
    override: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    await api.submit("h", {"n": 0}, **BASE)
    keys_before = await redis_client.dbsize()
    kwargs = {"handler": "h", "params": {"n": 1}, **BASE, **override}
    with pytest.raises(error, match=message):
        await api.submit(kwargs.pop("handler"), kwargs.pop("params"), **kwargs)
    assert await redis_client.dbsize() == keys_before


async def test_strict_submit_needs_a_live_handler(
    api: Api, redis_client: redis.asyncio.Redis
) -> None:
    now_ms = int(time.time() * 1000)
    await redis_client.hset("atd:handlers", mapping={"old:h": now_ms - 1000})
    keys_before = await redis_client.dbsize()
    for handler in ("ocr:demo", "old:h"):
        with pytest.raises(UnknownHandler, match=f"no live daemon serves handler '{handler}'"):
            await api.submit(handler, {}, tracking_timeout=60)
    assert await redis_client.dbsize() == keys_before
    await redis_client.hset("atd:handlers", "ocr:demo", now_ms + 30_000)
    t = await api.submit("ocr:demo", {}, tracking_timeout=60)  # refused keys are re-read
    assert t.handler == "ocr:demo"
    assert (await api.submit("never:seen", {}, tracking_timeout=60, strict=False)).id
    assert await api.handlers() == {"ocr:demo": (now_ms + 30_000) / 1000}


async def test_a_burst_of_submits_on_a_cold_client_refreshes_its_caches_once(
    redis_url: str, redis_client: redis.asyncio.Redis
) -> None:
    await redis_client.hset("atd:handlers", "ocr:demo", str(int(time.time() * 1000) + 60_000))
    await redis_client.script_flush()  # as after a restart: the first pipeline meets NOSCRIPT
    async with AsyncClient.from_url(redis_url) as client:
        tasks = await asyncio.gather(
            *(client.submit("ocr:demo", {"i": i}, tracking_timeout=60) for i in range(200))
        )
        trips = dict(client._store.round_trips)

    assert len({t.id for t in tasks}) == 200
    assert await redis_client.llen(Keys().intake(0)) == 200  # 200 requests for a daemon
    await ingest(Store(redis_client, Keys()))
    assert await redis_client.hget(Keys().counts(0), "PENDING_SUBMIT@ocr:demo") == b"200"
    # One read of the groups and handlers answered all 200, not one read each; the first
    # create went out alone at once (nothing of the client's was on its way), the other 199
    # together: once, and once more if they met NOSCRIPT before the first one's reload.
    assert trips in (
        {"read": 1, "create": 1, "pipeline": 1},
        {"read": 1, "create": 1, "pipeline": 2},
    )


async def test_a_submit_alone_goes_out_from_its_callers_task_and_others_meanwhile_together(
    redis_url: str, redis_client: redis.asyncio.Redis
) -> None:
    await redis_client.hset("atd:handlers", "ocr:demo", str(int(time.time() * 1000) + 60_000))
    async with AsyncClient.from_url(redis_url) as client:
        await client.load_scripts()
        await client.submit("ocr:demo", {}, tracking_timeout=60)  # caches and a connection
        senders: list[asyncio.Task[Any] | None] = []
        run = client._store.run

        async def recorded(call: Call[T]) -> T:
            senders.append(asyncio.current_task())
            return await run(call)

        client._store.run = recorded  # type: ignore[method-assign]
        before = dict(client._store.round_trips)
        for i in range(3):  # one after the other: each from this task, none through the batcher
            await client.submit("ocr:demo", {"i": i}, tracking_timeout=60)
        assert senders == [asyncio.current_task()] * 3
        # Ten at once: the first goes out alone, the nine made while it is on its way as
        # one pipeline.
        tasks = await asyncio.gather(
            *(client.submit("ocr:demo", {"i": i}, tracking_timeout=60) for i in range(10))
        )
        after = client._store.round_trips

    assert len({t.id for t in tasks}) == 10
    assert {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} == {
        "create": 4,
        "pipeline": 1,
    }
    assert await redis_client.llen(Keys().intake(0)) == 14


async def sent(client: AsyncClient, call: Call[T]) -> T:
    """A script call through the client's own batching, as its operations send them."""
    result, _ = await client._calls.call(call)
    return result


async def test_script_calls_made_together_each_get_their_own_outcome(
    redis_url: str, redis_client: redis.asyncio.Redis
) -> None:
    async with AsyncClient.from_url(redis_url) as client:
        ops = client._store.ops
        calls = [ops.create(new_task_id(), "h", b"{}", timeout_ms=60_000) for _ in range(3)]

        def unreadable(reply: object) -> object:
            raise CorruptTask("t", "an unreadable reply")

        calls[1] = Call(calls[1].script, calls[1].keys, calls[1].args, unreadable)
        await redis_client.script_load(client._store.scripts["create"].source)
        outcomes = await asyncio.gather(
            *(sent(client, call) for call in calls), return_exceptions=True
        )
        trips = dict(client._store.round_trips)

    assert isinstance(outcomes[1], CorruptTask)
    assert [type(o).__name__ for o in (outcomes[0], outcomes[2])] == ["Created", "Created"]
    assert trips == {"pipeline": 1}


async def test_a_call_whose_caller_gave_up_before_it_went_out_is_not_sent(
    redis_url: str, redis_client: redis.asyncio.Redis
) -> None:
    async with AsyncClient.from_url(redis_url) as client:
        ops = client._store.ops
        ids = [new_task_id(), new_task_id()]
        kept, dropped = (
            asyncio.ensure_future(sent(client, ops.create(i, "h", b"{}", timeout_ms=60_000)))
            for i in ids
        )
        # One pass of the loop: both calls are queued, and go out on the next pass.
        await asyncio.sleep(0)
        dropped.cancel()
        assert (await kept).task_id == ids[0]
        with pytest.raises(asyncio.CancelledError):
            await dropped

    assert await redis_client.exists(Keys().request(0, ids[0])) == 1
    assert await redis_client.exists(Keys().request(0, ids[1])) == 0
    assert client._store.round_trips == {"create": 1}  # a call alone goes out as it is


async def test_a_caller_that_stops_waiting_for_a_shared_refresh_stops_no_other(
    redis_url: str, redis_client: redis.asyncio.Redis
) -> None:
    await redis_client.hset("atd:handlers", "ocr:demo", str(int(time.time() * 1000) + 60_000))
    async with AsyncClient.from_url(redis_url) as client:
        reads = Reads(read("hgetall", "atd:handlers"), share="handlers")
        first = asyncio.ensure_future(client._execute(reads))
        second = asyncio.ensure_future(client._execute(reads))
        await asyncio.sleep(0)  # both wait on the one read now (the first sent it)
        assert list(client._sharing) == ["handlers"]
        first.cancel()
        (live,) = await second
        with pytest.raises(asyncio.CancelledError):
            await first

    assert b"ocr:demo" in live
    assert client._sharing == {}
    assert client._store.round_trips == {"read": 1}


async def test_calls_left_queued_by_an_event_loop_that_stopped_do_not_block_the_next(
    redis_url: str,
) -> None:
    # A loop stopped between a call's queueing and its sending (its callers are gone):
    # the next loop that uses the client must still send its own calls.
    stopped = asyncio.new_event_loop()
    orphan_done = stopped.create_future()  # as a call queued on that loop left it
    stopped.close()
    async with AsyncClient.from_url(redis_url) as client:
        ops = client._store.ops
        orphan = _Pending(
            ops.create(new_task_id(), "h", b"{}", timeout_ms=60_000), False, orphan_done
        )
        client._calls._loop = stopped
        client._calls._queue.append(orphan)
        task_id = new_task_id()
        with anyio.fail_after(5):
            created = await sent(client, ops.create(task_id, "h", b"{}", timeout_ms=60_000))

    assert created.task_id == task_id
    assert client._store.round_trips == {"create": 1}


async def test_dedup_key_returns_the_live_task_of_the_same_tenant(
    make_api: Callable[..., Api],
) -> None:
    api = make_api(shards=4)
    first = await api.submit("h", {"n": 1}, dedup_key="order-42", tenant="t1", **BASE)
    again = await api.submit("h", {"n": 2}, dedup_key="order-42", tenant="t1", **BASE)
    assert again == first
    other = await api.submit("h", {"n": 3}, dedup_key="order-42", tenant="t2", **BASE)
    assert other.id != first.id
    assert await api.cancel(first.id)
    await api.take_in()  # a daemon carries the cancel out, which frees the dedup key
    fresh = await api.submit("h", {"n": 4}, dedup_key="order-42", tenant="t1", **BASE)
    assert fresh.id != first.id
    assert fresh.shard == first.shard
    assert fresh.params == {"n": 4}


async def test_dedup_by_content_makes_the_same_request_one_task(
    make_api: Callable[..., Api],
) -> None:
    api = make_api(shards=4)
    first = await api.submit("h", {"a": 1, "b": [1, 2]}, dedup="content", tenant="t1", **BASE)
    assert first.dedup_key == content_dedup_key("h", {"b": [1, 2], "a": 1})
    assert first.dedup_key.startswith("content:") and len(first.dedup_key) == 72
    # the same request, its keys in another order: the live task
    again = await api.submit("h", {"b": [1, 2], "a": 1}, dedup="content", tenant="t1", **BASE)
    assert again == first
    for handler, params, tenant in (
        ("h", {"a": 1, "b": [2, 1]}, "t1"),  # other params
        ("h2", {"a": 1, "b": [1, 2]}, "t1"),  # another handler
        ("h", {"a": 1, "b": [1, 2]}, "t2"),  # another tenant
    ):
        other = await api.submit(handler, params, dedup="content", tenant=tenant, **BASE)
        assert other.id != first.id, (handler, params, tenant)
    with pytest.raises(InvalidTask, match="not both"):
        await api.submit("h", {}, dedup="content", dedup_key="k", **BASE)
    with pytest.raises(InvalidTask, match="dedup must be 'content'"):
        await api.submit("h", {}, dedup="params", **BASE)


# Reading, cancelling and tenant isolation.


async def test_get_checks_ids_and_hides_worker_fields(
    make_api: Callable[..., Api], store: Store
) -> None:
    api = make_api(shards=2)
    for bad in ("nope", new_task_id().lower(), new_task_id(0) + "-0", new_task_id(5), 17):
        with pytest.raises(InvalidTask):
            await api.get(bad)
    with pytest.raises(InvalidTask, match="on shard 5, but this client is configured with 2"):
        await api.get(new_task_id(5))
    assert await api.get(new_task_id(1)) is None
    t = await make_api().submit("h", {}, **BASE)  # one-shard client: shard 0 for the store
    await claim(store)
    seen = await api.get(t.id)
    assert seen is not None
    assert (seen.status, seen.fence, seen.owner) == (S.SUBMITTING, 0, None)
    inside = await api.get(t.id, internals=True)
    assert inside is not None
    assert (inside.fence, inside.owner) == (1, "w1")


async def test_cancel_outcomes(api: Api, store: Store) -> None:
    leased = await api.submit("h", {}, **BASE)
    await claim(store)
    pending = await api.submit("h", {}, **BASE)
    assert await api.cancel(pending.id) is True
    assert (await api.get(pending.id)).status is S.PENDING_SUBMIT  # asked for, not done yet
    await api.take_in()
    assert (await api.get(pending.id)).status is S.CANCELED
    assert await api.cancel(leased.id) is True  # requested from its worker
    await api.take_in()
    snapshot = await api.get(leased.id)
    assert (snapshot.status, snapshot.cancel_requested) == (S.SUBMITTING, True)
    assert await api.cancel(pending.id) is False
    with pytest.raises(TaskNotFound):
        await api.cancel(new_task_id())


async def test_tenants_cannot_see_each_others_tasks(api: Api) -> None:
    t = await api.submit("h", {}, tenant="t1", **BASE)
    assert await api.get(t.id, "t2") is None
    assert await api.get(t.id, "t1") == t
    with pytest.raises(TaskNotFound):
        await api.cancel(t.id, "t2")
    with pytest.raises(TaskNotFound):
        await api.wait(t.id, 0.1, tenant="t2")
    with pytest.raises(TaskNotFound):
        await api.collect(t.id, [], tenant="t2")
    await api.take_in()  # listed once a daemon has taken it in
    assert (await api.list(tenant="t2")).tasks == []
    assert [x.id for x in (await api.list(tenant="t1")).tasks] == [t.id]
    assert (await api.get(t.id, "t1")).status is S.PENDING_SUBMIT


# wait() and watch().


async def test_wait_returns_when_another_party_finishes_the_task(
    api: Api, store: Store, redis_client: redis.asyncio.Redis
) -> None:
    t = await api.submit("h", {}, **BASE)
    await to_submitted(store)
    out: dict[str, Any] = {}

    async def waiter() -> None:
        out["task"] = await api.in_background("wait", t.id, 60)
        out["at"] = time.monotonic()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await wait_until(lambda: blocked_readers(redis_client), "wait() blocked on the stream")
        reads_before = api.client._store.round_trips["read"]
        await finish(store)
        finished = time.monotonic()
    assert (out["task"].status, out["task"].result) == (S.SUCCEEDED, {"pages": 3})
    assert out["at"] - finished < 30  # woken by the event, not by its 60 s timeout
    assert api.client._store.round_trips["read"] - reads_before <= 2  # one XREAD, one re-read


async def test_wait_returns_the_snapshot_at_timeout_and_stops_on_parked(
    api: Api, store: Store
) -> None:
    t = await api.submit("h", {}, **BASE)
    started = time.monotonic()
    assert (await api.wait(t.id, 0.2)).status is S.PENDING_SUBMIT
    assert time.monotonic() - started >= 0.2  # it did wait its timeout
    await park(store)
    started = time.monotonic()
    assert (await api.wait(t.id, 60)).status is S.SUBMIT_UNKNOWN
    assert time.monotonic() - started < 30  # stopped on the parked task, not the timeout
    with pytest.raises(TaskNotFound):
        await api.wait(new_task_id(), 1)


@pytest.mark.parametrize("op", ["wait", "watch"])
async def test_a_change_right_after_the_snapshot_is_not_missed(
    api: Api, store: Store, sync_store: SyncStore, monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    t = await api.submit("h", {}, **BASE)
    (lease,) = await claim(store)
    fired: list[bool] = []

    def fail_after_snapshot(reads: Reads) -> None:
        # The snapshot is already read (SUBMITTING); the task fails before the client reads
        # the stream. A client that subscribed from "now" would sit out the whole timeout.
        if not fired and any(cmd[0] == "xrevrange" for cmd in reads.cmds):
            fired.append(True)
            fields = {"error_code": "BAD", "error_message": "refused"}
            assert sync_store.run(sync_store.ops.save(lease, S.FAILED, fields=fields)).ok

    api.hook_reads(monkeypatch, fail_after_snapshot)
    started = time.monotonic()
    if op == "wait":
        task = await api.wait(t.id, 60)
        assert (task.status, task.error) == (S.FAILED, TaskError("BAD", "refused"))
    else:
        events: list[TaskEvent] = []
        await api.collect(t.id, events)
        assert [e.status for e in events] == [S.SUBMITTING, S.FAILED]
    assert fired
    assert time.monotonic() - started < 30  # not the wait's 60 s timeout


async def test_watch_yields_progress_in_order_until_terminal(api: Api, store: Store) -> None:
    t = await api.submit("h", {}, **BASE)
    await to_submitted(store)
    events: list[TaskEvent] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(api.collect, t.id, events)
        await until(lambda: events, "the snapshot event")
        for p in (0.25, 0.5, 0.75):
            await report(store, p)
        await finish(store)
    assert [(e.status, e.progress) for e in events] == [
        (S.SUBMITTED, None), (S.RUNNING, 0.25), (S.RUNNING, 0.5), (S.RUNNING, 0.75),
        (S.SUCCEEDED, None),
    ]  # fmt: skip
    assert events[2].stage == "at 0.5"
    assert all(e.task_id == t.id for e in events)
    assert [e.version for e in events] == sorted({e.version for e in events})
    assert [e.at for e in events] == sorted(e.at for e in events)


async def test_watch_resumes_after_its_connection_is_killed(
    api: Api, store: Store, redis_client: redis.asyncio.Redis
) -> None:
    t = await api.submit("h", {}, **BASE)
    await to_submitted(store)
    events: list[TaskEvent] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(api.collect, t.id, events)
        await until(lambda: events, "the snapshot event")
        await report(store, 0.1)
        await until(lambda: len(events) == 2, "two events")
        await wait_until(lambda: blocked_readers(redis_client), "watch() blocked on the stream")
        # Kill the watcher's own connection (only it is blocked on XREAD) from another one.
        for c in await redis_client.client_list():
            if c.get("cmd") == "xread" and "b" in c.get("flags", ""):
                assert await redis_client.client_kill_filter(_id=c["id"]) == 1
        await report(store, 0.2)
        await report(store, 0.3)
        await finish(store)
    assert [e.progress for e in events] == [None, 0.1, 0.2, 0.3, None]
    assert events[-1].status is S.SUCCEEDED


async def test_watch_rides_out_store_errors_and_gives_up_after_its_budget(
    api: Api, store: Store, sync_store: SyncStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = await api.submit("h", {}, **BASE)
    await to_submitted(store)
    xreads: list[int] = []

    def flaky(reads: Reads) -> bool:
        if reads.cmds[0][0] != "xread":
            return False
        xreads.append(1)
        if len(xreads) == 1:  # a change lands while the client cannot read
            (c,) = sync_store.run(sync_store.ops.claim(0, "query", 1, 30_000, "w1", 10)).claimed
            fields = {"progress": "0.5"}
            assert sync_store.run(sync_store.ops.save(c.lease, S.RUNNING, fields=fields)).ok
        return len(xreads) <= 3

    api.fail_reads(monkeypatch, flaky)
    events: list[TaskEvent] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(api.collect, t.id, events)
        await until(lambda: len(events) == 2, "the event written during the outage")
        await finish(store)
    assert [(e.status, e.progress) for e in events] == [
        (S.SUBMITTED, None), (S.RUNNING, 0.5), (S.SUCCEEDED, None)
    ]  # fmt: skip

    other = await api.submit("h", {}, **BASE)
    monkeypatch.setattr(client_watch, "RECONNECT_BUDGET_S", 0.3)  # read where watch runs
    api.fail_reads(monkeypatch, lambda reads: reads.cmds[0][0] == "xread")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="watch gave up after"):
        await api.collect(other.id, [])
    assert time.monotonic() - started < 30  # gave up after its 0.3 s budget, not later


async def test_watch_shows_a_state_it_re_read_as_the_stream_shows_it(
    api: Api, store: Store, sync_store: SyncStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = await api.submit("h", {}, **BASE)
    await to_submitted(store)
    steps: list[str] = []

    def outage(reads: Reads) -> bool:
        name = reads.cmds[0][0]
        if name == "xread" and not steps:  # away while the task reports progress
            steps.append("away")
            (c,) = sync_store.run(sync_store.ops.claim(0, "query", 1, 30_000, "w1", 10)).claimed
            assert sync_store.run(
                sync_store.ops.save(c.lease, S.RUNNING, fields={"progress": "0.5"})
            ).ok
            return True
        if "hgetall" in [c[0] for c in reads.cmds] and steps == ["away"]:  # back: it finishes
            # before the re-read
            steps.append("finished")
            (c,) = sync_store.run(sync_store.ops.claim(0, "query", 1, 30_000, "w1", 10)).claimed
            assert sync_store.run(sync_store.ops.save(c.lease, S.SUCCEEDED)).ok
        return False

    api.fail_reads(monkeypatch, outage)
    events: list[TaskEvent] = []
    with anyio.fail_after(10):
        await api.collect(t.id, events)
    assert steps == ["away", "finished"]
    # the hash still holds the progress, but a SUCCEEDED event carries none, as in the stream
    assert [(e.status, e.progress) for e in events] == [
        (S.SUBMITTED, None), (S.RUNNING, 0.5), (S.SUCCEEDED, None)
    ]  # fmt: skip


def stream_id(entry_id: bytes) -> tuple[int, int]:
    ms, seq = entry_id.split(b"-")
    return int(ms), int(seq)


def take_in(sync_store: SyncStore) -> None:
    """A daemon's claim of nothing: it takes producers' requests in."""
    sync_store.run(sync_store.ops.claim(0, "submit", 0, 30_000, "take-in", 0))


def trim_events_past(sync_redis: Any, sync_store: SyncStore) -> None:
    """Add events, as other producers' creates do, until the capped stream has dropped its
    newest entry of now: `events_maxlen` is lowered to 1, so each create's XADD MAXLEN ~
    removes whole nodes of older entries."""
    keys = Keys()
    sync_redis.hset(keys.tag(0) + ":settings", "events_maxlen", 1)
    ((newest, _),) = sync_redis.xrevrange(keys.events(0), "+", "-", count=1)
    for _ in range(5000):
        first = sync_redis.xrange(keys.events(0), "-", "+", count=1)
        if first and stream_id(first[0][0]) > stream_id(newest):
            return
        sync_store.run(sync_store.ops.create(new_task_id(), "other", b"{}", timeout_ms=60_000))
        take_in(sync_store)  # a task's first event is written as a daemon takes it in
    raise AssertionError("the events stream was never trimmed")


async def test_wait_rereads_the_task_when_the_stream_was_trimmed_past_it(
    api: Api, sync_store: SyncStore, sync_redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = await api.submit("h", {}, **BASE)
    fired: list[bool] = []

    def cancel_then_trim(reads: Reads) -> None:
        # After the snapshot: the task is canceled, and its event trimmed away before the
        # client reads the stream; what it then reads is only other tasks' events.
        if not fired and reads.cmds[0][0] == "xrevrange":
            fired.append(True)
            assert sync_store.run(sync_store.ops.cancel(t.id)).code is Code.ACCEPTED
            take_in(sync_store)
            trim_events_past(sync_redis, sync_store)

    api.hook_reads(monkeypatch, cancel_then_trim)
    started = time.monotonic()
    assert (await api.wait(t.id, 60)).status is S.CANCELED
    assert fired
    assert time.monotonic() - started < 30  # the re-read found it, not the 60 s timeout


async def test_watch_reports_the_state_a_trimmed_stream_lost(
    api: Api, sync_store: SyncStore, sync_redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = await api.submit("h", {}, **BASE)
    leases: list[Lease] = []

    def claim_then_trim(reads: Reads) -> None:
        if not leases and reads.cmds[0][0] == "xrevrange":
            batch = sync_store.run(sync_store.ops.claim(0, "submit", 1, 30_000, "w1", 10))
            leases.append(batch.claimed[0].lease)
            trim_events_past(sync_redis, sync_store)

    api.hook_reads(monkeypatch, claim_then_trim)
    events: list[TaskEvent] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(api.collect, t.id, events)
        await until(lambda: len(events) == 2, "the state whose event was trimmed")
        assert sync_store.run(sync_store.ops.save(leases[0], S.FAILED)).ok
    assert [e.status for e in events] == [S.PENDING_SUBMIT, S.SUBMITTING, S.FAILED]
    assert [e.version for e in events] == sorted({e.version for e in events})


async def test_watch_rereads_the_task_after_a_reconnect(
    api: Api, sync_store: SyncStore, sync_redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = await api.submit("h", {}, **BASE)
    leases: list[Lease] = []

    def outage(reads: Reads) -> bool:
        if reads.cmds[0][0] != "xread":
            return False
        if not leases:
            # While the client is away the task changes, and the stream loses that entry
            # (deleted here; the stream's older entries, the client's position, remain).
            batch = sync_store.run(sync_store.ops.claim(0, "submit", 1, 30_000, "w1", 10))
            leases.append(batch.claimed[0].lease)
            ((newest, _),) = sync_redis.xrevrange(Keys().events(0), "+", "-", count=1)
            assert sync_redis.xdel(Keys().events(0), newest) == 1
            return True
        return False

    api.fail_reads(monkeypatch, outage)
    events: list[TaskEvent] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(api.collect, t.id, events)
        await until(lambda: len(events) == 2, "the state seen on reconnecting")
        assert sync_store.run(sync_store.ops.save(leases[0], S.FAILED)).ok
    assert [e.status for e in events] == [S.PENDING_SUBMIT, S.SUBMITTING, S.FAILED]


# list(), stats(), handlers().


async def test_list_pages_through_every_task_and_filters(make_api: Callable[..., Api]) -> None:
    api = make_api(shards=2)
    made = {}
    for i in range(17):
        handler, tenant = ("a", "t1") if i < 12 else ("b", "t2")
        made[(await api.submit(handler, {"i": i}, tenant=tenant, **BASE)).id] = (handler, tenant)
    await api.take_in()

    async def walk(**kwargs: Any) -> list[Task]:
        out: list[Task] = []
        cursor = None
        for _ in range(50):
            page = await api.list(cursor=cursor, **kwargs)
            assert len(page.tasks) <= kwargs.get("limit", 100)
            out += page.tasks
            if (cursor := page.cursor) is None:
                return out
        raise AssertionError("list() never finished")

    everything = await walk(limit=5)
    assert sorted(t.id for t in everything) == sorted(made)
    for shard in (0, 1):  # newest first; ids break ties within a millisecond
        order = [(t.created_at, t.id) for t in everything if t.shard == shard]
        assert order == sorted(order, reverse=True)
    assert {t.id for t in await walk(handler="b", limit=2)} == {
        k for k, v in made.items() if v[0] == "b"
    }
    assert len(await walk(handler="a", tenant="t1", status="PENDING_SUBMIT")) == 12
    assert await walk(handler="a", tenant="t2") == []
    assert await api.list(status=S.CANCELED) == TaskPage([], None)
    page = await api.list(limit=5)
    with pytest.raises(InvalidTask, match="cursor"):
        await api.list(status=S.CANCELED, cursor=page.cursor)
    with pytest.raises(InvalidTask, match="cursor"):
        await api.list(cursor="garbage")
    with pytest.raises(InvalidTask, match="limit"):
        await api.list(limit=0)
    with pytest.raises(InvalidTask, match="not a status"):
        await api.list(status="DONE")


async def test_list_filters_by_account_and_by_when_tasks_entered_their_status(
    api: Api, redis_client: redis.asyncio.Redis
) -> None:
    made = [await api.submit("h", {"i": i}, account=f"acc{i % 2}", **BASE) for i in range(6)]
    await api.take_in()
    index = Keys().index(0, S.PENDING_SUBMIT)
    start = 1_700_000_000  # entered their status 1 s apart, task i at start + i
    await redis_client.zadd(index, {t.id: (start + i) * 1000 for i, t in enumerate(made)})

    async def walk(**kwargs: Any) -> list[str]:
        out, cursor = [], None
        for _ in range(20):
            page = await api.list(limit=1, cursor=cursor, **kwargs)
            out += [t.id for t in page.tasks]
            if (cursor := page.cursor) is None:
                return out
        raise AssertionError("list() never finished")

    ids = [t.id for t in made]
    assert await walk(since=start + 1, until=start + 3) == ids[3:0:-1]  # bounds included
    aware = dt.datetime.fromtimestamp(start + 4, dt.UTC)
    assert await walk(since=aware) == ids[:3:-1]
    assert await walk(until=start + 0.5) == ids[:1]
    assert await walk(account="acc1") == ids[5::-2]
    assert await walk(account="acc0", since=start + 2) == [ids[4], ids[2]]
    assert await walk(account="nobody") == []
    # A cursor is bound to its time range and account too.
    page = await api.list(limit=1, account="acc0", since=start + 2)
    for other in ({"account": "acc0"}, {"account": "acc1", "since": start + 2},
                  {"account": "acc0", "since": start + 2, "until": start + 9}):  # fmt: skip
        with pytest.raises(InvalidTask, match=r"made by list\(\) with other filters"):
            await api.list(limit=1, cursor=page.cursor, **other)
    for bad, message in (
        ({"since": start + 2, "until": start + 1}, "since must not be after until"),
        ({"since": "yesterday"}, "since must be an aware datetime or epoch seconds"),
        ({"until": dt.datetime(2030, 1, 1)}, "until must be timezone-aware"),
        ({"since": start * 1000}, r"since must be epoch seconds \(not milliseconds\)"),
        ({"until": float("nan")}, "until must be epoch seconds"),
        ({"account": "no spaces"}, "account must be 1-64 characters"),
        ({"tenant": 7}, "tenant must be 1-64 characters"),
    ):
        with pytest.raises(InvalidTask, match=message):
            await api.list(**bad)


async def test_list_pages_over_equal_scores_and_bounds_its_work(api: Api, store: Store) -> None:
    for i in range(130):
        await api.submit("h", {"i": i}, **BASE)
    claimed = await claim(store, n=130)  # one script: every index entry has the same score
    seen: list[str] = []
    cursor = None
    while True:
        page = await api.list(status=S.SUBMITTING, limit=30, cursor=cursor)
        seen += [t.id for t in page.tasks]
        if (cursor := page.cursor) is None:
            break
    assert sorted(seen) == sorted(lease.task_id for lease in claimed)
    assert len(seen) == len(set(seen))
    calls = 0
    cursor = None
    while True:
        calls += 1
        page = await api.list(handler="nobody", limit=1, cursor=cursor)
        assert page.tasks == []
        if (cursor := page.cursor) is None:
            break
    assert calls >= 130 // 20  # each call looked at no more than 20 * limit tasks


async def test_a_list_cursor_tells_nothing_about_other_tenants_tasks(
    api: Api, redis_client: redis.asyncio.Redis
) -> None:
    mine = await api.submit("h", {}, tenant="t2", **BASE)
    others = [await api.submit("h", {"i": i}, tenant="t1", **BASE) for i in range(25)]
    await api.take_in()
    # Newest first: the walk meets t1's tasks before t2's, and its budget (20 entries per
    # task asked for) runs out on one of them.
    page = await api.list(tenant="t2", limit=1)
    assert page.tasks == []
    assert page.cursor is not None
    sealed = base64.urlsafe_b64decode(page.cursor + "=" * (-len(page.cursor) % 4))
    index = Keys().index(0, S.PENDING_SUBMIT)
    scores = [int(s) for _, s in await redis_client.zrange(index, 0, -1, withscores=True)]
    for t in others:
        assert t.id not in page.cursor
        assert t.id.encode() not in sealed
    for score in scores:
        assert str(score).encode() not in sealed
        assert score.to_bytes(8, "big") not in sealed
        assert struct.pack(">d", score) not in sealed
    page = await api.list(tenant="t2", limit=1, cursor=page.cursor)
    assert [t.id for t in page.tasks] == [mine.id]


async def test_a_list_cursor_is_stable_and_bound_to_its_filters(
    api: Api, redis_url: str, redis_client: redis.asyncio.Redis
) -> None:
    for i in range(5):
        await api.submit("a", {"i": i}, tenant="t1", **BASE)
    await api.take_in()
    first = await api.list(tenant="t1", limit=2)
    assert first.cursor is not None
    assert await api.list(tenant="t1", limit=2) == first  # the same page, the same cursor
    second = await api.list(tenant="t1", limit=2, cursor=first.cursor)
    assert await api.list(tenant="t1", limit=2, cursor=first.cursor) == second
    # any client of the namespace continues it, blocking or not
    async with AsyncClient.from_url(redis_url) as other:
        assert await other.list(tenant="t1", limit=2, cursor=first.cursor) == second
    with Client.from_url(redis_url) as blocking:
        assert blocking.list(tenant="t1", limit=2, cursor=first.cursor) == second
    assert {t.id for t in first.tasks} & {t.id for t in second.tasks} == set()
    for filters in (
        {"tenant": "t2"},
        {},
        {"tenant": "t1", "handler": "a"},
        {"tenant": "t1", "status": S.PENDING_SUBMIT},
    ):
        with pytest.raises(InvalidTask, match=r"made by list\(\) with other filters"):
            await api.list(limit=2, cursor=first.cursor, **filters)
    middle = len(first.cursor) // 2
    edited = first.cursor[:middle] + ("B" if first.cursor[middle] == "A" else "A")
    edited += first.cursor[middle + 1 :]
    with pytest.raises(InvalidTask, match="was not returned by list"):
        await api.list(tenant="t1", limit=2, cursor=edited)
    # A new cursor key (an operator deleted it): cursors made before are refused, saying so.
    await redis_client.delete(Keys().cursor_key())
    async with AsyncClient.from_url(redis_url) as fresh:
        with pytest.raises(InvalidTask, match="cursor key has changed"):
            await fresh.list(tenant="t1", limit=2, cursor=first.cursor)
        renewed = await fresh.list(tenant="t1", limit=2)
    assert renewed.tasks == first.tasks
    assert renewed.cursor != first.cursor
    # a client that read the key before it changed reads it again to open a newer cursor
    assert (await api.list(tenant="t1", limit=2, cursor=renewed.cursor)).tasks == second.tasks


async def test_stats_are_exact(api: Api, store: Store, redis_client: redis.asyncio.Redis) -> None:
    for _ in range(3):
        a = await api.submit("a", {}, **BASE)
    for _ in range(2):
        await api.submit("b", {}, priority=10, **BASE)  # claimed first
    await claim(store)
    await api.cancel(a.id)
    assert (await api.stats()).requests == 1  # the cancel, not taken in yet
    await api.take_in()
    now = time.time()
    await redis_client.hset("atd:daemons", mapping={
        "d1": msgspec.json.encode({"id": "d1", "heartbeat_at": now, "inflight": 3}),
        "d2": msgspec.json.encode({"id": "d2", "heartbeat_at": now - 60}),
        "d3": b"not json",
    })  # fmt: skip
    stats = await api.stats()
    assert stats.by_status == {
        **dict.fromkeys(Status, 0),
        S.PENDING_SUBMIT: 3,
        S.SUBMITTING: 1,
        S.CANCELED: 1,
    }
    assert stats.by_handler == {
        "a": {S.PENDING_SUBMIT: 2, S.CANCELED: 1},
        "b": {S.PENDING_SUBMIT: 1, S.SUBMITTING: 1},
    }
    assert stats.daemons == [{"id": "d1", "heartbeat_at": now, "inflight": 3}]
    assert stats.requests == 0


# Operator calls.


@pytest.mark.parametrize("target", [S.SUBMITTED, S.PENDING_SUBMIT, S.FAILED, S.CANCELED])
async def test_resolve_a_parked_task(api: Api, store: Store, target: Status) -> None:
    t = await api.submit("h", {}, **BASE)
    await park(store)
    if target is S.SUBMITTED:
        task = await api.resolve(t.id, target.value, external_id="job-9", query={"r": "eu"})
        assert task.external_id == "job-9"
    else:
        task = await api.resolve(t.id, target, message="checked at the vendor")
    assert task.status is target
    assert task == await api.get(t.id)
    if target.is_terminal:
        assert task.error == TaskError(f"RESOLVED_{target.value}", "checked at the vendor")
    elif target.phase is not None:  # due again at once, in the right phase
        assert (await claim(store, target.phase))[0].task_id == t.id


async def test_resolve_refusals(api: Api, store: Store) -> None:
    t = await api.submit("h", {}, **BASE)
    await api.take_in()
    with pytest.raises(
        IllegalTransition, match="is PENDING_SUBMIT: it cannot be resolved as FAILED"
    ):
        await api.resolve(t.id, S.FAILED)
    with pytest.raises(InvalidTask, match="needs the vendor's external_id"):
        await api.resolve(t.id, S.SUBMITTED)
    with pytest.raises(InvalidTask, match="can be resolved as"):
        await api.resolve(t.id, "RUNNING")
    with pytest.raises(InvalidTask, match="only used when resolving as SUBMITTED"):
        await api.resolve(t.id, S.FAILED, external_id="x")
    with pytest.raises(TaskNotFound):
        await api.resolve(new_task_id(), S.CANCELED)
    assert (await api.get(t.id)).version == t.version


async def test_requeue_failed_and_timed_out_tasks_only(api: Api, store: Store) -> None:
    failed = await api.submit("h", {"n": 1}, **BASE)
    await fail_submit(store)
    task = await api.requeue(failed.id)
    assert (task.status, task.error, task.params) == (S.PENDING_SUBMIT, None, {"n": 1})
    with pytest.raises(IllegalTransition, match="is PENDING_SUBMIT"):
        await api.requeue(failed.id)
    assert (await claim(store))[0].task_id == failed.id

    late = await api.submit("h", {}, tracking_timeout=0.001, strict=False)

    async def timed_out() -> bool:
        await store.time_out(0, 100)
        return (await api.get(late.id)).status is S.TRACKING_TIMED_OUT

    await wait_until(timed_out, "the deadline to pass")
    assert (await api.requeue(late.id)).status is S.PENDING_SUBMIT

    parked = await api.submit("h", {}, priority=50, **BASE)
    await park(store)
    with pytest.raises(IllegalTransition, match="SUBMIT_UNKNOWN"):
        await api.requeue(parked.id)
    assert (await api.get(parked.id)).status is S.SUBMIT_UNKNOWN
    with pytest.raises(TaskNotFound):
        await api.requeue(new_task_id())


@pytest.mark.parametrize("kind", ["path", "file"])
async def test_purge_archives_then_deletes_finished_tasks(
    api: Api, redis_client: redis.asyncio.Redis, tmp_path: Path, kind: str
) -> None:
    keep = await api.submit("h", {}, **BASE)
    done = [await api.submit("h", {"i": i}, tenant="t1", **BASE) for i in range(3)]
    finished_ms = 0
    for t in done:
        assert await api.cancel(t.id)
        await api.take_in()
        finished_ms = max(finished_ms, int((await api.get(t.id)).finished_at * 1000))
    assert await api.purge(3600) == 0
    await wait_until(
        lambda: _after(redis_client, finished_ms + 2), "the server clock to pass the finish time"
    )
    target: Any = tmp_path / "archive.jsonl" if kind == "path" else io.StringIO()
    assert await api.purge(0, archive=target) == 3
    text = target.read_text() if kind == "path" else target.getvalue()
    archived = [msgspec.json.decode(line, type=Task) for line in text.splitlines()]
    assert sorted(t.id for t in archived) == sorted(t.id for t in done)
    assert {(t.status, t.tenant) for t in archived} == {(S.CANCELED, "t1")}
    for t in done:
        assert await api.get(t.id) is None
    assert await api.get(keep.id) is not None
    assert (await api.stats()).by_status[S.CANCELED] == 0
    assert await api.purge(0, archive=target) == 0
    with pytest.raises(InvalidTask, match="older_than"):
        await api.purge(-1)


async def _after(r: redis.asyncio.Redis, ms: int) -> bool:
    return await server_ms(r) > ms


# Construction and import hygiene.


async def test_clients_close_only_what_they_opened(
    redis_url: str, redis_client: redis.asyncio.Redis, sync_redis: Any
) -> None:
    async with AsyncClient.from_url(redis_url) as a:
        t = await a.submit("h", {}, **BASE)
    with Client.from_url(redis_url) as c:
        assert c.get(t.id) == t
    async with AsyncClient(redis_client) as a:
        assert await a.get(t.id) == t
    with Client(sync_redis) as c:
        assert c.cancel(t.id)
    assert await redis_client.ping()
    assert sync_redis.ping()


def test_client_imports_no_daemon_code() -> None:
    code = (
        "import asynctaskd.client, sys; assert not any(m in sys.modules for m in "
        "('httpx', 'prometheus_client', 'asynctaskd.worker'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class _ReplyDroppingProxy:
    """A TCP proxy in front of the real server that, once, lets a create through and
    closes the connection instead of passing its reply back: a lost reply."""

    def __init__(self, target: str, marker: bytes) -> None:
        parts = urllib.parse.urlsplit(target)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self._marker = marker
        self.dropped = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self._target)
                armed = threading.Event()
                threading.Thread(
                    target=self._up, args=(client, upstream, armed), daemon=True
                ).start()
                threading.Thread(
                    target=self._down, args=(upstream, client, armed), daemon=True
                ).start()

    def _up(self, client: socket.socket, upstream: socket.socket, armed: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if self._marker in data and not self.dropped.is_set():
                    armed.set()
                upstream.sendall(data)

    def _down(self, upstream: socket.socket, client: socket.socket, armed: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                if armed.is_set() and not self.dropped.is_set():
                    self.dropped.set()  # the create ran; its reply never arrives
                    client.close()
                    upstream.close()
                    return
                client.sendall(data)

    def close(self) -> None:
        self._listener.close()


def test_a_create_whose_reply_was_lost_and_resent_by_redis_py_makes_one_task(
    redis_url: str, sync_redis: Any
) -> None:
    """A Client on the caller's own redis.Redis inherits its retries: a lost reply to
    create is sent again. The resend is answered as the first create was, not refused."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from asynctaskd.scripts import load_scripts

    create_sha = load_scripts()["create"].sha
    sync_redis.script_load(load_scripts()["create"].source)
    proxy = _ReplyDroppingProxy(redis_url, create_sha.encode())
    conn = SyncRedis.from_url(proxy.url, retry=Retry(NoBackoff(), 3))
    try:
        with Client(conn) as client:
            task = client.submit("h", {"n": 1}, tracking_timeout=60, dedup_key="d", strict=False)
        assert proxy.dropped.is_set(), "the proxy never dropped a reply: nothing was tested"
        assert sync_redis.llen(Keys().intake(0)) == 1  # one request, not two
        stored = Client(sync_redis).get(task.id)
        assert stored is not None and stored.params == {"n": 1}
    finally:
        conn.close()
        proxy.close()


async def test_aclose_gives_back_the_connection_lone_calls_keep(
    redis_url: str, sync_redis: SyncRedis
) -> None:
    """A client passed in stays open, but the connection its lone calls kept out of the
    pool goes back: the whole pool can be taken after; one the client opened itself
    leaves no connection open, its lone calls' lane included."""
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        redis_url,
        max_connections=4,
        protocol=3,
        socket_timeout=2,  # RESP3: no lane
    )
    passed_in = AsyncClient(redis.asyncio.Redis(connection_pool=pool))
    for _ in range(3):
        assert (await passed_in.submit("h", {}, tracking_timeout=60, strict=False)).id
    await passed_in.aclose()
    taken = [await asyncio.wait_for(pool.get_connection(), 2) for _ in range(4)]
    for connection in taken:
        await pool.release(connection)
    await pool.disconnect()

    def ours() -> int:
        listed = sync_redis.execute_command("CLIENT", "LIST")
        return listed.count(b"name=aclose-test ")

    owned = AsyncClient.from_url(redis_url + "?client_name=aclose-test")
    for _ in range(3):
        assert (await owned.submit("h", {}, tracking_timeout=60, strict=False)).id
    assert ours() >= 1
    await owned.aclose()

    async def none_left() -> bool:
        return ours() == 0

    await wait_until(none_left, "the client's connections to close")
