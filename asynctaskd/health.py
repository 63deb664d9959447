"""/metrics, /healthz and /readyz over a small anyio HTTP listener.

- `/metrics`: the Prometheus exposition. The format follows the scraper's `Accept`
  header (prometheus_client's `choose_encoder`): text format 0.0.4 by default,
  OpenMetrics when asked for.
- `/healthz`: 200 while the process serves requests (liveness).
- `/readyz`: 200 "ready", or 503 with the reason (starting, draining, Redis unreachable,
  due work not claimed for longer than `worker.watchdog`). Lines after the first, if any,
  are detail that does not decide readiness (the daemon's durability gate).

GET and HEAD are served; any other method gets 405 with an `Allow` header. One request
per connection (`Connection: close`): scrapers and probes do not need keep-alive.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
from anyio.abc import TaskStatus
from prometheus_client.exposition import choose_encoder

from .metrics import Metrics

__all__ = ["ReadyCheck", "serve_health"]

logger = logging.getLogger(__name__)

# (ready, reason); may be a coroutine function when checking needs I/O.
ReadyCheck = Callable[[], tuple[bool, str] | Awaitable[tuple[bool, str]]]

_TEXT = "text/plain; charset=utf-8"
_MAX_HEAD = 8192


def _response(
    status: str,
    body: bytes,
    content_type: str = _TEXT,
    *,
    head_only: bool = False,
    extra: str = "",
) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\n{extra}"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + (b"" if head_only else body)


def _header(head: bytes, name: bytes) -> str:
    for line in head.split(b"\r\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            return value.strip().decode("latin-1")
    return ""


async def _ready(check: ReadyCheck) -> tuple[bool, str]:
    result = check()
    if isinstance(result, tuple):
        return result
    return await result


async def respond(head: bytes, metrics: Metrics, ready: ReadyCheck) -> bytes:
    """The whole HTTP response for one request head (request line and headers)."""
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return _response("400 Bad Request", b"bad request line\n")
    method, target = parts[0], parts[1]
    path = target.split("?", 1)[0]
    if path not in ("/metrics", "/healthz", "/readyz"):
        return _response("404 Not Found", b"try /metrics, /healthz or /readyz\n")
    if method not in ("GET", "HEAD"):
        return _response(
            "405 Method Not Allowed", b"only GET and HEAD\n", extra="Allow: GET, HEAD\r\n"
        )
    head_only = method == "HEAD"
    if path == "/metrics":
        encode, content_type = choose_encoder(_header(head, b"accept"))
        body = encode(metrics.registry)
        return _response("200 OK", body, content_type, head_only=head_only)
    if path == "/healthz":
        return _response("200 OK", b"ok\n", head_only=head_only)
    try:
        ok, why = await _ready(ready)
    except Exception as exc:  # a failing check means "not ready", with the reason
        ok, why = False, f"readiness check failed: {exc}"
    status = "200 OK" if ok else "503 Service Unavailable"
    return _response(status, why.encode() + b"\n", head_only=head_only)


async def _handle(stream: anyio.abc.SocketStream, metrics: Metrics, ready: ReadyCheck) -> None:
    async with stream:
        try:
            with anyio.fail_after(5):
                data = b""
                while b"\r\n\r\n" not in data:
                    if len(data) >= _MAX_HEAD:
                        await stream.send(_response("431 Request Header Fields Too Large", b""))
                        return
                    chunk = await stream.receive(4096)
                    if not chunk:
                        return
                    data += chunk
                reply = await respond(data.split(b"\r\n\r\n", 1)[0], metrics, ready)
                await stream.send(reply)
        except (TimeoutError, anyio.BrokenResourceError, anyio.EndOfStream, OSError):
            return


async def serve_health(
    host: str,
    port: int,
    metrics: Metrics,
    ready: ReadyCheck,
    *,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; reports the bound port (port 0 picks a free one)."""
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
    async with listener:
        bound = listener.extra(anyio.abc.SocketAttribute.local_port)
        logger.info("metrics and health on http://%s:%d", host, bound)
        task_status.started(bound)
        await listener.serve(lambda s: _handle(s, metrics, ready))
