"""`Http1Pool`: keep-alive HTTP/1.1 connections per origin, at most `max_connections` in all.

Our own requests are checked before they are written (header injection); an idle
connection is polled before reuse once it has been idle a while (`_stirred`). "Never sent"
errors (`PoolTimeout`, `ConnectTimeout`, `ConnectError`) are raised only here, while
obtaining a connection; what happens on one is `asynctaskd.http1.protocol`'s.
"""

from __future__ import annotations

import asyncio
import collections
import re
import select
import ssl
from collections.abc import Mapping
from typing import Final

import httpx

from .protocol import Answer, _Connection

__all__ = ["Http1Pool"]

# The request is re-checked before it is written; httpx itself lets a CR or LF through in a
# header value and a colon in a name (header injection). The head must be a token method,
# a target without spaces or controls, and lines of a value without CR, LF or NUL, one
# line per header; the names, joined with spaces, must be tokens (a space inside a name
# already fails the block pattern; a colon would pass it). The request line is checked
# every time, a header block once (`Http1Pool._checked`). These check our own requests;
# the vendor's answers are parsed by llhttp.
_TOKEN: Final = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_REQUEST_LINE: Final = re.compile(rb"%s [\x21-\x7e\x80-\xff]+ HTTP/1\.1\r\n" % _TOKEN)
_HEADER_BLOCK: Final = re.compile(rb"(?:%s:[ \t]*[^\r\n\x00]*\r\n)*\r\n" % _TOKEN)
_HEADER_NAMES: Final = re.compile(rb"(?:%s(?: %s)*)?" % (_TOKEN, _TOKEN))
_CLOSE: Final = re.compile(rb"\nconnection:[^\r]*\bclose\b")  # in a lowercased head
# What a request target may not hold (`_REQUEST_LINE`): space, controls, DEL. A target
# `bytes.translate` deletes none of, after a method known good, makes a good line.
_NOT_IN_TARGET: Final = bytes(range(0x21)) + b"\x7f"
_METHODS_MAX: Final = 64
_CHECKED_MAX: Final = 256
# Idle this long, a connection may have met the server's idle timeout (2-5 s is common):
# its socket is polled before it is reused. Busier connections are not.
_PROBE_AFTER_S: Final = 1.0
_SWEEP_S: Final = 30.0  # how often idle lists are pruned when connections never expire


def _stirred(transport: asyncio.Transport) -> bool:
    """Whether bytes or an end of stream wait unread on an idle connection's socket.

    The event loop reports a server's close on its next pass, and a busy loop's pass can
    take milliseconds: a request written meanwhile races the close and fails as
    ambiguous. One poll(2) of the socket sees what the loop has not processed yet.
    """
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    poller = select.poll()
    try:
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):  # closed under us
        return True


class Http1Pool:
    """Keep-alive HTTP/1.1 connections per origin, at most `max_connections` in all.

    Bound to the event loop it was made in. `send` is the only entry point; `aclose`
    closes every connection, in use or idle.
    """

    def __init__(
        self,
        *,
        max_connections: int | None,
        keepalive: bool,
        keepalive_expiry: float | None,
        ssl_context: ssl.SSLContext,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self._max = max_connections
        self._keepalive = keepalive
        self._expiry = keepalive_expiry
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._opening = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False
        # Header blocks checked before (a handler's requests mostly repeat theirs): block
        # -> whether it asks the server to close. Bounded; cleared when full.
        self._checked: dict[bytes, bool] = {}
        # Methods of request lines that passed the check: a line is then checked by its
        # target alone (the same rule, without the regex). Bounded; cleared when full.
        self._methods: set[str] = set()

    async def send(
        self,
        method: str,
        origin: tuple[str, str, int],
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        timeouts: Mapping[str, float | None],
        limit: int | None,
        request: httpx.Request | None = None,
        *,
        block: bytes | None = None,
        plain: bool = False,
    ) -> Answer:
        """Send `method target` with `headers` (Host included) and `body` to `origin`
        (scheme, host, port) and read the answer: whole, or its head and a body stream.

        `limit` bounds the body (None: no bound); `request`, when there is one, is named
        by the exceptions raised. `block`, if given, is `headers` as a header block
        (`name: value` lines and the blank line), built once by a caller that sends the
        same headers often; it is checked as any other. `plain`: the caller reads only
        the status, headers and body (the answer's version and reason are empty)."""
        line = b"%s %s HTTP/1.1\r\n" % (method.encode("ascii", "replace"), target)
        if block is None:
            block = b"".join([name + b": " + value + b"\r\n" for name, value in headers])
            block += b"\r\n"
        close = self._checked.get(block)
        if (
            close is None
            or method not in self._methods  # a method whose request line passed before
            or not target
            or len(target.translate(None, _NOT_IN_TARGET)) != len(target)
        ):
            close = self._check(request, line, block, headers)
            if len(self._methods) >= _METHODS_MAX:
                self._methods.clear()
            self._methods.add(method)
        # An idle connection at hand (most requests) is taken without a coroutine of its own.
        connection = None if self._closed else self._reuse(origin)
        if connection is None:
            connection = await self._acquire(request, origin, timeouts)
        try:
            answer = await connection.exchange(
                request, method, line + block + body, timeouts.get("read"), limit, plain
            )
        except BaseException:
            connection.exchanged()
            connection.close()  # cancelled or failed mid-exchange: its state is unknown
            raise
        if close:
            connection.reusable = False  # the caller asked the server to close it
        if answer.stream is None:
            connection.exchanged()
            self.release(connection)
        return answer

    def _check(
        self,
        request: httpx.Request | None,
        line: bytes,
        block: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> bool:
        """Refuse a request line or header block HTTP/1.1 cannot carry; remember a good
        block. Returns whether the headers ask the server to close the connection."""
        if (
            _REQUEST_LINE.fullmatch(line) is None
            or _HEADER_BLOCK.fullmatch(block) is None
            or block.count(b"\n") != len(headers) + 1  # a CR LF inside a value
            or _HEADER_NAMES.fullmatch(b" ".join([name for name, _ in headers])) is None
        ):
            raise httpx.LocalProtocolError(
                "invalid request: the method, URL or a header holds a character HTTP/1.1 "
                "cannot carry (CR, LF or NUL anywhere, a space or colon in a header name)",
                request=request,
            )
        lowered = b"\n" + block.lower()
        if b"\ntransfer-encoding:" in lowered:
            # httpx adds Content-Length to an in-memory body; with both, the message is
            # invalid and a server rejects it, or worse, frames it its own way.
            raise httpx.LocalProtocolError(
                "a Transfer-Encoding header set by hand on an in-memory body: drop the "
                "header, or pass the body as an async iterator to have it sent chunked",
                request=request,
            )
        close = b"\nconnection:" in lowered and _CLOSE.search(lowered) is not None
        if len(self._checked) >= _CHECKED_MAX:
            self._checked.clear()
        self._checked[block] = close
        return close

    # -- connections --------------------------------------------------------------------

    def _reuse(self, key: tuple[str, str, int]) -> _Connection | None:
        """An idle connection to `key` that is still good to send on, or None."""
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            transport = connection.transport
            idle_for = self.loop.time() - connection.idle_since
            if (
                connection.closed
                or transport is None
                or transport.is_closing()
                or (idle_for > _PROBE_AFTER_S and _stirred(transport))
            ):
                connection.close()  # the server closed it while it was idle
            elif self._expiry is not None and idle_for > self._expiry:  # expired
                for stale in [connection, *idle]:  # the ones below went idle earlier
                    stale.close()
            else:
                return connection
        return None

    async def _acquire(
        self,
        request: httpx.Request | None,
        key: tuple[str, str, int],
        timeouts: Mapping[str, float | None],
    ) -> _Connection:
        """A connection for the request's origin: idle, new, or the first to free up."""
        if self._closed:
            raise RuntimeError("the HTTP pool is closed")
        waited = False
        deadline: float | None = None
        while True:
            connection = self._reuse(key)
            if connection is not None:
                return connection
            if self._max is None or len(self._all) + self._opening < self._max or self._evict():
                return await self._open(request, key, timeouts.get("connect"))
            if not waited:
                waited = True
                pool_timeout = timeouts.get("pool")
                deadline = None if pool_timeout is None else self.loop.time() + pool_timeout
            await self._wait_for_slot(request, deadline)
            if self._closed:
                raise RuntimeError(
                    "the HTTP client was closed while the request waited for a connection"
                )

    def _evict(self) -> bool:
        """Close the longest-idle connection of any origin to make room; False if none."""
        for idle in self._idle.values():
            if idle:
                idle.pop(0).close()
                return True
        return False

    async def _wait_for_slot(self, request: httpx.Request | None, deadline: float | None) -> None:
        waiter = self.loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._wake_one()  # woken, but leaving: hand the wakeup on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise httpx.PoolTimeout(
                    "timed out waiting for a free connection in the pool", request=request
                ) from None
            raise

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _open(
        self,
        request: httpx.Request | None,
        key: tuple[str, str, int],
        connect_timeout: float | None,
    ) -> _Connection:
        host = key[1]
        secure = key[0] == "https"
        self._opening += 1
        try:
            async with asyncio.timeout(connect_timeout):
                _, connection = await self.loop.create_connection(
                    lambda: _Connection(self, key),
                    host,
                    key[2],
                    ssl=self._ssl if secure else None,
                    server_hostname=host if secure else None,
                )
        except BaseException as exc:
            self._opening -= 1
            self._wake_one_if_room()
            if isinstance(exc, TimeoutError):
                raise httpx.ConnectTimeout(
                    f"timed out connecting to {host}:{key[2]}", request=request
                ) from exc
            if isinstance(exc, OSError):  # refused, unreachable, DNS, TLS handshake or cert
                raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from exc
            raise
        self._opening -= 1
        self._all.add(connection)
        if self._closed:
            connection.close()
            raise RuntimeError("the HTTP pool is closed")
        if connection.closed:  # the server hung up at once: nothing was written yet
            raise httpx.ConnectError(
                f"{host}:{key[2]} closed the connection as soon as it was open", request=request
            )
        return connection

    def _wake_one_if_room(self) -> None:
        if self._waiters and (self._max is None or len(self._all) + self._opening < self._max):
            self._wake_one()

    def release(self, connection: _Connection) -> None:
        if connection.closed or not connection.reusable or not self._keepalive or self._closed:
            connection.close()
            return
        connection.idle_since = self.loop.time()
        self._idle.setdefault(connection.key, []).append(connection)
        if self._sweep is None:
            self._sweep = self.loop.call_later(self._expiry or _SWEEP_S, self._sweep_idle)
        if self._waiters:
            self._wake_one()  # it can take this connection, or close it for another origin

    def forget(self, connection: _Connection) -> None:
        """A connection closed: drop it everywhere and hand its slot on."""
        if connection in self._all:
            self._all.discard(connection)
            idle = self._idle.get(connection.key)
            if idle and connection in idle:
                idle.remove(connection)
            self._wake_one_if_room()

    def _sweep_idle(self) -> None:
        """Close connections idle past keepalive_expiry and forget origins with none left
        (handlers may call many hosts once); come back while any connection stays idle."""
        self._sweep = None
        if self._expiry is not None:
            oldest_allowed = self.loop.time() - self._expiry
            for idle in self._idle.values():
                while idle and idle[0].idle_since <= oldest_allowed:
                    idle.pop(0).close()
        self._idle = {key: idle for key, idle in self._idle.items() if idle}
        if self._idle:
            self._sweep = self.loop.call_later(self._expiry or _SWEEP_S, self._sweep_idle)

    async def aclose(self) -> None:
        """Close every connection; requests still in flight fail."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for connection in list(self._all):
            connection.close()
        self._idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)  # they retry, and find the pool closed
        self._waiters.clear()
