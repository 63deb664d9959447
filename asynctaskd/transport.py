"""The handlers' HTTP client: a stock `httpx.AsyncClient` over our own transport.

Handlers get `ctx.http`, an unmodified `httpx.AsyncClient`; httpx's own connection pool
degrades badly with hundreds of concurrent requests, so the client built by
`make_http_client` sends through `PoolTransport`, plugged in at httpx's public transport
seam (`httpx.AsyncBaseTransport`). A request whose body is in memory (nearly every vendor
call) goes through `asynctaskd.http1.Http1Pool`, whose answers llhttp parses; a request
whose body streams goes through an `aiohttp.ClientSession`. Origins the environment or the
handler routes through a proxy are mounted on httpx's own `httpx.AsyncHTTPTransport(proxy=...)`
(`proxy_map` says which, with httpx's own rules). Every route bounds the response body
at `max_response_bytes`, while reading (`ResponseTooLarge`).

httpx's client costs some 40 us of CPU per request on top of the transport (URL parsing,
request and response models, auth and redirect machinery). `ctx.fetch` (a `Fetcher`) is
the fast way around it for the plain calls handlers make: method, URL, headers, a bytes
or JSON body, a `Reply` with status, headers and the whole body.

The worker reads the exception class to decide whether a failed submit may be sent again:
`httpx.ConnectError`, `httpx.ConnectTimeout` and `httpx.PoolTimeout` mean "the request
provably never reached the vendor" (safe to resubmit); every other `httpx.TransportError`
means "it may have arrived" (ambiguous: query or reconcile, never blindly resubmit). A
wrong "never sent" is a duplicate vendor job. `Http1Pool` raises those three only while
obtaining a connection, before any byte of the request is written. Through a proxy,
httpx's transport raises them only while connecting to the proxy (or, for https, while
opening the TLS session inside the tunnel); a proxy that refuses the tunnel (an answer
other than 2xx to CONNECT) becomes `ConnectError` too: the vendor never saw a byte. A
plain-http request goes to the proxy whole, so whatever happens after the proxy accepted
the connection is ambiguous, and a proxy's own error answer (502, say) is a response like
any other. On the aiohttp side, this module claims "never sent" only with two independent
pieces of evidence:

1. the aiohttp exception class is one aiohttp raises only while obtaining a connection, and
2. the request was still inside the connector's `connect()` (waiting for a pool slot or
   opening a connection) when it failed: none was ever handed to it. A connector of our
   own records that per request (aiohttp's `TraceConfig` signals could too, but any trace
   config makes aiohttp build and send a dozen trace events per request: a third more
   CPU per request, measured).

Everything else maps to an ambiguous error, including failures that in fact happened before
any byte was written but cannot be proved so (a reused keep-alive connection that the
server had already closed, or a proxy that closed the connection while answering CONNECT).

Known gaps, by design: neither the pool nor aiohttp enforces ``timeout.write`` (aiohttp has
no write timeout; `Http1Pool` hands the kernel the whole request at once); on the aiohttp
side ``timeout.pool`` and ``timeout.connect`` become one shared budget (see
`_client_timeout`); ``max_keepalive_connections`` counts only as 0 (no keep-alive) or not;
each route keeps its own pool of up to ``max_connections``; the ``trace``,
``sni_hostname`` and ``target`` request extensions are ignored outside the proxy route.
`max_response_bytes` bounds the bytes on the wire: httpx decodes a compressed body after
the transport, unbounded (`Fetcher` decodes gzip and deflate itself, within the bound).
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import functools
import http.cookiejar
import ipaddress
import re
import ssl
import urllib.parse
import urllib.request
import weakref
import zlib
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final

import aiohttp
import httpx
import msgspec
import yarl

from asynctaskd.http1 import Http1Pool, ResponseBody, ResponseTooLarge

__all__ = [
    "DEFAULT_MAX_RESPONSE_BYTES",
    "Fetcher",
    "PoolTransport",
    "Reply",
    "ResponseTooLarge",
    "fetcher_for",
    "make_http_client",
    "proxy_map",
]

DEFAULT_MAX_RESPONSE_BYTES: Final = 16 * 1024 * 1024
"""The largest response body a handler accepts unless configured otherwise: vendor
answers are small JSON documents; files are downloaded by finalize, not read whole."""

# aiohttp < 3.10 has no SocketTimeoutError (read timeouts are plain ServerTimeoutErrors).
_SOCKET_TIMEOUT: Final[Any] = getattr(aiohttp, "SocketTimeoutError", ())

# httpx's client sets every header it means to send; aiohttp must not add its own
# (a second User-Agent, an Accept-Encoding httpx cannot decode, a guessed Content-Type).
_NO_AUTO_HEADERS: Final = ("Accept", "Accept-Encoding", "Content-Type", "User-Agent")
_NEEDED_WITHOUT_BODY: Final = frozenset(("accept", "accept-encoding", "user-agent"))
_NEEDED_WITH_BODY: Final = _NEEDED_WITHOUT_BODY | {"content-type"}


def _skip_auto_headers(headers: list[tuple[str, str]], has_body: bool) -> tuple[str, ...] | None:
    """`_NO_AUTO_HEADERS` when aiohttp would add one of them, else None.

    httpx's client sends its own Accept, Accept-Encoding and User-Agent, and a JSON or
    form body its Content-Type, so aiohttp usually adds nothing; telling it what to skip
    costs it a header-dict copy per request, so it is told only when it matters.
    """
    needed = _NEEDED_WITH_BODY if has_body else _NEEDED_WITHOUT_BODY
    return _NO_AUTO_HEADERS if needed - {name.lower() for name, _ in headers} else None


class _Phase(enum.IntEnum):
    """How far one request got in obtaining a connection; it only ever moves forward."""

    STARTED = 0  # nothing asked of the pool yet, or no trace seen
    QUEUED = 1  # waiting for a free slot: the pool is at max_connections
    CONNECTING = 2  # opening a new connection: DNS, TCP, TLS
    CONNECTED = 3  # a connection (new or reused) was handed to this request


class _Progress:
    """Per-request evidence, filled in by the trace callbacks below."""

    __slots__ = ("phase",)

    def __init__(self) -> None:
        self.phase = _Phase.STARTED

    def reach(self, phase: _Phase) -> None:
        # Monotonic: should aiohttp ever acquire a second connection for the same request
        # (its retry loop, which we switch off), an earlier connection still counts.
        if phase > self.phase:
            self.phase = phase


# The request being sent by the current task: `_Connector.connect` runs in that task.
_PROGRESS: Final[contextvars.ContextVar[_Progress | None]] = contextvars.ContextVar(
    "asynctaskd_http_progress", default=None
)


class _Connector(aiohttp.TCPConnector):
    """Records, per request, whether it is still obtaining a connection."""

    async def connect(
        self, req: aiohttp.ClientRequest, traces: list[Any], timeout: aiohttp.ClientTimeout
    ) -> aiohttp.connector.Connection:
        progress = _PROGRESS.get()
        if progress is None:
            return await super().connect(req, traces, timeout)
        # The same test aiohttp makes before it waits for a free slot.
        full = self._available_connections(req.connection_key) <= 0
        progress.reach(_Phase.QUEUED if full else _Phase.CONNECTING)
        connection = await super().connect(req, traces, timeout)
        progress.reach(_Phase.CONNECTED)
        return connection


def _never_sent(
    exc: BaseException, progress: _Progress, request: httpx.Request
) -> httpx.TransportError | None:
    """The "provably never sent" error for `exc`, or None when that cannot be proved."""
    if progress.phase not in (_Phase.QUEUED, _Phase.CONNECTING):
        # Either a connection was handed to this request (bytes may have left from then
        # on), or no trace was seen at all: without positive evidence, claim nothing.
        return None
    message = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ClientConnectorError):
        # DNS failure, refused, unreachable, TLS handshake or certificate failure: aiohttp
        # raises ClientConnectorError (and its DNS/SSL/certificate/proxy subclasses) only
        # from the connector while creating a connection, before any HTTP byte exists.
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, aiohttp.ServerFingerprintMismatch):
        # The pinned certificate did not match: checked right after the TLS handshake,
        # before the request is written.
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, aiohttp.ServerTimeoutError) and not isinstance(exc, _SOCKET_TIMEOUT):
        # aiohttp >= 3.10 raises ConnectionTimeoutError only when the connector's
        # `timeout.connect` (pool wait plus DNS/TCP/TLS) or `sock_connect` ran out, i.e.
        # before a connection existed; aiohttp < 3.10 raises a plain ServerTimeoutError
        # for connect and read timeouts alike, told apart here by the phase check above.
        # aiohttp does not say which wait ran out; the trace does: a request still queued
        # for a pool slot is a PoolTimeout, one opening a connection a ConnectTimeout.
        if progress.phase is _Phase.QUEUED:
            return httpx.PoolTimeout(message, request=request)
        return httpx.ConnectTimeout(message, request=request)
    return None


def _ambiguous(exc: BaseException, request: httpx.Request) -> httpx.TransportError:
    """The error for a failure after which the vendor may or may not have the request."""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ServerTimeoutError | TimeoutError):
        # sock_read ran out (SocketTimeoutError) after the request was (being) written,
        # or any other timeout we cannot place: the vendor may be working on it.
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        # The server closed the connection before a complete response. Includes the
        # stale keep-alive race: the server closed a pooled connection just as we reused
        # it, and aiohttp may raise this before any byte of ours arrived. That is
        # unprovable from here, so it stays ambiguous (as httpcore reports it too).
        return httpx.RemoteProtocolError(message, request=request)
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ClientResponseError):
        # A malformed status line, headers or body (bad chunking, truncated gzip, content
        # length mismatch): the server answered, so it certainly received something.
        return httpx.RemoteProtocolError(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectionResetError):
        # "Cannot write to closing transport": the connection died while we were writing;
        # part of the request may have been delivered.
        return httpx.WriteError(message, request=request)
    upload_aborted = getattr(aiohttp, "UploadAbortedError", None)
    if upload_aborted is not None and isinstance(exc, upload_aborted):
        # "The request body was never fully sent": the headers and part of the body may
        # have arrived; a server could act on them.
        return httpx.WriteError(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectionError):
        # ClientOSError (reset by peer, broken pipe) after a connection existed, or
        # "Connection closed" while reading: a network failure mid-exchange. Also the
        # never-expected connector errors seen after CONNECTED: never Connect* then.
        return httpx.ReadError(message, request=request)
    if isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        # aiohttp refused the URL itself; httpx's own transport reports an unusable URL
        # scheme as UnsupportedProtocol. Not claimed "never sent": no need to, it fails
        # the same way every time.
        return httpx.UnsupportedProtocol(message, request=request)
    # Anything else aiohttp raises: a generic transport failure, deliberately not a
    # Connect*/Pool* error, so the worker treats it as ambiguous.
    return httpx.TransportError(message, request=request)


# What aiohttp raises. TimeoutError: aiohttp's timeouts subclass it; a bare one can only
# come from an aiohttp timer here (CancelledError, anyio's and asyncio's cancel scopes, is
# not a TimeoutError inside the scope).
_AIOHTTP_ERRORS: Final = (aiohttp.ClientError, TimeoutError)


def _mapped(
    exc: aiohttp.ClientError | TimeoutError, progress: _Progress, request: httpx.Request
) -> httpx.TransportError:
    """httpx's exception for one of `_AIOHTTP_ERRORS` (raise it `from exc`)."""
    return _never_sent(exc, progress, request) or _ambiguous(exc, request)


@contextmanager
def _mapped_errors(progress: _Progress, request: httpx.Request) -> Iterator[None]:
    """Re-raise aiohttp's exceptions as httpx's, keeping the original as __cause__."""
    try:
        yield
    except _AIOHTTP_ERRORS as exc:
        raise _mapped(exc, progress, request) from exc


@functools.lru_cache(maxsize=64)
def _client_timeout(
    connect: float | None, read: float | None, pool: float | None
) -> aiohttp.ClientTimeout:
    # aiohttp's `connect` bounds pool wait plus connection setup (DNS included) as one
    # budget; `sock_connect` bounds TCP and TLS setup per address. httpx's `pool` plus
    # `connect` is the closest expression, so a fast connect leaves the pool wait more
    # than `pool` seconds (at most pool + connect), and DNS is bounded only by the sum.
    # With no pool bound, aiohttp cannot bound DNS alone: only `sock_connect` applies.
    # `total` stays None: httpx has no total timeout, and sock_read restarts on every
    # chunk like httpx's read timeout. aiohttp has no write timeout at all.
    total_connect = None if pool is None or connect is None else pool + connect
    return aiohttp.ClientTimeout(
        total=None, connect=total_connect, sock_connect=connect, sock_read=read
    )


def _too_large(length: int | None, limit: int | None, request: httpx.Request) -> None:
    """Refuse an answer whose announced body is over the limit, before reading it."""
    if limit is not None and length is not None and length > limit:
        raise ResponseTooLarge(
            f"the response announces {length} bytes of body, over max_response_bytes ({limit})",
            request=request,
        )


def _content_length(headers: httpx.Headers) -> int | None:
    value = headers.get("content-length")
    return int(value) if value is not None and value.isdigit() else None


class _AiohttpBody(httpx.AsyncByteStream):
    """The aiohttp response body as an httpx stream, bounded; closing it releases the
    connection."""

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        progress: _Progress,
        request: httpx.Request,
        limit: int | None,
    ) -> None:
        self._response = response
        self._progress = progress
        self._request = request
        self._limit = limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        received = 0
        limit = self._limit
        with _mapped_errors(self._progress, self._request):
            async for chunk in self._response.content.iter_any():
                received += len(chunk)
                if limit is not None and received > limit:
                    self._response.close()  # the rest is never read
                    raise ResponseTooLarge(
                        f"the response body grew past max_response_bytes ({limit})",
                        request=self._request,
                    )
                yield chunk

    async def aclose(self) -> None:
        # release() hands a fully read connection back to the pool and closes one whose
        # body was left unread, so a half-read response never poisons the next request.
        self._response.release()


class _PoolBody(httpx.AsyncByteStream):
    """An `Http1Pool` answer's body: whole, or streaming from its connection."""

    def __init__(self, body: bytes, stream: ResponseBody | None) -> None:
        self._body = body
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._stream is None:
            if self._body:
                yield self._body
            return
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()


class _Capped(httpx.AsyncByteStream):
    """Another transport's response body, bounded at `limit` bytes."""

    def __init__(
        self, inner: httpx.AsyncByteStream, limit: int | None, request: httpx.Request
    ) -> None:
        self._inner = inner
        self._limit = limit
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        received = 0
        async for chunk in self._inner:
            received += len(chunk)
            if self._limit is not None and received > self._limit:
                await self._inner.aclose()  # the rest is never read
                raise ResponseTooLarge(
                    f"the response body grew past max_response_bytes ({self._limit})",
                    request=self._request,
                )
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


_DEFAULT_LIMITS: Final = httpx.Limits(
    max_connections=1000, max_keepalive_connections=1000, keepalive_expiry=30
)


class PoolTransport(httpx.AsyncBaseTransport):
    """An httpx transport: in-memory bodies through `Http1Pool`, streamed ones through
    one shared `aiohttp.ClientSession`; response bodies bounded at `max_response_bytes`.

    The pool and the session are created on first use, inside the running event loop,
    and are bound to that loop. Redirects, cookies, decompression and retries are left to
    httpx and to the caller: nothing here follows a redirect, keeps a cookie, decodes a
    body or resends a request.
    """

    def __init__(
        self,
        *,
        limits: httpx.Limits = _DEFAULT_LIMITS,
        verify: ssl.SSLContext | bool = True,
        max_response_bytes: int | None = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        self._limits = limits
        # The same trust store and TLS settings httpx's own transport would use.
        self._ssl_context = httpx.create_ssl_context(verify=verify)
        self.max_response_bytes = max_response_bytes
        self._session: aiohttp.ClientSession | None = None
        self._pool: Http1Pool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def _bound(self) -> None:
        """Bind to the running loop on first use; refuse any other loop, or use after close."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("PoolTransport used from an event loop it was not made in")
        if self._closed:
            raise RuntimeError("PoolTransport is closed")

    def pool(self) -> Http1Pool:
        """The pool, made on first use in the running loop."""
        if self._pool is None or self._loop is not asyncio.get_running_loop() or self._closed:
            self._bound()
            limits = self._limits
            self._pool = Http1Pool(
                max_connections=limits.max_connections,
                keepalive=limits.max_keepalive_connections != 0,
                keepalive_expiry=limits.keepalive_expiry,
                ssl_context=self._ssl_context,
            )
        return self._pool

    def _session_here(self) -> aiohttp.ClientSession:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            return self._session
        self._bound()
        limits = self._limits
        connector = _Connector(
            limit=limits.max_connections or 0,  # None means unlimited; aiohttp spells it 0
            limit_per_host=0,  # httpx has no per-host limit
            keepalive_timeout=limits.keepalive_expiry,
            force_close=limits.max_keepalive_connections == 0,
            ssl=self._ssl_context,
        )
        session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,  # httpx decodes Content-Encoding itself
            cookie_jar=aiohttp.DummyCookieJar(),  # httpx keeps the cookies
            trust_env=False,
        )
        # aiohttp silently resends GET/HEAD/OPTIONS/TRACE/PUT/DELETE once when the
        # connection drops (HTTP allows it for idempotent methods). A vendor's
        # PUT or DELETE is not necessarily idempotent, and the worker, not the transport,
        # decides what may be sent twice. There is no public switch; this private flag is
        # pinned by tests/test_transport.py (one PUT, one request at the server).
        session._retry_connection = False
        self._session = session
        return session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send `request`; the response's body is read whole or streams, bounded."""
        url = request.url
        if url.scheme in ("http", "https"):
            try:
                content = request.content
            except httpx.RequestNotRead:
                pass
            else:
                answer = await self.pool().send(
                    request.method,
                    (url.scheme, url.raw_host.decode("ascii"), url.port or _PORTS[url.scheme]),
                    url.raw_path,
                    request.headers.raw,
                    content,
                    request.extensions.get("timeout") or {},
                    self.max_response_bytes,
                    request,
                )
                return httpx.Response(
                    answer.status,
                    headers=answer.headers,
                    stream=_PoolBody(answer.body, answer.stream),
                    extensions={"http_version": answer.version, "reason_phrase": answer.reason},
                )
        response, progress = await self._open(request)
        try:
            _too_large(response.content_length, self.max_response_bytes, request)
        except ResponseTooLarge:
            response.close()
            raise
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=_AiohttpBody(response, progress, request, self.max_response_bytes),
            extensions=self._extensions(response),
        )

    @staticmethod
    def _extensions(response: aiohttp.ClientResponse) -> dict[str, bytes]:
        version = response.version
        return {
            "http_version": (
                f"HTTP/{version.major}.{version.minor}" if version else "HTTP/1.1"
            ).encode("ascii"),
            "reason_phrase": (response.reason or "").encode("latin-1", "replace"),
        }

    async def _open(self, request: httpx.Request) -> tuple[aiohttp.ClientResponse, _Progress]:
        """Send the request; return the response with its body not read yet."""
        session = self._session_here()
        timeouts: Mapping[str, float | None] = request.extensions.get("timeout", {})
        timeout = _client_timeout(
            timeouts.get("connect"), timeouts.get("read"), timeouts.get("pool")
        )
        # As written, not lowercased as multi_items() has them: httpx's own pool sends the
        # names in the case they were given, and so does Http1Pool.
        encoding = request.headers.encoding
        headers = [(k.decode(encoding), v.decode(encoding)) for k, v in request.headers.raw]
        chunked: bool | None = None
        data: bytes | AsyncIterable[bytes] | None
        try:
            data = request.content or None
        except httpx.RequestNotRead:
            if not isinstance(request.stream, AsyncIterable):
                raise RuntimeError("AiohttpTransport needs an async request body") from None
            data = request.stream
            if "chunked" in request.headers.get("Transfer-Encoding", "").lower():
                # aiohttp frames a body of unknown length itself and refuses a request that
                # already carries the header: let it write the header and the chunks.
                headers = [(k, v) for k, v in headers if k.lower() != "transfer-encoding"]
                chunked = True
        url = request.url
        if url.userinfo:
            # Credentials in the URL already became an Authorization header in httpx;
            # aiohttp refuses both at once, so the URL goes without them.
            url = url.copy_with(username=None, password=None)
        progress = _Progress()
        token = _PROGRESS.set(progress)
        try:
            response = await session.request(
                request.method,
                # encoded=True: httpx already percent-encoded the URL; send it as is.
                yarl.URL(str(url), encoded=True),
                headers=headers,
                data=data,
                chunked=chunked,
                allow_redirects=False,
                timeout=timeout,
                skip_auto_headers=_skip_auto_headers(headers, data is not None),
            )
        except _AIOHTTP_ERRORS as exc:
            raise _mapped(exc, progress, request) from exc
        finally:
            _PROGRESS.reset(token)
        return response, progress

    async def aclose(self) -> None:
        """Close the session, the pool and every connection they hold."""
        self._closed = True
        session, self._session = self._session, None
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.aclose()
        if session is not None:
            await session.close()


_PORTS: Final = {"http": 80, "https": 443}


# --- proxies ---------------------------------------------------------------------------


class ProxyTransport(httpx.AsyncBaseTransport):
    """httpx's own transport through a proxy, with this module's rules: a refused tunnel
    is "never sent" (`ConnectError`), and the response body is bounded."""

    def __init__(
        self,
        proxy: str,
        *,
        limits: httpx.Limits = _DEFAULT_LIMITS,
        verify: ssl.SSLContext | bool = True,
        max_response_bytes: int | None = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        self.proxy = httpx.Proxy(proxy)
        self.max_response_bytes = max_response_bytes
        self._inner = httpx.AsyncHTTPTransport(
            proxy=self.proxy, limits=limits, verify=httpx.create_ssl_context(verify=verify)
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await self._inner.handle_async_request(request)
        except httpx.ProxyError as exc:
            # httpx raises ProxyError only while setting up a tunnel (a CONNECT answered
            # with other than 2xx, or a SOCKS handshake refused): the request itself was
            # never written, so it never reached the vendor.
            raise httpx.ConnectError(
                f"the proxy refused the tunnel: {exc}", request=request
            ) from exc
        try:
            _too_large(_content_length(response.headers), self.max_response_bytes, request)
        except ResponseTooLarge:
            await response.aclose()
            raise
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_Capped(response.stream, self.max_response_bytes, request),  # type: ignore[arg-type]
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


def _is_ip(host: str, version: int) -> bool:
    try:
        return ipaddress.ip_address(host.split("/")[0]).version == version
    except ValueError:
        return False


def proxy_map(proxy: str | None = None, *, trust_env: bool = True) -> dict[str, str | None]:
    """URL pattern -> proxy URL (None: connect directly), by the rules httpx applies when
    it builds its own transports: `proxy` for every request if given ("" for none at all);
    else, with `trust_env`, HTTP_PROXY, HTTPS_PROXY and ALL_PROXY (lower case first) for
    their schemes and NO_PROXY's hosts, domains and IP addresses bypassing them ("*": no
    proxy at all). The patterns are httpx's `mounts` keys; httpx matches them."""
    if proxy is not None:
        return {"all://": proxy} if proxy else {}
    if not trust_env:
        return {}
    found = urllib.request.getproxies()
    mounts: dict[str, str | None] = {}
    for scheme in ("http", "https", "all"):
        value = found.get(scheme)
        if value:
            mounts[f"{scheme}://"] = value if "://" in value else f"http://{value}"
    for host in (part.strip() for part in found.get("no", "").split(",")):
        if host == "*":
            return {}
        if not host:
            continue
        if "://" in host:
            mounts[host] = None
        elif _is_ip(host, 4):
            mounts[f"all://{host}"] = None
        elif _is_ip(host, 6):
            mounts[f"all://[{host}]"] = None
        elif host.lower() == "localhost":
            mounts[f"all://{host}"] = None
        else:
            mounts[f"all://*{host}"] = None
    return mounts


# --- the fast API ----------------------------------------------------------------------


class Reply(msgspec.Struct, frozen=True, gc=False):
    """A whole answer from `Fetcher`: status, raw headers (as received), body (decoded
    from gzip or deflate)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    content: bytes

    def header(self, name: str) -> str | None:
        """The first value of header `name` (any case), or None."""
        wanted = name.lower().encode("latin-1")
        for key, value in self.headers:
            if key.lower() == wanted:
                return value.decode("latin-1")
        return None

    @property
    def text(self) -> str:
        """The body as UTF-8 text, undecodable bytes replaced."""
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON; ValueError if it is not JSON."""
        try:
            return _JSON.decode(self.content)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise ValueError(f"the response body is not JSON: {exc}") from None


_JSON: Final = msgspec.json.Decoder()
_ENCODE_JSON: Final = msgspec.json.Encoder()
# An origin, and a path and query made only of characters httpx's URL parser leaves
# exactly as they are (unreserved, sub-delims, ":", "@", "/", "?" in the query, %XX).
_ORIGIN: Final = re.compile(r"https?://[^/?#]*", re.IGNORECASE)
_PLAIN_TAIL: Final = re.compile(
    r"(?:/(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/]|%[0-9A-Fa-f]{2})*)?"
    r"(?:\?(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?]|%[0-9A-Fa-f]{2})*)?"
)
_ORIGINS_MAX: Final = 256
_BODY_METHODS: Final = frozenset(("POST", "PUT", "PATCH"))
_ACCEPT_ENCODING: Final = (b"Accept-Encoding", b"gzip, deflate")
_DROPPED: Final = frozenset((b"host", b"accept-encoding", b"content-length", b"transfer-encoding"))


def _inflate(body: bytes, coding: bytes, limit: int | None) -> bytes:
    """`body` decoded from gzip or deflate, no larger than `limit`."""
    attempts = (47,) if coding == b"gzip" else (15, -15)  # deflate: zlib-wrapped or raw
    for wbits in attempts:
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(body, 0 if limit is None else limit + 1)
        except zlib.error as exc:
            if wbits == attempts[-1]:
                raise httpx.DecodingError(f"undecodable {coding.decode()} body: {exc}") from None
            continue
        if limit is not None and (len(out) > limit or inflater.unconsumed_tail):
            raise ResponseTooLarge(
                f"the decoded response body grew past max_response_bytes ({limit})"
            )
        return out
    raise AssertionError("unreachable")


class Fetcher:
    """`await fetcher(method, url, headers=..., content=... or json=..., timeout=...)`:
    one request, the whole answer as a `Reply`. What `ctx.fetch` is.

    The fast path writes the request straight to the client's `Http1Pool`: no httpx URL,
    request or response objects. It takes plain http(s) URLs (no credentials, nothing a
    URL parser would rewrite), ASCII headers, and clients made by `make_http_client` with
    no proxy; anything else goes through the client's own `request()` (httpx's rules,
    proxies included), with the same result. Either way: no redirect is followed, no
    cookie is kept, the client's default headers and timeout apply, errors are httpx's
    exceptions (on the fast path without `request`), and the body is bounded by the
    client's `max_response_bytes`, decoded size included.
    """

    def __init__(self, client: httpx.AsyncClient, transport: PoolTransport | None) -> None:
        self._client = client
        self._transport = transport
        self._origins: dict[str, tuple[tuple[str, str, int], bytes] | None] = {}
        self._timeout: tuple[httpx.Timeout, dict[str, float | None]] | None = None

    async def __call__(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        content: bytes | str | None = None,
        json: Any = None,
        timeout: httpx.Timeout | float | None = None,
    ) -> Reply:
        transport = self._transport
        match = None if transport is None else _ORIGIN.match(url)
        origin = None if match is None else self._origin(match[0], url[match.end() :])
        if origin is None or (content is not None and json is not None):
            return await self._slow(method, url, headers, content, json, timeout)
        method = method.upper()
        raw = self._headers(origin[1], headers)
        if raw is None:
            return await self._slow(method, url, headers, content, json, timeout)
        body = b""
        if json is not None:
            body = _ENCODE_JSON.encode(json)
            if not any(name.lower() == b"content-type" for name, _ in raw):
                raw.append((b"Content-Type", b"application/json"))
        elif content is not None:
            body = content.encode("utf-8") if isinstance(content, str) else content
        if body or method in _BODY_METHODS:
            raw.append((b"Content-Length", b"%d" % len(body)))
        assert transport is not None and match is not None
        target = url[match.end() :] or "/"
        if target[0] == "?":
            target = "/" + target
        limit = transport.max_response_bytes
        answer = await transport.pool().send(
            method,
            origin[0],
            target.encode("ascii"),
            raw,
            body,
            self._timeouts(timeout),
            limit,
        )
        data = answer.body
        if answer.stream is not None:
            try:
                data = b"".join([chunk async for chunk in answer.stream])
            finally:
                await answer.stream.aclose()
        for name, value in answer.headers:
            if name.lower() == b"content-encoding":
                coding = value.strip().lower()
                if coding in (b"gzip", b"deflate", b"x-gzip"):
                    data = _inflate(data, b"deflate" if coding == b"deflate" else b"gzip", limit)
                break
        return Reply(answer.status, answer.headers, data)

    def _origin(self, text: str, tail: str) -> tuple[tuple[str, str, int], bytes] | None:
        """(scheme, host, port) and the Host header for a URL the fast path can send: its
        origin `text`, and a path and query `tail` that need no rewriting."""
        if _PLAIN_TAIL.fullmatch(tail) is None or "/." in tail:
            return None
        try:
            return self._origins[text]
        except KeyError:
            pass
        found: tuple[tuple[str, str, int], bytes] | None = None
        try:
            parts = urllib.parse.urlsplit(text)
            port = parts.port
        except ValueError:
            parts = None
        if (
            parts is not None
            and parts.hostname
            and text.isascii()
            and "@" not in parts.netloc
            and "%" not in parts.netloc
        ):
            scheme = parts.scheme.lower()
            default = _PORTS[scheme]
            host = parts.hostname
            shown = f"[{host}]" if ":" in host else host
            if port is not None and port != default:
                shown = f"{shown}:{port}"
            found = ((scheme, host, port or default), shown.encode("ascii"))
        if len(self._origins) >= _ORIGINS_MAX:
            self._origins.clear()
        self._origins[text] = found
        return found

    def _headers(
        self, host: bytes, headers: Mapping[str, str] | None
    ) -> list[tuple[bytes, bytes]] | None:
        """Host, the client's headers and then the call's (a call's replaces the client's
        of the same name, Host included); None if one is not ASCII."""
        base = self._client.headers.raw
        try:
            extra = (
                [(name.encode("ascii"), value.encode("ascii")) for name, value in headers.items()]
                if headers
                else []
            )
        except UnicodeEncodeError:
            return None
        given = {name.lower() for name, _ in extra}
        replaced = given | _DROPPED
        raw = [] if b"host" in given else [(b"Host", host)]
        raw += [pair for pair in base if pair[0].lower() not in replaced]
        if b"accept-encoding" not in given:
            raw.append(_ACCEPT_ENCODING)
        raw += [pair for pair in extra if pair[0].lower() != b"content-length"]
        return raw

    def _timeouts(self, timeout: httpx.Timeout | float | None) -> dict[str, float | None]:
        if timeout is not None:
            given = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
            return given.as_dict()
        current = self._client.timeout
        cached = self._timeout
        if cached is None or cached[0] is not current:
            cached = self._timeout = (current, current.as_dict())
        return cached[1]

    async def _slow(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None,
        content: bytes | str | None,
        json: Any,
        timeout: httpx.Timeout | float | None,
    ) -> Reply:
        response = await self._client.request(
            method,
            url,
            headers=dict(headers) if headers else None,
            content=content,
            json=json,
            timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout,
        )
        return Reply(response.status_code, response.headers.raw, response.content)


_FETCHERS: Final[weakref.WeakKeyDictionary[httpx.AsyncClient, Fetcher]] = (
    weakref.WeakKeyDictionary()
)


def fetcher_for(client: httpx.AsyncClient) -> Fetcher:
    """The `Fetcher` for `client`: its fast path if `make_http_client` made it."""
    fetcher = _FETCHERS.get(client)
    if fetcher is None:
        fetcher = _FETCHERS[client] = Fetcher(client, None)
    return fetcher


class _NoCookies(http.cookiejar.CookieJar):
    """A jar that takes no cookie from a response (its policy refuses them anyway):
    skipping the standard library's parsing saves ~12 us of httpx's ~175 per request."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None


def make_http_client(
    *,
    max_connections: int = 1000,
    timeout: httpx.Timeout = httpx.Timeout(30.0, connect=5.0),  # noqa: B008 - immutable
    headers: dict[str, str] | None = None,
    proxy: str | None = None,
    trust_env: bool = True,
    max_response_bytes: int | None = DEFAULT_MAX_RESPONSE_BYTES,
    verify: ssl.SSLContext | bool = True,
) -> httpx.AsyncClient:
    """The client handlers receive: a stock `httpx.AsyncClient` over a `PoolTransport`,
    with origins `proxy_map(proxy, trust_env=...)` routes through a proxy mounted on a
    `ProxyTransport`. Every route bounds response bodies at `max_response_bytes`.

    It keeps no cookies: one client serves every handler and account, so a cookie one
    vendor answer sets must not ride along on other requests (nor can a malformed one
    make later requests unbuildable). A handler that needs a session sends it itself.
    """
    limits = httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_connections,
        keepalive_expiry=30,
    )
    transport = PoolTransport(limits=limits, verify=verify, max_response_bytes=max_response_bytes)
    routes = proxy_map(proxy, trust_env=trust_env)
    mounts: dict[str, httpx.AsyncBaseTransport | None] = {
        pattern: None
        if url is None
        else ProxyTransport(
            url, limits=limits, verify=verify, max_response_bytes=max_response_bytes
        )
        for pattern, url in routes.items()
    }
    no_cookies = _NoCookies(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
    client = httpx.AsyncClient(
        transport=transport,
        mounts=mounts,
        timeout=timeout,
        headers=headers,
        cookies=no_cookies,
        trust_env=False,  # the environment's proxies are in `mounts` already
    )
    proxied = any(url is not None for url in routes.values())
    _FETCHERS[client] = Fetcher(client, None if proxied else transport)
    return client
