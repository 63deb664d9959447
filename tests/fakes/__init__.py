"""Local fakes of real vendor APIs (same request and response shapes), served in-process.

Each fake is an `aiohttp.web.Application` factory; `serve(app)` runs one on a free loopback
port of the running asyncio loop and yields its base URL.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

__all__ = ["serve"]


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    """Serve `app` on 127.0.0.1 (a free port) until the block exits; yields the base URL."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.1)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
