"""A lean HTTP/1.1 connection pool for the shared client's buffered requests.

Nearly every vendor call a handler makes is a small request whose whole answer is read at
once. aiohttp spends ~60 us of CPU on such a call here, httpx's own pool more; this pool
writes the request with one `transport.write` and parses the answer in `data_received`,
for ~20 us. It serves only what the shared client's direct path sends: http and https
URLs, a body already in memory, and the whole response read before returning.
Streaming goes through aiohttp (`asynctaskd.transport`).

"Never sent" is exact here: `PoolTimeout`, `ConnectTimeout` and `ConnectError` are raised
only while obtaining a connection, before the first byte of the request is written. Every
failure after that is ambiguous (`ReadTimeout`, `ReadError`, `RemoteProtocolError`), and
nothing is ever resent: a reused keep-alive connection that the server closed while the
request was on its way fails as `RemoteProtocolError`, like httpx's own pool reports it.
A close that already reached the socket is caught before reuse (see `_stirred`).

What it does not do, by design: HTTP/2, proxies, `Expect: 100-continue` waits (the body is
sent at once; an interim 1xx answer is skipped), protocol upgrades (a 101 answer ends the
exchange and the connection), and a write timeout (the body is handed to the kernel whole;
the read timeout starts once it is).
"""

from __future__ import annotations

import asyncio
import collections
import re
import select
import ssl
from typing import Final, cast

import httpx

__all__ = ["Answer", "Http1Pool"]

# The request httpx built is re-checked before it is written; httpx itself lets a CR or
# LF through in a header value and a colon in a name (header injection). The head must
# be a token method, a target without spaces or controls, and lines of a value without
# CR, LF or NUL, one line per header; the names, joined with spaces, must be tokens (a
# space inside a name already fails the block pattern; a colon would pass it). The
# request line is checked every time, a header block once (`Http1Pool._checked`).
_TOKEN: Final = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_REQUEST_LINE: Final = re.compile(rb"%s [\x21-\x7e\x80-\xff]+ HTTP/1\.1\r\n" % _TOKEN)
_HEADER_BLOCK: Final = re.compile(rb"(?:%s:[ \t]*[^\r\n\x00]*\r\n)*\r\n" % _TOKEN)
_HEADER_NAMES: Final = re.compile(rb"(?:%s(?: %s)*)?" % (_TOKEN, _TOKEN))
_STATUS_LINE: Final = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9]{2})(?: ([^\r\n\x00]*))?")
_HEADER_NAME: Final = re.compile(_TOKEN)
# A response's header lines after its status line, each "\r\n<token>:<value>": a value
# without NUL, and without CR LF, which ends a line (a bare CR or LF stays in the value).
_FIELD_LINES: Final = re.compile(rb"(?:\r\n%s:[^\r\x00]*(?:\r(?!\n)[^\r\x00]*)*)*" % _TOKEN)
_CHUNK_SIZE: Final = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\r\n]*)?")
_DIGITS: Final = re.compile(rb"[0-9]{1,19}")
_CLOSE: Final = re.compile(rb"\nconnection:[^\r]*\bclose\b")  # in a lowercased head
_CHECKED_MAX: Final = 256
# Idle this long, a connection may have met the server's idle timeout (2-5 s is common):
# its socket is polled before it is reused. Busier connections are not.
_PROBE_AFTER_S: Final = 1.0
_SWEEP_S: Final = 30.0  # how often idle lists are pruned when connections never expire
_MAX_HEAD: Final = 65536  # status line plus headers, or one chunk-size or trailer line

# How the response body is delimited (RFC 9112 section 6.3).
_NO_BODY: Final = 0
_LENGTH: Final = 1
_CHUNKED: Final = 2
_UNTIL_CLOSE: Final = 3

Answer = tuple[int, bytes, bytes, list[tuple[bytes, bytes]], bytes]
"""status, http_version (b"HTTP/1.1"), reason phrase, raw headers, body."""


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


class _ProtocolError(Exception):
    """The server's bytes are not a valid HTTP/1.1 response."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: one exchange at a time, the answer parsed as it arrives."""

    def __init__(self, pool: Http1Pool, key: tuple[bytes, bytes, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._loop = pool.loop
        self._waiter: asyncio.Future[Answer] | None = None
        self._request: httpx.Request | None = None
        self._buffer = bytearray()
        self._head_only = False
        self._status: tuple[int, bytes, bytes, list[tuple[bytes, bytes]]] | None = None
        self._framing = _NO_BODY
        self._length = 0
        self._chunks: list[bytes] = []
        self._trailers = False
        self.reusable = False
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
        if self._waiter is None or self._waiter.done():
            # Bytes while idle or after a complete answer (a 408, say): the connection can
            # no longer be trusted.
            self.close()
            return
        self._buffer += data
        if self._timeout is not None:
            self._last_read = self._loop.time()
        try:
            self._parse()
        except _ProtocolError as exc:
            self._fail(httpx.RemoteProtocolError(str(exc), request=self._request))
            self.close()

    def eof_received(self) -> bool:
        self._ended(None)
        return False  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        self._ended(exc)
        self.pool.forget(self)

    # -- one exchange -------------------------------------------------------------------

    def exchange(
        self, request: httpx.Request, payload: bytes, read_timeout: float | None
    ) -> asyncio.Future[Answer]:
        """Write `payload`; the future gets the parsed answer to it. Call `exchanged()`
        once it is done or given up on. (Not a coroutine of its own: the caller awaits
        the future itself, one coroutine fewer to pass through when the answer comes.)"""
        assert self.transport is not None
        self._request = request
        self._head_only = request.method == "HEAD"
        self._status = None
        self._chunks = []
        self._trailers = False
        self.reusable = False
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
        self._waiter = self._request = None
        self._timeout = None

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
        if self._timeout is None or self._waiter is None or self._waiter.done():
            return  # idle, or an exchange without a read timeout: nothing to watch
        due = self._last_read + self._timeout
        if self._loop.time() < due:  # bytes arrived meanwhile, or a later exchange began
            self._arm(due)
            return
        self._fail(httpx.ReadTimeout("timed out waiting for the response", request=self._request))
        self.close()

    def _answer(self, body: bytes) -> None:
        assert self._status is not None and self._waiter is not None
        status, version, reason, headers = self._status
        if not self._waiter.done():
            self._waiter.set_result((status, version, reason, headers, body))

    def _fail(self, exc: httpx.TransportError) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    def _ended(self, exc: Exception | None) -> None:
        """The server closed its side: the end of an until-close body, or a failure."""
        if self._waiter is None or self._waiter.done():
            return
        self.reusable = False
        if exc is None and self._status is not None and self._framing == _UNTIL_CLOSE:
            self._answer(bytes(self._buffer))
            return
        request = self._request
        if isinstance(exc, OSError):
            self._fail(httpx.ReadError(str(exc) or type(exc).__name__, request=request))
            return
        nothing = self._status is None and not self._buffer
        message = "without sending a response" if nothing else "before the response was complete"
        self._fail(httpx.RemoteProtocolError(f"Server disconnected {message}.", request=request))

    def close(self) -> None:
        """Close the connection without waiting for anything still unwritten or unread."""
        if not self.closed:
            self.closed = True
            self.reusable = False
            self._disarm()
            self._fail(  # an exchange in flight, when the pool closes
                httpx.ReadError(
                    "the connection was closed by the client while awaiting the response",
                    request=self._request,
                )
            )
            if self.transport is not None:
                self.transport.abort()
            self.pool.forget(self)  # its slot is free now, not when asyncio reports the loss

    # -- parsing ------------------------------------------------------------------------

    def _parse(self) -> None:
        buffer = self._buffer
        while self._status is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > _MAX_HEAD:
                    raise _ProtocolError("response head too large")
                return
            head = bytes(buffer[:end])
            del buffer[: end + 4]
            self._head(head)
        framing = self._framing
        if framing == _LENGTH:
            if len(buffer) >= self._length:
                body = bytes(buffer[: self._length])
                self._finish(len(buffer) - self._length)
                self._answer(body)
        elif framing == _CHUNKED:
            self._dechunk()
        elif framing == _NO_BODY:
            self._finish(len(buffer))
            self._answer(b"")
        # _UNTIL_CLOSE: the body is whatever arrives until the server closes.

    def _head(self, head: bytes) -> None:
        """Parse a status line and headers; an interim 1xx answer is dropped."""
        lines = head.split(b"\r\n")
        status_line = _STATUS_LINE.fullmatch(lines[0])
        if status_line is None:
            raise _ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        minor, code, reason = status_line.groups()
        status = int(code)
        headers: list[tuple[bytes, bytes]] = []
        lengths: set[bytes] = set()
        coding = connection = b""
        if _FIELD_LINES.fullmatch(head, len(lines[0])) is None:
            _name_bad_line(lines[1:])  # one match checks every line; this says which failed
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            value = value.strip(b" \t")
            headers.append((name, value))
            lowered = name.lower()
            if lowered == b"content-length":
                if b"," in value:  # "5, 5": a list of values, which must agree
                    lengths.update(part.strip(b" \t") for part in value.split(b","))
                else:
                    lengths.add(value)
            elif lowered == b"transfer-encoding":
                coding = value.rpartition(b",")[2].strip(b" \t").lower()
            elif lowered == b"connection":
                connection += b"," + value.lower()
        if 100 <= status < 200 and status != 101:
            return  # 100 Continue, 103 Early Hints: the real answer follows
        if connection:
            tokens = {token.strip(b" \t") for token in connection.split(b",")}
            self.reusable = b"close" not in tokens if minor == b"1" else b"keep-alive" in tokens
        else:
            self.reusable = minor == b"1"  # HTTP/1.1 keeps the connection, 1.0 closes it
        if self._head_only or status in (101, 204, 304):
            self._framing = _NO_BODY
            self.reusable = self.reusable and status != 101
        elif coding:
            # Transfer-Encoding overrides Content-Length; a body not ending in chunked
            # runs until the server closes.
            self._framing = _CHUNKED if coding == b"chunked" else _UNTIL_CLOSE
            self.reusable = self.reusable and coding == b"chunked" and not lengths
        elif lengths:
            length = lengths.pop()
            if lengths or _DIGITS.fullmatch(length) is None:
                raise _ProtocolError("invalid or conflicting Content-Length")
            self._framing, self._length = _LENGTH, int(length)
        else:
            self._framing = _UNTIL_CLOSE
        if self._framing == _UNTIL_CLOSE:
            self.reusable = False
        self._status = (status, b"HTTP/1." + minor, reason or b"", headers)

    def _dechunk(self) -> None:
        """Decode as much chunked body as has arrived; answer once the last chunk did."""
        buffer = self._buffer
        at = 0
        try:
            while True:
                eol = buffer.find(b"\r\n", at)
                if eol < 0:
                    if len(buffer) - at > _MAX_HEAD:
                        raise _ProtocolError("chunk-size or trailer line too long")
                    return
                line = bytes(buffer[at:eol])
                if self._trailers:
                    at = eol + 2
                    if not line:
                        self._finish(len(buffer) - at)
                        self._answer(b"".join(self._chunks))
                        return
                    continue
                size_line = _CHUNK_SIZE.fullmatch(line)
                if size_line is None:
                    raise _ProtocolError(f"malformed chunk-size line: {line[:80]!r}")
                size = int(size_line[1], 16)
                if size == 0:
                    self._trailers = True
                    at = eol + 2
                    continue
                start = eol + 2
                if len(buffer) < start + size + 2:
                    return  # wait for the whole chunk and its CRLF
                if buffer[start + size : start + size + 2] != b"\r\n":
                    raise _ProtocolError("chunk data not followed by CRLF")
                self._chunks.append(bytes(buffer[start : start + size]))
                at = start + size + 2
        finally:
            del buffer[:at]

    def _finish(self, extra: int) -> None:
        """The answer is complete; bytes after it make the connection untrustworthy."""
        if extra:
            self.reusable = False
        self._buffer.clear()


def _name_bad_line(lines: list[bytes]) -> None:
    """Raise for the first header line that is not "<token>:<value without NUL>"."""
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or _HEADER_NAME.fullmatch(name) is None:
            raise _ProtocolError(f"malformed header line: {line[:80]!r}")
        if b"\x00" in value:
            raise _ProtocolError(f"NUL in header {name!r}")


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
        self._idle: dict[tuple[bytes, bytes, int], list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._opening = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False
        # Header blocks checked before (a handler's requests mostly repeat theirs): block
        # -> whether it asks the server to close. Bounded; cleared when full.
        self._checked: dict[bytes, bool] = {}

    async def send(self, request: httpx.Request, body: bytes) -> Answer:
        """Send `request` with `body` (its content, already read) and read the answer."""
        headers = request.headers.raw
        line = b"%s %s HTTP/1.1\r\n" % (
            request.method.encode("ascii", "replace"),
            request.url.raw_path,
        )
        block = b"".join([name + b": " + value + b"\r\n" for name, value in headers]) + b"\r\n"
        close = self._checked.get(block)
        if close is None or _REQUEST_LINE.fullmatch(line) is None:
            close = self._check(request, line, block, headers)
        timeouts = request.extensions.get("timeout") or {}
        url = request.url
        secure = url.scheme == "https"
        key = (url.raw_scheme, url.raw_host, url.port or (443 if secure else 80))
        # An idle connection without a coroutine of its own (most requests): ~0.6 us less.
        connection = None if self._closed else self._reuse(key)
        if connection is None:
            connection = await self._acquire(request, key, secure, timeouts)
        try:
            try:
                answer = await connection.exchange(
                    request, line + block + body, timeouts.get("read")
                )
            finally:
                connection.exchanged()
        except BaseException:
            connection.close()  # cancelled or failed mid-exchange: its state is unknown
            raise
        if close:
            connection.reusable = False  # the caller asked the server to close it
        self._release(connection)
        return answer

    def _check(
        self,
        request: httpx.Request,
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
            # invalid (RFC 9112 6.3) and a server rejects it, or worse, frames it its way.
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

    def _reuse(self, key: tuple[bytes, bytes, int]) -> _Connection | None:
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
        request: httpx.Request,
        key: tuple[bytes, bytes, int],
        secure: bool,
        timeouts: dict[str, float | None],
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
                return await self._open(request, key, secure, timeouts.get("connect"))
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

    async def _wait_for_slot(self, request: httpx.Request, deadline: float | None) -> None:
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
        request: httpx.Request,
        key: tuple[bytes, bytes, int],
        secure: bool,
        connect_timeout: float | None,
    ) -> _Connection:
        host = key[1].decode("ascii")
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

    def _release(self, connection: _Connection) -> None:
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
