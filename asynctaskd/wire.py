"""Commands written as RESP on a pooled redis-py connection, their replies read back in
place; the one module that relies on redis-py internals.

The store sends the script calls of one flush (and a trailer such as WAITAOF) as one
write and reads their replies straight from the connection's parser: one timer bounds the
whole batch, and error replies come back as values. redis-py's `Pipeline` does the same
work at a cost the daemon feels on every save (it packs and keeps books per command, and
`Connection.read_response` arms a timer per reply and raises error replies), and no
public API reads a reply without that. So this module may use redis-py's private and
undocumented names, and no other may: `REDIS_PY_INTERNALS` lists every one, and
tests/test_wire.py checks that each still exists in the installed redis-py (naming the
release and the name when one is gone) and that no other module uses one. pyproject.toml
keeps redis below its next minor release; `make test-latest` is how a new one is tried.

Push messages and maintenance notifications. On RESP3 a server may send push frames
between replies: client-side caching invalidations, and on managed Redis maintenance
notifications, during which redis-py relaxes its read timeouts. `Connection.read_response`
handles them (its parser hands push frames to their handlers; the connection relaxes the
timeout), reading from the parser alone does not. redis-py 8 speaks RESP3 by default. The
fast path therefore runs only on RESP2 connections, which never carry a push frame: RESP2
has none, maintenance notifications need RESP3, and asynctaskd neither subscribes nor
turns client tracking on over a pooled connection. `connection.open_async` asks for RESP2.
A connection on RESP3 (a URL with protocol=3, or a client a producer built and passed in)
takes the public path instead: `read_response` per reply.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Final

import redis.asyncio
import redis.exceptions as rex

_pack_command: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _pack_command
except ImportError:  # hiredis comes with redis[hiredis]; without it, RESP is packed here
    _pack_command = None

__all__ = [
    "HOLD_MIN_POOL",
    "REDIS_PY_INTERNALS",
    "Held",
    "closed_under_io",
    "exchange",
    "pack",
    "refresh_slots",
]

# Every redis-py name this module relies on that redis-py does not document:
# (where it lives, the name, what wire.py does with it).
REDIS_PY_INTERNALS: Final = (
    ("redis.asyncio.Connection", "_parser", "read replies without read_response"),
    ("redis.asyncio.Connection", "_parser.read_response", "a reply; error replies as values"),
    ("redis.asyncio.Connection", "protocol", "RESP2 or RESP3: which path a batch takes"),
    ("redis.asyncio.Connection", "socket_timeout", "the budget of a batch's replies"),
    ("redis.asyncio.Connection", "health_check_interval", "when to note the next check"),
    ("redis.asyncio.Connection", "next_health_check", "noted as read_response would"),
    ("redis.asyncio.RedisCluster", "nodes_manager", "reload the slot map after MOVED"),
    ("redis.asyncio.RedisCluster", "nodes_manager.initialize", "reload the slot map"),
    ("redis.asyncio.connection", "(module)", "raises AttributeError when closed under I/O"),
    ("redis.asyncio.cluster", "(module)", "raises AttributeError while its map is rebuilt"),
)

# redis-py's asyncio modules that talk to connections and keep the cluster's map.
_IO_MODULES: Final = frozenset({"redis.asyncio.connection", "redis.asyncio.cluster"})


def _bulk(value: Any) -> bytes:
    """One RESP bulk string, encoded as redis-py's default encoder would."""
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str):
        data = value.encode()
    elif isinstance(value, int) and not isinstance(value, bool):
        data = b"%d" % value
    elif isinstance(value, float):
        data = repr(value).encode()
    else:
        raise rex.DataError(
            f"cannot send a {type(value).__name__} to Redis: pass bytes, str, int or float"
        )
    return b"$%d\r\n%s\r\n" % (len(data), data)


def pack(command: Sequence[Any]) -> bytes:
    """A command as RESP: packed by hiredis in C wherever it gives exactly the bytes of
    `_bulk`, that is, for exact str, bytes, int and float arguments (in C, not Python);
    hiredis refuses the others, bool and int subclasses included, and `_bulk` encodes
    them, or says why it cannot."""
    if _pack_command is not None:
        try:
            return _pack_command(tuple(command))
        except TypeError:
            pass
    return b"*%d\r\n" % len(command) + b"".join([_bulk(value) for value in command])


async def exchange(
    pool: redis.asyncio.ConnectionPool, payload: bytes, count: int, last_wait: float = 0.0
) -> list[Any]:
    """Write `payload` (`count` packed commands) on one connection of `pool`, then read one
    reply per command; an error reply is returned in its place, not raised.

    The replies may take the connection's socket timeout plus `last_wait`, the last
    command's own wait (WAIT, WAITAOF: commands that never answer nil). No retry: a
    dropped connection fails the whole batch, and a connection that failed is
    disconnected before it goes back to the pool (replies may still be on the wire)."""
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]  # unannotated in redis-py
    try:
        return await _exchange_on(connection, payload, count, last_wait)
    finally:
        await pool.release(connection)


async def _exchange_on(connection: Any, payload: bytes, count: int, last_wait: float) -> list[Any]:
    """`exchange` on a connection the caller has checked out; on any failure the
    connection is disconnected (a reply may still be on its way) and the error raised."""
    budget: float | None = connection.socket_timeout
    try:
        await connection.send_packed_command(payload)
        if connection.protocol in (2, "2"):
            return await _read_resp2(connection, count, budget, last_wait)
        return await _read_public(connection, count, budget, last_wait)
    except TimeoutError as exc:
        await connection.disconnect(nowait=True)
        raise rex.TimeoutError(f"no reply from Redis within {budget} s") from exc
    except BaseException:
        await connection.disconnect(nowait=True)
        raise


# The smallest pool a `Held` keeps a connection of: a pool smaller than this is a limit
# its owner chose, and one connection kept aside would take too much of it.
HOLD_MIN_POOL: Final = 4


class Held:
    """One connection of `pool` kept checked out for the calls a caller makes one at a
    time (a producer awaiting one submit after the other), so that each skips the pool's
    get and release (about 15 microseconds with redis-py 8, which takes a lock, a condition
    for the blocking pool, and runs its observability hooks on each).

    It is taken on first use and kept; it is never used by two calls at once (a call made
    while it is busy takes a pooled connection, as `exchange` does); a call that fails on
    it disconnects it and gives it back, and the next call takes a fresh one; it belongs
    to the event loop it was taken on (a call on another loop gives it back and takes a
    new one); `close` gives it back. Pools smaller than HOLD_MIN_POOL are left alone."""

    __slots__ = ("_busy", "_connection", "_drop", "_loop", "pool")

    def __init__(self, pool: redis.asyncio.ConnectionPool) -> None:
        self.pool = pool
        self._connection: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._busy = False
        self._drop = False  # give it back when the call on it ends

    async def exchange(self, payload: bytes, count: int, last_wait: float = 0.0) -> list[Any]:
        """As the module's `exchange`, on the held connection when it is free."""
        if self._busy or getattr(self.pool, "max_connections", 0) < HOLD_MIN_POOL:
            return await exchange(self.pool, payload, count, last_wait)
        self._busy = True
        try:
            loop = asyncio.get_running_loop()
            if self._connection is not None and self._loop is not loop:
                await self._give_back()
            if self._connection is None:
                self._connection = await self.pool.get_connection()  # type: ignore[no-untyped-call]  # unannotated in redis-py
                self._loop = loop
            connection = self._connection
            try:
                # The pool's own readiness check (reconnects a connection the server
                # closed while it sat idle: a restart, CLIENT KILL, an idle timeout), as
                # every connection the pool hands out gets; about a microsecond.
                await self.pool.ensure_connection(connection)
                return await _exchange_on(connection, payload, count, last_wait)
            except BaseException:
                self._drop = True
                raise
        finally:
            self._busy = False
            if self._drop:
                self._drop = False
                await self._give_back()

    async def _give_back(self) -> None:
        """Disconnect the held connection (it failed, or was closed, or its streams
        belong to another loop, maybe closed) and give it back to the pool."""
        connection, self._connection, self._loop = self._connection, None, None
        if connection is None:
            return
        with contextlib.suppress(Exception):
            await connection.disconnect(nowait=True)
        await self.pool.release(connection)

    async def close(self) -> None:
        """Disconnect the held connection and give it back to the pool (a call on it now
        fails, and gives it back as it ends; a call made after takes a new one)."""
        if self._connection is None:
            return
        if self._busy:
            self._drop = True
            with contextlib.suppress(Exception):
                await self._connection.disconnect(nowait=True)
            return
        await self._give_back()


async def _read_resp2(
    connection: Any, count: int, budget: float | None, last_wait: float
) -> list[Any]:
    """Replies straight from the parser, which returns error replies as values, under one
    timer; then the health-check note `read_response` would have made."""
    parser = connection._parser
    async with asyncio.timeout(None if budget is None else budget + last_wait):
        replies = [await parser.read_response() for _ in range(count)]
    if connection.health_check_interval:
        loop_time = asyncio.get_running_loop().time()
        connection.next_health_check = loop_time + connection.health_check_interval
    return replies


async def _read_public(
    connection: Any, count: int, budget: float | None, last_wait: float
) -> list[Any]:
    """Replies through `read_response`, which handles push frames and maintenance
    notifications; it raises error replies (leaving the connection as it is), so they are
    caught into place. A timeout given to it that runs out answers None."""
    replies: list[Any] = []
    for i in range(count):
        try:
            if i == count - 1 and last_wait > 0 and budget is not None:
                reply = await connection.read_response(timeout=budget + last_wait)
                if reply is None:
                    raise TimeoutError
            else:
                reply = await connection.read_response()
        except rex.ResponseError as exc:
            reply = exc
        replies.append(reply)
    return replies


async def refresh_slots(cluster: redis.asyncio.RedisCluster) -> None:
    """Ask a cluster again which node serves which slot (after MOVED, or a node gone).

    `RedisCluster.initialize()` does that only once per client."""
    await cluster.nodes_manager.initialize()


def closed_under_io(exc: BaseException) -> bool:
    """An AttributeError raised inside redis-py's asyncio connection or cluster code: a
    connection closed under a write (its cluster client closes every connection of every
    node on CLUSTERDOWN, those other tasks are using included, and their next write meets
    no writer), or a node missing from the cluster's map while it is rebuilt. Transient,
    as a dropped connection is. Our own bugs raise AttributeError too; they are told apart
    by the innermost frame."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_globals.get("__name__") in _IO_MODULES
