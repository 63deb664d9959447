"""Downloads of URLs a vendor chose: declared hosts only, public addresses only.

A vendor's answer may name any URL, and a producer may choose what runs at the vendor (a
Replicate model can output whatever URL it likes). The declarative handler's finalize
step fetches such URLs from inside our network, so this module keeps what should stay
outside outside: a URL is fetched only from a host the handler declared, and never from a
private, loopback, link-local or otherwise non-public address unless the handler allows
that explicitly (`allow_private_addresses`, for a vendor or a fake on a private network).
No credentials are added here: the caller decides what headers a URL may get.

DNS. Checking a URL's name once and letting the connection resolve it again would leave a
window: a public-looking name may resolve to a private address, or be made to (a short
TTL, a second answer). So the check runs on the addresses the connection actually uses:
the aiohttp connector gets a resolver that refuses a name when any of its addresses is not
public, and it connects only to the addresses that resolver returned; nothing resolves
the name a second time. IP literals never reach a resolver: they are checked here before
the request. Redirects are not followed, and no proxy is used (a proxy would resolve the
name itself).
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Final

import aiohttp
import aiohttp.abc
import anyio.to_thread
import httpx
import yarl

__all__ = [
    "Download",
    "DownloadFailed",
    "DownloadRefused",
    "Downloads",
    "host_pattern",
    "non_public",
    "origin_of",
]

_LABEL: Final = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOST_NAME: Final = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
# A host whose last label is a number is an IPv4 address in some spelling ("127.1",
# "2130706433", "0x7f.1"): only the canonical dotted quad is taken, as an address.
_NUMERIC_LABEL: Final = re.compile(r"(?:0x[0-9a-f]*|[0-9]+)")
_NAT64: Final = ipaddress.IPv6Network("64:ff9b::/96")  # the well-known NAT64 prefix
# No URL has these as they are; yarl would quietly percent-encode them and send it anyway.
# (A space in a path is encoded and sent, as httpx did.)
_NOT_IN_A_URL: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class DownloadRefused(Exception):
    """The URL is not one that may be fetched (undeclared host, non-public address); nothing
    was sent, and nothing would be on another attempt."""


class DownloadFailed(Exception):
    """The URL could not be used or the download failed (connection, timeout, framing)."""


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])  # an IPv6 zone does not matter
    except ValueError:
        return None


def non_public(address: str) -> str | None:
    """Why `address` (an IP address as text) is not a public one, or None if it is."""
    ip = _ip(address)
    if ip is None:
        return "not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        # An IPv4 address in IPv6 clothes reaches that IPv4 address: judge it as one.
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in _NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_private:
        return "a private address"
    site_local = isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local
    if site_local or ip.is_multicast or ip.is_reserved or ip.is_unspecified or not ip.is_global:
        return "not a public address"
    return None


def host_pattern(text: str) -> str:
    """A `finalize.hosts` entry, checked and normalised; ValueError says what is wrong.

    A host name ("files.example.com"), a name with a leading "*." for any host below it
    ("*.example.com", not example.com itself), or an IP address; no scheme, port or path.
    """
    value = text.strip().lower().rstrip(".")
    ip = _ip(value.removeprefix("[").removesuffix("]"))
    if ip is not None:
        return ip.compressed
    name = value.removeprefix("*.")
    if (
        not _HOST_NAME.fullmatch(name)
        or len(name) > 253
        or _NUMERIC_LABEL.fullmatch(name.rsplit(".", 1)[-1])
    ):
        raise ValueError(
            "expected a host name such as 'files.example.com', '*.example.com' for the "
            f"hosts below it, or an IP address (no scheme, port or path), got {text!r}"
        )
    return value


def _host_of(url: yarl.URL) -> str:
    """The URL's host as the connection will use it, normalised as `host_pattern` does;
    DownloadFailed if it is no host name or IP address."""
    raw = url.raw_host or ""
    ip = _ip(raw.replace("%25", "%"))
    if ip is not None:
        return ip.compressed
    host = raw.lower().rstrip(".")
    if not _HOST_NAME.fullmatch(host):
        raise DownloadFailed(f"not a usable URL: the host {raw[:80]!r} is no host name")
    if _NUMERIC_LABEL.fullmatch(host.rsplit(".", 1)[-1]):
        raise DownloadRefused(f"{raw[:80]!r} is not a canonical IP address")
    return host


def _failed(exc: BaseException, url: yarl.URL | str) -> DownloadFailed:
    """DownloadFailed for `exc`, without the URL. aiohttp and yarl quote it in their
    messages, and a vendor's file URL may carry a token (a presigned URL's signature) that
    must reach neither a log line nor an error stored with the task."""
    text = f"{type(exc).__name__}: {exc}"
    shown = {str(url)} | ({url.human_repr()} if isinstance(url, yarl.URL) else set())
    for form in sorted(shown, key=len, reverse=True):
        if form:
            text = text.replace(form, "<url>")
    return DownloadFailed(re.sub(r"url='[^']*'", "url=<url>", text))


def _parse(text: str) -> yarl.URL:
    if _NOT_IN_A_URL.search(text):
        raise DownloadFailed("not a usable URL: it has a control character")
    try:
        url = yarl.URL(text)
    except (ValueError, TypeError) as exc:
        raise DownloadFailed(f"not a usable URL: {_failed(exc, text)}") from None
    if url.scheme not in ("http", "https") or not url.absolute or not url.raw_host:
        raise DownloadFailed("not an absolute http(s) URL")
    return url


def origin_of(text: str) -> tuple[str, str, int | None] | None:
    """(scheme, host, port) of an absolute http(s) URL as `Downloads` connects to it, or
    None if it is not one."""
    try:
        url = _parse(text)
        return (url.scheme, _host_of(url), url.port)
    except (DownloadFailed, DownloadRefused):
        return None


class _NonPublicAddress(OSError):
    """Raised by the resolver; aiohttp hands it back as a connector error's `os_error`."""


class _PublicOnly(aiohttp.abc.AbstractResolver):
    """A resolver (by default aiohttp's) that refuses a name any of whose addresses is not
    public: the connector connects only to what this returns."""

    def __init__(self, resolver: aiohttp.abc.AbstractResolver | None = None) -> None:
        self._resolver = resolver or aiohttp.DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[aiohttp.abc.ResolveResult]:
        found = await self._resolver.resolve(host, port, family)
        for entry in found:
            why = non_public(entry["host"])
            if why is not None:
                raise _NonPublicAddress(
                    f"{host!r} resolves to {entry['host']}, {why} (finalize.allow_private_"
                    "addresses is off)"
                )
        return found

    async def close(self) -> None:
        await self._resolver.close()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # The trust store the handlers' httpx client uses. Loading it takes a tenth of a second
    # or more: done once, in a worker thread (see `Downloads.__aenter__`).
    return httpx.create_ssl_context()


class Download:
    """An answer whose body has not been read: `status`, `headers`, and `chunks()`."""

    def __init__(self, response: aiohttp.ClientResponse, url: yarl.URL) -> None:
        self._response = response
        self._url = url
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers  # case-insensitive

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body (Content-Encoding decoded), as it arrives."""
        try:
            async for chunk in self._response.content.iter_chunked(64 * 1024):
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _failed(exc, self._url) from None


class Downloads:
    """Fetches URLs under one policy, over a session of its own (enter it to open it).

    `hosts` are `host_pattern` entries; `also` a host allowed besides them (the vendor's own
    file host, from the handler's download template). Timeouts are in seconds: `connect`
    for DNS and the connection, `read` between two reads.
    """

    def __init__(
        self,
        hosts: Sequence[str],
        *,
        allow_private: bool = False,
        connect: float = 5.0,
        read: float = 30.0,
    ) -> None:
        self._exact = frozenset(h for h in hosts if not h.startswith("*."))
        self._suffixes = tuple(h[1:] for h in hosts if h.startswith("*."))  # ".example.com"
        self._allow_private = allow_private
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect, sock_connect=connect, sock_read=read
        )
        self._session: aiohttp.ClientSession | None = None
        self._resolver: _PublicOnly | None = None

    def check(self, text: str, also: str | None = None) -> yarl.URL:
        """The URL to fetch for `text`; DownloadRefused if it may not be fetched,
        DownloadFailed if it is no usable http(s) URL."""
        url = _parse(text)
        host = _host_of(url)
        if not (host == also or host in self._exact or host.endswith(self._suffixes)):
            raise DownloadRefused(
                f"{host!r} is not among the hosts files may be downloaded from (finalize.hosts)"
            )
        if not self._allow_private and _ip(host) is not None:
            why = non_public(host)
            if why is not None:
                raise DownloadRefused(f"{host} is {why} (finalize.allow_private_addresses is off)")
        return url

    async def __aenter__(self) -> Downloads:
        # A thread, not the event loop: the first call loads the trust store.
        trust = await anyio.to_thread.run_sync(_ssl_context)
        self._resolver = None if self._allow_private else _PublicOnly()
        connector = aiohttp.TCPConnector(resolver=self._resolver, ssl=trust)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,  # no proxy: it would resolve names where we cannot check them
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session, self._session = self._session, None
        resolver, self._resolver = self._resolver, None
        if session is not None:
            await session.close()
        if resolver is not None:  # the connector closes only a resolver it made itself
            await resolver.close()

    @asynccontextmanager
    async def get(self, url: yarl.URL, headers: Mapping[str, str]) -> AsyncIterator[Download]:
        """GET a URL `check` returned; the answer is released when the block exits."""
        if self._session is None:
            raise RuntimeError("Downloads is not open: use it as an async context manager")
        try:
            response = await self._session.get(url, headers=headers, allow_redirects=False)
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, _NonPublicAddress):
                raise DownloadRefused(str(exc.os_error)) from None
            raise _failed(exc, url) from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _failed(exc, url) from None
        try:
            yield Download(response, url)
        finally:
            response.release()
