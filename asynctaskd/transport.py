"""The handlers' httpx client: plain requests over `Http1Pool`, streaming over aiohttp.

Handlers get an `httpx.AsyncClient`; httpx's own connection pool degrades badly with
hundreds of concurrent requests (SPEC section 6). The client built by `make_http_client`
sends a request whose body is in memory and whose answer is read whole (nearly every
vendor call) through `asynctaskd.http1.Http1Pool`, and a streamed request or response
through an `aiohttp.ClientSession`. This module holds the aiohttp side and its error
mapping; `Http1Pool` maps its own errors by the same rule.

The worker reads the exception class to decide whether a failed submit may be sent again:
`httpx.ConnectError`, `httpx.ConnectTimeout` and `httpx.PoolTimeout` mean "the request
provably never reached the vendor" (safe to resubmit); every other `httpx.TransportError`
means "it may have arrived" (ambiguous: query or reconcile, never blindly resubmit). A
wrong "never sent" is a duplicate vendor job. `Http1Pool` raises those three only while
obtaining a connection, before any byte of the request is written. On the aiohttp side,
this module claims "never sent" only with two independent pieces of evidence:

1. the aiohttp exception class is one aiohttp raises only while obtaining a connection, and
2. the request was still inside the connector's `connect()` (waiting for a pool slot or
   opening a connection) when it failed: none was ever handed to it. A connector of our
   own records that per request (aiohttp's `TraceConfig` signals could too, but any trace
   config makes aiohttp build and send a dozen trace events per request: a third more
   CPU per request, measured).

Everything else maps to an ambiguous error, including failures that in fact happened before
any byte was written but cannot be proved so (a reused keep-alive connection that the
server had already closed, for example).

Known gaps, by design: neither side enforces ``timeout.write`` (aiohttp has no write
timeout; `Http1Pool` hands the kernel the whole request at once); on the aiohttp side
``timeout.pool`` and ``timeout.connect`` become one shared budget (see `_client_timeout`);
``max_keepalive_connections`` counts only as 0 (no keep-alive) or not; the two sides keep
separate pools of up to ``max_connections`` each (streaming is rare); the
``trace``, ``sni_hostname`` and ``target`` request extensions are ignored; proxies and
``trust_env`` are not supported (httpx ignores environment proxies for a custom transport
too).
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime
import enum
import functools
import http.cookiejar
import logging
import re
import ssl
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Final, cast

import aiohttp
import httpx
import msgspec
import yarl
from httpx._content import encode_request

from asynctaskd.http1 import Http1Pool

__all__ = ["AiohttpTransport", "make_http_client"]

_log: Final = logging.getLogger("httpx")  # the line httpx's own send would log

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


class _ResponseBody(httpx.AsyncByteStream):
    """The aiohttp response body as an httpx stream; closing it releases the connection."""

    def __init__(
        self, response: aiohttp.ClientResponse, progress: _Progress, request: httpx.Request
    ) -> None:
        self._response = response
        self._progress = progress
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _mapped_errors(self._progress, self._request):
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        # release() hands a fully read connection back to the pool and closes one whose
        # body was left unread, so a half-read response never poisons the next request.
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An httpx transport that sends requests with one shared `aiohttp.ClientSession`.

    The session is created on first use, inside the running event loop, and is bound to
    that loop. Redirects, cookies, decompression and retries are left to httpx and to the
    caller: aiohttp follows no redirect, keeps no cookie, decodes no body and never
    resends a request.
    """

    def __init__(
        self,
        *,
        limits: httpx.Limits = httpx.Limits(  # noqa: B008 - never mutated
            max_connections=1000, max_keepalive_connections=1000, keepalive_expiry=30
        ),
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self._limits = limits
        # The same trust store and TLS settings httpx's own transport would use.
        self._ssl_context = httpx.create_ssl_context(verify=verify)
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
            raise RuntimeError("AiohttpTransport used from an event loop it was not made in")
        if self._closed:
            raise RuntimeError("AiohttpTransport is closed")

    def _pool_here(self) -> Http1Pool:
        if self._pool is None or self._loop is not asyncio.get_running_loop():
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
        # connection drops (RFC 9112 9.3.1 allows it for idempotent methods). A vendor's
        # PUT or DELETE is not necessarily idempotent, and the worker, not the transport,
        # decides what may be sent twice. There is no public switch; this private flag is
        # pinned by tests/test_transport.py (one PUT, one request at the server).
        session._retry_connection = False
        self._session = session
        return session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send `request` and return a response whose body streams from the connection."""
        response, progress = await self._open(request)
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=_ResponseBody(response, progress, request),
            extensions=self._extensions(response),
        )

    async def handle_buffered(self, request: httpx.Request) -> httpx.Response:
        """Send `request` and read the whole body before returning.

        A request whose body is already in memory goes through `Http1Pool`, the rest
        through aiohttp. A body without Content-Encoding comes back already read, as
        `aread()` would leave it; an encoded one comes back as its stream, for httpx to
        decode.
        """
        if request.url.scheme in ("http", "https"):
            try:
                content = request.content
            except httpx.RequestNotRead:
                pass
            else:
                status, version, reason, headers, body = await self._pool_here().send(
                    request, content
                )
                return _buffered(status, headers, body, version, reason)
        response, progress = await self._open(request)
        try:
            body = await response.read()
        except _AIOHTTP_ERRORS as exc:
            raise _mapped(exc, progress, request) from exc
        finally:
            response.release()
        extensions = self._extensions(response)
        return _buffered(
            response.status,
            response.raw_headers,
            body,
            extensions["http_version"],
            extensions["reason_phrase"],
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


_JSON: Final = msgspec.json.Decoder()


def _headers(raw: Iterable[tuple[bytes, bytes]]) -> httpx.Headers:
    """`httpx.Headers(raw)` for (name, value) pairs of bytes, in one pass: its constructor
    takes each pair through two helpers and isinstance checks against ABCs, ~3 us for a
    request's five headers here, and every request builds two (its own, the response's).
    The list is kept as httpx keeps it; tests/test_transport.py compares the two."""
    headers = httpx.Headers.__new__(httpx.Headers)
    headers._list = [(name, name.lower(), value) for name, value in raw]
    headers._encoding = None
    return headers


class _Response(httpx.Response):
    """httpx's Response, whose `json()` decodes with msgspec: ~0.35 us for a vendor's
    small answer, against ~3.6 us for the standard library's `json.loads`.

    Where the two differ, msgspec refuses: NaN and Infinity, numbers beyond a double, a
    lone surrogate escape, a byte order mark, UTF-16 or -32. Anything it refuses, and any
    call with keyword arguments, goes to httpx's own `json()`, so the values and the
    errors are the standard library's (tests/fuzz/test_response_json.py compares them).
    """

    def json(self, **kwargs: Any) -> Any:
        if not kwargs:
            try:
                return _JSON.decode(self.content)
            except (msgspec.DecodeError, RecursionError):
                pass
        return super().json(**kwargs)


def _buffered(
    status: int,
    headers: Sequence[tuple[bytes, bytes]],
    body: bytes,
    http_version: bytes,
    reason_phrase: bytes,
) -> httpx.Response:
    """A response whose body was read whole: already read unless it must be decoded.

    Built as `Response(status, stream=...)` builds it, attribute for attribute, without
    the constructor's empty `Headers` and copies (~1.2 us of a vendor call's ~2 here);
    tests/test_transport.py checks the attributes against httpx's own response."""
    response = _Response.__new__(_Response)
    response.status_code = status
    response.headers = built = _headers(headers)
    response._request = None
    response.next_request = None
    response.extensions = {"http_version": http_version, "reason_phrase": reason_phrase}
    response.history = []
    response.is_closed = response.is_stream_consumed = False
    response.default_encoding = "utf-8"
    response.stream = httpx.ByteStream(body)
    response._num_bytes_downloaded = 0
    # Scanned raw (the lowered names _headers made): the first lookup in httpx's Headers
    # works out their text encoding.
    if not any(lowered == b"content-encoding" for _, lowered, _ in built._list):
        # What Response.aread() sets when the identity decoder passed the body through.
        response._content = body
        response._num_bytes_downloaded = len(body)
        response.is_stream_consumed = response.is_closed = True
    return response


# A URL's path and query made only of characters httpx's parser leaves exactly as they
# are (unreserved, sub-delims, ":", "@", "/", "?" in the query, and valid %XX escapes).
_PLAIN_TAIL: Final = re.compile(
    r"(/(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/]|%[0-9A-Fa-f]{2})*)"
    r"(?:\?((?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?]|%[0-9A-Fa-f]{2})*))?"
)
# The same without escapes, which most URLs have none of: a character class the regex
# engine runs through in one loop, against a choice per character (~0.2 us, not 0.7).
_PLAIN_TAIL_NO_ESCAPE: Final = re.compile(
    r"(/[A-Za-z0-9\-._~!$&'()*+,;=:@/]*)(?:\?([A-Za-z0-9\-._~!$&'()*+,;=:@/?]*))?"
)
_ORIGINS_MAX: Final = 256


class _Urls:
    """`httpx.URL(text)` for absolute http(s) URLs, parsing each origin once.

    httpx parses every URL in pure Python (~8 us here, a twentieth of a whole request).
    Handlers call few origins with many paths, so the origin (scheme, credentials, host,
    port) is parsed by httpx once and kept; a path and query that httpx would leave as
    they are (no dot segment, nothing to percent-encode) are attached to it as they are.
    Anything else is parsed by httpx in full.
    """

    def __init__(self) -> None:
        self._origins: dict[str, Any] = {}

    def __call__(self, text: str) -> httpx.URL:
        start = 8 if text.startswith("https://") else 7 if text.startswith("http://") else 0
        cut = text.find("/", start) if start else -1
        tail = None
        if cut > 0:
            tail = _PLAIN_TAIL_NO_ESCAPE.fullmatch(text, cut) or _PLAIN_TAIL.fullmatch(text, cut)
        if tail is None or "/." in tail[1]:
            return httpx.URL(text)
        origin_text = text[:cut]
        origin = self._origins.get(origin_text)
        if origin is None:
            if "?" in origin_text or "#" in origin_text:
                return httpx.URL(text)
            parsed = httpx.URL(origin_text)._uri_reference
            # The parse result's class and its scheme, userinfo, host and port.
            origin = (type(parsed), *parsed[:4])
            if len(self._origins) >= _ORIGINS_MAX:
                self._origins.clear()
            self._origins[origin_text] = origin
        make, scheme, userinfo, host, port = origin
        url = httpx.URL.__new__(httpx.URL)
        url._uri_reference = make(scheme, userinfo, host, port, tail[1], tail[2], None)
        return url


class _Client(httpx.AsyncClient):
    """httpx's `AsyncClient` with a direct path for the requests handlers nearly always make.

    httpx spends several layers per request that do nothing for a plain request on this
    client: merging a base URL, query parameters and cookies it does not have; an auth
    flow, a redirect loop, cookie extraction and a bound stream around the body in `send`.
    A plain request (no auth, no event hooks, no redirect to follow, no cookie jar, no
    base URL or client params, body read at once) is built with only what it needs and
    goes straight to the transport, and gets the same request and response: `request`,
    `elapsed`, `next_request` for a redirect, the encoding default, and httpx's log line.
    Anything else (streaming, auth, hooks, followed redirects, a cookie jar set later)
    takes httpx's own path unchanged.
    """

    def __init__(self, *, transport: AiohttpTransport, **kwargs: Any) -> None:
        super().__init__(transport=transport, **kwargs)
        self._buffering = transport  # httpx's `_transport`, typed for `handle_buffered`
        # The no-cookie jar; replacing it leaves the direct path. Typed Any for its
        # `_cookies` dict: `len(jar)` walks a generator, ~2% of a poll's CPU for an empty jar.
        self._jar: Any = self.cookies.jar
        self._no_base_url = self._base_url  # the setter makes a new URL
        self._urls = _Urls()

    def _direct(self) -> bool:
        """Whether the client's own settings let a request take the direct path."""
        hooks = self.event_hooks
        return not (
            self.follow_redirects
            or self.auth is not None
            or hooks["request"]
            or hooks["response"]
            or self._jar._cookies  # a cookie set by hand (Cookies.set skips the jar's policy)
            or self.cookies.jar is not self._jar
            or self.is_closed
        )

    async def request(
        self,
        method: str,
        url: httpx.URL | str,
        *,
        content: Any = None,
        data: Any = None,
        files: Any = None,
        json: Any = None,
        params: Any = None,
        headers: Any = None,
        cookies: Any = None,
        auth: Any = httpx.USE_CLIENT_DEFAULT,
        follow_redirects: Any = httpx.USE_CLIENT_DEFAULT,
        timeout: Any = httpx.USE_CLIENT_DEFAULT,
        extensions: Any = None,
    ) -> httpx.Response:
        if (
            type(url) is not str
            or data is not None
            or files is not None
            or params is not None
            or cookies is not None
            or auth is not httpx.USE_CLIENT_DEFAULT
            or follow_redirects is not httpx.USE_CLIENT_DEFAULT
            or timeout is not httpx.USE_CLIENT_DEFAULT
            or extensions is not None
            or self._base_url is not self._no_base_url
            or self.params
            or not self._direct()
        ):
            return await super().request(
                method,
                url,
                content=content,
                data=data,
                files=files,
                json=json,
                params=params,
                headers=headers,
                cookies=cookies,
                auth=auth,
                follow_redirects=follow_redirects,
                timeout=timeout,
                extensions=extensions,
            )
        # A new list of the client's headers, updated with the request's if it has any.
        merged = self.headers if headers is None else self._merge_headers(headers)
        raw = cast(httpx.Headers, merged).raw
        request = _plain_request(
            method,
            self._urls(url),
            raw,
            content,
            json,
            {"timeout": self.timeout.as_dict()},
        )
        return await self._send_plain(request)

    async def send(
        self,
        request: httpx.Request,
        *,
        stream: bool = False,
        auth: Any = httpx.USE_CLIENT_DEFAULT,
        follow_redirects: Any = httpx.USE_CLIENT_DEFAULT,
    ) -> httpx.Response:
        if (
            stream
            or auth is not httpx.USE_CLIENT_DEFAULT
            or (follow_redirects is not httpx.USE_CLIENT_DEFAULT and follow_redirects)
            or not self._direct()
        ):
            return await super().send(
                request, stream=stream, auth=auth, follow_redirects=follow_redirects
            )
        if "timeout" not in request.extensions:
            request.extensions["timeout"] = self.timeout.as_dict()
        return await self._send_plain(request)

    async def _send_plain(self, request: httpx.Request) -> httpx.Response:
        """A request the client's settings let through: httpx's own `send` if the URL
        carries credentials (httpx turns them into BasicAuth), else the direct path.

        One coroutine for what httpx does in several: each one between a handler and the
        connection is passed through again whenever the call resumes."""
        if request.url.userinfo:
            return await super().send(request)
        started = time.perf_counter()
        response = await self._buffering.handle_buffered(request)
        response.request = request
        response.default_encoding = self._default_encoding
        if _log.isEnabledFor(logging.INFO):  # its arguments cost ~0.5 us to work out
            _log.info(
                'HTTP Request: %s %s "%s %d %s"',
                request.method,
                request.url,
                response.http_version,
                response.status_code,
                response.reason_phrase,
            )
        if response.has_redirect_location:
            response.next_request = self._build_redirect_request(request, response)
        if not response.is_stream_consumed:  # an encoded body: httpx decodes it here
            await response.aread()
        response.elapsed = datetime.timedelta(seconds=time.perf_counter() - started)
        return response


_BODY_METHODS: Final = frozenset(("POST", "PUT", "PATCH"))


def _plain_request(
    method: str,
    url: httpx.URL,
    raw: list[tuple[bytes, bytes]],
    content: Any,
    json: Any,
    extensions: dict[str, Any],
) -> httpx.Request:
    """`httpx.Request(method, url, headers=raw, content=..., json=..., extensions=...)`,
    where `raw` is a list of the request's headers (names and values as bytes), its own.

    Built in one pass: `Request.__init__` copies the headers twice, looks a few up by
    name (which works out their text encoding) and sets each body header one by one,
    ~11 us here against ~4. The body and its headers come from httpx's own encoder, and
    the rules are `Request._prepare`'s: body headers unless already set, then Host and,
    for a body method without one, `Content-Length: 0` first. A body that is not in
    memory (an iterator) is left to httpx.
    """
    if content is None and json is None:
        body_headers: dict[str, str] = {}  # what httpx's encoder gives for no body
        stream = httpx.ByteStream(b"")
    else:
        body_headers, encoded = encode_request(content=content, json=json)
        if not isinstance(encoded, httpx.ByteStream):
            return httpx.Request(
                method, url, headers=raw, content=content, json=json, extensions=extensions
            )
        stream = encoded
    present = {name.lower() for name, _ in raw}
    for name, value in body_headers.items():
        lowered = name.lower().encode("ascii")
        if lowered not in present:
            present.add(lowered)
            raw.append((name.encode("ascii"), value.encode("ascii")))
    method = method.upper()
    auto: list[tuple[bytes, bytes]] = []
    if b"host" not in present and url.host:
        auto.append((b"Host", url.netloc))
    if method in _BODY_METHODS and not present & {b"content-length", b"transfer-encoding"}:
        auto.append((b"Content-Length", b"0"))
    request = httpx.Request.__new__(httpx.Request)
    request.method = method
    request.url = url
    request.headers = _headers(auto + raw if auto else raw)
    request.extensions = extensions
    request.stream = stream
    if body_headers:
        request.read()
    else:
        request._content = b""  # what `read()` keeps for no body
    return request


def make_http_client(
    *,
    max_connections: int = 1000,
    timeout: httpx.Timeout = httpx.Timeout(30.0, connect=5.0),  # noqa: B008 - immutable
    headers: dict[str, str] | None = None,
) -> httpx.AsyncClient:
    """The shared client handlers receive: httpx's API over an `AiohttpTransport`, whose
    plain requests go through its `Http1Pool`.

    It keeps no cookies: one client serves every handler and account, so a cookie one
    vendor answer sets must not ride along on other requests (nor can a malformed one
    make later requests unbuildable). A handler that needs a session sends it itself.
    """
    limits = httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_connections,
        keepalive_expiry=30,
    )
    no_cookies = http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
    return _Client(
        transport=AiohttpTransport(limits=limits),
        timeout=timeout,
        headers=headers,
        cookies=no_cookies,
    )
