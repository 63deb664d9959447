"""`asynctaskd web`: the HTTP API in a process of its own, until SIGTERM or SIGINT.

A process of its own, not a part of the daemon: the API scales and restarts apart from
the workers, holds no vendor credentials, and a flood of HTTP clients cannot slow the
claims. On a signal it stops accepting, lets requests being answered finish for up to
`_SHUTDOWN_S`, ends open event streams (clients reconnect elsewhere with Last-Event-ID),
and closes Redis.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any, Final

import anyio
from aiohttp import web

from asynctaskd import __version__, systemd
from asynctaskd.client import AsyncClient
from asynctaskd.config import Config, parse_listen
from asynctaskd.health import serve_health
from asynctaskd.store import open_redis

from .app import WebSettings, make_app, redis_ready
from .metrics import WebMetrics

__all__ = ["redis_url_of", "run_web", "serve_web"]

logger = logging.getLogger(__name__)

_SHUTDOWN_S: Final = 5.0


def redis_url_of(config: Config) -> str:
    """The Redis URL of `config`; for `embedded`, the daemon's server through its socket."""
    if config.redis.url == "embedded":
        return f"embedded://{Path(config.redis.data_dir).resolve()}"
    return config.redis.url


def settings_of(config: Config) -> WebSettings:
    return WebSettings(
        namespace=config.redis.namespace,
        shards=config.redis.shards,
        max_body=config.web.max_body,
        token_cache=float(config.web.token_cache),
        keepalive=float(config.web.keepalive),
        version=__version__,
    )


async def serve_web(
    config: Config,
    *,
    started: asyncio.Future[int] | None = None,
    metrics_started: asyncio.Future[int] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT; `started` receives the bound port (0 picks one),
    `metrics_started` the metrics listener's (with `[web] metrics_listen`)."""
    host, port = parse_listen(config.web.listen)
    redis = open_redis(redis_url_of(config), max_connections=config.web.redis_connections)
    client = AsyncClient(redis, config.redis.namespace, shards=config.redis.shards)
    metrics = WebMetrics()
    app = make_app(client, settings_of(config), metrics)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=_SHUTDOWN_S,
                           access_log=None)  # fmt: skip
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        async with anyio.create_task_group() as tg:
            if config.web.metrics_listen:  # the daemon's health server, on its own address
                m_host, m_port = parse_listen(config.web.metrics_listen)
                m_bound = await tg.start(serve_health, m_host, m_port, metrics,
                                         lambda: redis_ready(client))  # fmt: skip
                if metrics_started is not None:
                    metrics_started.set_result(m_bound)
            site = web.TCPSite(runner, host, port, reuse_port=False)
            await site.start()
            bound = int(runner.addresses[0][1])
            logger.info("HTTP API on http://%s:%d/api/v1 (namespace %s)", host, bound,
                        config.redis.namespace)  # fmt: skip
            if started is not None:
                started.set_result(bound)
            systemd.notify(f"READY=1\nSTATUS=HTTP API on {host}:{bound}")
            await stop.wait()
            systemd.notify("STOPPING=1")
            logger.info("stopping the HTTP API")
            tg.cancel_scope.cancel()  # the metrics listener
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await runner.cleanup()
        await redis.aclose()
        await redis.connection_pool.disconnect()


def run_web(config: Config) -> None:
    """Blocking entry point of `asynctaskd web`."""
    options: dict[str, Any] = {}
    try:
        import uvloop

        options["loop_factory"] = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - a declared dependency, absent on some platforms
        pass
    with asyncio.Runner(**options) as runner:
        runner.run(serve_web(config))
