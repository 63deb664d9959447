"""Regression tests for bugs found while building the chaos suite, as small in-process tests.

All of them are fixed (8720864; docs/reliability.md section 6): a vendor handle dropped
by a drain, a refused submit parked after a Redis blink, uvloop's closed-transport
RuntimeError unmapped by the store, a failed lease release killing the worker, and a
must-land save that could never land holding SIGTERM; and, found by the cluster run,
CLUSTERDOWN/MOVED/... replies taken for script errors and redis-py's AttributeError on a
connection its cluster client closed. Each test fails if its bug returns.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import redis.asyncio
from redis import Redis as SyncRedis
from redis.asyncio.connection import AbstractConnection

from asynctaskd.codec import encode_json
from asynctaskd.config import parse_config
from asynctaskd.connection.lane import Lane
from asynctaskd.embedded import ServerProcess, find_binary, free_port
from asynctaskd.errors import StoreUnavailable
from asynctaskd.handlers import HandlerContext, HandlerEntry, Submitted, Succeeded
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.store import Code, Store, SyncStore
from asynctaskd.store.failures import _mapped
from asynctaskd.worker import Worker
from tests.conftest import wait_until
from tests.lua.helpers import ingest

pytestmark = pytest.mark.anyio


class Gated:
    """submit() waits until the test opens the gate, then returns a handle."""

    key = "demo"
    idempotent_submit = False

    def __init__(self) -> None:
        self.gate = anyio.Event()
        self.inside = anyio.Event()

    async def submit(self, params: Any, ctx: HandlerContext) -> Submitted:
        self.inside.set()
        await self.gate.wait()
        return Submitted("job-" + ctx.task_id)

    async def query(self, handle: dict[str, Any], ctx: HandlerContext) -> Succeeded:
        return Succeeded({"ok": True})


async def park_started_submit(store: Store, r: redis.asyncio.Redis, keys: Keys, tid: str) -> None:
    """Expire the holder's lease and reap at once: SUBMIT_UNKNOWN, started fence kept."""

    async def parked() -> bool:
        # the holder's renewal may extend the lease again between our two calls: retry
        await r.zadd(keys.leases(0), {tid: 1}, xx=True)
        await store.reap(0, 100, 5)
        return (await r.hget(keys.task(0, tid), "status")) == b"SUBMIT_UNKNOWN"

    await wait_until(parked, "the task to be parked", 2)


class Outage:
    """The worker's saves fail (Redis away) until `until` (monotonic seconds)."""

    def __init__(self) -> None:
        self.until = 0.0
        self.refused = anyio.Event()  # set at the first save refused


def saves_fail_until(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> Outage:
    outage = Outage()
    real_call = worker.batcher.call

    async def flaky(call: Any, *, gated: bool = False) -> Any:
        if call.script == "save" and time.monotonic() < outage.until:
            outage.refused.set()
            raise StoreUnavailable("save: Redis is unavailable (injected)")
        return await real_call(call, gated=gated)

    monkeypatch.setattr(worker.batcher, "call", flaky)
    return outage


async def test_a_vendor_handle_is_saved_even_when_the_daemon_drains(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    tid = new_task_id()
    await store.run(store.ops.create(tid, "demo", encode_json({}), timeout_ms=60_000))
    handler = Gated()
    config = parse_config("[worker]\nlease = 2\nshutdown_grace = 0.3\nsave_retry_for = 30\n")
    async with httpx.AsyncClient() as http:
        entries = {"demo": HandlerEntry(key="demo", handler=handler, provider="demo")}
        worker = Worker(store, entries, config, http=http)
        away = saves_fail_until(worker, monkeypatch)
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            with anyio.fail_after(5):
                await handler.inside.wait()
            away.until = time.monotonic() + 1.5  # Redis is away for 1.5 s from now
            handler.gate.set()  # the vendor returns the job id
            with anyio.fail_after(5):
                await away.refused.wait()  # the handle's save is retrying now
            worker.stop()  # SIGTERM: grace 0.3 s, while the handle's save retries
            tg.cancel_scope.deadline = anyio.current_time() + 10
    task = await store.get(tid)
    assert task is not None
    assert task.status is Status.SUBMITTED and task.external_id == "job-" + tid, task


async def test_drain_is_not_held_by_a_late_save_that_can_never_land(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """The other side of the fix of the test above: must-land saves outlive the drain now.

    One that can never land must still give up: the parked task was canceled (or resolved)
    meanwhile, so save.lua answers NO_LEASE forever (the fence did not change). Retrying it
    until save_retry_for (300 s by default) would hold SIGTERM past systemd's
    TimeoutStopSec (45 s); NO_LEASE on a save is final since the fix.
    """
    tid = new_task_id()
    await store.run(store.ops.create(tid, "demo", encode_json({}), timeout_ms=60_000))
    handler = Gated()
    config = parse_config(
        "[worker]\nlease = 1\nshutdown_grace = 0.5\nsave_retry_for = 8\n"
        "[retry]\npoll_interval = 0.05\n"
    )
    async with httpx.AsyncClient() as http:
        entries = {"demo": HandlerEntry(key="demo", handler=handler, provider="demo")}
        worker = Worker(store, entries, config, http=http)
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            with anyio.fail_after(5):
                await handler.inside.wait()
            # The holder looks dead to the reaper (SIGSTOP, a Redis pause) and the task
            # parks; an operator (or the producer) then cancels the parked task.
            await park_started_submit(store, redis_client, keys, tid)
            assert (await store.cancel(tid)).code is Code.ACCEPTED
            await ingest(store)
            handler.gate.set()  # the vendor answers: the late save can never land now
            refused = worker.metrics.rejected_writes.labels("save", "no_lease")
            await wait_until(_true(lambda: refused._value.get() >= 1), "the refused save", 5)
            started = time.monotonic()
            worker.stop()
            with anyio.fail_after(20):
                await wait_until(lambda: _idle(worker), "the drain", timeout=15)
            drained_in = time.monotonic() - started
    task = await store.get(tid)
    assert task is not None and task.status is Status.CANCELED
    assert drained_in < 3.0, f"SIGTERM took {drained_in:.1f}s to drain one call"


def _true(check: Any) -> Any:
    async def predicate() -> bool:
        return bool(check())

    return predicate


async def _idle(worker: Worker) -> bool:
    return worker.inflight == 0


async def test_a_refused_submit_is_not_parked_when_redis_blinks(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asynctaskd.errors import RetryableError

    tid = new_task_id()
    await store.run(store.ops.create(tid, "demo", encode_json({}), timeout_ms=60_000))

    class Throttled(Gated):
        async def submit(self, params: Any, ctx: HandlerContext) -> Submitted:
            raise RetryableError("429", throttled=True, retry_after=0.05)

    config = parse_config("[worker]\nlease = 1\nshutdown_grace = 0.5\n")
    async with httpx.AsyncClient() as http:
        entries = {"demo": HandlerEntry(key="demo", handler=Throttled(), provider="demo")}
        worker = Worker(store, entries, config, http=http)
        away = saves_fail_until(worker, monkeypatch)
        away.until = time.monotonic() + 60  # Redis is away when the outcome is saved...
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            await wait_until(lambda: _attempted(redis_client, keys, tid), "a submit", 5)
            away.until = time.monotonic() + 3  # ... for 3 s, longer than the 1 s lease

            async def settled() -> bool:
                await store.reap(0, 100, 5)  # the reaper of any daemon
                status = await redis_client.hget(keys.task(0, tid), "status")
                return status != b"SUBMITTING"  # the outcome landed, or the task was parked

            await wait_until(settled, "the refusal saved or the task parked", 10)
            worker.stop(now=True)
            tg.cancel_scope.deadline = anyio.current_time() + 5
    task = await store.get(tid)
    assert task is not None
    assert task.status is not Status.SUBMIT_UNKNOWN, task.error


async def _attempted(r: redis.asyncio.Redis, keys: Keys, tid: str) -> bool:
    return (await r.hget(keys.task(0, tid), "submit_attempts")) is not None


UVLOOP_CLOSED = (
    "unable to perform operation on <TCPTransport closed=True reading=False 0x55a2fe6eea30>; "
    "the handler is closed"
)


def break_script(store: Store, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """Make every write carrying `script` fail the way uvloop does when Redis restarts under
    a connection that redis-py is reconnecting (seen in the CI chaos run, daemon exit 1)."""
    sha = store.scripts[script].sha.encode()
    real = AbstractConnection.send_packed_command

    async def send(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        packed = command if isinstance(command, bytes) else b"".join(command)
        if sha in packed:
            raise RuntimeError(UVLOOP_CLOSED)
        await real(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", send)
    # Calls and batches (`call` with a count) go out on the store's lanes, not redis-py
    # connections: their writes fail so.
    real_call = Lane.call

    async def call(self: Lane, payload: bytes, last_wait: float = 0.0, **kw: Any) -> Any:
        if sha in payload:
            raise RuntimeError(UVLOOP_CLOSED)
        return await real_call(self, payload, last_wait, **kw)

    monkeypatch.setattr(Lane, "call", call)


async def test_a_closed_transport_is_store_unavailable(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    break_script(store, monkeypatch, "claim")
    with pytest.raises(StoreUnavailable):
        await store.claim(0, "submit", 1, 1000, "w")


async def test_a_failed_release_does_not_kill_the_worker(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    tid = new_task_id()
    await store.run(store.ops.create(tid, "demo", encode_json({}), timeout_ms=60_000))

    # A submit whose start failed gives its lease back by `withdraw` (its start may have
    # run); a query call cut off, by `release`. Both break here.
    break_script(store, monkeypatch, "release")
    break_script(store, monkeypatch, "withdraw")
    config = parse_config("[worker]\nlease = 1\nshutdown_grace = 0.5\nsave_retry_for = 1\n")
    async with httpx.AsyncClient() as http:
        entries = {"demo": HandlerEntry(key="demo", handler=Gated(), provider="demo")}
        worker = Worker(store, entries, config, http=http)
        real_call = worker.batcher.call

        async def start_fails(call: Any, *, gated: bool = False) -> Any:
            # As logged: "Redis unavailable while handling the task", then the lease given
            # back in the call's cleanup.
            if call.script == "start":
                raise StoreUnavailable("pipeline: Redis is unavailable (injected)")
            return await real_call(call, gated=gated)

        monkeypatch.setattr(worker.batcher, "call", start_fails)
        with anyio.fail_after(10):
            await worker.run_until_idle()  # raised an ExceptionGroup(RuntimeError) before
    # The start never ran, so the task was never sent: it waits, leased or due again, for
    # the next claim (the lease could not be given back, so the reaper frees it).
    task = await store.get(tid)
    assert task is not None and task.submit_attempts == 0
    assert task.status in (Status.SUBMITTING, Status.PENDING_SUBMIT), task.status


# --- Found by the cluster chaos run (a master kill -9 + restart on a 3-master cluster) ---
#
# A restarted master answers CLUSTERDOWN for its first ~2 s. redis-py strips the code off
# the reply (ClusterDownError("The cluster is down")), so the store's text match missed it
# and called it a ScriptError: producers' submits were refused, and a daemon gave up the
# save of a vendor handle ("saving SUBMITTED failed"; the task was parked in SUBMIT_UNKNOWN
# although its job existed). And redis-py's async cluster client, on CLUSTERDOWN, closes
# every connection of every node, those other tasks are writing on included: their write
# raised AttributeError ('NoneType' object has no attribute 'writelines'), which the store
# did not map, and the daemon exited 1.

NOT_NOW_REPLIES = [
    "CLUSTERDOWN The cluster is down",
    "CLUSTERDOWN Hash slot not served",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "TRYAGAIN Multiple keys request during rehashing of slot",
    "MOVED 3999 127.0.0.1:6381",
    "ASK 3999 127.0.0.1:6381",
    "READONLY You can't write against a read only replica.",
]


@pytest.mark.parametrize("reply", NOT_NOW_REPLIES)
def test_a_not_now_reply_is_store_unavailable_not_a_script_error(reply: str) -> None:
    from redis._parsers import _RESP2Parser

    exc = _RESP2Parser(socket_read_size=65536).parse_error(reply)  # as redis-py raises it
    assert reply.split()[0] not in str(exc)  # the code is gone from the text
    with pytest.raises(StoreUnavailable), _mapped("claim"):
        raise exc


def test_a_cluster_node_serving_no_slot_is_store_unavailable(tmp_path: Path) -> None:
    binary = find_binary("redis-server") or find_binary("valkey-server")
    if binary is None:
        pytest.skip("no redis-server or valkey-server")
    # An explicit bus port: the default (port + 10,000) is out of range for a free port
    # above 55535, and the server refuses to start.
    bus = ("--cluster-port", str(free_port()))
    args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", *bus)
    with ServerProcess(binary, data_dir=tmp_path, extra_args=args) as node:
        client = SyncRedis(port=node.port)
        try:
            store = SyncStore(client, Keys())
            with pytest.raises(StoreUnavailable, match="ClusterDownError"):
                store.get(new_task_id())  # CLUSTERDOWN Hash slot not served
        finally:
            client.close()


async def test_a_connection_closed_under_a_write_is_store_unavailable() -> None:
    conn = redis.asyncio.Connection()  # never connected: _writer is None, as after a close
    with pytest.raises(StoreUnavailable, match="connection closed"), _mapped("claim"):
        await conn._send_packed_command([b"PING\r\n"])


def test_our_own_attribute_error_is_not_swallowed() -> None:
    with pytest.raises(AttributeError), _mapped("claim"):
        None.missing  # type: ignore[attr-defined]  # noqa: B018 - the point of the test
