"""A lean connection for script calls: one asyncio Protocol, its replies parsed by
`hiredis.Reader`, one request on it at a time (a packed command, or a batch of them).

Why: a call spends most of its client CPU in redis-py's connection (a timer task per
write, a stream reader, the parser's readiness checks, the pool's lock and condition),
not in the client. The lane writes the packed commands on the transport and waits for
one future the protocol sets when hiredis has read every reply: what `wire.exchange`
does, in about half the CPU for one command (a producer's lone submit) and less still
for a batch (a daemon's claims and saves). `Lanes` keeps a few of them for one pool.

What it is not: a client. It serves only what `lane_settings` accepts, a pool of plain
TCP or unix-socket connections of redis-py's own classes (or asynctaskd's, which only
word connect errors better) speaking RESP2, without a credential provider or decoded
replies; TLS, Sentinel, Cluster, RESP3 keep the pool. It takes the pool's settings: host
and port or path, username and password (AUTH), db (SELECT), client name (CLIENT
SETNAME), socket timeout and connect timeout, and sends the library name and version
redis-py sends (CLIENT SETINFO, a label for CLIENT LIST). It runs no health checks:
before each call it checks, as the pool does before it hands a connection out, that the
server has not closed the connection (and opens a new one if it has).

Behaviour, as the pool's path (`wire.exchange`): an error reply comes back as a value,
the same redis-py exception class with the same text (`reply_error`, redis-py's own
table); a reply later than the socket timeout (plus the call's own wait) raises
`redis.exceptions.TimeoutError`; a closed or refused connection raises
`redis.exceptions.ConnectionError` (a reset, its `OSError`), a refused AUTH
`AuthenticationError`; after any of
these, a protocol error or a cancelled call, the lane is closed, and the next call opens
a new one. It belongs to the event loop it was opened on (a call on another loop opens a
new one). Not safe for two calls at once: `busy` says it is in use, and the caller then
takes another path (`Lanes.idle` hands out one that is not).
"""

from __future__ import annotations

import asyncio
import contextlib
import select
from typing import Any, Final, NamedTuple

import hiredis
import redis.exceptions as rex

from asynctaskd.wire import pack

__all__ = ["Lane", "LaneSettings", "Lanes", "lane_settings", "lanes_for", "reply_error"]

# redis-py's table (the one its parsers use): an error reply's first word, the class
# redis-py raises for it, with the word cut off the text; under ERR, by whole text.
# tests/test_lane.py checks every entry of the installed redis-py's against this one.
_CODES: Final[dict[str, type[rex.RedisError]]] = {
    "OOM": rex.OutOfMemoryError,
    "WRONGPASS": rex.AuthenticationError,
    "EXECABORT": rex.ExecAbortError,
    "LOADING": rex.BusyLoadingError,
    "NOSCRIPT": rex.NoScriptError,
    "READONLY": rex.ReadOnlyError,
    "NOAUTH": rex.AuthenticationError,
    "NOPERM": rex.NoPermissionError,
    "ASK": rex.AskError,
    "TRYAGAIN": rex.TryAgainError,
    "MOVED": rex.MovedError,
    "CLUSTERDOWN": rex.ClusterDownError,
    "CROSSSLOT": rex.ClusterCrossSlotError,
    "MASTERDOWN": rex.MasterDownError,
}
_ERR: Final[dict[str, type[rex.RedisError]]] = {
    "max number of clients reached": rex.ConnectionError,
    "invalid password": rex.AuthenticationError,
    "wrong number of arguments for 'auth' command": rex.AuthenticationWrongNumberOfArgsError,
    "wrong number of arguments for 'AUTH' command": rex.AuthenticationWrongNumberOfArgsError,
    "Client sent AUTH, but no password is set": rex.AuthenticationError,
    "AUTH <password> called without any password configured for the default user. "
    "Are you sure your configuration is correct?": rex.AuthenticationError,
    "Error loading the extension. Please check the server logs.": rex.ModuleError,
    "Error unloading module: the module exports one or more module-side data types, "
    "can't unload": rex.ModuleError,
    "Error unloading module: no such module with that name": rex.ModuleError,
    "Error unloading module: operation not possible.": rex.ModuleError,
    # (classes of newer redis-py releases only)
    "problem with LDAP service": getattr(rex, "ExternalAuthProviderError", rex.ResponseError),
    "no such fieldset": getattr(rex, "NoSuchFieldsetError", rex.ResponseError),
}

# What redis-py says when the server closes a connection under a read.
CLOSED: Final = "Connection closed by server."

# Connection classes whose connections the lane may stand in for: redis-py's plain TCP
# and unix socket ones, and asynctaskd's TCP one (which only words connect errors better).
_TCP_CLASSES: Final = ("redis.asyncio.connection.Connection",
                       "asynctaskd.connection.clients._AsyncTcpConnection")  # fmt: skip
_UNIX_CLASS: Final = "redis.asyncio.connection.UnixDomainSocketConnection"


def reply_error(message: str) -> rex.RedisError:
    """An error reply as the exception redis-py's parsers make of it."""
    code, _, rest = message.partition(" ")
    cls: type[rex.RedisError] | None = _CODES.get(code)
    if cls is None and code == "ERR":
        cls = _ERR.get(rest, rex.ResponseError)
    if cls is None:
        return rex.ResponseError(message)
    try:
        return cls(rest, status_code=code)
    except TypeError:  # an older redis-py, without status codes
        return cls(rest)
    except ValueError:  # MOVED/ASK text that names no slot and node
        return rex.ResponseError(message)


class LaneSettings(NamedTuple):
    """Where and how to connect: the pool's own settings."""

    host: str
    port: int
    path: str | None  # a unix socket, instead of host and port
    username: str | None
    password: str | None
    db: int
    client_name: str | None
    socket_timeout: float | None
    connect_timeout: float | None
    # What redis-py tells the server about itself (CLIENT SETINFO), None: nothing
    lib_name: str | None = None
    lib_version: str | None = None


def lane_settings(pool: Any) -> LaneSettings | None:
    """The settings of a lane for `pool`'s connections, or None where a lane cannot stand
    in for them (TLS, Sentinel, RESP3, decoded replies, a credential provider, a
    connection class of someone else's)."""
    cls = getattr(pool, "connection_class", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    if not isinstance(cls, type) or not isinstance(kwargs, dict):
        return None
    name = f"{cls.__module__}.{cls.__qualname__}"
    if name not in (*_TCP_CLASSES, _UNIX_CLASS):
        return None
    if kwargs.get("protocol", 2) not in (2, "2") or kwargs.get("decode_responses"):
        return None
    if kwargs.get("credential_provider") is not None:
        return None
    timeout = kwargs.get("socket_timeout")
    lib_name, lib_version = _library(cls, kwargs)
    return LaneSettings(
        host=str(kwargs.get("host", "localhost")),
        port=int(kwargs.get("port", 6379)),
        path=str(kwargs["path"]) if name == _UNIX_CLASS else None,
        username=kwargs.get("username"),
        password=kwargs.get("password"),
        db=int(kwargs.get("db", 0) or 0),
        client_name=kwargs.get("client_name"),
        socket_timeout=timeout,
        connect_timeout=kwargs.get("socket_connect_timeout") or timeout,
        lib_name=lib_name,
        lib_version=lib_version,
    )


def _library(cls: type, kwargs: dict[str, Any]) -> tuple[str | None, str | None]:
    """The library name and version redis-py sends on the pool's connections (CLIENT
    SETINFO LIB-NAME and LIB-VER), read off one it makes and does not open: its
    `driver_info` (redis-py 7 and on) or its `lib_name` and `lib_version` (before)."""
    try:
        connection = cls(**kwargs)
    except Exception:  # (a connection class that will not be made without a socket)
        return None, None
    info = getattr(connection, "driver_info", None)
    if info is not None:
        name, version = getattr(info, "formatted_name", None), getattr(info, "lib_version", None)
    else:
        name = getattr(connection, "lib_name", None)
        version = getattr(connection, "lib_version", None)
    return (name if isinstance(name, str) and name else None,
            version if isinstance(version, str) and version else None)  # fmt: skip


class _Protocol(asyncio.Protocol):
    """Bytes in, one reply out to the waiting future."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader(replyError=reply_error, protocolError=rex.InvalidResponse)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Any] | None = None
        # A batch's replies so far, and how many it is (None: one reply, set as it is)
        self.replies: list[Any] | None = None
        self.expected = 1
        self.lost = False
        self.poller: Any = None  # select.poll on the socket (no FD_SETSIZE limit)
        # One timer for the waiting reply, kept across calls (a timer armed and cancelled
        # per call costs more than the rest of a call's own work here).
        self.deadline = 0.0
        self.watchdog: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport
        # poll, not select: a process with a thousand sockets open (a daemon's vendor
        # connections, a web process's streams) has descriptors select cannot take
        self.poller = select.poll()
        self.poller.register(transport.get_extra_info("socket").fileno(), select.POLLIN)

    def stale(self) -> bool:
        """Readable while no request is out: the server closed the connection (a
        restart, CLIENT KILL, its idle timeout) and the loop has not yet seen it; what
        the pool's readiness check finds before it hands a connection out. One poll
        with no wait, about a microsecond."""
        return bool(self.poller.poll(0))

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        while True:
            try:
                reply = reader.gets()
            except Exception as exc:  # a protocol error: nothing after it can be trusted
                self._fail(rex.InvalidResponse(f"Protocol error: {exc}"))
                return
            if reply is False:  # (RESP2 has no false: this is "not yet a whole reply")
                return
            waiter = self.waiter
            if waiter is None or waiter.done():
                self._fail(rex.InvalidResponse("a reply nobody asked for"))  # out of step
                return
            replies = self.replies
            if replies is not None:
                replies.append(reply)
                if len(replies) < self.expected:
                    continue
                reply = replies
            if reader.has_data():  # more than was asked for: out of step (the call fails)
                self._fail(rex.InvalidResponse("a reply nobody asked for"))
                return
            self.waiter = self.replies = None
            waiter.set_result(reply)
            return

    def arm(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """The reply now awaited must come by `deadline` (loop time)."""
        self.deadline = deadline
        watchdog = self.watchdog
        if watchdog is not None and watchdog.when() > deadline:
            watchdog.cancel()  # (an earlier call's longer wait)
            watchdog = None
        if watchdog is None:
            self.watchdog = loop.call_at(deadline, self._watch, loop)

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        self.watchdog = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # idle: the next call arms it again
        if loop.time() >= self.deadline:
            waiter.set_exception(TimeoutError())
        else:  # a later call's reply: wait for its own deadline
            self.watchdog = loop.call_at(self.deadline, self._watch, loop)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        # A reset (or another socket error) is raised as it is, as the pool path's read
        # raises it; a connection the server closed, in redis-py's words.
        self._fail(exc if isinstance(exc, OSError) else rex.ConnectionError(CLOSED))

    def _fail(self, exc: Exception) -> None:
        self.lost = True
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        waiter, self.waiter, self.replies = self.waiter, None, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        if self.transport is not None:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nothing to do
                self.transport.abort()


class Lane:
    """One connection for lone calls (the module says what it does and does not)."""

    __slots__ = ("_loop", "_protocol", "busy", "settings")

    def __init__(self, settings: LaneSettings) -> None:
        self.settings = settings
        self.busy = False
        self._protocol: _Protocol | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def call(
        self, payload: bytes, last_wait: float = 0.0, *, count: int | None = None
    ) -> Any:
        """Write one packed command, return its reply (an error reply as a value); with
        `count`, `payload` is that many packed commands, and the reply the list of theirs
        in order (error replies as values): `wire.exchange`'s contract. The reply may take
        the socket timeout plus `last_wait` (the last command's own wait). Raises
        RuntimeError if busy."""
        if count is not None and count < 1:
            raise ValueError("a batch holds at least one command")
        if self.busy:
            raise RuntimeError("the lane is in use")
        self.busy = True
        try:
            loop = asyncio.get_running_loop()
            protocol = self._protocol
            if protocol is None or protocol.lost or self._loop is not loop or protocol.stale():
                protocol = await self._open(loop)
            if count is not None:
                protocol.replies, protocol.expected = [], count
            reply = await self._round_trip(protocol, loop, payload, last_wait)
            if count is None:
                return self._checked(reply)
            for each in reply:
                self._checked(each)
            return reply
        finally:
            self.busy = False

    def _checked(self, reply: Any) -> Any:
        """As redis-py's parser: an error reply that means a connection error (the server's
        "max number of clients reached") is raised, and the connection dropped."""
        if isinstance(reply, rex.ConnectionError) or (
            isinstance(reply, list) and reply and isinstance(reply[0], rex.ConnectionError)
        ):
            self.close()
            raise reply if isinstance(reply, rex.ConnectionError) else reply[0]
        return reply

    async def _round_trip(
        self, protocol: _Protocol, loop: asyncio.AbstractEventLoop, payload: bytes, wait: float
    ) -> Any:
        budget = self.settings.socket_timeout
        waiter = protocol.waiter = loop.create_future()
        if budget is not None:
            protocol.arm(loop, loop.time() + budget + wait)
        try:
            protocol.transport.write(payload)  # type: ignore[union-attr]  # set on connect
            return await waiter
        except TimeoutError:
            self.close()
            raise rex.TimeoutError(f"no reply from Redis within {budget} s") from None
        except BaseException:  # closed, refused, cancelled: a reply may still be on its way
            self.close()
            raise

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Protocol:
        self.close()
        s = self.settings
        where = s.path or f"{s.host}:{s.port}"
        try:
            async with asyncio.timeout(s.connect_timeout):
                if s.path is not None:
                    _, protocol = await loop.create_unix_connection(_Protocol, s.path)
                else:
                    _, protocol = await loop.create_connection(_Protocol, s.host, s.port)
        except TimeoutError:
            raise rex.TimeoutError(f"Timeout connecting to {where}") from None
        except OSError as exc:
            raise rex.ConnectionError(f"Error {exc.errno} connecting to {where}. {exc}") from exc
        self._protocol, self._loop = protocol, loop
        handshake: list[tuple[Any, ...]] = []
        if s.password is not None:
            handshake.append(("AUTH", s.password) if s.username is None
                             else ("AUTH", s.username, s.password))  # fmt: skip
        if s.client_name:
            handshake.append(("CLIENT", "SETNAME", s.client_name))
        if s.lib_name:
            handshake.append(("CLIENT", "SETINFO", "LIB-NAME", s.lib_name))
        if s.lib_version:
            handshake.append(("CLIENT", "SETINFO", "LIB-VER", s.lib_version))
        if s.db:
            handshake.append(("SELECT", s.db))
        for command in handshake:
            reply = self._checked(await self._round_trip(protocol, loop, pack(command), 0.0))
            if isinstance(reply, rex.ResponseError) and command[1:2] == ("SETINFO",):
                continue  # a server before 7.2 has no SETINFO: as redis-py, go on without
            if isinstance(reply, Exception):
                self.close()
                if command[0] == "SELECT":
                    raise rex.ConnectionError("Invalid Database")  # as redis-py words it
                raise reply
        return protocol

    def close(self) -> None:
        """Close the connection (a call on it fails; the next call opens a new one)."""
        protocol, self._protocol, self._loop = self._protocol, None, None
        if protocol is not None:
            protocol._fail(rex.ConnectionError("the lane was closed"))


# A pool's lanes: one per this many of its connections, at least one, at most _LANES_MAX.
_CONNECTIONS_PER_LANE: Final = 16
_LANES_MAX: Final = 4


class Lanes:
    """A few lanes with the same settings, opened as calls need them: `idle()` hands out
    one that is not in use, or None once `limit` are (the caller takes the pool's path).

    They are connections beside the pool's, not of it: `limit` more at most. Lanes that
    are idle stay open (and are checked as they are taken, as one lane is)."""

    __slots__ = ("_lanes", "limit", "settings")

    def __init__(self, settings: LaneSettings, limit: int) -> None:
        if limit < 1:
            raise ValueError("a set of lanes holds at least one")
        self.settings = settings
        self.limit = limit
        self._lanes: list[Lane] = []

    def idle(self) -> Lane | None:
        """The first lane not in use (a new one while fewer than `limit` are open), or
        None if `limit` are in use: as many are opened as calls ever overlapped. The
        caller calls it at once: a lane is marked busy as its call begins."""
        for lane in self._lanes:
            if not lane.busy:
                return lane
        if len(self._lanes) < self.limit:
            lane = Lane(self.settings)
            self._lanes.append(lane)
            return lane
        return None

    def close(self) -> None:
        """Close every lane (a call on one fails; the next call opens it again)."""
        for lane in self._lanes:
            lane.close()


def lanes_for(pool: Any) -> Lanes | None:
    """The lanes that may stand in for `pool`'s connections (None: none may, as
    `lane_settings` says): one per _CONNECTIONS_PER_LANE of its connections, at least one
    and at most _LANES_MAX."""
    settings = lane_settings(pool)
    if settings is None:
        return None
    size = getattr(pool, "max_connections", 0)
    size = size if isinstance(size, int) else 0
    return Lanes(settings, max(1, min(_LANES_MAX, size // _CONNECTIONS_PER_LANE)))
