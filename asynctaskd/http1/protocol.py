"""One HTTP/1.1 connection of `Http1Pool`: the request written at once, the answer fed to
llhttp (through `httptools`) as it arrives, and handed over whole or as a `ResponseBody`
stream with flow control; `ResponseTooLarge` past `max_response_bytes`.

Every failure here comes after the request was written, so none is "never sent"
(`asynctaskd.http1` says which errors are).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Final, cast

import httptools
import httpx
import msgspec

if TYPE_CHECKING:
    from .pool import Http1Pool

__all__ = ["Answer", "ResponseBody", "ResponseTooLarge"]

_MAX_HEAD: Final = 65536  # status line plus headers, or a chunk-size line and trailers
# A streamed body: reading from the socket pauses while this much waits unread.
_HIGH_WATER: Final = 1 << 20
_LOW_WATER: Final = 1 << 18


class _Trailing(Exception):
    """Bytes after a complete answer: parsing stops there."""


class ResponseTooLarge(httpx.RemoteProtocolError):
    """The vendor's answer has a body larger than `max_response_bytes`: the exchange
    failed after the request was sent (ambiguous, like any other protocol error)."""


class Answer(msgspec.Struct, eq=False):
    """A parsed answer: status, version (b"HTTP/1.1"), reason phrase (both empty for a
    `plain` exchange), raw headers, and either the whole body (`stream` None) or the
    stream its body arrives on. A msgspec Struct, not a class with an `__init__` of its
    own: one is built per request."""

    status: int
    version: bytes
    reason: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    stream: ResponseBody | None


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
        self._spare: httptools.HttpResponseParser | None = None  # kept for the next exchange
        self._parsed = False  # llhttp completed the answer itself (on_message_complete)
        self._limit: int | None = None
        self._head_only = False
        self._plain = False  # the exchange's answer needs no version nor reason
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
        # The read timeout: one timer per connection, not per exchange (arming and
        # cancelling a timer per exchange showed in every poll's profile). It stays armed
        # across exchanges and,
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
        self._spare = None  # the kept parser holds this protocol's methods: no cycle left
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
            size = len(name)
            if size != 14 and size != 17:
                continue  # neither name below: no lowercase copy of every header's name
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
            self._parsed = True  # llhttp saw the answer end: it is ready for the next one

    # -- one exchange -------------------------------------------------------------------

    def exchange(
        self,
        request: httpx.Request | None,
        method: str,
        payload: bytes,
        read_timeout: float | None,
        limit: int | None,
        plain: bool = False,
    ) -> asyncio.Future[Answer]:
        """Write `payload`; the future gets the answer to it. Call `exchanged()` once it
        is done or given up on, unless the answer streams (its `ResponseBody` does).
        (Not a coroutine of its own: the caller awaits the future itself, one coroutine
        fewer to pass through when the answer comes.) `plain`: the caller reads only the
        status, headers and body, so the answer's version and reason are left empty
        (asking llhttp for the version formats a string: ~1% of a poll's work)."""
        assert self.transport is not None
        self._request = request
        self._plain = plain
        self._head_only = method == "HEAD"
        self._limit = limit
        parser, self._spare = self._spare, None
        self._llhttp = parser or httptools.HttpResponseParser(self)
        self._head_done = self._complete = self._until_close = self._parsed = False
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
        if self._parsed and self.reusable and self._problem is None and not self._head_only:
            # The answer ended where llhttp ended it, nothing after it, and the connection
            # stays open: its parser reads the next answer (llhttp starts a new message
            # after a complete one), not a new one per exchange.
            self._spare = self._llhttp
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
        if self._plain:
            version = reason = b""
        else:
            version = b"HTTP/" + parser.get_http_version().encode("ascii")
            reason = bytes(self._reason)
        if self._complete:
            body = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
            self._chunks = []
            waiter.set_result(Answer(self._status, version, reason, self._headers, body, None))
            return
        stream = self._stream = ResponseBody(self)
        for chunk in self._chunks:
            stream.feed(chunk)
        self._chunks = []
        waiter.set_result(Answer(self._status, version, reason, self._headers, b"", stream))

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
            self._spare = None  # no parser kept for an exchange that will not come
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
