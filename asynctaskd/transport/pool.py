"""The transports under the handlers' httpx client: `PoolTransport` (in-memory bodies
through `Http1Pool`, streamed ones through aiohttp) and `ProxyTransport` (httpx's own,
for the origins `proxy_map` routes through a proxy); both bound response bodies at
`max_response_bytes`."""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
import urllib.request
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import Final

import aiohttp
import httpx
import yarl

from asynctaskd.http1 import Http1Pool, ResponseBody, ResponseTooLarge

from .streamed import (
    _AIOHTTP_ERRORS,
    _PROGRESS,
    _AiohttpBody,
    _client_timeout,
    _Connector,
    _mapped,
    _Progress,
    _skip_auto_headers,
)

__all__ = ["DEFAULT_MAX_RESPONSE_BYTES", "PoolTransport", "ProxyTransport", "proxy_map"]


DEFAULT_MAX_RESPONSE_BYTES: Final = 16 * 1024 * 1024
"""The largest response body a handler accepts unless configured otherwise: vendor
answers are small JSON documents; files are downloaded by finalize, not read whole."""


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
