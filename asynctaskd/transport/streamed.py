"""The aiohttp route of `PoolTransport`, for request bodies that stream, and how
aiohttp's exceptions become httpx's.

"Never sent" (`ConnectError`, `ConnectTimeout`, `PoolTimeout`) is claimed only with two
pieces of evidence: an aiohttp exception class raised only while obtaining a connection,
and the request still inside our connector's `connect()` when it failed (`_Progress`);
everything else is ambiguous. `asynctaskd.transport` says why that matters.
"""

from __future__ import annotations

import contextvars
import enum
import functools
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any, Final

import aiohttp
import httpx

from asynctaskd.http1 import ResponseTooLarge

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
