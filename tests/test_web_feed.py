"""The shared events-stream reader behind the event streams (asynctaskd/web/feed.py), over
real sockets: a real aiohttp server on a free loopback port, a private Redis behind it.

Where a test needs many changes of one task fast, it writes them as the scripts do: the
task hash and its events-stream entry in one MULTI (docs/protocol.md, sections 4 and 8).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import msgspec
import pytest
import redis.asyncio
from aiohttp import web
from prometheus_client import generate_latest

from asynctaskd.client import AsyncClient
from asynctaskd.embedded import ServerProcess
from asynctaskd.keys import Keys
from asynctaskd.store import Store, open_redis
from asynctaskd.web import WebSettings, make_app
from asynctaskd.web.common import _FEED, _METRICS
from asynctaskd.web.feed import Feed
from asynctaskd.web.metrics import WebMetrics
from asynctaskd.web.tokens import mint, tokens_key
from tests.conftest import wait_until
from tests.lua.helpers import ingest
from tests.test_web import event_frames

pytestmark = pytest.mark.anyio

API = "/api/v1"
KEYS = Keys("atd", 1)
STREAM = KEYS.events(0)


class Web(msgspec.Struct):
    url: str
    http: httpx.AsyncClient
    redis: redis.asyncio.Redis
    feed: Feed
    auth: dict[str, str]
    metrics: WebMetrics

    async def task(self) -> str:
        """A new task of tenant t1, taken in (PENDING_SUBMIT, version 1, one event)."""
        body = {"handler": "demo", "params": {}, "tracking_timeout": 600, "strict": False}
        r = await self.http.post(f"{API}/tasks", json=body, headers=self.auth)
        assert r.status_code == 201, r.text
        store = Store(self.redis, KEYS)
        await store.prepare()
        await ingest(store)
        return str(r.json()["id"])

    async def change(self, task_id: str, version: int, message: str = "") -> None:
        """One RUNNING change, as `save` writes it: the hash and its event together."""
        pipe = self.redis.pipeline(transaction=True)
        fields = {"status": "RUNNING", "version": version, "progress": version / 10_000}
        pipe.hset(KEYS.task(0, task_id), mapping={**fields, "message": message})
        pipe.xadd(STREAM, {"task": task_id, **fields, "message": message})
        await pipe.execute()

    async def xread_clients(self) -> int:
        """Connections of this Redis whose last command was an XREAD: the feed's readers."""
        clients = await self.redis.client_list()
        return sum(1 for c in clients if c.get("cmd") == "xread")


async def _serve(redis_client: redis.asyncio.Redis) -> AsyncIterator[Web]:
    settings = WebSettings(token_cache=0.05, keepalive=0.5)
    app = make_app(AsyncClient(redis_client, "atd"), settings)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    token, record = mint("producer", "t1")
    await redis_client.hset(tokens_key("atd"), record.id, msgspec.json.encode(record))
    try:
        async with httpx.AsyncClient(base_url=url, timeout=20) as http:
            auth = {"Authorization": f"Bearer {token}"}
            yield Web(url, http, redis_client, app[_FEED], auth, app[_METRICS])
    finally:
        await runner.cleanup()


@pytest.fixture
async def api(redis_client: redis.asyncio.Redis) -> AsyncIterator[Web]:
    async for served in _serve(redis_client):
        yield served


async def _events(
    api: Web, task_id: str, last: int | None = None, upto: int = 1_000_000
) -> AsyncIterator[dict[str, Any]]:
    """Each event of one stream as {"id", "event", "data"}, until it ends or `upto`."""
    async for frame in event_frames(api.http, task_id, api.auth, last, upto):
        yield frame


async def _cancel(api: Web, task_id: str) -> None:
    r = await api.http.post(f"{API}/tasks/{task_id}/cancel", headers=api.auth)
    assert r.status_code == 202, r.text
    store = Store(api.redis, KEYS)
    await store.prepare()
    await ingest(store)  # a daemon takes the cancel in: CANCELED, with its event


async def test_many_watchers_of_one_task_share_one_reader_and_all_end_when_it_settles(
    api: Web,
) -> None:
    task_id = await api.task()
    seen: list[list[str]] = [[] for _ in range(20)]
    opened = anyio.Event()

    async def follow(i: int) -> None:
        async for event in _events(api, task_id):
            seen[i].append(event["data"]["status"])
            if all(seen):
                opened.set()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(follow, i)
            await opened.wait()
            assert api.feed.watchers == 20 and api.feed.shards == [0]
            assert await api.xread_clients() == 1  # one reader, not one per watcher
            await _cancel(api, task_id)
        # Every stream ended by itself at the settled state (the task group returned).
    assert seen == [["PENDING_SUBMIT", "CANCELED"]] * 20
    await wait_until(lambda: _now(api.feed.shards == []), "the reader to stop")
    # A watcher of a task that has settled gets its state, and the stream ends.
    with anyio.fail_after(10):
        late = [e["data"]["status"] async for e in _events(api, task_id)]
    assert late == ["CANCELED"]


async def _now(value: bool) -> bool:
    return value


async def test_the_reader_stops_when_the_last_watcher_leaves(api: Web) -> None:
    first, second = await api.task(), await api.task()
    with anyio.fail_after(20):
        async with contextlib.aclosing(_events(api, first)) as a:
            await anext(a)
            async with contextlib.aclosing(_events(api, second)) as b:
                await anext(b)
                assert api.feed.watchers == 2 and await api.xread_clients() == 1
            # One left (its connection closed): the reader serves the other.
            await wait_until(lambda: _now(api.feed.watchers == 1), "one watcher to leave")
            assert api.feed.shards == [0]
            await api.change(first, 2)
            assert (await anext(a))["data"]["version"] == 2
    await wait_until(lambda: _now(api.feed.shards == []), "the reader to stop", timeout=10)
    await wait_until(lambda: _true_async(api), "its XREAD connection to go", timeout=10)


async def _true_async(api: Web) -> bool:
    return await api.xread_clients() == 0


async def test_resume_across_the_replay_live_switch_loses_and_repeats_nothing(api: Web) -> None:
    """Clients that follow live, drop the connection every few events and reconnect with
    Last-Event-ID while changes keep coming: each reconnect reads its snapshot, replays
    from the events stream, then switches to the shared feed, with changes landing in
    between. Every version of the task has an event, so a lost or repeated one shows."""
    task_id = await api.task()
    top, lag = 300, 2
    runs: list[list[int]] = [[] for _ in range(4)]
    progressed = asyncio.Event()

    async def write() -> None:
        for version in range(2, top + 1):
            # At most `lag` versions ahead of the slowest reader: the readers stay near
            # the head, so most writes land while some reader is reconnecting.
            while True:
                progressed.clear()  # before the check: a wake-up after it is not lost
                if min(got[-1] if got else 1 for got in runs) >= version - lag:
                    break
                await progressed.wait()
            await api.change(task_id, version)

    async def resume(got: list[int]) -> None:
        last = 1
        while last < top:
            async with contextlib.aclosing(_events(api, task_id, last=last, upto=3)) as events:
                async for event in events:
                    assert int(event["id"]) == event["data"]["version"]
                    got.append(last := int(event["id"]))
                    progressed.set()
                    if last == top:
                        break

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for got in runs:
                tg.start_soon(resume, got)
            tg.start_soon(write)
    for got in runs:
        assert got == list(range(2, top + 1))


async def test_a_stalled_watcher_is_dropped_without_holding_up_the_others(api: Web) -> None:
    api.feed.limit = 4  # events waiting per watcher before it is dropped
    task_id = await api.task()
    # A client that sends its request and never reads: a tiny receive buffer, and an
    # asyncio reader that stops reading once 1 KB waits.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = api.url.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    writer.write(
        f"GET {API}/tasks/{task_id}/events HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: {api.auth['Authorization']}\r\n\r\n".encode()
    )
    await wait_until(lambda: _now(api.feed.watchers == 1), "the stalled watcher to open")
    big = "x" * 16_384
    with anyio.fail_after(60):
        async with contextlib.aclosing(_events(api, task_id)) as healthy:
            assert (await anext(healthy))["data"]["version"] == 1
            version = 1
            while api.feed.dropped == 0:
                version += 1
                assert version < 2000, "the stalled watcher was never dropped"
                await api.change(task_id, version, big)
                # The healthy watcher gets each change, in order, while the other stalls.
                assert (await anext(healthy))["data"]["version"] == version
            assert api.feed.watchers == 1  # the healthy one, still served
            await api.change(task_id, version + 1)
            assert (await anext(healthy))["data"]["version"] == version + 1
        # The stalled client's connection was cut: it reconnects with Last-Event-ID.
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass
    writer.close()
    scraped = generate_latest(api.metrics.registry).decode()
    assert "\nasynctaskd_web_event_streams_dropped_total 1.0\n" in scraped


async def test_a_trimmed_stream_makes_the_watchers_re_read(api: Web) -> None:
    """The reader's position was trimmed away with a change after it: the watchers
    re-read their task (the capped-stream fallback) and show its state."""
    task_id, other = await api.task(), await api.task()
    with anyio.fail_after(20):
        async with contextlib.aclosing(_events(api, task_id)) as events:
            await anext(events)
            await api.redis.xtrim(STREAM, maxlen=0)
            # A change whose event was lost (trimmed before anyone read it).
            await api.redis.hset(KEYS.task(0, task_id), mapping={"status": "RUNNING",
                                 "version": 7, "progress": 0.5})  # fmt: skip
            await api.change(other, 2)  # wakes the reader; its position is gone
            event = await anext(events)
    assert (event["data"]["status"], event["data"]["version"]) == ("RUNNING", 7)
    assert event["data"]["progress"] == 0.5


@pytest.fixture
async def aof_api(aof_server: ServerProcess) -> AsyncIterator[tuple[Web, ServerProcess]]:
    client = open_redis(aof_server.url)
    try:
        async for served in _serve(client):
            yield served, aof_server
    finally:
        await client.aclose()


async def test_a_stream_survives_a_redis_restart(aof_api: tuple[Web, ServerProcess]) -> None:
    api, server = aof_api
    task_id = await api.task()
    with anyio.fail_after(60):
        async with contextlib.aclosing(_events(api, task_id)) as events:
            assert (await anext(events))["data"]["status"] == "PENDING_SUBMIT"
            await anyio.to_thread.run_sync(server.restart)  # SIGKILL, then the AOF
            # The same HTTP stream, after Redis came back: a change still arrives.
            await api.change(task_id, 2)
            event = await anext(events)
    assert (event["data"]["status"], event["data"]["version"]) == ("RUNNING", 2)


async def test_streams_end_when_redis_stays_away(
    aof_api: tuple[Web, ServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the reconnect budget the shard's streams end (their clients reconnect, and get
    503 while Redis is away) instead of hanging on with nothing to say."""
    monkeypatch.setattr("asynctaskd.web.feed.RECONNECT_BUDGET_S", 0.5)
    api, server = aof_api
    task_id = await api.task()
    with anyio.fail_after(30):
        async with contextlib.aclosing(_events(api, task_id)) as events:
            assert (await anext(events))["data"]["status"] == "PENDING_SUBMIT"
            await anyio.to_thread.run_sync(server.kill)
            rest = [e async for e in events]  # ends, though the task never settled
    assert rest == []
    await wait_until(lambda: _now(api.feed.shards == []), "the reader to stop")
    r = await api.http.get(f"{API}/tasks/{task_id}/events", headers=api.auth)
    assert r.status_code == 503
