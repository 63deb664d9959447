"""asynctaskd.connection.lane against the path it stands in for (`wire.exchange` on a
redis-py pool): the same replies, error replies as the same exception classes, the same
exceptions on a closed connection, a timeout, a wrong password; and the store sends its
lone calls on it only where it may."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio
import redis.exceptions as rex
from redis._parsers.base import BaseParser  # the test reads redis-py's own table

from asynctaskd import wire
from asynctaskd.connection import open_async
from asynctaskd.connection.lane import Lane, Lanes, lane_settings, lanes_for
from asynctaskd.errors import StoreUnavailable
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.store import Store

from .conftest import wait_until
from .lua.helpers import create
from .servers import start_server


def _pool(url: str, **options: Any) -> redis.asyncio.BlockingConnectionPool:
    options = {"max_connections": 4, "protocol": 2, "socket_timeout": 0.5, **options}
    return redis.asyncio.BlockingConnectionPool.from_url(url, **options)


@pytest.fixture
async def pool(redis_url: str) -> AsyncIterator[redis.asyncio.BlockingConnectionPool]:
    made = _pool(redis_url)
    try:
        yield made
    finally:
        await made.disconnect()


def _lane(pool: Any) -> Lane:
    settings = lane_settings(pool)
    assert settings is not None
    return Lane(settings)


def _same(ours: Any, theirs: Any) -> None:
    """The same reply, an exception as the same class with the same text and code."""
    if isinstance(theirs, BaseException):
        assert type(ours) is type(theirs), (ours, theirs)
        assert str(ours) == str(theirs)
        assert getattr(ours, "status_code", None) == getattr(theirs, "status_code", None)
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, type(theirs)) and len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            _same(a, b)
    else:
        assert type(ours) is type(theirs) and ours == theirs, (ours, theirs)


def _error_texts() -> list[str]:
    """An error reply for each code redis-py knows (and each special ERR text), a few it
    does not."""
    texts = ["ERR plain", "WHATEVER no code redis-py knows", "BUSY script running"]
    for code, cls in BaseParser.EXCEPTION_CLASSES.items():
        if isinstance(cls, dict):
            texts += [f"{code} {text}" for text in cls]
        elif code in ("MOVED", "ASK"):
            texts.append(f"{code} 3999 127.0.0.1:6381")  # (other text: redis-py fails)
        else:
            texts.append(f"{code} some text")
    return texts


async def test_replies_and_error_replies_are_those_of_the_pool_path(pool: Any) -> None:
    await wire.exchange(pool, wire.pack(("RPUSH", "list", "a")), 1)
    big = b"x" * (3 * 1024 * 1024 + 7)
    commands: list[tuple[Any, ...]] = [
        ("SET", "big", big),
        ("GET", "big"),
        ("GET", "missing"),  # nil
        ("STRLEN", "big"),
        ("EVAL", "return {1, {2, {'three', false}}, redis.error_reply('WRONGTYPE in')}", 0),
        ("EVAL", "return {}", 0),
        ("EVAL", "return redis.status_reply('FINE')", 0),
        ("EVALSHA", "0" * 40, 0),  # NOSCRIPT
        ("GET", "list"),  # WRONGTYPE
        ("NOSUCHCOMMAND",),
        ("INCR", "big"),  # ERR not an integer
    ]
    commands += [("EVAL", "return redis.error_reply(ARGV[1])", 0, t) for t in _error_texts()]
    lane = _lane(pool)
    try:
        for command in commands:
            payload = wire.pack(command)
            try:  # a reply, or what reading it raised
                [theirs] = await wire.exchange(pool, payload, 1)
            except rex.RedisError as exc:
                theirs = ("raised", exc)
            try:
                ours = await lane.call(payload)
            except rex.RedisError as exc:
                ours = ("raised", exc)
            _same(ours, theirs)
        # the error classes the store tells apart are among them
        [noscript] = await wire.exchange(pool, wire.pack(("EVALSHA", "0" * 40, 0)), 1)
        assert isinstance(await lane.call(wire.pack(("EVALSHA", "0" * 40, 0))), type(noscript))
        assert isinstance(noscript, rex.NoScriptError)
    finally:
        lane.close()


async def test_a_batch_gets_the_replies_of_the_pool_path_in_order(pool: Any) -> None:
    """A batch (`call` with a count), as the store sends a pipeline: replies (error
    replies as values) in the order of the commands, a big one split over many reads
    among them, the same as `wire.exchange` gets; then the lane goes on with lone calls
    and batches of one."""
    commands: list[tuple[Any, ...]] = [
        ("SET", "big", b"y" * (2 * 1024 * 1024 + 3)),
        ("GET", "big"),
        ("GET", "missing"),
        ("EVALSHA", "0" * 40, 0),  # NOSCRIPT
        ("EVAL", "return {1, {2, {'three', false}}, redis.error_reply('WRONGTYPE in')}", 0),
        ("INCR", "big"),  # ERR not an integer
        ("EVAL", "return redis.error_reply(ARGV[1])", 0, "MOVED 3999 127.0.0.1:6381"),
        ("ECHO", "last"),
    ]
    payload = b"".join(wire.pack(c) for c in commands)
    theirs = await wire.exchange(pool, payload, len(commands))
    lane = _lane(pool)
    try:
        ours = await lane.call(payload, count=len(commands))
        _same(ours, theirs)
        assert await lane.call(wire.pack(("ECHO", "lone"))) == b"lone"
        assert await lane.call(wire.pack(("ECHO", "one")), count=1) == [b"one"]
        many = await lane.call(b"".join(wire.pack(("INCR", "n")) for _ in range(500)), count=500)
        assert many == list(range(1, 501))
        with pytest.raises(ValueError, match="at least one"):
            await lane.call(b"", count=0)  # (nothing would ever answer it)
    finally:
        lane.close()


async def test_a_batch_cut_short_closes_the_lane_and_the_next_opens_a_new_one(
    pool: Any,
) -> None:
    lane = _lane(pool)
    try:
        # a batch whose last reply takes longer than the socket timeout (0.5 s)
        payload = wire.pack(("ECHO", "a")) + wire.pack(("BLPOP", "nothing", 2))
        with pytest.raises(rex.TimeoutError):
            await lane.call(payload, count=2)
        # ...unless the call allows for the last command's own wait
        assert await lane.call(payload, last_wait=2.5, count=2) == [b"a", None]
        assert await lane.call(wire.pack(("ECHO", "b")) * 2, count=2) == [b"b", b"b"]
    finally:
        lane.close()


def _until(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    """`check` as the async predicate `wait_until` polls."""

    async def holds() -> bool:
        return check()

    return holds


async def test_more_replies_than_asked_for_fail_the_call_or_close_the_lane(pool: Any) -> None:
    """Out of step (a reply nobody asked for): the call fails at once if the extra reply
    came with its own (it used to wait forever), else the lane closes when it comes; the
    next call opens a new connection either way."""
    lane = _lane(pool)
    try:
        two = wire.pack(("ECHO", "a")) + wire.pack(("ECHO", "b"))
        got: Any
        try:
            got = await asyncio.wait_for(lane.call(two), 5)
        except rex.InvalidResponse as exc:
            got = exc
        if isinstance(got, rex.InvalidResponse):
            assert "nobody asked for" in str(got)
        else:
            assert got == b"a"
            closed = _until(lambda: lane._protocol is None or lane._protocol.lost)
            await wait_until(closed, "the lane closed by the extra reply")
        assert await lane.call(wire.pack(("ECHO", "c")) * 2, count=2) == [b"c", b"c"]
    finally:
        lane.close()


async def test_lanes_hand_out_an_idle_lane_up_to_their_limit(pool: Any) -> None:
    settings = lane_settings(pool)
    assert settings is not None
    lanes = Lanes(settings, 2)
    try:
        first = lanes.idle()
        assert first is not None and lanes.idle() is first  # idle: the same one again
        slow = asyncio.ensure_future(first.call(wire.pack(("BLPOP", "nothing", 0.3))))
        await wait_until(_until(lambda: first.busy), "the first lane in use")
        with pytest.raises(RuntimeError, match="in use"):  # one call at a time...
            await first.call(wire.pack(("ECHO", "x")))
        assert first.busy  # ...and refusing another leaves the first one's lane in use
        second = lanes.idle()
        assert second is not None and second is not first
        other = asyncio.ensure_future(second.call(wire.pack(("BLPOP", "nothing", 0.3))))
        await wait_until(_until(lambda: second.busy), "the second lane in use")
        assert lanes.idle() is None  # both in use: the caller takes the pool's path
        assert await slow is None and await other is None
        assert lanes.idle() is first
    finally:
        lanes.close()
    with pytest.raises(ValueError, match="at least one"):
        Lanes(settings, 0)


@pytest.mark.parametrize(("size", "limit"), [(1, 1), (4, 1), (16, 1), (32, 2), (64, 4), (1000, 4)])
def test_a_pool_gets_a_lane_per_sixteen_connections_one_to_four(
    redis_url: str, size: int, limit: int
) -> None:
    lanes = lanes_for(_pool(redis_url, max_connections=size))
    assert lanes is not None and lanes.limit == limit
    assert lanes_for(_pool(redis_url, protocol=3)) is None


async def test_the_store_sends_its_batches_on_lanes_while_the_pool_is_taken(
    keys: Keys,
) -> None:
    """Every pooled connection checked out (a blocking pool would make a pipeline wait):
    batches still go, on the lane (a pool of 16 has one); with one pooled connection
    free, two batches and a lone call at once take the lane, that connection and the
    held connection."""
    server = start_server("redis-server")
    client = open_async(server.url, socket_timeout=2, max_connections=16)
    taken: list[Any] = []
    store = Store(client, keys)
    try:
        await store.prepare()
        created = [await create(store) for _ in range(6)]
        pool = client.connection_pool
        taken = [await pool.get_connection() for _ in range(pool.max_connections)]
        results = await store.run_many([store.ops.cancel(c.task_id) for c in created[:2]])
        assert all(r is not None and not isinstance(r, Exception) for r in results)
        await pool.release(taken.pop())  # one for the call that finds both lanes in use
        assert store._lanes is not None and store._lanes.limit == 1
        both = await asyncio.gather(
            store.run_many([store.ops.cancel(created[2].task_id)]),
            store.run_many([store.ops.cancel(created[3].task_id)]),
            store.run(store.ops.cancel(created[4].task_id)),
        )
        assert all(r is not None for r in both)
    finally:
        for connection in taken:
            await client.connection_pool.release(connection)
        await store.close()
        await client.aclose()
        server.stop()


async def _blocked(client: redis.asyncio.Redis, name: str) -> None:
    async def blocked() -> bool:
        listed: bytes = await client.execute_command("CLIENT", "LIST")
        return any(b"name=" + name.encode() in line and b"cmd=blpop" in line
                   for line in listed.splitlines())  # fmt: skip

    await wait_until(blocked, f"{name} to block")


async def test_a_connection_killed_under_a_call_raises_what_the_pool_path_raises(
    redis_url: str, redis_client: redis.asyncio.Redis
) -> None:
    raised: list[BaseException] = []
    for name in ("pooled", "laned"):
        pool = _pool(redis_url, client_name=name)
        lane = _lane(pool)
        blpop = wire.pack(("BLPOP", "nothing", 5))
        if name == "pooled":
            call = asyncio.ensure_future(wire.exchange(pool, blpop, 1, last_wait=6))
        else:
            call = asyncio.ensure_future(lane.call(blpop, last_wait=6))
        await _blocked(redis_client, name)
        await redis_client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        with pytest.raises(rex.RedisError) as caught:
            await asyncio.wait_for(call, 3)
        raised.append(caught.value)
        # and the next call opens a new connection
        assert await lane.call(wire.pack(("ECHO", "next"))) == b"next"
        lane.close()
        await pool.disconnect()
    assert [type(e) for e in raised] == [rex.ConnectionError, rex.ConnectionError]
    assert str(raised[0]) == str(raised[1])


async def test_a_late_reply_times_out_as_on_the_pool_path_and_is_not_read_after(
    pool: Any,
) -> None:
    lane = _lane(pool)
    late = wire.pack(("WAIT", 1, 800))  # answers after 0.8 s; the socket timeout is 0.5 s
    with pytest.raises(rex.TimeoutError) as theirs:
        await wire.exchange(pool, late, 1)
    with pytest.raises(rex.TimeoutError) as ours:
        await lane.call(late)
    assert str(ours.value) == str(theirs.value)
    assert await lane.call(wire.pack(("ECHO", "next"))) == b"next"  # not WAIT's 0
    assert await lane.call(late, last_wait=2.0) == 0  # the call's own wait is allowed
    # after a call that was allowed a long wait, the next one still has only its own
    assert await lane.call(wire.pack(("ECHO", "long")), last_wait=5.0) == b"long"
    with pytest.raises(rex.TimeoutError):
        await asyncio.wait_for(lane.call(late), 2)
    lane.close()


async def test_a_cancelled_call_closes_the_lane(pool: Any) -> None:
    lane = _lane(pool)
    assert await lane.call(wire.pack(("ECHO", "open"))) == b"open"
    call = asyncio.ensure_future(lane.call(wire.pack(("BLPOP", "nothing", 1)), last_wait=2))
    await asyncio.sleep(0)  # one step: on an open lane the call writes and waits in it
    assert lane.busy
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert not lane.busy
    assert await lane.call(wire.pack(("ECHO", "after"))) == b"after"  # BLPOP's nil is gone
    lane.close()


def test_only_plain_resp2_pools_get_a_lane(redis_url: str) -> None:
    assert lane_settings(open_async(redis_url).connection_pool) is not None
    assert lane_settings(open_async("unix:///tmp/redis.sock?db=2").connection_pool) is not None
    for url in (
        redis_url + "?protocol=3",
        "rediss://127.0.0.1:1/0",
        "redis+sentinel://127.0.0.1:1/mymaster",
    ):
        assert lane_settings(open_async(url).connection_pool) is None, url
    decoded = redis.asyncio.Redis.from_url(redis_url, decode_responses=True, protocol=2)
    assert lane_settings(decoded.connection_pool) is None


@pytest.fixture
def password_server() -> Any:
    server = start_server("redis-server", None, "--requirepass", "s3cret")
    try:
        yield server
    finally:
        server.stop()


async def test_the_handshake_takes_the_pools_password_db_and_name(password_server: Any) -> None:
    url = f"redis://:s3cret@127.0.0.1:{password_server.port}/3?client_name=lane-test"
    pool = _pool(url)
    lane = _lane(pool)
    try:
        await lane.call(wire.pack(("SET", "k", "laned")))
        [got] = await wire.exchange(pool, wire.pack(("GET", "k")), 1)  # db 3 on both
        assert got == b"laned"
        assert await lane.call(wire.pack(("CLIENT", "GETNAME"))) == b"lane-test"
        assert await lane.call(wire.pack(("EVAL", "return redis.call('GET', 'k')", 0))) == got
    finally:
        lane.close()
        await pool.disconnect()


def _client_info(listed: bytes) -> dict[str, str]:
    """CLIENT LIST's (or CLIENT INFO's) fields of one connection."""
    return dict(field.split("=", 1) for field in listed.decode().split() if "=" in field)


@pytest.mark.parametrize("options", [{}, {"driver_info": None}], ids=["default", "no-info"])
async def test_the_lane_tells_the_server_what_the_pools_connections_do(
    redis_url: str, options: dict[str, Any]
) -> None:
    """CLIENT SETINFO: the library name and version redis-py sends (or nothing, where the
    pool sends nothing); a server without SETINFO (Redis 7.0) shows neither on either."""
    pool = _pool(redis_url, **options)
    lane = _lane(pool)
    try:
        [theirs] = await wire.exchange(pool, wire.pack(("CLIENT", "INFO")), 1)
        ours = await lane.call(wire.pack(("CLIENT", "INFO")))
        pooled, laned = _client_info(theirs), _client_info(ours)
        assert laned["id"] != pooled["id"]  # two connections...
        for field in ("lib-name", "lib-ver"):  # ...that say the same of themselves
            assert laned.get(field) == pooled.get(field)
        if "lib-name" in pooled and not options:  # the server has SETINFO (7.2 and on)
            assert pooled["lib-name"] == "redis-py" and pooled["lib-ver"] == redis.__version__
    finally:
        lane.close()
        await pool.disconnect()


async def _error(call: Any) -> BaseException:
    """The error a call raised, or the one it answered (a refused AUTH raises, a command
    without it answers NOAUTH)."""
    try:
        reply = await call
    except rex.RedisError as exc:
        return exc
    reply = reply[0] if isinstance(reply, list) else reply
    assert isinstance(reply, rex.RedisError), reply
    return reply


@pytest.mark.parametrize("password", ["wrong", None])
async def test_a_refused_password_raises_what_the_pool_path_raises(
    password_server: Any, password: str | None
) -> None:
    auth = "" if password is None else f":{password}@"
    pool = _pool(f"redis://{auth}127.0.0.1:{password_server.port}/0")
    lane = _lane(pool)
    try:
        theirs = await _error(wire.exchange(pool, wire.pack(("ECHO", "x")), 1))
        ours = await _error(lane.call(wire.pack(("ECHO", "x"))))
        assert type(ours) is type(theirs)
        assert isinstance(ours, rex.AuthenticationError)
    finally:
        lane.close()
        await pool.disconnect()


async def test_a_dead_server_is_unavailable_to_the_store_on_both_paths(keys: Keys) -> None:
    server = start_server("redis-server")
    port = server.port
    server.stop()
    for url in (f"redis://127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0?protocol=3"):
        client = open_async(url, socket_timeout=0.5)
        store = Store(client, keys)
        with pytest.raises(StoreUnavailable, match="ConnectionError"):
            await store.run(store.ops.cancel(new_task_id()))
        await store.close()
        await client.aclose()


async def test_the_store_sends_lone_calls_on_the_lane_and_survives_a_restart(
    keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = start_server("redis-server")
    client = open_async(server.url, socket_timeout=2)
    try:
        store = Store(client, keys)
        await store.prepare()
        gets: list[int] = []
        real = client.connection_pool.get_connection

        async def counted(*args: Any, **kwargs: Any) -> Any:
            gets.append(1)
            return await real(*args, **kwargs)

        monkeypatch.setattr(client.connection_pool, "get_connection", counted)
        first = await create(store)
        assert gets == []  # the lane, not the pool
        # A restart between two calls, the loop not running meanwhile: the next call finds
        # the connection closed before it writes (and the server's script cache empty).
        server.restart()
        second = await create(store)
        assert second.task_id != first.task_id
        assert await store.run(store.ops.cancel(second.task_id)) is not None
    finally:
        await store.close()
        await client.aclose()
        server.stop()


async def test_a_lone_call_and_a_pipeline_at_once(store: Store) -> None:
    created = [await create(store) for _ in range(4)]
    lone = [store.run(store.ops.cancel(c.task_id)) for c in created[:2]]  # one waits: busy
    piped = store.run_many([store.ops.cancel(c.task_id) for c in created[2:]])
    results = await asyncio.gather(*lone, piped)
    assert len(results) == 3
    assert all(r is not None for r in results)


def test_the_lane_on_uvloop(redis_url: str, sync_redis: Any) -> None:
    """What the daemon and the producers run on where it is installed."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        pool = _pool(redis_url, client_name="uvloop-lane")
        lane = _lane(pool)
        try:
            assert await lane.call(wire.pack(("ECHO", "a"))) == b"a"
            sync_redis.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            assert await lane.call(wire.pack(("ECHO", "b"))) == b"b"  # found closed, reopened
            with pytest.raises(rex.TimeoutError):
                await lane.call(wire.pack(("WAIT", 1, 800)))
            noscript = await lane.call(wire.pack(("EVALSHA", "0" * 40, 0)))
            assert type(noscript) is rex.NoScriptError
        finally:
            lane.close()
            await pool.disconnect()

    uvloop.run(scenario())


def test_the_lane_follows_its_caller_to_another_event_loop(redis_url: str) -> None:
    """A client used from one `asyncio.run` after another: the lane of a closed loop is
    left behind (its socket closes when collected), a new one opened."""
    lane = Lane(lane_settings(_pool(redis_url)))  # type: ignore[arg-type]  # not None here

    async def call(text: str) -> Any:
        return await lane.call(wire.pack(("ECHO", text)))

    async def close_after(text: str) -> Any:
        try:
            return await call(text)
        finally:
            lane.close()

    assert asyncio.run(call("one")) == b"one"
    assert asyncio.run(close_after("two")) == b"two"


async def test_the_lane_works_on_a_descriptor_past_what_select_takes(store: Store) -> None:
    """A daemon or web process holds more than 1,024 sockets (select's limit): the lane's
    check that its connection is still open must take any descriptor."""
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        await store.close()  # the next lone call opens the lane on a descriptor > 1024
        created = await create(store)
        assert await store.run(store.ops.cancel(created.task_id)) is not None
        assert store._lanes is not None
        lane = store._lanes.idle()
        assert lane is not None and lane._protocol is not None
        fd = lane._protocol.transport.get_extra_info("socket").fileno()
        assert fd > 1024
    finally:
        for fd in spare:
            os.close(fd)
