"""A vendor whose every answer a test scripts: statuses, bodies, delays and resets.

Routes ``POST /jobs`` (submit), ``GET /jobs/{id}`` (query), ``POST /jobs/{id}/cancel``,
``GET /files/{name}`` and ``POST /uploads`` (a submit step) each play their own script: a
list of actions, one per request, the last one repeated. Every request is recorded with
its headers and body.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web
from multidict import CIMultiDict

__all__ = [
    "Action", "Recorded", "Scripted", "echo", "garbage", "json", "reset", "slow", "status"
]  # fmt: skip

Action = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json(body: Any, code: int = 200, headers: dict[str, str] | None = None) -> Action:
    """Answer `body` as JSON with status `code`."""

    async def act(request: web.Request) -> web.StreamResponse:
        return web.Response(body=msgspec.json.encode(body), status=code,
                            content_type="application/json", headers=headers)  # fmt: skip

    return act


def status(code: int, headers: dict[str, str] | None = None, text: str = "") -> Action:
    """Answer `code` with a plain-text body."""

    async def act(request: web.Request) -> web.StreamResponse:
        return web.Response(status=code, text=text or f"status {code}", headers=headers)

    return act


def garbage(body: bytes, code: int = 200, content_type: str = "text/html") -> Action:
    """Answer bytes that are not what the client expects."""

    async def act(request: web.Request) -> web.StreamResponse:
        return web.Response(body=body, status=code, content_type=content_type)

    return act


def echo(code: int = 200, header: str = "Authorization") -> Action:
    """Answer a non-JSON body quoting one request header (a vendor leaking what it got)."""

    async def act(request: web.Request) -> web.StreamResponse:
        text = f"<html>you sent {header}: {request.headers.get(header, '')}</html>"
        return web.Response(status=code, text=text, content_type="text/html")

    return act


def slow(seconds: float, then: Action) -> Action:
    """Read the request, wait, then answer (the client may have given up by then)."""

    async def act(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(seconds)
        return await then(request)

    return act


def reset() -> Action:
    """Read the whole request, then drop the connection without answering."""

    async def act(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.abort()
        return web.Response(status=204)  # never written: the transport is gone

    return act


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    headers: CIMultiDict[str]  # names are case-insensitive
    body: bytes
    at: float  # time.monotonic() when it arrived


@dataclass
class Scripted:
    """Scripts per route; `app()` builds the aiohttp application."""

    submit: list[Action] = field(default_factory=lambda: [json({"id": "job-1"}, 201)])
    query: list[Action] = field(default_factory=lambda: [json({"status": "done"})])
    cancel: list[Action] = field(default_factory=lambda: [json({"status": "canceled"})])
    files: list[Action] = field(default_factory=lambda: [status(404)])
    uploads: list[Action] = field(default_factory=lambda: [json({"id": "file-1"})])
    seen: list[Recorded] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.post("/jobs", self._play("submit")),
                web.get("/jobs/{id}", self._play("query")),
                web.post("/jobs/{id}/cancel", self._play("cancel")),
                web.get("/files/{name}", self._play("files")),
                web.post("/uploads", self._play("uploads")),
                web.put("/store/{tail:.*}", self._store),
            ]
        )
        return app

    def _play(self, route: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            self._record(request, body)
            script: list[Action] = getattr(self, route)
            action = script.pop(0) if len(script) > 1 else script[0]
            return await action(request)

        return handle

    async def _store(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self._record(request, body)
        return web.Response(status=201)

    def _record(self, request: web.Request, body: bytes) -> None:
        headers = CIMultiDict(request.headers)
        self.seen.append(Recorded(request.method, request.path_qs, headers, body, time.monotonic()))

    def calls(self, method: str, prefix: str) -> list[Recorded]:
        """Recorded requests with this method whose path starts with `prefix`."""
        return [r for r in self.seen if r.method == method and r.path.startswith(prefix)]
