"""asynctaskd.wire, the one module that relies on redis-py internals: the bets it makes
still hold on the installed redis-py, no other module makes one, and the batches it sends
get their replies in place on RESP2 and on RESP3 (push frames between replies included).
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import redis.asyncio
import redis.exceptions as rex

import asynctaskd
from asynctaskd import wire
from asynctaskd.connection import open_async
from asynctaskd.errors import StoreUnavailable
from asynctaskd.keys import Keys
from asynctaskd.store import Code, Store

from .conftest import wait_until
from .lua.helpers import create

PACKAGE = Path(asynctaskd.__file__).parent
REDIS_PACKAGE = Path(redis.__file__).parent


# ---- the bets still hold on the installed redis-py ----


def _instance(owner: str) -> Any:
    """A module, or an object of the named class made without any I/O."""
    module_name, _, name = owner.rpartition(".")
    try:
        return importlib.import_module(owner)
    except ModuleNotFoundError:
        pass
    cls = getattr(importlib.import_module(module_name), name)
    if cls is redis.asyncio.RedisCluster:
        return cls(host="127.0.0.1", port=1)  # connects only on first use
    return cls()


@pytest.mark.parametrize(
    ("owner", "name", "why"),
    wire.REDIS_PY_INTERNALS,
    ids=[f"{owner}.{name}" for owner, name, _ in wire.REDIS_PY_INTERNALS],
)
def test_the_installed_redis_py_still_has_what_wire_relies_on(
    owner: str, name: str, why: str
) -> None:
    found: Any = _instance(owner)
    if name != "(module)":
        for part in name.split("."):
            if not hasattr(found, part):
                pytest.fail(
                    f"redis-py {redis.__version__} has no {owner}.{name}, which "
                    f"asynctaskd/wire.py relies on ({why}): adapt wire.py to this release "
                    "before allowing it in pyproject.toml",
                    pytrace=False,
                )
            found = getattr(found, part)
    if name.endswith(("read_response", "initialize")):
        assert inspect.iscoroutinefunction(found), (
            f"redis-py {redis.__version__}: {owner}.{name} is no longer a coroutine function"
        )


def test_a_connection_closed_under_a_write_fails_inside_the_module_wire_names() -> None:
    conn = redis.asyncio.Connection()  # never connected: no writer, as after a close
    with pytest.raises(AttributeError) as caught:
        asyncio.run(conn._send_packed_command([b"PING\r\n"]))
    assert wire.closed_under_io(caught.value), (
        f"redis-py {redis.__version__} no longer fails a write on a closed connection "
        "inside redis.asyncio.connection: asynctaskd/wire.py's closed_under_io needs updating"
    )


# ---- no module but wire makes such a bet ----


def _private_names_of_redis_py() -> set[str]:
    """Every single-underscore name redis-py defines: functions, methods, attributes,
    module and class variables."""
    names: set[str] = set()
    for path in REDIS_PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _defined_in(tree: ast.Module) -> set[str]:
    """Names a module defines itself, so that its own privates are not mistaken."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            own.add(node.value)  # __slots__ entries
    return own


def _redis_py_bets(path: Path, private: set[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    imports_redis = any(
        (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "redis" for a in n.names))
        or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "redis")
        for n in ast.walk(tree)
    )
    listed = {name.split(".")[0] for _, name, _ in wire.REDIS_PY_INTERNALS if name[0] != "("}
    # Attributes that are not redis-py's own undocumented names in every module (the
    # listed ones named `protocol`, `socket_timeout` and `health_check_interval` are also
    # constructor arguments, read back as such elsewhere).
    listed -= {"protocol", "socket_timeout", "health_check_interval"}
    own = _defined_in(tree)

    def private_of_redis_py(node: ast.Attribute) -> bool:
        if node.attr in listed:
            return True
        mine = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        return imports_redis and node.attr in private and node.attr not in own and not mine

    found = []
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("redis"):
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in [*(node.module or "").split("."), *names]):
                found.append(f"{where}: imports {node.module}: {names}")
        elif isinstance(node, ast.Import):
            found += [
                f"{where}: imports {a.name}"
                for a in node.names
                if a.name.startswith("redis") and "._" in a.name
            ]
        elif isinstance(node, ast.Attribute) and private_of_redis_py(node):
            found.append(f"{where}: .{node.attr}")
    return found


def test_no_module_but_wire_uses_redis_py_internals() -> None:
    private = _private_names_of_redis_py()
    assert "_parser" in private  # the scan sees what wire.py relies on
    bets = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "wire.py":
            bets += _redis_py_bets(path, private)
    assert not bets, "redis-py internals outside asynctaskd/wire.py:\n" + "\n".join(bets)


def test_the_scan_finds_a_bet_where_there_is_one(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import redis.asyncio\n"
        "async def f(pool: redis.asyncio.ConnectionPool) -> None:\n"
        "    connection = await pool.get_connection()\n"
        "    await connection._parser.read_response()\n"
        "    connection.next_health_check = 0\n"
    )
    bets = _redis_py_bets(sample, _private_names_of_redis_py())
    assert sorted(b.split(": ", 1)[1] for b in bets) == ["._parser", ".next_health_check"]


# ---- batches on RESP2 and RESP3 ----


async def _resp_of(client: redis.asyncio.Redis) -> str:
    info = await client.execute_command("CLIENT", "INFO")
    fields = dict(f.split("=", 1) for f in info.decode().split() if "=" in f)
    return fields["resp"]


async def test_our_clients_speak_resp2_whatever_redis_py_defaults_to(redis_url: str) -> None:
    client = open_async(redis_url)
    try:
        assert await _resp_of(client) == "2"
    finally:
        await client.aclose()
    # a URL that asks for RESP3 gets it (and the store then reads through redis-py)
    client = open_async(redis_url + "?protocol=3")
    try:
        assert await _resp_of(client) == "3"
    finally:
        await client.aclose()


def test_sentinel_and_cluster_clients_ask_for_resp2_too() -> None:
    sentinel = open_async("redis+sentinel://127.0.0.1:1/mymaster")
    assert sentinel.connection_pool.connection_kwargs["protocol"] == 2
    cluster: Any = open_async("redis+cluster://127.0.0.1:1")
    assert cluster.nodes_manager.connection_kwargs["protocol"] == 2


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
async def one_connection(
    request: pytest.FixtureRequest, redis_url: str
) -> AsyncIterator[redis.asyncio.Redis]:
    """A client of one connection (so every batch uses the connection set up before it),
    on RESP2 or RESP3, as a producer might build and pass in."""
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        redis_url, max_connections=1, protocol=request.param, socket_timeout=0.2
    )
    client = redis.asyncio.Redis(connection_pool=pool)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()
        await pool.disconnect()


async def test_replies_come_back_in_place_with_errors_as_values(
    one_connection: redis.asyncio.Redis,
) -> None:
    commands = [("SET", "k", "v"), ("EVALSHA", "0" * 40, 0), ("INCR", "k"), ("GET", "k")]
    payload = b"".join(wire.pack(c) for c in commands)
    replies = await wire.exchange(one_connection.connection_pool, payload, len(commands))
    assert replies[0] in (b"OK", True)
    assert isinstance(replies[1], rex.NoScriptError)
    assert isinstance(replies[2], rex.ResponseError) and "not an integer" in str(replies[2])
    assert replies[3] == b"v"
    assert await one_connection.get("k") == b"v"  # the connection was handed back clean


async def test_the_last_command_may_wait_longer_and_a_timeout_drops_the_connection(
    one_connection: redis.asyncio.Redis,
) -> None:
    pool = one_connection.connection_pool
    # WAIT for a replica that does not exist answers 0 after its own timeout (0.4 s),
    # longer than the socket timeout (0.2 s).
    payload = wire.pack(("ECHO", "first")) + wire.pack(("WAIT", 1, 400))
    assert await wire.exchange(pool, payload, 2, last_wait=2.0) == [b"first", 0]
    with pytest.raises(rex.TimeoutError):
        await wire.exchange(pool, payload, 2)
    # the late WAIT reply died with its connection: the next batch reads its own
    assert await wire.exchange(pool, wire.pack(("ECHO", "next")), 1) == [b"next"]


async def _push_follows_a_write(host: str, port: int) -> bytes:
    """What a RESP3 connection with broadcast tracking receives after a SET: the reply,
    then an invalidation push frame (">...")."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for command in (("HELLO", 3), ("CLIENT", "TRACKING", "ON", "BCAST"), ("SET", "a", "b")):
            writer.write(wire.pack(command))
        await writer.drain()
        data = b""
        while b"invalidate" not in data:
            data += await asyncio.wait_for(reader.read(4096), 5)
        return data
    finally:
        writer.close()


async def test_a_batch_reads_its_replies_past_push_frames(
    redis_url: str, keys: Keys, one_connection: redis.asyncio.Redis
) -> None:
    """With broadcast tracking on RESP3 every write sends the writer an invalidation push
    frame, so the replies of a batch of script calls arrive with push frames between
    them; none is taken for a reply. (On RESP2 the server drops them: a RESP2 connection
    gets invalidations only while subscribed, which a pooled connection never is.)"""
    parts = urlsplit(redis_url)
    raw = await _push_follows_a_write(parts.hostname or "127.0.0.1", parts.port or 6379)
    assert raw.index(b"+OK\r\n>") > 0  # the setup does put push frames between replies
    store = Store(one_connection, keys)
    await store.prepare()
    await one_connection.execute_command("CLIENT", "TRACKING", "ON", "BCAST")
    created = [await create(store) for _ in range(5)]  # pushes follow each reply
    results = await store.run_many([store.ops.cancel(c.task_id) for c in created])
    assert [r.code for r in results] == [Code.ACCEPTED] * 5
    again = await store.run_many([store.ops.cancel(c.task_id) for c in created])
    assert [r.code for r in again] == [Code.ACCEPTED] * 5
    assert await one_connection.ping()


async def test_a_timed_out_batch_is_unavailable_to_the_store(
    one_connection: redis.asyncio.Redis, keys: Keys
) -> None:
    store = Store(one_connection, keys)
    await store.prepare()
    created = await create(store)
    with pytest.raises(StoreUnavailable, match="Redis is unavailable"):
        await store.pipeline([store.ops.cancel(created.task_id)], ("WAIT", 1, 400))


# ---- the connection lone calls keep out of the pool (`Held`) ----


@pytest.fixture
async def held_pool(redis_url: str) -> AsyncIterator[redis.asyncio.BlockingConnectionPool]:
    """A pool of HOLD_MIN_POOL connections (the smallest a `Held` keeps one of)."""
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        redis_url, max_connections=wire.HOLD_MIN_POOL, protocol=2, socket_timeout=0.5
    )
    try:
        yield pool
    finally:
        await pool.disconnect()


def _counting_gets(pool: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the pool's get_connection calls."""
    gets: list[int] = []
    real = pool.get_connection

    async def counted(*args: Any, **kwargs: Any) -> Any:
        gets.append(1)
        return await real(*args, **kwargs)

    monkeypatch.setattr(pool, "get_connection", counted)
    return gets


async def test_lone_calls_take_one_connection_from_the_pool_and_keep_it(
    held_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = wire.Held(held_pool)
    gets = _counting_gets(held_pool, monkeypatch)
    for i in range(10):
        assert await held.exchange(wire.pack(("ECHO", i)), 1) == [b"%d" % i]
    assert len(gets) == 1
    # Given back on close: every connection of the pool can be taken again.
    await held.close()
    taken = [await asyncio.wait_for(held_pool.get_connection(), 2) for _ in range(4)]
    for connection in taken:
        await held_pool.release(connection)


async def test_a_small_pool_keeps_no_connection_aside(
    one_connection: redis.asyncio.Redis, keys: Keys
) -> None:
    """A pool of one: a lone call and then a pipeline on it must both get the connection."""
    store = Store(one_connection, keys)
    await store.prepare()
    created = await create(store)
    replies = await asyncio.wait_for(store.run_many([store.ops.cancel(created.task_id)]), 2)
    assert [r.code for r in replies] == [Code.ACCEPTED]


async def test_a_lone_call_and_others_at_once_each_get_their_reply(held_pool: Any) -> None:
    held = wire.Held(held_pool)
    # The first waits on the held connection (BLPOP), the others meanwhile take the pool's.
    first = asyncio.ensure_future(held.exchange(wire.pack(("BLPOP", "l", 2)), 1, last_wait=3))
    await asyncio.sleep(0)  # let it take the held connection
    others = await asyncio.gather(
        held.exchange(wire.pack(("ECHO", "a")), 1),
        wire.exchange(held_pool, wire.pack(("RPUSH", "l", "x")) + wire.pack(("ECHO", "b")), 2),
    )
    assert others == [[b"a"], [1, b"b"]]
    assert await first == [[b"l", b"x"]]
    await held.close()


async def test_a_connection_killed_while_held_and_idle_is_replaced(
    held_pool: Any, redis_client: redis.asyncio.Redis
) -> None:
    held = wire.Held(held_pool)
    [first_id] = await held.exchange(wire.pack(("CLIENT", "ID")), 1)
    await redis_client.execute_command("CLIENT", "KILL", "ID", first_id)
    # the pool's readiness check notices, as it would for a connection it hands out
    [second_id] = await held.exchange(wire.pack(("CLIENT", "ID")), 1)
    assert second_id != first_id
    await held.close()


async def test_a_connection_killed_under_a_lone_call_fails_it_and_is_dropped(
    held_pool: Any, redis_client: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = wire.Held(held_pool)
    [victim] = await held.exchange(wire.pack(("CLIENT", "ID")), 1)
    call = asyncio.ensure_future(held.exchange(wire.pack(("BLPOP", "l", 5)), 1, last_wait=6))
    await _blocked(redis_client, victim)
    await redis_client.execute_command("CLIENT", "KILL", "ID", victim)
    with pytest.raises(rex.ConnectionError):
        await call
    gets = _counting_gets(held_pool, monkeypatch)
    assert await held.exchange(wire.pack(("ECHO", "next")), 1) == [b"next"]
    assert len(gets) == 1  # a fresh one, taken from the pool
    await held.close()


async def test_a_lone_call_that_times_out_drops_the_held_connection(
    held_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = wire.Held(held_pool)
    assert await held.exchange(wire.pack(("ECHO", "first")), 1) == [b"first"]
    with pytest.raises(rex.TimeoutError):  # WAIT answers after 0.8 s, the timeout is 0.5 s
        await held.exchange(wire.pack(("WAIT", 1, 800)), 1)
    gets = _counting_gets(held_pool, monkeypatch)
    # the late WAIT reply died with its connection: the next call reads its own
    assert await held.exchange(wire.pack(("ECHO", "next")), 1) == [b"next"]
    assert len(gets) == 1
    await held.close()


async def _blocked(client: redis.asyncio.Redis, client_id: int) -> None:
    async def blocked() -> bool:
        listed = await client.execute_command("CLIENT", "LIST", "ID", client_id)
        return b"cmd=blpop" in listed

    await wait_until(blocked, "the lone call to block")


async def test_closing_under_a_lone_call_fails_it_and_gives_the_connection_back(
    held_pool: Any, redis_client: redis.asyncio.Redis
) -> None:
    held = wire.Held(held_pool)
    [held_id] = await held.exchange(wire.pack(("CLIENT", "ID")), 1)
    call = asyncio.ensure_future(held.exchange(wire.pack(("BLPOP", "l", 5)), 1, last_wait=6))
    await _blocked(redis_client, held_id)
    await held.close()
    with pytest.raises((rex.ConnectionError, OSError)):
        await asyncio.wait_for(call, 2)
    taken = [await asyncio.wait_for(held_pool.get_connection(), 2) for _ in range(4)]
    for connection in taken:
        await held_pool.release(connection)


def test_a_held_connection_follows_its_caller_to_another_event_loop(redis_url: str) -> None:
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        redis_url, max_connections=wire.HOLD_MIN_POOL, protocol=2, socket_timeout=2
    )
    held = wire.Held(pool)

    async def call(text: str) -> list[Any]:
        return await held.exchange(wire.pack(("ECHO", text)), 1)

    assert asyncio.run(call("one")) == [b"one"]  # its loop is closed after
    assert asyncio.run(call("two")) == [b"two"]

    async def close() -> None:
        await held.close()
        # the connection of the first loop went back too: the whole pool can be taken
        taken = [await asyncio.wait_for(pool.get_connection(), 2) for _ in range(4)]
        for connection in taken:
            await pool.release(connection)
        await pool.disconnect()

    asyncio.run(close())
