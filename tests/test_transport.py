"""PoolTransport over real loopback sockets, and its exception table, row by row.

The servers run in the test's own event loop: aiohttp.web for well-behaved HTTP, raw
asyncio streams for servers that misbehave on purpose. Tests synchronise on events the
servers set when a request has arrived, never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import gzip
import json
import shutil
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import aiohttp
import anyio
import httpx
import pytest
import yarl
from aiohttp import web
from aiohttp.client_reqrep import ConnectionKey
from multidict import CIMultiDict, CIMultiDictProxy

from asynctaskd.config import parse_config
from asynctaskd.daemon import shared_http_client
from asynctaskd.transport import Fetcher, PoolTransport, Reply, fetcher_for, make_http_client
from asynctaskd.transport.streamed import _mapped_errors, _Phase, _Progress

pytestmark = pytest.mark.anyio

NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


# --- servers ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def web_server(app: web.Application) -> AsyncIterator[str]:
    """Serve `app` on a free loopback port; yields the base URL."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    # A deep backlog: a thousand simultaneous connects must not wait on SYN retransmits.
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=2048)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[str]:
    """Serve raw bytes with `handler` per connection; yields the base URL."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        # Python 3.12+ waits for open connections here; close them first.
        close_clients = getattr(server, "close_clients", None)
        if close_clients is not None:
            close_clients()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP/1.1 request head and its body (Content-Length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    chunked = False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
        elif name.strip().lower() == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    if not chunked:
        return head, await reader.readexactly(length) if length else b""
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        body += await reader.readexactly(size + 2)
        if size == 0:
            return head, body[:-2]
        body = body[:-2]


def ok_response(body: bytes = b"ok") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


class Arrivals:
    """Counts requests that reached a raw server and signals the first one."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.connections = 0
        self.arrived = asyncio.Event()

    def record(self, head: bytes) -> None:
        self.heads.append(head)
        self.arrived.set()


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# Every failure test runs each way a shared-client request can go: a request with its
# body in memory through Http1Pool (read whole, or streamed: the pool serves both), the
# same through `ctx.fetch`'s direct path, and a request whose body streams through aiohttp.
VIA = pytest.mark.parametrize("via", ["pool", "pool-stream", "fetch", "aiohttp"])


async def _streamed(body: bytes) -> AsyncIterator[bytes]:
    if body:
        yield body


async def fetch(
    http: httpx.AsyncClient, via: str, method: str, url: str, **kwargs: object
) -> httpx.Response:
    """`method url` one of the `VIA` ways."""
    if via == "pool":
        return await http.request(method, url, **kwargs)  # type: ignore[arg-type]
    if via == "fetch":
        reply = await fetcher_for(http)(method, url, **kwargs)  # type: ignore[arg-type]
        return httpx.Response(reply.status, headers=reply.headers, content=reply.content)
    if via == "aiohttp":
        kwargs["content"] = _streamed(kwargs.pop("content", b""))  # type: ignore[arg-type]
    async with http.stream(method, url, **kwargs) as response:  # type: ignore[arg-type]
        await response.aread()
    return response


# --- the happy path --------------------------------------------------------------------


def echo_app() -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response(
            {
                "method": request.method,
                "path": request.path_qs,
                "headers": [[k, v] for k, v in request.headers.items()],
                "json": json.loads(body) if body else None,
            },
            headers={"X-Server": "echo"},
        )

    async def status(request: web.Request) -> web.Response:
        return web.Response(status=int(request.match_info["code"]), text="status")

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("/echo/after-redirect")

    async def gzipped(request: web.Request) -> web.Response:
        payload = json.dumps({"words": ["compressed"] * 200}).encode()
        return web.Response(
            body=gzip.compress(payload),
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )

    async def cookie(request: web.Request) -> web.Response:
        response = web.json_response({"cookie": request.headers.getall("Cookie", [])})
        response.set_cookie("session", "s1")
        return response

    app = web.Application()
    app.router.add_route("*", "/echo/{tail:.*}", echo)
    app.router.add_get("/status/{code}", status)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/gzip", gzipped)
    app.router.add_get("/cookie", cookie)
    return app


@pytest.fixture
async def echo_url() -> AsyncIterator[str]:
    async with web_server(echo_app()) as url:
        yield url


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with make_http_client(headers={"X-Client": "asynctaskd"}) as http:
        yield http


async def test_get_json_round_trip_with_headers(client: httpx.AsyncClient, echo_url: str) -> None:
    response = await client.get(
        f"{echo_url}/echo/jobs/a%2Fb?q=a+b&x=%C3%A9", headers={"X-Request": "one"}
    )

    assert response.status_code == 200
    assert response.http_version == "HTTP/1.1"
    assert response.reason_phrase == "OK"
    assert response.headers["x-server"] == "echo"
    assert response.request.url.path == "/echo/jobs/a/b"
    echoed = response.json()
    assert echoed["method"] == "GET"
    assert echoed["path"] == "/echo/jobs/a%2Fb?q=a+b&x=%C3%A9"  # sent byte for byte
    headers = [(k.lower(), v) for k, v in echoed["headers"]]
    assert ("x-request", "one") in headers
    assert ("x-client", "asynctaskd") in headers
    # httpx's headers only: aiohttp adds no User-Agent, Accept or Accept-Encoding of its own.
    names = [k for k, _ in headers]
    for name in ("user-agent", "accept", "accept-encoding"):
        assert names.count(name) == 1, name
    assert dict(headers)["user-agent"].startswith("python-httpx/")
    assert "content-type" not in names


async def test_post_json_round_trip(client: httpx.AsyncClient, echo_url: str) -> None:
    payload = {"input": {"prompt": "a cat", "n": [1, 2.5, None]}, "ref": "t-1"}

    response = await client.post(f"{echo_url}/echo/v1/jobs", json=payload)

    assert response.status_code == 200
    echoed = response.json()
    assert echoed["method"] == "POST"
    assert echoed["json"] == payload
    assert ["Content-Type", "application/json"] in echoed["headers"]


async def test_streamed_request_body(client: httpx.AsyncClient, echo_url: str) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b'{"input": '
        yield b'{"streamed": true}}'

    response = await client.post(f"{echo_url}/echo/stream", content=body())

    assert response.json()["json"] == {"input": {"streamed": True}}


@pytest.mark.parametrize("code", [201, 204, 400, 404, 429, 500, 503])
async def test_status_codes_pass_through(
    client: httpx.AsyncClient, echo_url: str, code: int
) -> None:
    response = await client.get(f"{echo_url}/status/{code}")

    assert response.status_code == code
    assert response.content == (b"" if code == 204 else b"status")


async def test_redirects_are_httpx_business(client: httpx.AsyncClient, echo_url: str) -> None:
    not_followed = await client.get(f"{echo_url}/redirect")
    followed = await client.get(f"{echo_url}/redirect", follow_redirects=True)

    assert not_followed.status_code == 302
    assert not_followed.headers["location"] == "/echo/after-redirect"
    assert followed.status_code == 200
    assert followed.json()["path"] == "/echo/after-redirect"
    assert [r.status_code for r in followed.history] == [302]


async def test_gzip_body_is_decoded_once_by_httpx(client: httpx.AsyncClient, echo_url: str) -> None:
    async with client.stream("GET", f"{echo_url}/gzip") as response:
        raw = b"".join([chunk async for chunk in response.aiter_raw()])

    decoded = await client.get(f"{echo_url}/gzip")

    assert raw[:2] == b"\x1f\x8b"  # aiohttp left the body compressed
    assert decoded.headers["content-encoding"] == "gzip"
    assert decoded.json() == {"words": ["compressed"] * 200}


async def test_the_shared_client_keeps_no_cookies(client: httpx.AsyncClient, echo_url: str) -> None:
    first = await client.get(f"{echo_url}/cookie")
    second = await client.get(f"{echo_url}/cookie")

    assert first.json() == {"cookie": []}
    assert second.json() == {"cookie": []}  # one client serves every handler and account
    assert not client.cookies


async def test_cookies_are_kept_by_httpx_only(echo_url: str) -> None:
    async with httpx.AsyncClient(transport=PoolTransport()) as own:
        await own.get(f"{echo_url}/cookie")
        second = await own.get(f"{echo_url}/cookie")

    assert second.json() == {"cookie": ["session=s1"]}  # once: aiohttp keeps no jar


def _seen(response: httpx.Response) -> dict[str, object]:
    """Everything a handler can read from a response, for comparing two send paths."""
    return {
        "status": response.status_code,
        "version": response.http_version,
        "reason": response.reason_phrase,
        "headers": [(k, v) for k, v in response.headers.multi_items() if k != "date"],
        "content": response.content,
        "text": response.text,
        "encoding": response.encoding,
        "request": (response.request.method, str(response.request.url)),
        "next": None if response.next_request is None else str(response.next_request.url),
        "history": response.history,
        "closed": response.is_closed,
    }


DIRECT_CASES = {
    "get": ("GET", "/echo/a?b=c", {}),
    "escapes": ("GET", "/echo/a%2Fb/./c/../d?q=a+b&x=%C3%A9&y=%zz&z=\u00e9", {}),
    "post-json": ("POST", "/echo/v1/jobs", {"json": {"input": {"é": [1, 2.5]}, "ref": "t"}}),
    "put-bytes": ("PUT", "/echo/raw", {"content": b'{"raw": true}', "headers": {"X-A": "1"}}),
    "delete": ("DELETE", "/echo/v1/jobs/1", {}),
    "redirect": ("GET", "/redirect", {}),
    "gzip": ("GET", "/gzip", {}),
    "no-content": ("GET", "/status/204", {}),
    "set-cookie": ("GET", "/cookie", {}),
}


@pytest.mark.parametrize("case", list(DIRECT_CASES))
async def test_the_pool_transport_answers_exactly_as_httpx_own_transport(
    client: httpx.AsyncClient, echo_url: str, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The shared client against plain httpx with its own transport: same bytes out, same
    response in; and `ctx.fetch` sends what they send and reads what they read."""
    method, path, kwargs = DIRECT_CASES[case]
    caplog.set_level("INFO", logger="httpx")
    ours = await client.request(method, f"{echo_url}{path}", **kwargs)
    async with httpx.AsyncClient(headers={"X-Client": "asynctaskd"}) as plain:
        reference = await plain.request(method, f"{echo_url}{path}", **kwargs)
    lines = [r.getMessage() for r in caplog.records if r.name == "httpx"]
    reply = await fetcher_for(client)(method, f"{echo_url}{path}", **kwargs)

    assert _seen(ours) == _seen(reference)
    assert ours.request.headers.multi_items() == reference.request.headers.multi_items()
    assert ours.request.content == reference.request.content
    assert ours.elapsed > datetime.timedelta(0)
    assert len(lines) == 2 and lines[0] == lines[1]
    assert isinstance(reply, Reply)
    assert reply.status == reference.status_code
    assert [(k, v) for k, v in reply.headers if k.lower() != b"date"] == [
        (k, v) for k, v in reference.headers.raw if k.lower() != b"date"
    ]
    if reference.headers.get("x-server") != "echo":
        assert reply.content == reference.content
        return
    # The echo: the same request arrived (fetch orders the headers its own way).
    sent, expected = reply.json(), reference.json()
    assert sent["headers"] != expected["headers"] or sent == expected
    sent["headers"].sort()
    expected["headers"].sort()
    assert sent == expected


async def test_aiohttp_adds_no_header_httpx_did_not_send(echo_url: str) -> None:
    async with make_http_client() as http:
        for name in ("User-Agent", "Accept", "Accept-Encoding"):
            del http.headers[name]
        echoed = (await http.post(f"{echo_url}/echo/bare", content=b'{"bare": 1}')).json()

    names = {name.lower() for name, _ in echoed["headers"]}
    assert echoed["json"] == {"bare": 1}
    assert not names & {"user-agent", "accept", "accept-encoding", "content-type"}


async def test_what_the_direct_path_cannot_do_goes_through_httpx(echo_url: str) -> None:
    async with make_http_client() as http:
        # A cookie set by hand (httpx's Cookies.set bypasses the jar's policy) is sent.
        http.cookies.set("by", "hand", domain="127.0.0.1")
        assert (await http.get(f"{echo_url}/cookie")).json() == {"cookie": ["by=hand"]}
        http.cookies.clear()
        # A base URL and client-wide query parameters are merged in.
        http.base_url = httpx.URL(f"{echo_url}/echo/")
        http.params = httpx.QueryParams({"p": "1"})
        assert (await http.get("relative")).json()["path"] == "/echo/relative?p=1"
        http.base_url, http.params = httpx.URL(""), httpx.QueryParams()
        # Credentials in the URL become a Basic Authorization header.
        echoed = (await http.get(f"{echo_url.replace('//', '//user:pw@')}/echo/auth")).json()
        assert ["Authorization", "Basic dXNlcjpwdw=="] in echoed["headers"]
        # A client-wide auth, a redirect to follow, a cookie jar set later.
        http.auth = httpx.BasicAuth("other", "pw")
        echoed = (await http.get(f"{echo_url}/echo/auth")).json()
        assert ["Authorization", "Basic b3RoZXI6cHc="] in echoed["headers"]
        http.auth = None
        followed = await http.get(f"{echo_url}/redirect", follow_redirects=True)
        assert followed.json()["path"] == "/echo/after-redirect"
        http.cookies = httpx.Cookies()
        await http.get(f"{echo_url}/cookie")
        assert (await http.get(f"{echo_url}/cookie")).json() == {"cookie": ["session=s1"]}
    closed = make_http_client()
    await closed.aclose()
    with pytest.raises(RuntimeError, match="client has been closed"):
        await closed.get(f"{echo_url}/echo/late")


async def test_a_hand_set_transfer_encoding_on_a_bytes_body_is_refused_unsent() -> None:
    arrivals = Arrivals()

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        arrivals.connections += 1
        writer.close()

    async with raw_server(record) as url, make_http_client() as http:
        with pytest.raises(httpx.LocalProtocolError, match="Transfer-Encoding"):
            await http.post(
                f"{url}/v1/jobs", content=b"{}", headers={"Transfer-Encoding": "chunked"}
            )

    # httpx adds Content-Length too, and a message with both is invalid: nothing is sent.
    assert arrivals.connections == 0


async def test_head_request(client: httpx.AsyncClient, echo_url: str) -> None:
    response = await client.head(f"{echo_url}/echo/head")

    assert response.status_code == 200
    assert response.content == b""


async def test_streaming_response_arrives_chunk_by_chunk() -> None:
    first_seen = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first")
        await first_seen.wait()  # the client has the first chunk before the second exists
        await response.write(b"second")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/stream", stream)
    async with (
        web_server(app) as url,
        make_http_client() as http,
        http.stream("GET", f"{url}/stream") as response,
    ):
        chunks = response.aiter_raw()
        first = await anext(chunks)
        first_seen.set()
        rest = b"".join([chunk async for chunk in chunks])

    assert first == b"first"
    assert rest == b"second"


async def test_closing_a_half_read_stream_frees_the_connection() -> None:
    release = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"x" * 1024)
        await release.wait()
        return response

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/endless", endless)
    app.router.add_get("/hello", hello)
    async with web_server(app) as url, make_http_client(max_connections=1) as http:
        async with http.stream("GET", f"{url}/endless") as response:
            await anext(response.aiter_raw())
        # The only pooled connection was closed, not handed back with a body half read.
        with anyio.fail_after(5):
            async with http.stream("GET", f"{url}/hello") as hello_response:
                await hello_response.aread()
        release.set()

    assert hello_response.text == "hello"


async def test_a_thousand_concurrent_requests_complete() -> None:
    total = 1000
    in_flight = 0
    all_arrived = asyncio.Event()

    async def gather_everyone(request: web.Request) -> web.Response:
        nonlocal in_flight
        in_flight += 1
        if in_flight == total:
            all_arrived.set()
        await all_arrived.wait()  # answers only once all 1,000 are in flight at once
        return web.json_response({"n": int(request.query["n"])})

    app = web.Application()
    app.router.add_get("/all", gather_everyone)
    results: list[int] = []

    async def one(http: httpx.AsyncClient, url: str, n: int) -> None:
        response = await http.get(f"{url}/all", params={"n": n})
        results.append(response.json()["n"])

    async with web_server(app) as url, make_http_client(max_connections=total) as http:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for n in range(total):
                    tg.start_soon(one, http, url, n)

    assert sorted(results) == list(range(total))


async def test_make_http_client_wires_transport_timeout_and_headers() -> None:
    timeout = httpx.Timeout(10.0, connect=2.0)
    async with make_http_client(timeout=timeout, headers={"X-A": "1"}) as http:
        assert isinstance(http._transport, PoolTransport)
        assert http.timeout == timeout
        assert http.headers["x-a"] == "1"


@pytest.mark.parametrize(("max_inflight", "pool"), [(10, 1000), (1000, 1000), (3000, 3000)])
def test_the_shared_http_pool_holds_every_call_in_flight(max_inflight: int, pool: int) -> None:
    config = parse_config(f"[worker]\nmax_inflight = {max_inflight}\n")

    http = shared_http_client(config)

    assert isinstance(http, httpx.AsyncClient)
    assert http._transport._limits.max_connections == pool


# --- TLS ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1: (cert file, key file)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = str(directory / "cert.pem"), str(directory / "key.pem")
    argv = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
    argv += ["-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1"]
    argv += ["-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(argv, check=True, capture_output=True)
    return cert, key


@pytest.fixture
async def tls_url(certificate: tuple[str, str]) -> AsyncIterator[str]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="secret")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    try:
        yield f"https://127.0.0.1:{runner.addresses[0][1]}/"
    finally:
        await runner.cleanup()


@VIA
async def test_untrusted_certificate_is_connect_error(tls_url: str, via: str) -> None:
    async with make_http_client() as http:
        with pytest.raises(httpx.ConnectError) as caught:
            await fetch(http, via, "GET", tls_url)

    cause = (
        ssl.SSLCertVerificationError
        if via != "aiohttp"
        else aiohttp.ClientConnectorCertificateError
    )
    assert isinstance(caught.value.__cause__, cause)


async def test_verify_with_a_context_or_off(tls_url: str, certificate: tuple[str, str]) -> None:
    trusting = ssl.create_default_context(cafile=certificate[0])
    for verify in (trusting, False):
        async with httpx.AsyncClient(transport=PoolTransport(verify=verify)) as http:
            assert (await http.get(tls_url)).text == "secret"


# --- failures that prove the request never left -----------------------------------------


@VIA
async def test_connect_refused_is_connect_error(via: str) -> None:
    async with make_http_client() as http:
        with pytest.raises(httpx.ConnectError) as caught:
            await fetch(http, via, "GET", f"http://127.0.0.1:{closed_port()}/v1/jobs")

    cause = ConnectionRefusedError if via != "aiohttp" else aiohttp.ClientConnectorError
    assert isinstance(caught.value.__cause__, cause)
    if via != "fetch":  # the fast path has no httpx request to name
        assert caught.value.request.url.port is not None


@pytest.fixture
def unanswered_address() -> Iterator[tuple[str, int]]:
    """A loopback listener whose accept queue is full, so new SYNs go unanswered."""
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # never accepted: Linux queues one connection, then drops SYNs
        address: tuple[str, int] = listener.getsockname()
        for _ in range(2):
            filler = stack.enter_context(socket.socket())
            filler.setblocking(False)
            filler.connect_ex(address)
        # Decide with a plain socket whether this kernel really leaves SYNs unanswered
        # (SYN cookies or a different backlog rule would complete the handshake).
        probe = stack.enter_context(socket.socket())
        probe.settimeout(0.3)
        try:
            probe.connect(address)
        except TimeoutError:
            yield address
        else:
            pytest.skip("this kernel completes handshakes despite a full accept queue")


@VIA
async def test_connect_timeout_on_a_full_backlog_is_connect_timeout(
    unanswered_address: tuple[str, int], via: str
) -> None:
    host, port = unanswered_address
    timeout = httpx.Timeout(5.0, connect=0.3)
    async with make_http_client(timeout=timeout) as http:
        with anyio.fail_after(10), pytest.raises(httpx.ConnectTimeout) as caught:
            await fetch(http, via, "GET", f"http://{host}:{port}/v1/jobs")

    cause = TimeoutError if via != "aiohttp" else aiohttp.ServerTimeoutError
    assert isinstance(caught.value.__cause__, cause)


@VIA
async def test_waiting_for_a_pool_slot_is_pool_timeout(via: str) -> None:
    arrivals = Arrivals()
    release = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        arrivals.record(head)
        await release.wait()
        writer.write(ok_response())
        await writer.drain()
        writer.close()

    # aiohttp bounds pool wait plus connect together: 0.1 + 0.1 s here.
    timeout = httpx.Timeout(5.0, connect=0.1, pool=0.1)
    async with (
        raw_server(hold) as url,
        make_http_client(max_connections=1, timeout=timeout) as http,
        anyio.create_task_group() as tg,
    ):
        first: list[httpx.Response] = []

        async def occupy() -> None:
            first.append(await fetch(http, via, "GET", f"{url}/first"))

        tg.start_soon(occupy)
        await arrivals.arrived.wait()  # the only connection is busy
        with pytest.raises(httpx.PoolTimeout):
            await fetch(http, via, "GET", f"{url}/second")
        release.set()

    assert len(arrivals.heads) == 1  # the second request never reached the server
    assert first[0].text == "ok"


# --- failures after the request may have arrived: never Connect* -------------------------


@VIA
@pytest.mark.parametrize("method", ["POST", "PUT", "GET", "DELETE"])
async def test_server_reads_request_then_closes_is_ambiguous_and_not_resent(
    method: str, via: str
) -> None:
    arrivals = Arrivals()

    async def read_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        arrivals.record(head)
        writer.close()

    async with raw_server(read_then_close) as url, make_http_client() as http:
        with pytest.raises(httpx.TransportError) as caught:
            await fetch(http, via, method, f"{url}/v1/jobs", json={"input": {}})

    assert isinstance(caught.value, httpx.RemoteProtocolError | httpx.ReadError)
    assert not isinstance(caught.value, NEVER_SENT)
    # aiohttp would silently resend PUT, GET and DELETE once; the transport switches it off.
    assert len(arrivals.heads) == 1


@VIA
async def test_reused_keepalive_connection_closed_by_server_is_ambiguous(via: str) -> None:
    arrivals = Arrivals()

    async def one_answer_then_drop(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        arrivals.connections += 1
        head, _ = await read_request(reader)
        arrivals.record(head)
        writer.write(ok_response())
        await writer.drain()
        head, _ = await read_request(reader)  # the second request, on the same connection
        arrivals.record(head)
        writer.close()

    async with raw_server(one_answer_then_drop) as url, make_http_client() as http:
        assert (await fetch(http, via, "GET", f"{url}/first")).text == "ok"
        with pytest.raises(httpx.TransportError) as caught:
            await fetch(http, via, "POST", f"{url}/v1/jobs", json={"input": {}})

    assert not isinstance(caught.value, NEVER_SENT)
    assert arrivals.connections == 1
    assert len(arrivals.heads) == 2


@VIA
async def test_server_reads_request_never_answers_is_read_timeout(via: str) -> None:
    arrivals = Arrivals()
    done = asyncio.Event()

    async def read_then_hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        arrivals.record(head)
        await done.wait()
        writer.close()

    timeout = httpx.Timeout(5.0, read=0.2)
    async with raw_server(read_then_hang) as url, make_http_client(timeout=timeout) as http:
        with anyio.fail_after(5), pytest.raises(httpx.ReadTimeout) as caught:
            await fetch(http, via, "POST", f"{url}/v1/jobs", json={"input": {}})
        done.set()

    if via == "aiohttp":
        assert isinstance(caught.value.__cause__, aiohttp.ServerTimeoutError)
    assert arrivals.arrived.is_set()


@VIA
async def test_read_timeout_in_the_middle_of_the_body(via: str) -> None:
    done = asyncio.Event()

    async def half_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
        await writer.drain()
        await done.wait()
        writer.close()

    timeout = httpx.Timeout(5.0, read=0.2)
    async with raw_server(half_body) as url, make_http_client(timeout=timeout) as http:
        with anyio.fail_after(5), pytest.raises(httpx.ReadTimeout):
            await fetch(http, via, "GET", f"{url}/slow-body")
        done.set()


@VIA
async def test_truncated_body_is_remote_protocol_error(via: str) -> None:
    async def truncated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()
        writer.close()

    async with raw_server(truncated) as url, make_http_client() as http:
        with pytest.raises(httpx.RemoteProtocolError) as caught:
            await fetch(http, via, "GET", f"{url}/truncated")

    if via == "aiohttp":
        assert isinstance(caught.value.__cause__, aiohttp.ClientPayloadError)


@VIA
async def test_garbage_instead_of_http_is_remote_protocol_error(via: str) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        writer.close()

    async with raw_server(garbage) as url, make_http_client() as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await fetch(http, via, "POST", f"{url}/v1/jobs", json={"input": {}})


async def test_transport_is_bound_to_its_event_loop() -> None:
    transport = PoolTransport()
    async with web_server(echo_app()) as url, httpx.AsyncClient(transport=transport) as http:
        assert (await http.get(f"{url}/status/204")).status_code == 204

        def elsewhere() -> None:
            async def send() -> None:
                await transport.handle_async_request(httpx.Request("GET", url))

            asyncio.run(send())

        with pytest.raises(RuntimeError, match="event loop"):
            await anyio.to_thread.run_sync(elsewhere)


# --- the exception table, row by row -----------------------------------------------------

KEY = ConnectionKey("vendor.example", 443, True, True, None, None, None)
REQUEST_INFO = aiohttp.RequestInfo(
    yarl.URL("https://vendor.example/v1/jobs"), "POST", CIMultiDictProxy(CIMultiDict())
)


def aiohttp_errors() -> dict[str, BaseException]:
    """One instance of every aiohttp exception the transport may see, by a short name."""
    return {
        "refused": aiohttp.ClientConnectorError(KEY, ConnectionRefusedError(111, "refused")),
        "dns": aiohttp.ClientConnectorDNSError(KEY, OSError(-2, "Name or service not known")),
        "certificate": aiohttp.ClientConnectorCertificateError(
            KEY, ssl.CertificateError("hostname mismatch")
        ),
        "tls": aiohttp.ClientConnectorSSLError(KEY, ssl.SSLError(1, "handshake failure")),
        "proxy": aiohttp.ClientProxyConnectionError(KEY, OSError(111, "refused")),
        "fingerprint": aiohttp.ServerFingerprintMismatch(b"a", b"b", "vendor.example", 443),
        "connect-timeout": aiohttp.ConnectionTimeoutError("Connection timeout to host"),
        "old-timeout": aiohttp.ServerTimeoutError("Timeout (aiohttp < 3.10 style)"),
        "read-timeout": aiohttp.SocketTimeoutError("Timeout on reading data from socket"),
        "disconnected": aiohttp.ServerDisconnectedError(),
        "reset": aiohttp.ClientOSError(104, "Connection reset by peer"),
        "write-reset": aiohttp.ClientConnectionResetError("Cannot write to closing transport"),
        "closed": aiohttp.ClientConnectionError("Connection closed"),
        "payload": aiohttp.ClientPayloadError("Response payload is not completed"),
        "bad-response": aiohttp.ClientResponseError(
            REQUEST_INFO, (), status=400, message="Bad status line"
        ),
        "upload-aborted": aiohttp.UploadAbortedError("The request body was not fully sent"),
        "invalid-url": aiohttp.InvalidURL("not a url"),
        "non-http": aiohttp.NonHttpUrlClientError("ftp://vendor.example"),
        "unknown": aiohttp.ClientError("something new"),
        "bare-timeout": TimeoutError(),
    }


def mapped(exc: BaseException, phase: _Phase) -> httpx.TransportError:
    progress = _Progress()
    progress.reach(phase)
    request = httpx.Request("POST", "https://vendor.example/v1/jobs")
    with pytest.raises(httpx.TransportError) as caught, _mapped_errors(progress, request):
        raise exc
    assert caught.value.__cause__ is exc
    assert caught.value.request is request
    return caught.value


STARTED, QUEUED, CONNECTING, CONNECTED = (
    _Phase.STARTED,
    _Phase.QUEUED,
    _Phase.CONNECTING,
    _Phase.CONNECTED,
)
TABLE = [
    # Could not connect, and the trace shows no connection ever existed: never sent.
    ("refused", CONNECTING, httpx.ConnectError),
    ("dns", CONNECTING, httpx.ConnectError),
    ("certificate", CONNECTING, httpx.ConnectError),
    ("tls", CONNECTING, httpx.ConnectError),
    ("proxy", CONNECTING, httpx.ConnectError),
    ("fingerprint", CONNECTING, httpx.ConnectError),
    ("connect-timeout", CONNECTING, httpx.ConnectTimeout),
    ("connect-timeout", QUEUED, httpx.PoolTimeout),
    ("old-timeout", CONNECTING, httpx.ConnectTimeout),
    ("old-timeout", QUEUED, httpx.PoolTimeout),
    # The same classes without trace evidence, or once a connection existed: ambiguous.
    ("refused", STARTED, httpx.ReadError),
    ("refused", CONNECTED, httpx.ReadError),
    ("certificate", CONNECTED, httpx.ReadError),
    ("connect-timeout", STARTED, httpx.ReadTimeout),
    ("connect-timeout", CONNECTED, httpx.ReadTimeout),
    ("old-timeout", STARTED, httpx.ReadTimeout),
    ("old-timeout", CONNECTED, httpx.ReadTimeout),
    # Failures once the request may have arrived; the class alone keeps them ambiguous.
    ("read-timeout", CONNECTED, httpx.ReadTimeout),
    ("read-timeout", CONNECTING, httpx.ReadTimeout),
    ("disconnected", CONNECTED, httpx.RemoteProtocolError),
    ("disconnected", CONNECTING, httpx.RemoteProtocolError),
    ("reset", CONNECTED, httpx.ReadError),
    ("write-reset", CONNECTED, httpx.WriteError),
    ("closed", CONNECTED, httpx.ReadError),
    ("payload", CONNECTED, httpx.RemoteProtocolError),
    ("bad-response", CONNECTED, httpx.RemoteProtocolError),
    ("upload-aborted", CONNECTED, httpx.WriteError),
    ("invalid-url", STARTED, httpx.UnsupportedProtocol),
    ("non-http", STARTED, httpx.UnsupportedProtocol),
    ("unknown", CONNECTED, httpx.TransportError),
    ("bare-timeout", CONNECTED, httpx.ReadTimeout),
]


@pytest.mark.parametrize(
    ("name", "phase", "expected"),
    TABLE,
    ids=[f"{name}-{phase.name}" for name, phase, _ in TABLE],
)
def test_exception_table(name: str, phase: _Phase, expected: type[Exception]) -> None:
    assert type(mapped(aiohttp_errors()[name], phase)) is expected


@pytest.mark.parametrize("name", list(aiohttp_errors()))
@pytest.mark.parametrize("phase", [STARTED, CONNECTED], ids=lambda phase: phase.name)
def test_never_sent_is_claimed_only_while_obtaining_a_connection(name: str, phase: _Phase) -> None:
    assert not isinstance(mapped(aiohttp_errors()[name], phase), NEVER_SENT)


def test_phase_only_moves_forward() -> None:
    progress = _Progress()
    progress.reach(_Phase.CONNECTED)
    progress.reach(_Phase.QUEUED)  # e.g. a retry queuing for a second connection

    assert progress.phase is _Phase.CONNECTED


def test_non_aiohttp_errors_pass_through() -> None:
    request = httpx.Request("GET", "https://vendor.example/")
    with pytest.raises(ValueError, match="bug"), _mapped_errors(_Progress(), request):
        raise ValueError("bug")


async def test_aclose_is_idempotent_and_final() -> None:
    transport = PoolTransport()
    await transport.aclose()
    await transport.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await transport.handle_async_request(httpx.Request("GET", "http://127.0.0.1:1/"))


async def test_fetch_sends_the_client_headers_then_the_call_headers(
    client: httpx.AsyncClient, echo_url: str
) -> None:
    fetch = fetcher_for(client)
    reply = await fetch(
        "PUT",
        f"{echo_url}/echo/h?x=1",
        headers={"Host": "vendor.test", "X-Client": "call", "Accept-Encoding": "identity"},
        content='"é"',
    )
    echoed = reply.json()
    headers = {name.lower(): value for name, value in echoed["headers"]}
    assert echoed["method"] == "PUT" and echoed["path"] == "/echo/h?x=1"
    assert headers["host"] == "vendor.test"  # the call's Host replaces the URL's
    assert headers["x-client"] == "call"  # and its headers the client's
    assert headers["accept-encoding"] == "identity"
    assert headers["content-length"] == "4"  # the text as UTF-8
    assert echoed["json"] == "é"
    assert reply.header("X-SERVER") == "echo" and reply.header("missing") is None
    # A URL httpx would rewrite does not take the direct path: httpx sends it, its way.
    reply = await fetch("GET", f"{echo_url}/echo/a b/./c?q=é")
    assert reply.json()["path"] == "/echo/a%20b/c?q=%C3%A9"


async def test_a_plain_get_sends_the_client_headers_as_they_are_now(
    client: httpx.AsyncClient, echo_url: str
) -> None:
    """A plain GET's header block is built once per origin and client headers: a change
    to the client's headers, or another origin, is sent as it is, not the block before."""
    fetch = fetcher_for(client)

    async def sent(url: str) -> dict[str, str]:
        echoed = (await fetch("GET", url)).json()
        return {name.lower(): value for name, value in echoed["headers"]}

    first = await sent(f"{echo_url}/echo/a")
    assert first["x-client"] == "asynctaskd" and "x-added" not in first
    assert (await sent(f"{echo_url}/echo/b")) == first  # the same block again
    client.headers["X-Client"] = "changed"
    client.headers["X-Added"] = "1"
    changed = await sent(f"{echo_url}/echo/c")
    assert changed["x-client"] == "changed" and changed["x-added"] == "1"
    other = echo_url.replace("127.0.0.1", "localhost")  # the same server, another Host
    assert (await sent(f"{other}/echo/d"))["host"] == other.removeprefix("http://")
    del client.headers["X-Added"]
    assert "x-added" not in await sent(f"{echo_url}/echo/e")


@pytest.mark.parametrize(
    "tail",
    ["", "/", "/v1/jobs/job-1", "/a/b.c~d_e-f:g@h!$&'()*+,;=", "?q=1", "/p?q=1&r=%20",
     "/p%2Fq", "/p%zz", "/a b", "/é", "/a|b", "/a^b", "/a#f", "#f", "/a/./b", "/a/../b",
     "/.hidden", "x", "/a\\b", "/a\tb", "/[x]", "/{x}"],
)  # fmt: skip
def test_the_direct_path_takes_exactly_the_urls_its_pattern_allows(tail: str) -> None:
    """A plain path is recognised without the regex: the same URLs as the regex, no more."""
    from asynctaskd.transport.fetcher import _PLAIN_TAIL

    fetcher = Fetcher(httpx.AsyncClient(), None)
    expected = _PLAIN_TAIL.fullmatch(tail) is not None and "/." not in tail
    assert (fetcher._origin("http://vendor.test", tail) is not None) is expected


def test_fetcher_for_gives_each_client_its_own_whichever_was_asked_last() -> None:
    # fetcher_for remembers the last client asked for (ctx.fetch asks on every poll).
    first, second = make_http_client(), make_http_client()
    mine = fetcher_for(first)
    assert fetcher_for(first) is mine
    theirs = fetcher_for(second)
    assert theirs is not mine and fetcher_for(second) is theirs
    assert fetcher_for(first) is mine and fetcher_for(second) is theirs
    plain = httpx.AsyncClient()
    made = fetcher_for(plain)  # made on first use (no fast path), then kept
    assert made is not mine and made is not theirs and fetcher_for(plain) is made
    assert fetcher_for(first) is mine
