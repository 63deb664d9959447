"""A lean HTTP/1.1 connection pool behind the shared client's transport.

Nearly every vendor call a handler makes is a small request whose whole answer arrives at
once. aiohttp spends ~60 us of CPU on such a call here, httpx's own pool more; this pool
writes the request with one `transport.write` and feeds the answer to llhttp (the parser
of Node.js, through `httptools`, as uvicorn uses it) in `data_received`. An answer that is
complete when its first bytes have been parsed comes back whole; a longer one comes back
after its head, its body streaming from the connection with flow control
(`ResponseBody`). Either way no more than `max_response_bytes` of body are accepted: a
larger Content-Length is refused before its body is read, and a body that grows past the
limit fails the exchange and closes the connection (`ResponseTooLarge`).

"Never sent" is exact here: `PoolTimeout`, `ConnectTimeout` and `ConnectError` are raised
only while obtaining a connection, before the first byte of the request is written. Every
failure after that is ambiguous (`ReadTimeout`, `ReadError`, `RemoteProtocolError`), and
nothing is ever resent: a reused keep-alive connection that the server closed while the
request was on its way fails as `RemoteProtocolError`, like httpx's own pool reports it.
A close that already reached the socket is caught before reuse (see `_stirred`).

What it does not do, by design: HTTP/2, proxies (`asynctaskd.transport` routes proxied
origins elsewhere), request bodies that are not in memory, `Expect: 100-continue` waits
(the body is sent at once; an interim 1xx answer is skipped), protocol upgrades (a 101
answer ends the exchange and the connection), and a write timeout (the body is handed to
the kernel whole; the read timeout starts once it is). A HEAD answer's connection is not
reused (llhttp cannot be told that a HEAD answer's Content-Length announces no body).
"""

from __future__ import annotations

import asyncio
import collections
import re
import select
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Final, cast

import httptools
import httpx

__all__ = ["Answer", "Http1Pool", "ResponseBody", "ResponseTooLarge"]

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
_CHECKED_MAX: Final = 256
# Idle this long, a connection may have met the server's idle timeout (2-5 s is common):
# its socket is polled before it is reused. Busier connections are not.
_PROBE_AFTER_S: Final = 1.0
_SWEEP_S: Final = 30.0  # how often idle lists are pruned when connections never expire
_MAX_HEAD: Final = 65536  # status line plus headers, or a chunk-size line and trailers
# A streamed body: reading from the socket pauses while this much waits unread.
_HIGH_WATER: Final = 1 << 20
_LOW_WATER: Final = 1 << 18


class _Trailing(Exception):
    """Bytes after a complete answer: parsing stops there."""


class ResponseTooLarge(httpx.RemoteProtocolError):
    """The vendor's answer has a body larger than `max_response_bytes`: the exchange
    failed after the request was sent (ambiguous, like any other protocol error)."""


class Answer:
    """A parsed answer: status, version (b"HTTP/1.1"), reason phrase, raw headers, and
    either the whole body (`stream` None) or the stream its body arrives on."""

    __slots__ = ("body", "headers", "reason", "status", "stream", "version")

    def __init__(
        self,
        status: int,
        version: bytes,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        stream: ResponseBody | None,
    ) -> None:
        self.status = status
        self.version = version
        self.reason = reason
        self.headers = headers
        self.body = body
        self.stream = stream


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


class ResponseBody:
    """The rest of an answer's body, as it arrives on its connection.

    Iterate it once; `aclose()` (always call it) hands a fully read connection back to the
    pool and closes one whose body was left unread.
    """

    def __init__(self, connection: _Connection) -> None:
        self._connection: _Connection | None = connection
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._ended = False
        self._error: httpx.TransportError | None = None
        self._wakeup: asyncio.Future[None] | None = None

    # -- fed by the connection --------------------------------------------------------

    def feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        self._wake()

    def end(self) -> None:
        self._ended = True
        self._wake()

    def fail(self, exc: httpx.TransportError) -> None:
        if not self._ended and self._error is None:
            self._error = exc
            self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    @property
    def buffered(self) -> int:
        return self._buffered

    # -- read by the caller ------------------------------------------------------------

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                connection = self._connection
                if connection is not None and self._buffered < _LOW_WATER:
                    connection.drained()
                yield chunk
            elif self._error is not None:
                raise self._error
            elif self._ended:
                return
            else:
                connection = self._connection
                if connection is None:
                    raise httpx.StreamClosed()
                self._wakeup = connection.pool.loop.create_future()
                try:
                    await self._wakeup
                finally:
                    self._wakeup = None

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        self._chunks.clear()
        connection.exchanged()
        if self._ended and self._error is None:
            connection.pool.release(connection)
        else:
            connection.close()


def _keeps_alive(version: str, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether an answer without a body leaves its connection open: HTTP/1.1 unless
    `Connection: close`, HTTP/1.0 only with `Connection: keep-alive`."""
    tokens = {
        token.strip(b" \t").lower()
        for name, value in headers
        if name.lower() == b"connection"
        for token in value.split(b",")
    }
    return b"close" not in tokens if version == "1.1" else b"keep-alive" in tokens


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: one exchange at a time, the answer parsed as it arrives."""

    def __init__(self, pool: Http1Pool, key: tuple[str, str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reusable = False
        self._loop = pool.loop
        self._busy = False  # an exchange is in flight: from the write to the body's end
        self._waiter: asyncio.Future[Answer] | None = None
        self._request: httpx.Request | None = None
        self._llhttp: httptools.HttpResponseParser | None = None
        self._limit: int | None = None
        self._head_only = False
        # The answer being parsed.
        self._status = 0
        self._reason = bytearray()
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_done = False
        self._complete = False
        self._until_close = False
        self._chunks: list[bytes] = []
        self._received = self._fed = self._chunk_count = 0
        self._stream: ResponseBody | None = None
        self._paused = False
        self._problem: httpx.TransportError | None = None
        # The read timeout: one timer per connection, not per exchange (call_at and
        # cancel cost ~2 us, over 1% of a poll). It stays armed across exchanges and,
        # when it fires, re-arms itself from the last read if an exchange is still going.
        self._timer: asyncio.TimerHandle | None = None
        self._timeout: float | None = None  # the exchange in flight's read timeout
        self._last_read = 0.0

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        parser = self._llhttp
        if not self._busy or parser is None or self._complete:
            # Bytes while idle or after a complete answer (a 408, say): the connection can
            # no longer be trusted.
            self.reusable = False
            if not self._busy:
                self.close()
            return
        if self._timeout is not None:
            self._last_read = self._loop.time()
        # llhttp keeps no bytes, but httptools gathers a header line until it ends, and a
        # chunk-size line or trailers may run on: bound the bytes that are not body.
        self._fed += len(data)
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # a 101 answer: its head was taken; the connection ends with it
        except httptools.HttpParserError as exc:
            if self._problem is None and not self._complete:
                self._problem = httpx.RemoteProtocolError(
                    f"malformed response: {exc}", request=self._request
                )
            self.reusable = False
        if self._problem is None and not self._complete:
            if not self._head_done and self._fed > _MAX_HEAD:
                self._problem = httpx.RemoteProtocolError(
                    "response head too large", request=self._request
                )
            elif self._fed - self._received > _MAX_HEAD + 64 * self._chunk_count:
                self._problem = httpx.RemoteProtocolError(
                    "chunk-size lines or trailers too large", request=self._request
                )
        if self._problem is not None:
            self._fail(self._problem)
            self.close()
            return
        self._deliver()

    def eof_received(self) -> bool:
        self._ended(None)
        return False  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        self._ended(exc)
        self.pool.forget(self)

    # -- llhttp callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:
            # A second answer to one request: stop parsing; the connection is not reused.
            raise _Trailing
        self._reason.clear()
        self._headers = []

    def on_status(self, status: bytes) -> None:
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._head_done:  # trailers of a chunked body are dropped
            self._headers.append((name, value.strip(b" \t")))

    def on_headers_complete(self) -> None:
        parser = self._llhttp
        assert parser is not None
        status = parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            return  # 100 Continue, 103 Early Hints: the real answer follows
        self._head_done = True
        self._status = status
        self.reusable = parser.should_keep_alive()
        length: int | None = None
        chunked = False
        for name, value in self._headers:
            lowered = name.lower()
            if lowered == b"content-length":
                length = int(value)  # llhttp let only digits and one value through
            elif lowered == b"transfer-encoding":
                chunked = value.rpartition(b",")[2].strip(b" \t").lower() == b"chunked"
        if self._head_only or status in (101, 204, 304):
            self._complete = True
            if status == 101:
                self.reusable = False
            elif self._head_only:
                # llhttp does not know a HEAD answer has no body (it would wait for one, or
                # for the server to close): whether the connection stays open is read here.
                self.reusable = _keeps_alive(parser.get_http_version(), self._headers)
            return
        if length is None and not chunked:
            self._until_close = True  # the body runs until the server closes
            self.reusable = False
        limit = self._limit
        if limit is not None and length is not None and length > limit:
            self._problem = ResponseTooLarge(
                f"the response announces {length} bytes of body, over max_response_bytes ({limit})",
                request=self._request,
            )

    def on_chunk_header(self) -> None:
        self._chunk_count += 1

    def on_body(self, body: bytes) -> None:
        if self._problem is not None or self._complete:
            self.reusable = False  # a body after an answer without one (a HEAD's)
            return
        self._received += len(body)
        limit = self._limit
        if limit is not None and self._received > limit:
            self._problem = ResponseTooLarge(
                f"the response body grew past max_response_bytes ({limit})",
                request=self._request,
            )
            return
        stream = self._stream
        if stream is None:
            self._chunks.append(body)
            return
        stream.feed(body)
        if stream.buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self._head_done:
            self._complete = True

    # -- one exchange -------------------------------------------------------------------

    def exchange(
        self,
        request: httpx.Request | None,
        method: str,
        payload: bytes,
        read_timeout: float | None,
        limit: int | None,
    ) -> asyncio.Future[Answer]:
        """Write `payload`; the future gets the answer to it. Call `exchanged()` once it
        is done or given up on, unless the answer streams (its `ResponseBody` does).
        (Not a coroutine of its own: the caller awaits the future itself, one coroutine
        fewer to pass through when the answer comes.)"""
        assert self.transport is not None
        self._request = request
        self._head_only = method == "HEAD"
        self._limit = limit
        self._llhttp = httptools.HttpResponseParser(self)
        self._head_done = self._complete = self._until_close = False
        self._chunks = []
        self._received = self._fed = self._chunk_count = 0
        self._stream = None
        self._problem = None
        self.reusable = False
        self._busy = True
        waiter: asyncio.Future[Answer] = self._loop.create_future()
        self._waiter = waiter
        self.transport.write(payload)
        self._timeout = read_timeout
        if read_timeout is not None:
            self._last_read = now = self._loop.time()
            if self._timer is None or self._timer.when() > now + read_timeout:
                self._arm(now + read_timeout)
        return waiter

    def exchanged(self) -> None:
        """The exchange is over (answered, failed or abandoned): stop watching for it."""
        self._busy = False
        self._waiter = self._request = self._llhttp = self._stream = None
        self._timeout = None
        self._chunks = []
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def drained(self) -> None:
        """The streamed body's reader caught up: read from the socket again."""
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def _deliver(self) -> None:
        """Hand the answer over: whole once complete, or its head and a body stream."""
        if not self._head_done:
            return
        stream = self._stream
        if stream is not None:
            if self._complete:
                stream.end()
            return
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        parser = self._llhttp
        assert parser is not None
        version = b"HTTP/" + parser.get_http_version().encode("ascii")
        if self._complete:
            body = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
            self._chunks = []
            waiter.set_result(
                Answer(self._status, version, bytes(self._reason), self._headers, body, None)
            )
            return
        stream = self._stream = ResponseBody(self)
        for chunk in self._chunks:
            stream.feed(chunk)
        self._chunks = []
        waiter.set_result(
            Answer(self._status, version, bytes(self._reason), self._headers, b"", stream)
        )

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._check_timeout)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_timeout(self) -> None:
        self._timer = None
        if self._timeout is None or not self._busy or self._complete:
            return  # idle, or an exchange without a read timeout: nothing to watch
        due = self._last_read + self._timeout
        now = self._loop.time()
        if now < due or self._paused:
            # Bytes arrived meanwhile, a later exchange began, or the reader of a streamed
            # body is behind (reading is paused for it, not for the server).
            self._arm(max(due, now + self._timeout) if self._paused else due)
            return
        self._fail(httpx.ReadTimeout("timed out waiting for the response", request=self._request))
        self.close()

    def _fail(self, exc: httpx.TransportError) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        if self._stream is not None:
            self._stream.fail(exc)

    def _ended(self, exc: Exception | None) -> None:
        """The server closed its side: the end of an until-close body, or a failure."""
        if not self._busy or self._complete:
            return
        self.reusable = False
        if exc is None and self._head_done and self._until_close and self._problem is None:
            self._complete = True
            self._deliver()
            return
        request = self._request
        if isinstance(exc, OSError):
            self._fail(httpx.ReadError(str(exc) or type(exc).__name__, request=request))
            return
        nothing = self._llhttp is None or not self._fed
        message = "without sending a response" if nothing else "before the response was complete"
        self._fail(httpx.RemoteProtocolError(f"Server disconnected {message}.", request=request))

    def close(self) -> None:
        """Close the connection without waiting for anything still unwritten or unread."""
        if not self.closed:
            self.closed = True
            self.reusable = False
            self._disarm()
            if not self._complete:
                self._fail(  # an exchange in flight, when the pool closes
                    httpx.ReadError(
                        "the connection was closed by the client while awaiting the response",
                        request=self._request,
                    )
                )
            if self.transport is not None:
                self.transport.abort()
            self.pool.forget(self)  # its slot is free now, not when asyncio reports the loss


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
    ) -> Answer:
        """Send `method target` with `headers` (Host included) and `body` to `origin`
        (scheme, host, port) and read the answer: whole, or its head and a body stream.

        `limit` bounds the body (None: no bound); `request`, when there is one, is named
        by the exceptions raised."""
        line = b"%s %s HTTP/1.1\r\n" % (method.encode("ascii", "replace"), target)
        block = b"".join([name + b": " + value + b"\r\n" for name, value in headers]) + b"\r\n"
        close = self._checked.get(block)
        if close is None or _REQUEST_LINE.fullmatch(line) is None:
            close = self._check(request, line, block, headers)
        # An idle connection without a coroutine of its own (most requests): ~0.6 us less.
        connection = None if self._closed else self._reuse(origin)
        if connection is None:
            connection = await self._acquire(request, origin, timeouts)
        try:
            answer = await connection.exchange(
                request, method, line + block + body, timeouts.get("read"), limit
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
            if (
                connection.closed
                or transport is None
                or transport.is_closing()
                or (self._idle_for(connection) > _PROBE_AFTER_S and _stirred(transport))
            ):
                connection.close()  # the server closed it while it was idle
            elif self._expired(connection):
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

    def _idle_for(self, connection: _Connection) -> float:
        return self.loop.time() - connection.idle_since

    def _expired(self, connection: _Connection) -> bool:
        return self._expiry is not None and self._idle_for(connection) > self._expiry

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
