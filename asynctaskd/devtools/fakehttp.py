"""A small keep-alive HTTP/1.1 server: the one the fake vendor answers on.

The fake vendor runs beside the daemon and Redis on the benchmark host, so what it spends
on a request is taken from the processes it serves, where a real vendor would be
elsewhere: aiohttp's low-level server spent about half as much again on a poll as this
one when measured (docs/performance-history.md, tenth pass).
It takes what the fake vendor's clients send: HTTP/1.0 and 1.1, a body framed by
Content-Length or chunked (at most 16 MiB), `Expect: 100-continue`, and
pipelined requests, answered in order. A handler returns its `Answer` at once, or an
awaitable when it has to wait (an injected latency): only then does the request get a
task, owned by the server. Every answer carries Content-Length.

A request it cannot read is answered 400 (413 for a body over the limit, 431 for a head
over 64 KiB) and its connection closed. A handler that raises is answered 500 in the
fake vendor's JSON error shape, and the connection goes on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import http
import logging
import re
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Final, NamedTuple

import msgspec

__all__ = ["Answer", "Request", "serving"]

logger = logging.getLogger(__name__)

_TOKEN: Final = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_CHUNK_SIZE: Final = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\r\n]*)?")
_DIGITS: Final = re.compile(rb"[0-9]{1,19}")
_MAX_HEAD: Final = 65536  # request line plus headers, or one chunk-size or trailer line
_REQUEST_LINE: Final = re.compile(rb"(%s) ([\x21-\x7e\x80-\xff]+) HTTP/1\.([01])" % _TOKEN)
# The header lines after the request line, each "\r\n<token>:<value without CR, LF, NUL>".
_FIELD_LINES: Final = re.compile(rb"(?:\r\n%s:[^\r\n\x00]*)*" % _TOKEN)
_MAX_BODY: Final = 16 * 1024 * 1024
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
_encode = msgspec.json.Encoder().encode


class Answer(NamedTuple):
    """What a handler answers: a status, a JSON body already encoded, extra headers."""

    status: int
    body: bytes
    headers: Mapping[str, str] | None = None


class Request:
    """One request, read whole: method, percent-decoded path, headers, body."""

    __slots__ = ("_connection", "_headers", "body", "method", "path", "query")

    def __init__(
        self,
        connection: _Connection,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> None:
        self._connection = connection
        self.method = method
        path, _, self.query = target.partition("?")
        self.path = urllib.parse.unquote(path) if "%" in path else path
        self._headers = headers  # (lowered name, value) as they came
        self.body = body

    def header(self, name: str) -> str | None:
        """The first value of header `name` (any case), or None."""
        wanted = name.lower().encode("latin-1")
        for key, value in self._headers:
            if key == wanted:
                return value.decode("latin-1")
        return None

    def abort(self) -> None:
        """Drop the connection without answering: the client sees a reset or an EOF."""
        self._connection.abort()


Handler = Callable[[Request], Answer | Awaitable[Answer]]


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Head(NamedTuple):
    method: str
    target: str
    http10: bool
    headers: list[tuple[bytes, bytes]]
    length: int  # -1: chunked
    keep_alive: bool
    expect_continue: bool


_PHRASES: Final = {status.value: status.phrase.encode("ascii") for status in http.HTTPStatus}


def error_body(code: str, message: str) -> bytes:
    """The fake vendor's JSON error shape."""
    return _encode({"error": {"code": code, "message": message}})


class _Connection(asyncio.Protocol):
    """One client connection: requests parsed as bytes arrive, answered in order.

    The queue holds what has been read and not answered yet: (request, head) pairs, and
    at most one refusal (a request that could not be read) at its end, answered in its
    turn; nothing after it is read."""

    def __init__(self, server: _Server) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._head: _Head | None = None  # read, its body not yet whole
        self._continued = False  # 100 Continue sent for the head above
        self._queue: collections.deque[tuple[Request, _Head] | _BadRequest] = collections.deque()
        self._waiting: asyncio.Task[None] | None = None  # an answer being awaited
        self._closed = False
        self._done_reading = False  # the last request came (Connection: close, a refusal)

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self._server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._done_reading:
            return
        self._buffer += data
        try:
            self._read_requests()
        except _BadRequest as exc:
            self._done_reading = True
            self._queue.append(exc)
        self._answer_queued()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._server.connections.discard(self)
        if self._waiting is not None:
            self._waiting.cancel()

    # -- reading ------------------------------------------------------------------------

    def _read_requests(self) -> None:
        buffer = self._buffer
        while buffer and not self._done_reading:
            head = self._head
            if head is None:
                end = buffer.find(b"\r\n\r\n")
                if end < 0 and len(buffer) <= _MAX_HEAD:
                    return
                if end < 0 or end > _MAX_HEAD:
                    raise _BadRequest(431, "a request head over 64 KiB")
                head = self._head = _parse_head(bytes(buffer[:end]))
                del buffer[: end + 4]
                self._continued = False
            if head.length >= 0:
                if len(buffer) < head.length:
                    self._continue(head)
                    return
                body = bytes(buffer[: head.length])
                del buffer[: head.length]
            else:
                chunked = _dechunk(buffer)
                if chunked is None:
                    self._continue(head)
                    return
                body = chunked
            self._head = None
            self._queue.append((Request(self, head.method, head.target, head.headers, body), head))
            self._done_reading = not head.keep_alive

    def _continue(self, head: _Head) -> None:
        if head.expect_continue and not self._continued and self._transport is not None:
            self._continued = True
            self._transport.write(_CONTINUE)

    # -- answering ----------------------------------------------------------------------

    def _answer_queued(self) -> None:
        """Answer what is queued, in order, until an answer has to be awaited."""
        while self._queue and self._waiting is None and not self._closed:
            item = self._queue.popleft()
            if isinstance(item, _BadRequest):
                body = error_body("bad_request", str(item))
                self._write(Answer(item.status, body), None)
                return
            request, head = item
            try:
                answer = self._server.handler(request)
            except Exception as exc:
                answer = _crashed(request, exc)
            if isinstance(answer, Answer):
                self._write(answer, head)
            else:
                self._waiting = self._server.spawn(self._await(request, head, answer))

    async def _await(self, request: Request, head: _Head, pending: Awaitable[Answer]) -> None:
        try:
            answer = await pending
        except Exception as exc:
            answer = _crashed(request, exc)
        finally:
            self._waiting = None
        self._write(answer, head)
        self._answer_queued()

    def _write(self, answer: Answer, head: _Head | None) -> None:
        """Write the answer to the request `head` read (None: a refusal, which closes)."""
        transport = self._transport
        if transport is None or self._closed:
            return  # aborted while answering (an ambiguous submit): nothing goes out
        status, body, extra = answer
        lines = [
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            % (status, _PHRASES.get(status, b"Unknown"), len(body))
        ]
        if extra:
            lines += [
                b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1"))
                for name, value in extra.items()
            ]
        closing = head is None or not head.keep_alive
        if closing:
            lines.append(b"Connection: close\r\n")
        elif head is not None and head.http10:  # (not None: closing says so; mypy can't)
            lines.append(b"Connection: keep-alive\r\n")
        lines.append(b"\r\n")
        if head is None or head.method != "HEAD":
            lines.append(body)
        transport.write(b"".join(lines))
        if closing:
            self.close()

    def abort(self) -> None:
        self._closed = self._done_reading = True
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        """Close once what was written has gone out."""
        self._closed = self._done_reading = True
        if self._transport is not None:
            self._transport.close()


def _crashed(request: Request, exc: Exception) -> Answer:
    logger.exception("the fake vendor failed answering %s %s", request.method, request.path)
    return Answer(500, error_body("internal", f"{type(exc).__name__}: {exc}"))


def _parse_head(head: bytes) -> _Head:
    line_end = head.find(b"\r\n")
    first = head if line_end < 0 else head[:line_end]
    request_line = _REQUEST_LINE.fullmatch(first)
    if request_line is None:
        raise _BadRequest(400, f"not an HTTP/1.x request line: {first[:80]!r}")
    if line_end >= 0 and _FIELD_LINES.fullmatch(head, line_end) is None:
        raise _BadRequest(400, "a header line is not <token>:<value>")
    method, target, minor = request_line.groups()
    headers: list[tuple[bytes, bytes]] = []
    lengths: set[bytes] = set()
    coding = connection = b""
    expect = False
    if line_end >= 0:
        for line in head[line_end + 2 :].split(b"\r\n"):
            name, _, value = line.partition(b":")
            name = name.lower()
            value = value.strip(b" \t")
            headers.append((name, value))
            if name == b"content-length":
                lengths.update(part.strip(b" \t") for part in value.split(b","))
            elif name == b"transfer-encoding":
                coding += b"," + value.lower()
            elif name == b"connection":
                connection += b"," + value.lower()
            elif name == b"expect":
                expect = value.lower() == b"100-continue"
    tokens = {token.strip(b" \t") for token in connection.split(b",")}
    keep_alive = b"close" not in tokens if minor == b"1" else b"keep-alive" in tokens
    if coding:
        if lengths:
            raise _BadRequest(400, "both Transfer-Encoding and Content-Length")
        if coding.rpartition(b",")[2].strip(b" \t") != b"chunked":
            raise _BadRequest(400, "a Transfer-Encoding that does not end in chunked")
        length = -1
    elif lengths:
        value = lengths.pop()
        if lengths or _DIGITS.fullmatch(value) is None:
            raise _BadRequest(400, "an invalid or conflicting Content-Length")
        length = int(value)
        if length > _MAX_BODY:
            raise _BadRequest(413, f"a body of {length} bytes, over the limit of {_MAX_BODY}")
    else:
        length = 0
    return _Head(
        method.decode("ascii"),
        target.decode("latin-1"),
        minor == b"0",
        headers,
        length,
        keep_alive,
        expect and minor == b"1",
    )


def _dechunk(buffer: bytearray) -> bytes | None:
    """The chunked body at the start of `buffer`, removed from it; None until it is whole."""
    chunks: list[bytes] = []
    size_total = 0
    at = 0
    while True:
        eol = buffer.find(b"\r\n", at)
        if eol < 0:
            if len(buffer) - at > _MAX_HEAD:
                raise _BadRequest(400, "a chunk-size line over 64 KiB")
            return None
        size_line = _CHUNK_SIZE.fullmatch(buffer, at, eol)
        if size_line is None:
            raise _BadRequest(400, "a malformed chunk-size line")
        size = int(size_line[1], 16)
        start = eol + 2
        if size == 0:
            break
        size_total += size
        if size_total > _MAX_BODY:
            raise _BadRequest(413, f"a chunked body over the limit of {_MAX_BODY} bytes")
        if len(buffer) < start + size + 2:
            return None
        if buffer[start + size : start + size + 2] != b"\r\n":
            raise _BadRequest(400, "chunk data not followed by CRLF")
        chunks.append(bytes(buffer[start : start + size]))
        at = start + size + 2
    # Trailer lines until an empty one.
    at = start
    while True:
        eol = buffer.find(b"\r\n", at)
        if eol < 0:
            return None
        if eol == at:
            del buffer[: eol + 2]
            return b"".join(chunks)
        at = eol + 2


class _Server:
    """The listening socket, its connections, and the tasks of awaited answers."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coroutine: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def close(self) -> None:
        for connection in list(self.connections):
            connection.abort()
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


@contextlib.asynccontextmanager
async def serving(
    handler: Handler, host: str = "127.0.0.1", port: int = 0, *, backlog: int = 4096
) -> AsyncIterator[int]:
    """Serve `handler` on the running loop; yields the bound port. On exit the listener
    closes, every connection is dropped and every awaited answer cancelled."""
    server = _Server(handler)
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(lambda: _Connection(server), host, port, backlog=backlog)
    try:
        yield listener.sockets[0].getsockname()[1]
    finally:
        listener.close()
        await server.close()
        await listener.wait_closed()
