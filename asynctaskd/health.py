"""/metrics, /healthz and /readyz over a small anyio HTTP listener."""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import anyio.abc
from anyio.abc import TaskStatus
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .metrics import Metrics

__all__ = ["serve_health"]

logger = logging.getLogger(__name__)

ReadyCheck = Callable[[], tuple[bool, str]]


def _response(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


async def _handle(stream: anyio.abc.SocketStream, metrics: Metrics, ready: ReadyCheck) -> None:
    async with stream:
        try:
            with anyio.fail_after(5):
                data = b""
                while b"\r\n\r\n" not in data and len(data) < 8192:
                    chunk = await stream.receive(4096)
                    if not chunk:
                        return
                    data += chunk
            line = data.split(b"\r\n", 1)[0].decode("latin-1")
            parts = line.split()
            path = parts[1].split("?", 1)[0] if len(parts) >= 2 else "/"
            if path == "/metrics":
                reply = _response("200 OK", generate_latest(metrics.registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                reply = _response("200 OK", b"ok\n")
            elif path == "/readyz":
                ok, why = ready()
                reply = _response(
                    "200 OK" if ok else "503 Service Unavailable", why.encode() + b"\n"
                )
            else:
                reply = _response("404 Not Found", b"try /metrics, /healthz or /readyz\n")
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
