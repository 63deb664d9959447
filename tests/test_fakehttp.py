"""The fake vendor's HTTP/1.1 server over real loopback sockets, byte for byte.

Each test serves a handler of its own with `fakehttp.serving` on the test's event loop and
talks to it through a raw asyncio stream, so it controls framing, pipelining and the
moment bytes arrive; it waits on what the server writes (or on events its handler sets),
never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest

from asynctaskd.devtools.fakehttp import Answer, Request, _dechunk, serving

pytestmark = pytest.mark.anyio

HandlerFn = Callable[[Request], Answer | Awaitable[Answer]]


def echo(request: Request) -> Answer:
    """Answers what it was asked: method, path, query, body length, one header."""
    body = {
        "method": request.method,
        "path": request.path,
        "query": request.query,
        "body": len(request.body),
        "key": request.header("X-Key"),
    }
    return Answer(200, msgspec.json.encode(body))


@contextlib.asynccontextmanager
async def connected(
    handler: HandlerFn = echo,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    async with serving(handler) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            yield reader, writer
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def read_answer(
    reader: asyncio.StreamReader, *, head_only: bool = False
) -> tuple[int, dict[str, str], bytes]:
    """One answer: status, headers (lowercased names), body (by its Content-Length)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 "), head[:80]  # nothing stray before an answer
    lines = head[:-4].decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.lower()] = value.strip()
    length = int(headers["content-length"])
    body = b"" if head_only else await asyncio.wait_for(reader.readexactly(length), 5)
    return status, headers, body


async def at_eof(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed the connection (EOF or a reset), within 5 s."""
    try:
        return await asyncio.wait_for(reader.read(1), 5) == b""
    except ConnectionResetError:
        return True


def get(path: str = "/x", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: t\r\n{extra}\r\n".encode()


async def test_keep_alive_serves_many_requests_on_one_connection() -> None:
    async with connected() as (reader, writer):
        for i in range(3):
            writer.write(get(f"/n/{i}?a=1", "X-Key: v\r\n"))
            status, headers, body = await read_answer(reader)
            assert status == 200 and "connection" not in headers
            assert msgspec.json.decode(body) == {
                "method": "GET", "path": f"/n/{i}", "query": "a=1", "body": 0, "key": "v"
            }  # fmt: skip


async def test_pipelined_requests_are_answered_in_order_behind_an_awaited_one() -> None:
    entered, release = asyncio.Event(), asyncio.Event()

    def handler(request: Request) -> Answer | Awaitable[Answer]:
        if request.path == "/slow":

            async def later() -> Answer:
                entered.set()
                await release.wait()
                return Answer(200, b'"slow"')

            return later()
        return Answer(200, b'"fast"')

    async with connected(handler) as (reader, writer):
        # One write: the server reads the fast requests while the slow answer is pending,
        # and must still answer them after it.
        writer.write(get("/slow") + get("/fast") + get("/fast"))
        await asyncio.wait_for(entered.wait(), 5)
        release.set()
        answers = [(await read_answer(reader))[2] for _ in range(3)]
        assert answers == [b'"slow"', b'"fast"', b'"fast"']


async def test_bodies_by_content_length_and_chunked_arrive_whole() -> None:
    async with connected() as (reader, writer):
        writer.write(b"POST /a HTTP/1.1\r\nContent-Length: 5\r\n\r\nhe")
        await writer.drain()
        writer.write(b"llo")
        assert msgspec.json.decode((await read_answer(reader))[2])["body"] == 5
        writer.write(b"POST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + CHUNKED)
        assert msgspec.json.decode((await read_answer(reader))[2])["body"] == 13


CHUNKED = b"3;ext=1\r\nabc\r\nA\r\n0123456789\r\n0\r\nX-Trailer: t\r\n\r\n"


def test_a_chunked_body_cut_anywhere_waits_for_the_rest() -> None:
    # Sockets coalesce small writes, so every cut point is tried on the decoder itself.
    for cut in range(len(CHUNKED)):
        buffer = bytearray(CHUNKED[:cut])
        assert _dechunk(buffer) is None, cut
        assert buffer == CHUNKED[:cut]  # nothing consumed until the body is whole
    buffer = bytearray(CHUNKED + b"GET /next")
    assert _dechunk(buffer) == b"abc0123456789"
    assert buffer == b"GET /next"  # what follows the body stays for the next request


async def test_expect_100_continue_is_answered_before_the_body() -> None:
    async with connected() as (reader, writer):
        writer.write(b"POST /a HTTP/1.1\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"body")
        status, _, body = await read_answer(reader)
        assert status == 200 and msgspec.json.decode(body)["body"] == 4


@pytest.mark.parametrize(
    ("request_bytes", "answer_header"),
    [
        (get("/x", "Connection: close\r\n"), "close"),
        (b"GET /x HTTP/1.0\r\n\r\n", "close"),
    ],
    ids=["close", "http10"],
)
async def test_a_closing_request_is_answered_then_the_connection_closed(
    request_bytes: bytes, answer_header: str
) -> None:
    async with connected() as (reader, writer):
        writer.write(request_bytes + get("/ignored"))
        status, headers, _ = await read_answer(reader)
        assert status == 200 and headers["connection"] == answer_header
        assert await at_eof(reader)  # the request after it was not answered


async def test_http10_keep_alive_is_kept_and_said() -> None:
    async with connected() as (reader, writer):
        for _ in range(2):
            writer.write(b"GET /x HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            status, headers, _ = await read_answer(reader)
            assert status == 200 and headers["connection"] == "keep-alive"


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /x HTTP/2.0\r\n\r\n", 400),
        (b"GET  /x HTTP/1.1\r\n\r\n", 400),
        (b"G\x00T /x HTTP/1.1\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nBad Name: v\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\nName: a\x00b\r\n\r\n", 400),
        (b"GET /x HTTP/1.1\r\n folded\r\n\r\n", 400),
        (b"POST /x HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"POST /x HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
        (b"POST /x HTTP/1.1\r\nContent-Length: 1, 2\r\n\r\n", 400),
        (b"POST /x HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        (b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
        (b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab\r\n", 400),
        (b"POST /x HTTP/1.1\r\nContent-Length: 16777217\r\n\r\n", 413),
        (b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1000001\r\n", 413),
        (b"GET /x HTTP/1.1\r\nBig: " + b"v" * 70000, 431),
    ],
)
async def test_a_request_it_cannot_read_is_refused_then_the_connection_closed(
    request_bytes: bytes, status: int
) -> None:
    async with connected() as (reader, writer):
        writer.write(request_bytes)
        got, headers, body = await read_answer(reader)
        assert (got, headers["connection"]) == (status, "close")
        assert msgspec.json.decode(body)["error"]["code"] == "bad_request"
        assert await at_eof(reader)


async def test_requests_before_a_refused_one_are_answered_first() -> None:
    async with connected() as (reader, writer):
        writer.write(get("/one") + get("/two") + b"BAD\r\n\r\n" + get("/never"))
        assert msgspec.json.decode((await read_answer(reader))[2])["path"] == "/one"
        assert msgspec.json.decode((await read_answer(reader))[2])["path"] == "/two"
        assert (await read_answer(reader))[0] == 400
        assert await at_eof(reader)


async def test_a_handler_that_raises_gets_500_and_the_connection_goes_on() -> None:
    def handler(request: Request) -> Answer | Awaitable[Answer]:
        if request.path == "/boom":
            raise RuntimeError("broken")
        if request.path == "/later-boom":

            async def later() -> Answer:
                raise ValueError("broken later")

            return later()
        return Answer(200, b"{}")

    async with connected(handler) as (reader, writer):
        for path, message in (("/boom", "RuntimeError: broken"), ("/later-boom", "ValueError")):
            writer.write(get(path))
            status, _, body = await read_answer(reader)
            error = msgspec.json.decode(body)["error"]
            assert status == 500 and error["code"] == "internal" and message in error["message"]
        writer.write(get("/ok"))
        assert (await read_answer(reader))[0] == 200


async def test_head_answers_the_length_without_the_body() -> None:
    async with connected() as (reader, writer):
        writer.write(b"HEAD /x HTTP/1.1\r\n\r\n" + get("/after"))
        status, headers, _ = await read_answer(reader, head_only=True)
        assert status == 200 and int(headers["content-length"]) > 0
        # No body came: the next bytes are the next answer's status line.
        assert msgspec.json.decode((await read_answer(reader))[2])["path"] == "/after"


async def test_extra_headers_and_a_percent_encoded_path() -> None:
    def handler(request: Request) -> Answer:
        return Answer(429, b"{}", {"Retry-After": "3", "Allow": "GET, POST"})

    async with connected(handler) as (reader, writer):
        writer.write(get("/a"))
        status, headers, _ = await read_answer(reader)
        assert (status, headers["retry-after"], headers["allow"]) == (429, "3", "GET, POST")
    async with connected() as (reader, writer):
        writer.write(get("/v1/jobs/job%5F1"))
        assert msgspec.json.decode((await read_answer(reader))[2])["path"] == "/v1/jobs/job_1"


async def test_abort_drops_the_connection_without_an_answer() -> None:
    def handler(request: Request) -> Answer:
        request.abort()
        return Answer(201, b"{}")  # never written

    async with connected(handler) as (reader, writer):
        writer.write(get("/x"))
        assert await at_eof(reader)


async def test_leaving_serving_cancels_awaited_answers_and_drops_connections() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def never(request: Request) -> Answer:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    async with serving(lambda request: never(request)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(get("/x"))
        await asyncio.wait_for(started.wait(), 5)
    assert cancelled.is_set()
    assert await at_eof(reader)
    writer.close()
