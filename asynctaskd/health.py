"""/metrics, /healthz and /readyz, served by aiohttp's web server on the configured address.

- `/metrics`: the Prometheus exposition. The format follows the scraper's `Accept`
  header (prometheus_client's `choose_encoder`): text format 0.0.4 by default,
  OpenMetrics when asked for.
- `/healthz`: 200 while the process serves requests (liveness).
- `/readyz`: 200 "ready", or 503 with the reason (starting, draining, Redis unreachable,
  due work not claimed for longer than `worker.watchdog`). Lines after the first, if any,
  are detail that does not decide readiness (the daemon's durability gate).

GET and HEAD are served; any other method gets 405 with an `Allow` header, any other path
404; aiohttp answers a request it cannot parse with 400. One request per connection
(`Connection: close`): scrapers and probes do not need keep-alive, and a drain leaves no
idle connection behind. The listener binds exactly the host it is given (the daemon's
`[metrics] listen`, loopback unless configured otherwise; `asynctaskd web`'s
`[web] metrics_listen`), never every interface.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio
from aiohttp import web
from aiohttp.http import HttpProcessingError
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

__all__ = ["Exported", "ReadyCheck", "serve_health"]

logger = logging.getLogger(__name__)


class _ClientMistakes(logging.Filter):
    """A request aiohttp cannot parse is the client's mistake, answered 400: logged at
    debug (as aiohttp does for non-HTTP traffic), never as an error of the daemon."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return _http_logger.isEnabledFor(logging.DEBUG)
        return True


# What aiohttp's server logs about the requests it handles for us.
_http_logger = logging.getLogger(__name__ + ".http")
_http_logger.addFilter(_ClientMistakes())


class Exported(Protocol):
    """What /metrics serves: the daemon's `Metrics`, the web process's `WebMetrics`."""

    @property
    def registry(self) -> CollectorRegistry: ...


# (ready, reason); may be a coroutine function when checking needs I/O.
ReadyCheck = Callable[[], tuple[bool, str] | Awaitable[tuple[bool, str]]]

_PATHS = ("/metrics", "/healthz", "/readyz")
_TEXT = "text/plain; charset=utf-8"
# How long a drain waits for requests being answered before it closes their connections.
_SHUTDOWN_S = 1.0


async def _ready(check: ReadyCheck) -> tuple[bool, str]:
    result = check()
    if isinstance(result, tuple):
        return result
    return await result


def _response(status: int, body: bytes, content_type: str = _TEXT, **headers: str) -> web.Response:
    response = web.Response(
        status=status,
        body=body,
        headers={"Content-Type": content_type, "Cache-Control": "no-store", **headers},
    )
    response.force_close()
    return response


def _handler(
    metrics: Exported, ready: ReadyCheck
) -> Callable[[web.BaseRequest], Awaitable[web.Response]]:
    async def handle(request: web.BaseRequest) -> web.Response:
        if request.path not in _PATHS:
            return _response(404, b"try /metrics, /healthz or /readyz\n")
        if request.method not in ("GET", "HEAD"):
            return _response(405, b"only GET and HEAD\n", Allow="GET, HEAD")
        if request.path == "/metrics":
            encode, content_type = choose_encoder(request.headers.get("Accept", ""))
            return _response(200, encode(metrics.registry), content_type)
        if request.path == "/healthz":
            return _response(200, b"ok\n")
        try:
            ok, why = await _ready(ready)
        except Exception as exc:  # a failing check means "not ready", with the reason
            ok, why = False, f"readiness check failed: {exc}"
        return _response(200 if ok else 503, why.encode() + b"\n")

    return handle


async def serve_health(
    host: str,
    port: int,
    metrics: Exported,
    ready: ReadyCheck,
    *,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; reports the bound port (port 0 picks a free one).

    `host` is required: aiohttp, given no host, would listen on every interface."""
    if not host:
        raise ValueError("serve_health needs the address to listen on")
    server = web.Server(_handler(metrics, ready), access_log=None, logger=_http_logger)
    runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=_SHUTDOWN_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_port=False)
        await site.start()
        addresses = runner.addresses
        bound = int(addresses[0][1])
        shown = ", ".join(f"{a[0]}:{a[1]}" for a in addresses)
        logger.info("metrics and health on http://%s:%d (listening on %s)", host, bound, shown)
        task_status.started(bound)
        await anyio.sleep_forever()
    finally:
        with anyio.move_on_after(_SHUTDOWN_S + 1, shield=True):
            await runner.cleanup()
