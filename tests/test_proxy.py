"""Proxies and response-size limits on the shared client, through real loopback servers.

The proxy is a small asyncio server started by each test on a free loopback port: it
forwards an absolute-form request (an http target) and opens a CONNECT tunnel (an https
target, served by a local TLS server whose certificate the client trusts). It can also
refuse (502 to a forwarded request, 403 to a CONNECT) or hang up after reading a request.

What "never sent" means through a proxy: connecting to the proxy failed, or the proxy
refused the tunnel (the vendor saw no byte): ConnectError. A forwarded request is with
the proxy once written, so a proxy that hangs up afterwards is ambiguous, and a proxy's
own error answer is a response like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import ssl
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import pytest

from asynctaskd.transport import (
    ResponseTooLarge,
    fetcher_for,
    make_http_client,
    proxy_map,
)
from tests.test_transport import (
    NEVER_SENT,
    certificate,  # noqa: F401 - a fixture
    closed_port,
    raw_server,
    read_request,
)

pytestmark = pytest.mark.anyio

PROXY_VARIABLES = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
    "REQUEST_METHOD",
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


class Proxy:
    """A forward and CONNECT proxy: `mode` is "ok", "refuse" or "hang-up"."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.lines: list[bytes] = []  # request lines it received
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        line, _, rest = head.partition(b"\r\n")
        self.lines.append(line)
        method, target, _ = line.split(b" ", 2)
        if self.mode == "hang-up":
            writer.close()
            return
        if method == b"CONNECT":
            if self.mode == "refuse":
                writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                writer.close()
                return
            host, _, port = target.decode().rpartition(":")
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await self._pipe(reader, writer, up_reader, up_writer)
            return
        if self.mode == "refuse":
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 3\r\n\r\nbad")
            await writer.drain()
            writer.close()
            return
        # Forward: one request at a time, each on a new upstream connection, so that every
        # request line of a kept-alive client connection is seen here.
        url = httpx.URL(target.decode())
        length = _content_length(rest)
        body = await reader.readexactly(length) if length else b""
        up_reader, up_writer = await asyncio.open_connection(url.host, url.port)
        try:
            up_writer.write(b"%s %s HTTP/1.1\r\n%s%s" % (method, url.raw_path, rest, body))
            answer = await up_reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            length = _content_length(answer)
            while length is None or length > 0:  # None: until the upstream closes
                data = await up_reader.read(65536 if length is None else min(65536, length))
                if not data:
                    break
                writer.write(data)
                await writer.drain()
                if length is not None:
                    length -= len(data)
        except ConnectionError:
            writer.close()
            return
        finally:
            up_writer.close()
        if length is None:
            writer.close()
            return
        await self.handle(reader, writer)  # the next request on this connection

    @staticmethod
    async def _pipe(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
    ) -> None:
        async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return None


@contextlib.asynccontextmanager
async def proxy_server(mode: str = "ok") -> AsyncIterator[Proxy]:
    proxy = Proxy(mode)
    async with raw_server(proxy.handle) as url:
        proxy.url = url
        yield proxy


class Origin:
    """A plain-http vendor that counts the requests reaching it."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head, _ = await read_request(reader)
                self.heads.append(head)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\norigin")
                await writer.drain()
        writer.close()


@contextlib.asynccontextmanager
async def origin_server() -> AsyncIterator[Origin]:
    origin = Origin()
    async with raw_server(origin.handle) as url:
        origin.url = url
        yield origin


@pytest.fixture
async def tls_origin(certificate: tuple[str, str]) -> AsyncIterator[tuple[str, list[bytes]]]:  # noqa: F811
    """An https vendor on 127.0.0.1: its URL, and the request heads it received."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            while True:
                head, _ = await read_request(reader)
                heads.append(head)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecret")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"https://127.0.0.1:{port}/", heads
    finally:
        server.close()
        close_clients = getattr(server, "close_clients", None)
        if close_clients is not None:
            close_clients()
        await server.wait_closed()


def trusting(certificate: tuple[str, str]) -> ssl.SSLContext:  # noqa: F811
    return ssl.create_default_context(cafile=certificate[0])


# --- the environment, read as httpx reads it ---------------------------------------------


ENVIRONMENTS: list[dict[str, str]] = [
    {},
    {"HTTP_PROXY": "http://p:3128"},
    {"https_proxy": "p:3128"},
    {"ALL_PROXY": "socks5://p:1080", "NO_PROXY": "example.com, .internal,10.0.0.1,::1"},
    {"HTTP_PROXY": "http://p:1", "http_proxy": "http://lower:2"},
    {"HTTPS_PROXY": "http://p:1", "NO_PROXY": "localhost,https://vendor.example"},
    {"HTTPS_PROXY": "http://p:1", "NO_PROXY": "*"},
    {"NO_PROXY": "example.com"},
    {"HTTP_PROXY": "http://p:1", "REQUEST_METHOD": "GET"},  # CGI: HTTP_PROXY is a header
]


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_the_proxy_map_is_the_one_httpx_builds(
    environment: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # httpx's own reading of the environment, the one a plain httpx.AsyncClient applies
    # (private to httpx: used here only to pin that ours agrees with it).
    from httpx._utils import get_environment_proxies

    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert proxy_map() == get_environment_proxies()
    assert proxy_map(trust_env=False) == {}
    assert proxy_map("http://own:1") == {"all://": "http://own:1"}
    assert proxy_map("") == {}


def test_an_unusable_proxy_url_is_refused_when_the_client_is_made() -> None:
    with pytest.raises(ValueError, match="proxy"):
        make_http_client(proxy="ftp://p:21")


# --- through a real proxy ----------------------------------------------------------------


@pytest.mark.parametrize("variable", ["HTTP_PROXY", "http_proxy", "ALL_PROXY"])
async def test_an_http_target_goes_through_the_environment_proxy(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with proxy_server() as proxy, origin_server() as origin:
        monkeypatch.setenv(variable, proxy.url)
        async with make_http_client() as http:
            with anyio.fail_after(5):
                response = await http.get(f"{origin.url}/v1/jobs/1")
                reply = await fetcher_for(http)("GET", f"{origin.url}/v1/jobs/2")

    assert (response.status_code, response.text) == (200, "origin")
    assert (reply.status, reply.content) == (200, b"origin")
    assert proxy.lines == [
        f"GET {origin.url}/v1/jobs/1 HTTP/1.1".encode(),
        f"GET {origin.url}/v1/jobs/2 HTTP/1.1".encode(),
    ]
    assert [head.split(b"\r\n")[0] for head in origin.heads] == [
        b"GET /v1/jobs/1 HTTP/1.1",
        b"GET /v1/jobs/2 HTTP/1.1",
    ]


async def test_an_https_target_goes_through_a_connect_tunnel(
    tls_origin: tuple[str, list[bytes]],
    certificate: tuple[str, str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, heads = tls_origin
    async with proxy_server() as proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:1")  # not for https targets
        async with make_http_client(verify=trusting(certificate)) as http:
            with anyio.fail_after(5):
                first = await http.get(url)
                second = await fetcher_for(http)("GET", url)

    assert (first.text, second.content) == ("secret", b"secret")
    authority = url.removeprefix("https://").rstrip("/")
    assert proxy.lines == [f"CONNECT {authority} HTTP/1.1".encode()]  # one tunnel, reused
    assert len(heads) == 2


@pytest.mark.parametrize("no_proxy", ["127.0.0.1", "*", "localhost,127.0.0.1"])
async def test_no_proxy_hosts_bypass_the_proxy(
    no_proxy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with proxy_server() as proxy, origin_server() as origin:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.setenv("NO_PROXY", no_proxy)
        async with make_http_client() as http:
            with anyio.fail_after(5):
                assert (await http.get(f"{origin.url}/direct")).text == "origin"
                assert (await fetcher_for(http)("GET", f"{origin.url}/fast")).status == 200

    assert proxy.lines == []
    assert len(origin.heads) == 2


async def test_a_handler_proxy_overrides_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    async with proxy_server() as own, proxy_server() as ambient, origin_server() as origin:
        monkeypatch.setenv("HTTP_PROXY", ambient.url)
        async with make_http_client(proxy=own.url) as http:
            assert (await http.get(f"{origin.url}/own")).text == "origin"
        async with make_http_client(proxy="") as http:  # "": no proxy at all
            assert (await http.get(f"{origin.url}/none")).text == "origin"

    assert own.lines == [f"GET {origin.url}/own HTTP/1.1".encode()]
    assert ambient.lines == []
    assert len(origin.heads) == 2


# --- never sent, through a proxy ---------------------------------------------------------


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_an_unreachable_proxy_is_never_sent(scheme: str) -> None:
    proxy = f"http://127.0.0.1:{closed_port()}"
    async with make_http_client(proxy=proxy) as http:
        with anyio.fail_after(5), pytest.raises(httpx.ConnectError):
            await http.get(f"{scheme}://127.0.0.1:{closed_port()}/v1/jobs")
        with anyio.fail_after(5), pytest.raises(httpx.ConnectError):
            await fetcher_for(http)("POST", f"{scheme}://127.0.0.1:1/v1/jobs", json={})


async def test_a_refused_tunnel_is_never_sent(
    tls_origin: tuple[str, list[bytes]],
    certificate: tuple[str, str],  # noqa: F811
) -> None:
    url, heads = tls_origin
    async with (
        proxy_server("refuse") as proxy,
        make_http_client(proxy=proxy.url, verify=trusting(certificate)) as http,
    ):
        with anyio.fail_after(5), pytest.raises(httpx.ConnectError, match="403") as caught:
            await http.post(f"{url}v1/jobs", json={"input": 1})

    assert isinstance(caught.value.__cause__, httpx.ProxyError)
    assert len(proxy.lines) == 1 and proxy.lines[0].startswith(b"CONNECT ")
    assert heads == []  # the vendor saw nothing


async def test_a_forward_proxy_error_answer_is_a_response() -> None:
    """The request reached the proxy whole; its 502 may come after the vendor got it."""
    async with (
        proxy_server("refuse") as proxy,
        origin_server() as origin,
        make_http_client(proxy=proxy.url) as http,
    ):
        response = await http.post(f"{origin.url}/v1/jobs", json={"input": 1})

    assert (response.status_code, response.text) == (502, "bad")
    assert len(proxy.lines) == 1


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_a_proxy_that_hangs_up_is_ambiguous(
    scheme: str,
    tls_origin: tuple[str, list[bytes]],
    certificate: tuple[str, str],  # noqa: F811
) -> None:
    """Whatever the proxy did with the bytes it read is unknown from here: not never-sent
    (for CONNECT that is conservative: the request was not written yet, but this client
    cannot tell a dropped CONNECT from a dropped request)."""
    async with (
        proxy_server("hang-up") as proxy,
        origin_server() as origin,
        make_http_client(proxy=proxy.url, verify=trusting(certificate)) as http,
    ):
        url = f"{origin.url}/v1/jobs" if scheme == "http" else f"{tls_origin[0]}v1/jobs"
        with anyio.fail_after(5), pytest.raises(httpx.TransportError) as caught:
            await http.post(url, json={"input": 1})

    assert not isinstance(caught.value, NEVER_SENT)
    assert len(proxy.lines) == 1


# --- max_response_bytes -------------------------------------------------------------------


class Big:
    """A vendor whose answers are over a small limit, in the ways a body can be framed."""

    def __init__(self) -> None:
        self.finished = asyncio.Event()  # the server wrote the whole of an endless body
        self.closed_early = asyncio.Event()
        self.heads: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head, _ = await read_request(reader)
                self.heads.append(head)
                path = head.split(b" ")[1]
                if path == b"/small":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nsmall")
                elif path == b"/announced":  # a length over the limit, body never sent
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n")
                elif path == b"/gzip-bomb":
                    bomb = gzip.compress(b"0" * 200_000)
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(bomb), bomb)
                    )
                else:  # chunked or until close, 10 KiB at a time, for 100 MiB
                    chunked = path == b"/chunked"
                    framing = b"Transfer-Encoding: chunked" if chunked else b"Connection: close"
                    writer.write(b"HTTP/1.1 200 OK\r\n%s\r\n\r\n" % framing)
                    piece = b"x" * 10240
                    for _ in range(10240):
                        writer.write(b"2800\r\n%s\r\n" % piece if chunked else piece)
                        await writer.drain()
                    self.finished.set()
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_early.set()
        writer.close()


@contextlib.asynccontextmanager
async def big_server() -> AsyncIterator[tuple[str, Big]]:
    big = Big()
    async with raw_server(big.handle) as url:
        yield url, big


async def _stream_all(http: httpx.AsyncClient, url: str) -> bytes:
    async with http.stream("GET", url) as response:
        return b"".join([chunk async for chunk in response.aiter_raw()])


async def _streamed_request_body() -> AsyncIterator[bytes]:
    yield b"{}"


WAYS: dict[str, Any] = {
    "buffered": lambda http, url: http.get(url),
    "streamed": _stream_all,
    "fetch": lambda http, url: fetcher_for(http)("GET", url),
    "aiohttp": lambda http, url: http.post(url, content=_streamed_request_body()),
}
LIMIT = 50_000


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    with anyio.fail_after(seconds):
        yield


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("path", ["/announced", "/chunked", "/until-close"])
async def test_a_body_over_max_response_bytes_fails_unread(way: str, path: str) -> None:
    async with big_server() as (url, big), make_http_client(max_response_bytes=LIMIT) as http:
        with within(10), pytest.raises(ResponseTooLarge):
            await WAYS[way](http, url + path)
        # The connection was closed with the body unread: the server's endless write
        # fails rather than finishing.
        if path != "/announced":
            with within(10):
                await big.closed_early.wait()
            assert not big.finished.is_set()
        # The client goes on.
        with within(5):
            response = await http.get(url + "/small")
        assert response.text == "small"


async def test_a_body_over_the_limit_through_a_proxy_fails() -> None:
    async with (
        proxy_server() as proxy,
        big_server() as (url, _),
        make_http_client(proxy=proxy.url, max_response_bytes=LIMIT) as http,
    ):
        for path in ("/announced", "/chunked"):
            with within(10), pytest.raises(ResponseTooLarge):
                await http.get(url + path)
        assert (await http.get(url + "/small")).text == "small"


async def test_fetch_bounds_the_decoded_body_too() -> None:
    async with big_server() as (url, _):
        async with make_http_client(max_response_bytes=LIMIT) as http:
            with pytest.raises(ResponseTooLarge, match="decoded"):
                await fetcher_for(http)("GET", url + "/gzip-bomb")
        async with make_http_client(max_response_bytes=300_000) as http:
            reply = await fetcher_for(http)("GET", url + "/gzip-bomb")
            assert reply.content == b"0" * 200_000


async def test_a_body_within_the_limit_arrives_whole_on_every_way() -> None:
    async with big_server() as (url, _), make_http_client(max_response_bytes=5) as http:
        for way in WAYS:
            out = await WAYS[way](http, url + "/small")
            body = out if isinstance(out, bytes) else out.content
            assert body == b"small", way


# --- per-handler settings ---------------------------------------------------------------


def _http_handler(url: str, **config: Any) -> Any:
    from asynctaskd.config import HandlerConfig
    from asynctaskd.http_handler import build

    options = {
        "base_url": url,
        "max_connections": 4,  # a client of its own, made with the handler's settings
        "submit": {"url": "{base_url}/small", "id": "/id"},
        "query": {"url": "{base_url}/chunked", "status": "/s", "succeeded": ["done"]},
    }
    return build(HandlerConfig(key="h", type="http", options=options, **config))


def _ctx(http: httpx.AsyncClient) -> Any:
    import logging
    import time

    from asynctaskd.handlers import HandlerContext

    return HandlerContext(
        task_id="t", idempotency_key="t", handler="h", tenant="", account="", provider="h",
        submit_attempt=1, poll_count=0, deadline_at=time.time() + 60, cancel_requested=False,
        http=http, logger=logging.LoggerAdapter(logging.getLogger("test.proxy"), {}),
    )  # fmt: skip


async def test_an_http_handler_answer_over_its_limit_is_a_retryable_vendor_error() -> None:
    from asynctaskd.errors import RetryableError

    async with big_server() as (url, _), make_http_client() as shared:
        handler = _http_handler(url, max_response_bytes=LIMIT)
        try:
            with within(10), pytest.raises(RetryableError) as caught:
                await handler.query({"external_id": "j"}, _ctx(shared))
        finally:
            await handler.aclose()

    assert caught.value.code == "RESPONSE_TOO_LARGE"
    assert "may have reached the vendor" in caught.value.message


async def test_an_http_handler_proxy_that_refuses_the_tunnel_is_not_sent(
    tls_origin: tuple[str, list[bytes]],
) -> None:
    from asynctaskd.errors import NotSent

    url, heads = tls_origin
    async with proxy_server("refuse") as proxy, make_http_client() as shared:
        handler = _http_handler(url.rstrip("/"), proxy=proxy.url)
        try:
            with within(10), pytest.raises(NotSent):
                await handler.submit({}, _ctx(shared))
        finally:
            await handler.aclose()

    assert heads == []


def test_the_daemon_gives_a_handler_with_settings_a_client_of_its_own() -> None:
    from asynctaskd.config import parse_config
    from asynctaskd.daemon import handler_http_clients
    from asynctaskd.errors import ConfigError

    handlers = """
[[handlers]]
key = "plain"
factory = "asynctaskd.devtools.demo:make_handler"
[[handlers]]
key = "proxied"
factory = "asynctaskd.devtools.demo:make_handler"
proxy = "http://127.0.0.1:3128"
[[handlers]]
key = "small"
factory = "asynctaskd.devtools.demo:make_handler"
max_response_bytes = 1000
"""
    clients = handler_http_clients(parse_config(handlers))
    assert sorted(clients) == ["proxied", "small"]
    bad = parse_config(handlers.replace("http://127.0.0.1:3128", "ftp://p:21"))
    with pytest.raises(ConfigError, match="proxy"):
        handler_http_clients(bad)
