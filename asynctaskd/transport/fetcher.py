"""The fast API, `Fetcher` (what `ctx.fetch` is) and its `Reply`, and `make_http_client`,
which builds the handlers' client over a `PoolTransport` and gives it its `Fetcher`."""

from __future__ import annotations

import http.cookiejar
import re
import ssl
import urllib.parse
import weakref
import zlib
from collections.abc import Mapping
from typing import Any, Final

import httpx
import msgspec

from asynctaskd.http1 import ResponseTooLarge

from .pool import _PORTS, DEFAULT_MAX_RESPONSE_BYTES, PoolTransport, ProxyTransport, proxy_map

__all__ = ["Fetcher", "Reply", "fetcher_for", "make_http_client"]


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
# A path's characters: a tail of only these (no "?", no "%") that starts with "/" is one
# `_PLAIN_TAIL` matches, found by `bytes.translate` (deleting them all) without the regex.
_PATH_CHARS: Final = (
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~!$&'()*+,;=:@/"
)
# `_ORIGIN` as most URLs spell it (a lowercase scheme): the same match, without the
# case-folding of every character that IGNORECASE costs.
_ORIGIN_LOWER: Final = re.compile(r"https?://[^/?#]*")
_ORIGINS_MAX: Final = 256
_BODY_METHODS: Final = frozenset(("POST", "PUT", "PATCH"))
_ACCEPT_ENCODING: Final = (b"Accept-Encoding", b"gzip, deflate")
_DROPPED: Final = frozenset((b"host", b"accept-encoding", b"content-length", b"transfer-encoding"))


def _block(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The header block of `headers` as HTTP/1.1 writes it, the blank line included."""
    return b"".join([name + b": " + value + b"\r\n" for name, value in headers]) + b"\r\n"


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
        # (Host, the client's raw headers...) -> the headers and header block of a plain
        # GET: built once, not per request. Bounded; cleared when full.
        self._blocks: dict[tuple[Any, ...], tuple[list[tuple[bytes, bytes]], bytes]] = {}

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
        match = None if transport is None else (_ORIGIN_LOWER.match(url) or _ORIGIN.match(url))
        origin = None if match is None else self._origin(match[0], url[match.end() :])
        if origin is None or (content is not None and json is not None):
            return await self._slow(method, url, headers, content, json, timeout)
        method = method.upper()
        body = b""
        block = None
        if headers is None and json is None and content is None and method not in _BODY_METHODS:
            # A plain GET (every poll, most often): its header block is the same for every
            # request to the origin while the client's headers stay as they are.
            key = (origin[1], *self._client.headers.raw)
            cached = self._blocks.get(key)
            if cached is None:
                raw = self._headers(origin[1], None)
                assert raw is not None  # no headers of the call's: nothing to refuse
                if len(self._blocks) >= _ORIGINS_MAX:
                    self._blocks.clear()
                cached = self._blocks[key] = (raw, _block(raw))
            raw, block = cached
        else:
            raw = self._headers(origin[1], headers)
            if raw is None:
                return await self._slow(method, url, headers, content, json, timeout)
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
        cached_timeouts = self._timeout
        if timeout is None and cached_timeouts is not None:
            timeouts = (
                cached_timeouts[1]
                if cached_timeouts[0] is self._client.timeout
                else self._timeouts(None)
            )
        else:
            timeouts = self._timeouts(timeout)
        answer = await transport.pool().send(
            method,
            origin[0],
            target.encode("ascii"),
            raw,
            body,
            timeouts,
            limit,
            block=block,
            plain=True,  # a Reply has no version nor reason phrase
        )
        data = answer.body
        if answer.stream is not None:
            try:
                data = b"".join([chunk async for chunk in answer.stream])
            finally:
                await answer.stream.aclose()
        for name, value in answer.headers:
            if len(name) == 16 and name.lower() == b"content-encoding":
                coding = value.strip().lower()
                if coding in (b"gzip", b"deflate", b"x-gzip"):
                    data = _inflate(data, b"deflate" if coding == b"deflate" else b"gzip", limit)
                break
        return Reply(answer.status, answer.headers, data)

    def _origin(self, text: str, tail: str) -> tuple[tuple[str, str, int], bytes] | None:
        """(scheme, host, port) and the Host header for a URL the fast path can send: its
        origin `text`, and a path and query `tail` that need no rewriting."""
        plain = (
            (tail[:1] == "/" or not tail)
            and tail.isascii()
            and not tail.encode().translate(None, _PATH_CHARS)
        )
        if "/." in tail or (not plain and _PLAIN_TAIL.fullmatch(tail) is None):
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


# The last client asked for and its Fetcher, both weakly: `ctx.fetch` asks on every poll,
# nearly always for the same client, and a WeakKeyDictionary lookup makes a weak
# reference and runs Python code each time.
_last: tuple[weakref.ref[httpx.AsyncClient], weakref.ref[Fetcher]] | None = None


def fetcher_for(client: httpx.AsyncClient) -> Fetcher:
    """The `Fetcher` for `client`: its fast path if `make_http_client` made it."""
    global _last
    last = _last
    if last is not None and last[0]() is client:
        fetcher = last[1]()
        if fetcher is not None:
            return fetcher
    fetcher = _FETCHERS.get(client)
    if fetcher is None:
        fetcher = _FETCHERS[client] = Fetcher(client, None)
    _last = (weakref.ref(client), weakref.ref(fetcher))
    return fetcher


class _NoCookies(http.cookiejar.CookieJar):
    """A jar that takes no cookie from a response (its policy refuses them anyway):
    skipping the standard library's cookie parsing saves httpx's client a part of every
    request."""

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
