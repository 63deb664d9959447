"""The store's pipeline: many script calls (and a trailer) in one round trip, on a real server.

The single-node path writes RESP itself on a pooled connection; these tests pin what it
must keep from redis-py's pipeline: replies in order with errors in place, arguments
encoded the same way, NOSCRIPT recovered, and a connection that fails mid-batch never
handed out again.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis.asyncio

from asynctaskd.errors import ScriptError, StoreUnavailable
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.store import Batcher, Code, Created, Gate, Lease, Result, Store, open_redis
from asynctaskd.store.ops import Ops

from .conftest import wait_until
from .lua.helpers import claim_one, create, ingest, submitted


async def _status(store: Store, task_id: str) -> Status | None:
    task = await store.get(task_id)
    return None if task is None else task.status


async def _blocked_in(client: redis.asyncio.Redis, command: str) -> bool:
    clients = await client.client_list()
    return any(c.get("cmd") == command for c in clients)


async def test_replies_come_back_in_order_with_an_error_in_its_place(
    store: Store, redis_client: redis.asyncio.Redis
) -> None:
    first, second = await create(store), await create(store)
    broken = new_task_id()
    await redis_client.set(store.ops._task(broken)[1], "not a hash")
    calls = [store.ops.cancel(first.task_id), store.ops.cancel(broken)]
    calls.append(store.ops.cancel(second.task_id))
    results, rerun, trailers = await store.pipeline(calls, ("ECHO", "after"))
    assert isinstance(results[0], Result) and results[0].code is Code.ACCEPTED
    assert isinstance(results[1], ScriptError) and "WRONGTYPE" in str(results[1])
    assert isinstance(results[2], Result) and results[2].code is Code.ACCEPTED
    await ingest(store)
    assert [await _status(store, c.task_id) for c in (first, second)] == [Status.CANCELED] * 2
    assert rerun == [False, False, False]
    assert trailers == [b"after"] * 3


async def test_a_master_that_refuses_writes_without_replicas_is_unavailable(
    store: Store, redis_client: redis.asyncio.Redis
) -> None:
    # A master set to take no writes without a replica (min-replicas-to-write: what bounds
    # the writes an old master cut off from its replicas takes in a failover) answers
    # NOREPLICAS, from inside the script: not now, not a broken script. Taken for a
    # ScriptError, it ended the call, and the save of a vendor handle was given up.
    created = await create(store)
    await redis_client.config_set("min-replicas-to-write", 1)
    try:
        with pytest.raises(StoreUnavailable, match="NOREPLICAS"):
            await store.run(store.ops.cancel(created.task_id))
        results, _, _ = await store.pipeline([store.ops.cancel(created.task_id)])
        assert isinstance(results[0], StoreUnavailable)
    finally:
        await redis_client.config_set("min-replicas-to-write", 0)
    assert await _status(store, created.task_id) is Status.PENDING_SUBMIT


class _Int(int):
    pass


class _Text(str):
    __slots__ = ()


# What a caller may pass as an argument: hiredis packs the exact types, we pack the rest.
ARGUMENTS = [
    "plain", "ünïcödé ✓", "with\r\nCRLF and $3\r\n", "", b"\x00\xffbytes", 0, -17,
    2**63 - 1, 10**30, 0.25, -1e-300, 1e16, float("inf"), _Int(7), _Text("sub"),
]  # fmt: skip


@pytest.mark.parametrize("value", ARGUMENTS)
async def test_arguments_reach_redis_as_redis_py_would_send_them(
    store: Store, redis_client: redis.asyncio.Redis, value: object
) -> None:
    created = await create(store)
    _, _, trailers = await store.pipeline([store.ops.cancel(created.task_id)], ("ECHO", value))
    assert trailers[0] == await redis_client.echo(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [v for v in ARGUMENTS if v != ""])  # "": a save clears
async def test_script_arguments_reach_redis_as_redis_py_would_send_them(
    store: Store, redis_client: redis.asyncio.Redis, value: object
) -> None:
    """EVALSHA is packed by hiredis where it gives the same bytes, by us otherwise (int
    subclasses): either way, a saved field holds what redis-py would have sent."""
    await submitted(store)
    c = await claim_one(store, "query")
    fields: dict[str, Any] = {"message": value}
    results, _, _ = await store.pipeline([store.ops.save(c.lease, Status.RUNNING, fields=fields)])
    assert isinstance(results[0], Result) and results[0].ok, results
    stored = await redis_client.hget(store.ops._task(c.lease.task_id)[1], "message")
    assert stored == await redis_client.echo(value)  # type: ignore[arg-type]


async def test_an_argument_redis_cannot_take_fails_the_batch_before_anything_is_sent(
    store: Store, redis_client: redis.asyncio.Redis
) -> None:
    created = await create(store)
    with pytest.raises(StoreUnavailable, match="pass bytes, str, int or float"):
        await store.pipeline([store.ops.cancel(created.task_id)], ("ECHO", True))
    task = await store.get(created.task_id)
    assert task is not None and task.status is Status.PENDING_SUBMIT
    # the same for a script argument (hiredis refuses a bool; ours says why)
    cancel = store.ops.cancel(created.task_id)
    cancel.args.append(True)
    with pytest.raises(StoreUnavailable, match="cannot send a bool"):
        await store.pipeline([cancel])
    task = await store.get(created.task_id)
    assert task is not None and task.status is Status.PENDING_SUBMIT


async def test_a_flushed_script_cache_is_reloaded_and_the_call_run_again(
    store: Store, redis_client: redis.asyncio.Redis
) -> None:
    created = [await create(store) for _ in range(3)]
    await redis_client.script_flush()
    before = dict(store.round_trips)
    results, rerun, _ = await store.pipeline([store.ops.cancel(c.task_id) for c in created])
    assert rerun == [True, True, True]
    assert all(isinstance(r, Result) and r.code is Code.ACCEPTED for r in results)
    await ingest(store)
    for c in created:
        assert await _status(store, c.task_id) is Status.CANCELED
    # The script loaded once and the three calls sent again together: two round trips.
    assert store.round_trips["pipeline"] - before.get("pipeline", 0) == 2
    assert store.round_trips.get("cancel", 0) == before.get("cancel", 0)


async def test_a_connection_killed_mid_batch_is_unavailable_and_never_reused(
    store: Store, redis_client: redis.asyncio.Redis, redis_url: str
) -> None:
    created = await create(store)
    # WAIT for a replica that does not exist blocks for its timeout: time to kill it.
    batch = asyncio.create_task(
        store.pipeline([store.ops.cancel(created.task_id)], ("WAIT", 1, 30_000))
    )
    await wait_until(lambda: _blocked_in(redis_client, "wait"), "the pipeline blocked in WAIT")
    killer = redis.asyncio.Redis.from_url(redis_url)
    try:
        assert await killer.client_kill_filter(_type="normal", skipme=True) >= 1
    finally:
        await killer.aclose()
    with pytest.raises(StoreUnavailable):
        await batch
    # The cancel itself ran before the kill; the next batch gets a healthy connection.
    results, _, trailers = await store.pipeline(
        [store.ops.cancel(created.task_id)], ("ECHO", "fresh")
    )
    assert isinstance(results[0], Result) and trailers == [b"fresh"]


class _ResettingProxy:
    """A TCP proxy in front of the real server that can reset its clients' connections
    (RST, as a peer's crash or a middlebox does), which `CLIENT KILL`'s close cannot."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self._clients: list[asyncio.StreamWriter] = []
        self.url = ""

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.append(writer)
        upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        await asyncio.gather(
            self._pipe(reader, upstream_writer), self._pipe(upstream_reader, writer)
        )

    def reset_all(self) -> None:
        for writer in self._clients:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            server.close()
            for writer in self._clients:
                writer.transport.abort()


async def test_a_connection_reset_while_replies_are_awaited_is_unavailable(
    redis_client: redis.asyncio.Redis, redis_url: str, keys: Keys
) -> None:
    proxy = _ResettingProxy(redis_url)
    async with proxy.serving() as url:
        client = open_redis(url)
        try:
            store = Store(client, keys)
            await store.prepare()
            created = await create(store)
            batch = asyncio.create_task(
                store.pipeline([store.ops.cancel(created.task_id)], ("WAIT", 1, 30_000))
            )
            await wait_until(lambda: _blocked_in(redis_client, "wait"), "the batch in WAIT")
            proxy.reset_all()
            # The reset reaches the parser's read as ConnectionResetError: unavailable, like
            # any dropped connection, so that callers retry (a save that must land does).
            with pytest.raises(StoreUnavailable) as caught:
                await batch
            assert isinstance(caught.value.__cause__, ConnectionResetError)
            _, _, trailers = await store.pipeline(
                [store.ops.cancel(created.task_id)], ("ECHO", "fresh")
            )
            assert trailers == [b"fresh"]
        finally:
            await client.aclose()


async def test_replies_may_take_the_socket_timeout_plus_the_trailer_wait(
    redis_url: str, keys: Keys
) -> None:
    client = open_redis(redis_url, socket_timeout=0.2)
    try:
        store = Store(client, keys)
        await store.prepare()
        created = await create(store)
        # WAIT for a replica that does not exist answers 0 after its own timeout (0.4 s).
        wait = ("WAIT", 1, 400)
        _, _, trailers = await store.pipeline([store.ops.cancel(created.task_id)], wait, 2.0)
        assert trailers == [0]
        with pytest.raises(StoreUnavailable, match=r"no reply from Redis within 0\.2 s"):
            await store.pipeline([store.ops.cancel(created.task_id)], wait)
        _, _, trailers = await store.pipeline([store.ops.cancel(created.task_id)], ("ECHO", "next"))
        assert trailers == [b"next"]  # the timed-out connection was not handed out again
    finally:
        await client.aclose()


async def test_a_stopped_batcher_answers_its_waiting_callers(
    store: Store, redis_client: redis.asyncio.Redis
) -> None:
    created = await create(store)
    batcher = Batcher(store, Gate("WAIT", 0, 1, 30_000))
    runner = asyncio.create_task(batcher.run())
    caller = asyncio.create_task(batcher.call(store.ops.cancel(created.task_id), gated=True))
    await wait_until(lambda: _blocked_in(redis_client, "wait"), "the batch blocked in WAIT")
    runner.cancel()
    with pytest.raises(StoreUnavailable, match="stopped before Redis answered"):
        await caller
    with pytest.raises(asyncio.CancelledError):
        await runner


async def test_a_caller_that_stops_waiting_does_not_disturb_the_others(store: Store) -> None:
    made: list[Created] = [await create(store) for _ in range(3)]
    batcher = Batcher(store)
    runner = asyncio.create_task(batcher.run())
    try:
        callers = [asyncio.create_task(batcher.call(store.ops.cancel(c.task_id))) for c in made]
        callers[1].cancel()
        done = await asyncio.gather(callers[0], callers[2])
        assert [r.code for r, _ in done] == [Code.ACCEPTED, Code.ACCEPTED]
        assert callers[1].cancelled()
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner


async def test_claims_of_both_phases_go_in_one_round_trip_each_with_its_own_outcome(
    store: Store, redis_client: redis.asyncio.Redis
) -> None:
    created = [await create(store) for _ in range(3)]
    corrupt = await create(store)
    await redis_client.hset(store.ops._task(corrupt.task_id)[1], "created_ms", "soon")
    before = dict(store.round_trips)

    submit, query, refused = await store.claim_each(
        [
            store.ops.claim(0, "submit", 10, 30_000, "w", 1000),
            store.ops.claim(0, "query", 10, 30_000, "w", 1000),
            store.ops.claim(0, "query", -1, 30_000, "w", 1000),  # the script refuses n = -1
        ]
    )

    assert not isinstance(submit, Exception) and not isinstance(query, Exception)
    assert {c.task.id for c in submit.claimed} == {c.task_id for c in created}
    assert [bad.task_id for bad in submit.corrupt] == [corrupt.task_id]
    assert query.claimed == []
    assert isinstance(refused, ScriptError)
    # Quarantined, as claim() does.
    assert await redis_client.zrange(Keys().quarantine(0), 0, -1) == [corrupt.task_id.encode()]
    after = store.round_trips
    assert after["claim"] - before.get("claim", 0) == 1


async def test_a_gated_call_is_durable_only_when_the_gate_is_met(
    store: Store, redis_client: redis.asyncio.Redis
) -> None:
    """The worker starts a vendor submit only on `durable`: a gate that times out (no
    replica acknowledged) must say so, and one that asks for nothing passes."""
    has_waitaof = b"waitaof" in await redis_client.command_list()
    cases = [(Gate("WAIT", 0, 1, 30), False), (Gate("WAIT", 0, 0, 30), True)]
    if has_waitaof:
        cases += [(Gate("WAITAOF", 0, 1, 30), False), (Gate("WAITAOF", 0, 0, 30), True)]
    for gate, durable in cases:
        created = await create(store)
        batcher = Batcher(store, gate)
        runner = asyncio.create_task(batcher.run())
        try:
            result, ok = await batcher.call(store.ops.cancel(created.task_id), gated=True)
            assert result.code is Code.ACCEPTED
            assert ok is durable, gate
        finally:
            runner.cancel()
            with pytest.raises(asyncio.CancelledError):
                await runner


async def test_a_server_setting_is_read_or_none(store: Store) -> None:
    assert await store.server_setting("maxmemory-policy") == "noeviction"  # as started
    assert await store.server_setting("no-such-setting") is None


@pytest.mark.parametrize("shards", [1, 3])
def test_ops_name_each_shards_keys_as_keys_does(shards: int) -> None:
    # Ops formats each shard's prefixes once; the keys a call names are still Keys' own.
    keys = Keys("ns-1", shards=shards)
    ops = Ops(keys)
    for shard in range(shards):
        task_id = new_task_id() + (f"-{shard}" if shard else "")
        call = ops.save(Lease(task_id, 3, 7), Status.RUNNING, delay_ms=5,
                        fields={"poll_count": 2, "stage": "x"})  # fmt: skip
        assert call.keys == [keys.tag(shard) + ":", keys.task(shard, task_id)]
        assert call.args == [task_id, 3, 7, "RUNNING", 5, "poll_count", 2, "stage", "x"]
        assert ops.claim(shard, "query", 1, 1000, "w", 10).keys == [keys.tag(shard) + ":"]
    assert ops.save(Lease(new_task_id(), 1, 1), Status.RUNNING).args[3:] == ["RUNNING", 0]
    assert ops.reap(shards + 5, 1, 1).keys == [keys.tag(shards + 5) + ":"]
    with pytest.raises(ValueError, match="shard"):
        ops.save(Lease(new_task_id() + f"-{shards}", 1, 1), Status.RUNNING)


async def test_a_batcher_run_again_serves_its_callers_as_before(store: Store) -> None:
    # While run() runs, calls make their futures on its loop (no running-loop lookup);
    # stopped and run again, it serves callers just the same.
    made = [await create(store) for _ in range(2)]
    batcher = Batcher(store)
    for created in made:
        runner = asyncio.create_task(batcher.run())
        try:
            result, durable = await batcher.call(store.ops.cancel(created.task_id))
            assert (result.code, durable) == (Code.ACCEPTED, True)
        finally:
            runner.cancel()
            with pytest.raises(asyncio.CancelledError):
                await runner
    queued = asyncio.create_task(batcher.call(store.ops.cancel(made[0].task_id)))
    await asyncio.sleep(0)  # queued before run() starts: served once it does
    runner = asyncio.create_task(batcher.run())
    try:
        assert (await queued)[0].code in (Code.ACCEPTED, Code.TERMINAL)
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
