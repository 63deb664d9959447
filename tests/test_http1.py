"""Http1Pool over real loopback sockets: framing, keep-alive, limits, errors, cancellation, TLS.

Every request here is a request with its body in memory on the shared client, which
`PoolTransport` sends through `asynctaskd.http1.Http1Pool`. The servers
are raw asyncio streams in the test's own event loop that write exact bytes, so each test
controls the framing byte for byte and counts the connections it accepts. Tests
synchronise on events the servers (or the pool's connections) set, never on sleeps.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import anyio
import httpx
import pytest

from asynctaskd.http1 import Http1Pool
from asynctaskd.http1 import pool as http1_pool
from asynctaskd.http1 import protocol as http1_protocol
from asynctaskd.http1.protocol import _Connection
from asynctaskd.transport import Fetcher, PoolTransport, fetcher_for, make_http_client
from asynctaskd.transport import fetcher as transport_fetcher
from tests.test_transport import (
    NEVER_SENT,
    Handler,
    certificate,  # noqa: F401 - a fixture, used by tls_url
    ok_response,
    raw_server,
    read_request,
    tls_url,  # noqa: F401 - a fixture
)

pytestmark = pytest.mark.anyio


# --- servers and observers ---------------------------------------------------------------


class Seen:
    """What a raw server saw: connections accepted, request heads, connections the client
    closed (EOF or reset while the server waited for the next request)."""

    def __init__(self) -> None:
        self.accepted = 0
        self.heads: list[bytes] = []
        self.hang_ups = 0
        self.arrived = asyncio.Event()
        self.hung_up = asyncio.Event()

    def record(self, head: bytes) -> None:
        self.heads.append(head)
        self.arrived.set()

    def client_closed(self) -> None:
        self.hang_ups += 1
        self.hung_up.set()

    @property
    def paths(self) -> list[bytes]:
        return [head.split(b" ", 2)[1] for head in self.heads]


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    """`raw_server`, which on exit also closes every connection it accepted and lets its
    handlers finish (Python 3.11 leaves them running with their sockets open)."""
    writers: list[asyncio.StreamWriter] = []
    handlers: set[asyncio.Task[object]] = set()

    async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        writers.append(writer)
        await handler(reader, writer)

    async with raw_server(tracked) as url:
        try:
            yield url
        finally:
            for writer in writers:
                writer.close()  # a handler blocked on a read sees EOF and returns
            if handlers:
                with anyio.move_on_after(5):
                    await asyncio.wait(handlers)


async def until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read and discard until the client closes the connection, then close this side."""
    try:
        while await reader.read(65536):
            pass
    except ConnectionError:
        pass
    writer.close()


def replying(seen: Seen, replies: Sequence[bytes], *, hang_up: bool = False) -> Handler:
    """A server answering the n-th request it receives (on any connection) with replies[n]
    (the last one once they run out), closing the connection after each reply if `hang_up`."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.accepted += 1
        try:
            while True:
                try:
                    head, _ = await read_request(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    seen.client_closed()
                    return
                index = len(seen.heads)
                seen.record(head)
                writer.write(replies[min(index, len(replies) - 1)])
                await writer.drain()
                if hang_up:
                    return
        finally:
            writer.close()

    return handler


def silent(seen: Seen) -> Handler:
    """A server that reads one request, never answers, and notes when the client closes."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.accepted += 1
        with contextlib.suppress(asyncio.IncompleteReadError):  # closed before a request
            head, _ = await read_request(reader)
            seen.record(head)
        await until_closed(reader, writer)
        seen.client_closed()

    return handler


class Reads:
    """Every `data_received` call of the pool's connections, observed and passed on as is."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self._more = asyncio.Event()

    def saw(self, data: bytes) -> None:
        self.sizes.append(len(data))
        self._more.set()

    async def until(self, count: int) -> None:
        """Wait until the pool's connections have received `count` reads in all."""
        while len(self.sizes) < count:
            self._more.clear()
            await self._more.wait()


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    """Lets a server wait until the client has parsed what it wrote (the network is real)."""
    observed = Reads()
    original = _Connection.data_received

    def data_received(self: _Connection, data: bytes) -> None:
        observed.saw(data)
        original(self, data)

    monkeypatch.setattr(_Connection, "data_received", data_received)
    return observed


def pool_of(http: httpx.AsyncClient) -> Http1Pool:
    transport = fetcher_for(http)._transport
    assert transport is not None and transport._pool is not None
    return transport._pool


def _client(transport: PoolTransport) -> httpx.AsyncClient:
    """A stock client over `transport`, whose `fetcher_for` knows the transport."""
    client = httpx.AsyncClient(transport=transport)
    transport_fetcher._FETCHERS[client] = Fetcher(client, transport)
    return client


def client_with(limits: httpx.Limits) -> httpx.AsyncClient:
    """A stock client over a transport with `limits` (make_http_client fixes keep-alive
    at 30 s)."""
    return _client(PoolTransport(limits=limits))


class SlotQueue(collections.deque["asyncio.Future[None]"]):
    """Http1Pool's queue of requests waiting for a slot, signalling each one that joins."""

    def __init__(self) -> None:
        super().__init__()
        self.joined = asyncio.Event()

    def append(self, waiter: asyncio.Future[None]) -> None:
        super().append(waiter)
        self.joined.set()


async def get_many(http: httpx.AsyncClient, url: str, count: int) -> list[bytes]:
    return [(await http.get(f"{url}/{n}")).content for n in range(count)]


async def get_twice(replies: Sequence[bytes], *, hang_up: bool = False) -> tuple[list[bytes], int]:
    """Two GETs in turn from a new shared client to a `replying` server: the two bodies,
    and how many connections the server accepted."""
    seen = Seen()
    async with (
        serving(replying(seen, replies, hang_up=hang_up)) as url,
        make_http_client() as http,
    ):
        with anyio.fail_after(5):
            bodies = await get_many(http, url, 2)
    return bodies, seen.accepted


# --- keep-alive and response framing -----------------------------------------------------


async def test_sequential_requests_share_one_keepalive_connection() -> None:
    seen = Seen()
    replies = [ok_response(b"one"), ok_response(b"two"), ok_response(b"three")]
    async with serving(replying(seen, replies)) as url, make_http_client() as http:
        bodies = await get_many(http, url, 3)

    assert bodies == [b"one", b"two", b"three"]
    assert seen.accepted == 1
    assert seen.paths == [b"/0", b"/1", b"/2"]


async def test_a_post_body_is_sent_with_its_head() -> None:
    bodies: list[bytes] = []

    async def echo_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, body = await read_request(reader)
        bodies.append(body)
        writer.write(ok_response(body))
        await writer.drain()
        await until_closed(reader, writer)

    async with serving(echo_body) as url, make_http_client() as http:
        response = await http.post(f"{url}/v1/jobs", content=b'{"input": {"n": 1}}')

    assert bodies == [b'{"input": {"n": 1}}']
    assert response.content == b'{"input": {"n": 1}}'


FRAMED = {
    "content-length": (b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world", b"hello world"),
    "zero-length": (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", b""),
    "chunked-with-extension-and-trailers": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;x=y\r\nhello\r\n1\r\n \r\nA\r\nworld\r\n!!!\r\n0\r\nX-Trailer: t\r\nX-More: u\r\n\r\n",
        b"hello world\r\n!!!",
    ),
    "chunked-without-trailers": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        b"ok",
    ),
}


@pytest.mark.parametrize("case", list(FRAMED))
async def test_a_framed_body_is_read_whole_and_the_connection_reused(case: str) -> None:
    reply, body = FRAMED[case]
    bodies, accepted = await get_twice([reply])

    assert bodies == [body, body]
    assert accepted == 1


async def test_a_chunked_body_split_into_single_bytes_is_reassembled(reads: Reads) -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = b"3;ext=1\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\nX-T: 1\r\n\r\n"
    seen = Seen()

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.accepted += 1
        head_in, _ = await read_request(reader)
        seen.record(head_in)
        writer.write(head)
        await reads.until(1)
        # One byte at a time, each written only once the client has parsed the one before:
        # every size line, chunk, CRLF and trailer is split at every possible point.
        for n in range(len(body)):
            writer.write(body[n : n + 1])
            await writer.drain()
            await reads.until(2 + n)
        head_in, _ = await read_request(reader)
        seen.record(head_in)
        writer.write(ok_response(b"next"))
        await writer.drain()
        await until_closed(reader, writer)

    async with serving(trickle) as url, make_http_client() as http:
        with anyio.fail_after(5):
            first = await http.get(f"{url}/trickled")
            second = await http.get(f"{url}/next")

    assert first.content == b"abc0123456789abcdef"
    assert reads.sizes[: 1 + len(body)] == [len(head)] + [1] * len(body)
    assert second.content == b"next"
    assert seen.accepted == 1  # the trickled exchange left the connection reusable


async def test_a_body_delimited_by_close_arrives_whole_and_is_not_reused() -> None:
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end"
    bodies, accepted = await get_twice([reply], hang_up=True)

    assert bodies == [b"until the end", b"until the end"]
    assert accepted == 2


# The server keeps every connection open: only the client decides whether to reuse one.
REUSE = {
    "http/1.1": (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", 1),
    "http/1.1-connection-close": (
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
        2,
    ),
    "http/1.1-connection-close-in-a-list": (
        b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive, Close\r\nContent-Length: 2\r\n\r\nok",
        2,
    ),
    "http/1.0": (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", 2),
    "http/1.0-keep-alive": (
        b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok",
        1,
    ),
}


@pytest.mark.parametrize("case", list(REUSE))
async def test_the_response_decides_whether_the_connection_is_reused(case: str) -> None:
    reply, connections = REUSE[case]
    bodies, accepted = await get_twice([reply])

    assert bodies == [b"ok", b"ok"]
    assert accepted == connections


@pytest.mark.parametrize(("connection", "connections"), [("close", 3), ("keep-alive", 1)])
async def test_a_request_that_asks_to_close_is_not_reused(
    connection: str, connections: int
) -> None:
    seen = Seen()  # the server answers without Connection: close and keeps the socket open
    async with serving(replying(seen, [ok_response()])) as url, make_http_client() as http:
        with anyio.fail_after(5):
            first = await http.get(f"{url}/first", headers={"Connection": connection})
            # the same headers again: the pool remembers the checked block and its close
            again = await http.get(f"{url}/again", headers={"Connection": connection})
            second = await http.get(f"{url}/second")

    assert (first.text, again.text, second.text) == ("ok", "ok", "ok")
    assert seen.accepted == connections


async def test_a_bad_request_line_is_refused_with_headers_checked_before() -> None:
    seen = Seen()
    async with serving(replying(seen, [ok_response()])) as url, make_http_client() as http:
        with anyio.fail_after(5):
            assert (await http.get(f"{url}/ok")).text == "ok"
            with pytest.raises(httpx.LocalProtocolError):
                await http.request("GET\r\nX-Evil: 1\r\nGET", f"{url}/ok")
            with pytest.raises(httpx.LocalProtocolError):
                await http.request("G T", f"{url}/ok")

    assert seen.paths == [b"/ok"]


@pytest.mark.parametrize("target", [b"/ok x", b"/ok\x7f", b"/ok\x00", b"/ok\r\nX-Evil: 1", b""])
async def test_a_bad_target_is_refused_after_good_requests_of_the_same_shape(
    target: bytes,
) -> None:
    """A request line is checked by its target alone once its method passed: a target
    with a space, a control or DEL is still refused, unsent, whatever went before."""
    seen = Seen()
    async with serving(replying(seen, [ok_response()])) as url, make_http_client() as http:
        with anyio.fail_after(5):
            fetch = fetcher_for(http)
            assert (await fetch("GET", f"{url}/ok")).text == "ok"
            assert (await fetch("GET", f"{url}/ok")).text == "ok"
            pool = pool_of(http)
            host = url.removeprefix("http://")
            hostname, port = host.rsplit(":", 1)
            with pytest.raises(httpx.LocalProtocolError):
                await pool.send(
                    "GET",
                    ("http", hostname, int(port)),
                    target,
                    [(b"Host", host.encode())],
                    b"",
                    {"read": 5.0, "connect": 5.0, "pool": 5.0},
                    None,
                )

    assert seen.paths == [b"/ok", b"/ok"]


async def test_a_keepalive_connection_reads_each_answer_with_one_parser(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """llhttp starts a new message after a complete one: a connection kept alive reuses its
    parser, and takes a new one after an answer llhttp did not end itself (a HEAD's)."""
    made: list[object] = []
    real = http1_protocol.httptools.HttpResponseParser

    def counted(protocol: object) -> object:
        made.append(protocol)
        return real(protocol)

    monkeypatch.setattr(http1_protocol.httptools, "HttpResponseParser", counted)
    seen = Seen()
    chunked = FRAMED["chunked-with-extension-and-trailers"][0]
    replies = [chunked, ok_response(b"two"), NO_BODY["head"][1], ok_response(b"four")]
    async with serving(replying(seen, replies)) as url, make_http_client() as http:
        with anyio.fail_after(5):
            first = await http.get(f"{url}/1")
            second = await http.get(f"{url}/2")
            assert len(made) == 1  # one parser for both answers
            third = await http.head(f"{url}/3")
            fourth = await http.get(f"{url}/4")
            (connection,) = pool_of(http)._all
            assert connection._spare is not None  # kept for a fifth

    assert (first.content, second.content) == (b"hello world\r\n!!!", b"two")
    assert (third.content, fourth.content) == (b"", b"four")
    assert seen.accepted == 1
    assert len(made) == 2  # a new one after the HEAD
    assert connection._spare is None  # closed with the client: nothing kept


NO_BODY = {
    "head": ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"),
    "head-chunked": ("HEAD", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"),
    "204": ("GET", b"HTTP/1.1 204 No Content\r\n\r\n"),
    "304": ("GET", b"HTTP/1.1 304 Not Modified\r\nContent-Length: 100\r\n\r\n"),
}


@pytest.mark.parametrize("case", list(NO_BODY))
async def test_a_response_without_body_is_empty_and_the_connection_reused(case: str) -> None:
    method, reply = NO_BODY[case]
    seen = Seen()
    replies = [reply, ok_response(b"after")]
    async with serving(replying(seen, replies)) as url, make_http_client() as http:
        with anyio.fail_after(5):
            first = await http.request(method, f"{url}/nobody")
            second = await http.get(f"{url}/after")

    assert first.content == b""
    assert first.status_code == int(reply.split(b" ")[1])
    assert second.content == b"after"  # not the 100 body bytes the first one announced
    assert seen.accepted == 1


INTERIM = {
    "100-continue": b"HTTP/1.1 100 Continue\r\n\r\n",
    "103-early-hints": b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n",
    "both": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n",
}


@pytest.mark.parametrize("case", list(INTERIM))
async def test_interim_responses_are_skipped(case: str) -> None:
    seen = Seen()
    reply = INTERIM[case] + b"HTTP/1.1 200 OK\r\nX-Final: yes\r\nContent-Length: 5\r\n\r\nfinal"
    async with serving(replying(seen, [reply])) as url, make_http_client() as http:
        with anyio.fail_after(5):
            response = await http.post(f"{url}/v1/jobs", json={"input": {}})

    assert response.status_code == 200
    assert response.content == b"final"
    assert response.headers["x-final"] == "yes"
    assert "link" not in response.headers


async def test_bytes_after_a_complete_response_poison_the_connection() -> None:
    replies = [ok_response(b"first") + ok_response(b"unsolicited"), ok_response(b"second")]
    bodies, accepted = await get_twice(replies)

    assert bodies == [b"first", b"second"]
    assert accepted == 2  # the connection with the extra bytes was not reused


async def test_bytes_arriving_on_an_idle_connection_poison_it(reads: Reads) -> None:
    seen = Seen()
    poisoned = asyncio.Event()

    async def then_408(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.accepted += 1
        head, _ = await read_request(reader)
        seen.record(head)
        writer.write(ok_response(b"answer"))
        if len(seen.heads) == 1:
            await reads.until(1)  # the client has the answer: the connection is idle now
            writer.write(b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n\r\n")
            await reads.until(2)  # and the client has read the unsolicited 408 too
            poisoned.set()
        await until_closed(reader, writer)
        seen.client_closed()

    async with serving(then_408) as url, make_http_client() as http:
        with anyio.fail_after(5):
            first = await http.get(f"{url}/first")
            await poisoned.wait()
            await seen.hung_up.wait()  # the client closed the connection the 408 came on
            second = await http.get(f"{url}/second")

    assert (first.content, second.content) == (b"answer", b"answer")
    assert seen.accepted == 2
    assert seen.paths == [b"/first", b"/second"]


# --- protocol errors ---------------------------------------------------------------------

OK_HEAD = b"HTTP/1.1 200 OK\r\n"
MALFORMED = {
    "conflicting-content-lengths": OK_HEAD
    + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    # llhttp refuses a repeated Content-Length even when the values agree.
    "same-length-twice": OK_HEAD + b"Content-Length: 2\r\nContent-Length: 2\r\n\r\nok",
    "content-length-list": OK_HEAD + b"Content-Length: 5, 6\r\n\r\nhello!",
    "non-numeric-content-length": OK_HEAD + b"Content-Length: five\r\n\r\nhello",
    "negative-content-length": OK_HEAD + b"Content-Length: -5\r\n\r\nhello",
    "status-line-without-code": b"HTTP/1.1 OK\r\nContent-Length: 2\r\n\r\nok",
    "status-line-two-digit-code": b"HTTP/1.1 20 OK\r\nContent-Length: 2\r\n\r\nok",
    "not-http": b"ICY 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "http-2-status-line": b"HTTP/2 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "header-without-colon": OK_HEAD + b"X-Broken\r\nContent-Length: 2\r\n\r\nok",
    "space-inside-header-name": OK_HEAD + b"X Broken: 1\r\nContent-Length: 2\r\n\r\nok",
    "space-before-colon": OK_HEAD + b"Content-Length : 2\r\n\r\nok",
    "folded-header": OK_HEAD + b"X-A: 1\r\n  continued\r\nContent-Length: 2\r\n\r\nok",
    "nul-in-header-value": OK_HEAD + b"X-A: a\x00b\r\nContent-Length: 2\r\n\r\nok",
    "bad-chunk-size": OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    "chunk-data-without-crlf": OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhelloXY0\r\n\r\n",
    "head-over-64-kib": OK_HEAD + b"X-Pad: " + b"a" * (70 * 1024),
    "chunk-size-line-over-64-kib": OK_HEAD
    + b"Transfer-Encoding: chunked\r\n\r\n5;"
    + b"x" * (70 * 1024),
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_a_malformed_response_is_remote_protocol_error(case: str) -> None:
    seen = Seen()

    async def malformed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        seen.record(head)
        writer.write(MALFORMED[case])
        await writer.drain()
        # The server stays: the error must come from parsing, not from a disconnect.
        await until_closed(reader, writer)
        seen.client_closed()

    async with serving(malformed) as url, make_http_client() as http:
        with anyio.fail_after(5):
            with pytest.raises(httpx.RemoteProtocolError) as caught:
                await http.get(f"{url}/bad")
            await seen.hung_up.wait()  # and the client dropped the connection

    assert not isinstance(caught.value, NEVER_SENT)
    assert "disconnected" not in str(caught.value)
    assert caught.value.request.url.path == "/bad"


# --- what the request carries ------------------------------------------------------------

INVALID_HEADERS = [
    pytest.param({"X-A": "v\r\nX-Evil: 1"}, id="crlf-then-header-in-value"),
    pytest.param({"X-A": "v\nX-Evil: 1"}, id="lf-in-value"),
    pytest.param({"X-A": "v\rX-Evil: 1"}, id="cr-in-value"),
    pytest.param({"X-A": "v\r\n"}, id="trailing-crlf-in-value"),
    pytest.param({"X-A": "v\x00x"}, id="nul-in-value"),
    pytest.param({"X Evil": "1"}, id="space-in-name"),
    pytest.param({"X-A:B": "1"}, id="colon-in-name"),
]


@pytest.mark.parametrize("headers", INVALID_HEADERS)
async def test_a_header_http_1_1_cannot_carry_is_refused_before_connecting(
    headers: dict[str, str],
) -> None:
    # httpx itself lets all of these through (h11 refuses them only in httpx's own pool).
    httpx.Request("GET", "http://127.0.0.1/", headers=headers)
    seen = Seen()
    async with serving(replying(seen, [ok_response()])) as url, make_http_client() as http:
        with anyio.fail_after(5):
            with pytest.raises(httpx.LocalProtocolError):
                await http.get(f"{url}/injected", headers=headers)
            assert (await http.get(f"{url}/clean")).text == "ok"

    assert seen.accepted == 1
    assert seen.paths == [b"/clean"]  # the refused request never reached the server
    assert b"X-Evil" not in b"".join(seen.heads)


async def test_header_names_are_sent_in_the_case_written() -> None:
    seen = Seen()
    async with serving(replying(seen, [ok_response()])) as url, make_http_client() as http:
        await http.get(f"{url}/case", headers={"X-Mixed-Case": "1", "x-lower": "2"})

    assert b"\r\nX-Mixed-Case: 1\r\n" in seen.heads[0]
    assert b"\r\nx-lower: 2\r\n" in seen.heads[0]
    assert seen.heads[0].startswith(b"GET /case HTTP/1.1\r\nHost: 127.0.0.1:")


# --- read timeout ------------------------------------------------------------------------

READ_TIMEOUT = httpx.Timeout(5.0, read=0.3)
PACE = 0.1  # well under the read timeout


def paced(pieces: int) -> Handler:
    """Answer with a 6-byte Content-Length body, writing `pieces` bytes of it PACE apart."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n")
        for byte in b"paced!"[:pieces]:
            # The stimulus under test, not synchronisation: a server that keeps sending,
            # slowly. Each gap is a third of the read timeout; together they exceed it.
            await asyncio.sleep(PACE)
            writer.write(bytes([byte]))
            await writer.drain()
        await until_closed(reader, writer)  # then silence

    return handler


async def test_the_read_timeout_restarts_while_bytes_keep_arriving() -> None:
    async with (
        serving(paced(6)) as url,
        make_http_client(timeout=READ_TIMEOUT) as http,
    ):
        started = time.monotonic()
        with anyio.fail_after(5):
            response = await http.get(f"{url}/slowly")
        elapsed = time.monotonic() - started

    assert response.content == b"paced!"
    assert elapsed >= 6 * PACE  # longer than the read timeout, in all


async def test_silence_after_part_of_the_body_is_read_timeout() -> None:
    async with (
        serving(paced(2)) as url,
        make_http_client(timeout=READ_TIMEOUT) as http,
    ):
        started = time.monotonic()
        with anyio.fail_after(5), pytest.raises(httpx.ReadTimeout):
            await http.get(f"{url}/stalls")
        elapsed = time.monotonic() - started

    # Counted from the last byte, not from the request: two gaps plus the whole timeout.
    assert elapsed >= 2 * PACE + 0.3 - 0.02


def answering_after(seen: Seen, delays: Sequence[float | None]) -> Handler:
    """Answer the n-th request on the connection after delays[n] seconds (None: never)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.accepted += 1
        for delay in delays:
            head, _ = await read_request(reader)
            seen.record(head)
            if delay is None:
                break
            await asyncio.sleep(delay)  # the stimulus: a server this slow to answer
            writer.write(ok_response(b"late"))
            await writer.drain()
        await until_closed(reader, writer)

    return handler


async def test_exchanges_on_one_connection_each_get_the_whole_read_timeout() -> None:
    # The read timer lives with the connection, armed by the first exchange: each later
    # one must still be timed from its own start, not from the first's.
    seen = Seen()
    async with (
        serving(answering_after(seen, [2 * PACE] * 4)) as url,
        make_http_client(timeout=READ_TIMEOUT) as http,
    ):
        started = time.monotonic()
        with anyio.fail_after(5):
            for _ in range(4):
                assert (await http.get(f"{url}/each")).content == b"late"
        elapsed = time.monotonic() - started

    assert seen.accepted == 1
    assert elapsed >= 8 * PACE  # over twice the read timeout on the one connection


async def test_a_shorter_read_timeout_on_a_reused_connection_applies() -> None:
    seen = Seen()
    async with (
        serving(answering_after(seen, [0.0, None])) as url,
        make_http_client(timeout=httpx.Timeout(5.0, read=60.0)) as http,
    ):
        assert (await http.get(f"{url}/first")).content == b"late"
        http.timeout = READ_TIMEOUT  # the timer the first exchange armed fires in 60 s
        started = time.monotonic()
        with anyio.fail_after(5), pytest.raises(httpx.ReadTimeout):
            await http.get(f"{url}/second")
        elapsed = time.monotonic() - started

    assert seen.accepted == 1
    assert 0.3 - 0.02 <= elapsed < 30  # the 0.3 s timeout, not the 60 s one armed before


# --- pool limits, eviction, expiry -------------------------------------------------------


def holding(seen: Seen, release: asyncio.Event, answer: Callable[[bytes], bytes]) -> Handler:
    """A server that reads requests one after another and answers each with
    `answer(path)`, but only once `release` is set."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.accepted += 1
        while True:
            try:
                head, _ = await read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
                return
            seen.record(head)
            await release.wait()
            writer.write(answer(head.split(b" ")[1]))
            await writer.drain()

    return handler


@pytest.mark.parametrize(
    ("connection_header", "connections"),
    [(b"", 1), (b"Connection: close\r\n", 2)],
    ids=["kept-alive", "closed-after-the-first"],
)
async def test_one_slot_serves_concurrent_requests_in_turn(
    connection_header: bytes, connections: int
) -> None:
    """The queued request takes the slot when the first one hands its connection back, or
    when that connection is closed instead."""
    seen = Seen()
    release = asyncio.Event()

    def echo_path(path: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\n%sContent-Length: %d\r\n\r\n%s" % (
            connection_header,
            len(path),
            path,
        )

    hold_first = holding(seen, release, echo_path)
    bodies: dict[str, bytes] = {}

    async def get(http: httpx.AsyncClient, url: str, path: str) -> None:
        bodies[path] = (await http.get(f"{url}{path}")).content

    async with (
        serving(hold_first) as url,
        make_http_client(max_connections=1) as http,
        anyio.create_task_group() as tg,
    ):
        with anyio.fail_after(5):
            tg.start_soon(get, http, url, "/first")
            await seen.arrived.wait()
            queue = SlotQueue()
            pool_of(http)._waiters = queue
            tg.start_soon(get, http, url, "/second")
            await queue.joined.wait()  # the second request waits for the only slot
            assert seen.paths == [b"/first"]
            release.set()

    assert bodies == {"/first": b"/first", "/second": b"/second"}
    assert seen.accepted == connections
    assert seen.paths == [b"/first", b"/second"]


async def test_a_cancelled_waiter_does_not_take_the_next_free_slot() -> None:
    seen = Seen()
    release = asyncio.Event()
    hold_first = holding(seen, release, lambda path: ok_response())

    async with (
        serving(hold_first) as url,
        make_http_client(max_connections=1) as http,
        anyio.create_task_group() as tg,
    ):
        with anyio.fail_after(5):
            tg.start_soon(http.get, f"{url}/first")
            await seen.arrived.wait()
            queue = SlotQueue()
            pool_of(http)._waiters = queue
            async with anyio.create_task_group() as doomed:
                doomed.start_soon(http.get, f"{url}/cancelled")
                await queue.joined.wait()
                doomed.cancel_scope.cancel()
            release.set()
            third = await http.get(f"{url}/third")

    assert third.text == "ok"
    assert seen.paths == [b"/first", b"/third"]
    assert seen.accepted == 1
    assert not queue  # the cancelled waiter left the queue


async def test_an_idle_connection_to_another_origin_is_evicted_at_the_limit() -> None:
    seen_a, seen_b = Seen(), Seen()
    async with (
        serving(replying(seen_a, [ok_response(b"a")])) as url_a,
        serving(replying(seen_b, [ok_response(b"b")])) as url_b,
        make_http_client(max_connections=1) as http,
    ):
        with anyio.fail_after(5):
            first = await http.get(f"{url_a}/a")
            second = await http.get(f"{url_b}/b")
            await seen_a.hung_up.wait()  # A's idle connection was closed to make room

        assert (first.content, second.content) == (b"a", b"b")
        assert (seen_a.accepted, seen_b.accepted) == (1, 1)
        assert seen_b.hang_ups == 0  # B's connection stays pooled


@contextlib.contextmanager
def closing_after_first_answer() -> Iterator[tuple[str, threading.Event, list[socket.socket]]]:
    """A blocking server in a thread of its own, so that its close reaches the client's
    socket while the test's event loop does not run: it answers every connection once
    and closes the first one when the event is set. Yields (url, event, accepted)."""
    listener = socket.create_server(("127.0.0.1", 0))
    close_first = threading.Event()
    accepted: list[socket.socket] = []

    def serve() -> None:
        with contextlib.suppress(OSError):  # the listener closed at the end
            while True:
                conn, _ = listener.accept()
                accepted.append(conn)
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                conn.sendall(ok_response())
                if len(accepted) == 1:
                    close_first.wait(5)
                    conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", close_first, accepted
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept(); close() may not
        listener.close()
        for conn in accepted:
            conn.close()
        thread.join(5)


@pytest.mark.parametrize("probed", [True, False], ids=["idle-long-enough", "busy"])
async def test_a_close_the_loop_has_not_seen_yet_is_caught_before_reuse(
    probed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server's close that reached the socket but not yet the event loop: a connection
    idle past the probe threshold is polled and dropped; a busier one is reused as is,
    and the request fails as ambiguous (the race the probe narrows)."""
    monkeypatch.setattr(http1_pool, "_PROBE_AFTER_S", -1.0 if probed else 3600.0)
    with closing_after_first_answer() as (url, close_first, accepted):
        async with make_http_client() as http:
            with anyio.fail_after(5):
                assert (await http.get(f"{url}/first")).text == "ok"
            ((idle,),) = pool_of(http)._idle.values()
            assert idle.transport is not None
            close_first.set()
            # Block the event loop until the server's FIN is in our socket: the loop must
            # not see it before the next request picks a connection.
            sock = idle.transport.get_extra_info("socket")
            assert select.select([sock], [], [], 5)[0]
            with anyio.fail_after(5):
                if probed:
                    second = await http.get(f"{url}/second")
                else:
                    with pytest.raises(httpx.RemoteProtocolError) as caught:
                        await http.get(f"{url}/second")

    if probed:
        assert second.text == "ok"
        assert len(accepted) == 2
    else:
        assert not isinstance(caught.value, NEVER_SENT)
        assert len(accepted) == 1


async def test_an_idle_connection_is_closed_after_keepalive_expiry() -> None:
    seen = Seen()
    limits = httpx.Limits(max_connections=10, max_keepalive_connections=10, keepalive_expiry=0.2)
    async with serving(replying(seen, [ok_response()])) as url, client_with(limits) as http:
        with anyio.fail_after(5):
            await http.get(f"{url}/first")
            answered = time.monotonic()
            await seen.hung_up.wait()  # the pool's sweep closed the idle connection
            idle_for = time.monotonic() - answered
            origins_after_sweep = dict(pool_of(http)._idle)
            second = await http.get(f"{url}/second")

    assert second.text == "ok"
    assert seen.accepted == 2
    assert idle_for >= 0.1  # not closed at once: it was kept alive for a while
    assert origins_after_sweep == {}  # an origin with no idle connection is forgotten


async def test_no_keepalive_connections_means_a_new_connection_per_request() -> None:
    seen = Seen()
    limits = httpx.Limits(max_connections=10, max_keepalive_connections=0)
    async with serving(replying(seen, [ok_response()])) as url, client_with(limits) as http:
        with anyio.fail_after(5):
            bodies = await get_many(http, url, 3)

    assert bodies == [b"ok"] * 3
    assert seen.accepted == 3


# --- cancellation and close --------------------------------------------------------------


async def test_cancelling_a_request_closes_its_connection_and_frees_the_slot() -> None:
    stuck, fine = Seen(), Seen()
    async with (
        serving(silent(stuck)) as stuck_url,
        serving(replying(fine, [ok_response(b"fine")])) as fine_url,
        make_http_client(max_connections=1) as http,
    ):
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(http.get, f"{stuck_url}/never-answered")
                await stuck.arrived.wait()
                tg.cancel_scope.cancel()
            await stuck.hung_up.wait()  # the cancelled exchange's connection was closed
            after = await http.get(f"{fine_url}/after")

        assert after.content == b"fine"
        assert (stuck.accepted, fine.accepted) == (1, 1)
        assert len(pool_of(http)._all) == 1  # only the connection to the well-behaved server


async def test_closing_the_client_fails_a_request_in_flight() -> None:
    seen = Seen()
    outcome: list[BaseException] = []

    async def in_flight(http: httpx.AsyncClient, url: str) -> None:
        try:
            await http.get(f"{url}/in-flight")
        except Exception as exc:
            outcome.append(exc)

    async with serving(silent(seen)) as url:
        http = make_http_client()
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(in_flight, http, url)
                await seen.arrived.wait()
                await http.aclose()
            await seen.hung_up.wait()
        with pytest.raises(RuntimeError, match="client has been closed"):
            await http.get(f"{url}/after-close")

    assert len(outcome) == 1
    assert isinstance(outcome[0], httpx.TransportError)
    assert not isinstance(outcome[0], NEVER_SENT)
    assert seen.accepted == 1  # nothing was sent after the close


async def test_closing_the_client_fails_a_queued_request_without_connecting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = Seen()
    opened: list[_Connection] = []
    original = _Connection.connection_made

    def connection_made(self: _Connection, transport: asyncio.BaseTransport) -> None:
        opened.append(self)
        original(self, transport)

    monkeypatch.setattr(_Connection, "connection_made", connection_made)
    outcome: dict[str, BaseException] = {}

    async def fail(http: httpx.AsyncClient, url: str, path: str) -> None:
        try:
            await http.get(f"{url}{path}")
        except Exception as exc:
            outcome[path] = exc

    async with serving(silent(seen)) as url:
        http = make_http_client(max_connections=1)
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(fail, http, url, "/in-flight")
                await seen.arrived.wait()
                queue = SlotQueue()
                pool_of(http)._waiters = queue
                tg.start_soon(fail, http, url, "/queued")
                await queue.joined.wait()
                await http.aclose()

    assert isinstance(outcome["/in-flight"], httpx.TransportError)
    assert isinstance(outcome["/queued"], RuntimeError | httpx.TransportError)
    assert len(opened) == 1  # the queued request found the pool closed: no new connection


async def test_closing_the_client_mid_body_does_not_return_a_truncated_body(
    reads: Reads,
) -> None:
    """A body delimited by close ends when the server closes, never when the client does:
    the aclose() must fail the exchange, not answer it with the part read so far."""
    seen = Seen()
    outcome: list[httpx.Response | BaseException] = []

    async def partial(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        seen.record(head)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npart of a body that runs until clo")
        await until_closed(reader, writer)

    async def in_flight(http: httpx.AsyncClient, url: str) -> None:
        try:
            outcome.append(await http.get(f"{url}/until-close"))
        except Exception as exc:
            outcome.append(exc)

    async with serving(partial) as url:
        http = make_http_client()
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(in_flight, http, url)
                await reads.until(1)  # the client has the head and part of the body
                await http.aclose()

    assert len(outcome) == 1
    assert isinstance(outcome[0], httpx.TransportError), outcome[0]


# --- TLS ---------------------------------------------------------------------------------


async def test_https_through_the_pool_with_a_trusted_certificate(
    tls_url: str,  # noqa: F811 - the fixture imported above
    certificate: tuple[str, str],  # noqa: F811
) -> None:
    transport = PoolTransport(verify=ssl.create_default_context(cafile=certificate[0]))
    async with _client(transport) as http:
        with anyio.fail_after(5):
            first = await http.get(tls_url)
            second = await http.get(tls_url)

        assert (first.text, second.text) == ("secret", "secret")
        assert transport._session is None  # aiohttp was never involved
        assert len(pool_of(http)._all) == 1  # one TLS connection, kept alive and reused


async def test_https_with_an_untrusted_certificate_is_connect_error(
    tls_url: str,  # noqa: F811 - the fixture imported above
) -> None:
    async with make_http_client() as http:
        with anyio.fail_after(5), pytest.raises(httpx.ConnectError) as caught:
            await http.get(tls_url)

    assert isinstance(caught.value.__cause__, ssl.SSLCertVerificationError)


async def test_a_plain_exchange_leaves_version_and_reason_out_and_others_keep_them() -> None:
    # ctx.fetch's Reply has neither: its exchanges are `plain`, and llhttp is not asked.
    seen = Seen()
    replies = [ok_response(b"one"), ok_response(b"two"), ok_response(b"three")]
    async with serving(replying(seen, replies)) as url, make_http_client() as http:
        reply = await fetcher_for(http)("GET", f"{url}/0")
        response = await http.get(f"{url}/1")
        pool = pool_of(http)
        origin = ("http", *url.removeprefix("http://").split(":"))
        answer = await pool.send(
            "GET", (origin[0], origin[1], int(origin[2])), b"/2",
            [(b"Host", b"x")], b"", {}, None, plain=True,
        )  # fmt: skip
    assert (reply.status, reply.content) == (200, b"one")
    assert response.content == b"two"
    assert response.extensions["http_version"] == b"HTTP/1.1"
    assert response.extensions["reason_phrase"] == b"OK"
    assert (answer.status, answer.body, answer.version, answer.reason) == (200, b"three", b"", b"")
    assert seen.accepted == 1
