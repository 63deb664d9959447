"""The /api/v1 routes on aiohttp.web, with AsyncClient doing every Redis call but the
event streams' shared reads of the events streams (`sse`, `feed`).

The server adds only what HTTP needs: tokens and their roles, status codes, the event
stream. Every rule about tasks (names, ranges, payload size, tenants, dedup, quotas) is the
client's, and so are its error messages. Roles (docs/api.md):

- producer (bound to a tenant): submit, read, list, watch and cancel that tenant's tasks;
- viewer (bound to a tenant): read, list and watch that tenant's tasks;
- operator: everything, for every tenant, plus stats, resolve, requeue, pauses, limits,
  handler groups and purge.

Another tenant's task is answered exactly as a missing one (404), so a token cannot learn
whether an id exists. A request is authenticated before its body is read, and its body is
decoded and checked before anything is written.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from aiohttp import web

from asynctaskd.client import AsyncClient
from asynctaskd.keys import Keys
from asynctaskd.tracing import from_headers

from .common import (
    _ANY,
    _CLIENT,
    _FEED,
    _KEYS,
    _METRICS,
    _OPERATOR,
    _RATES,
    _SETTINGS,
    _TOKENS,
    _WRITERS,
    PREFIX,
    ApiError,
    WebSettings,
    _auth,
    _body,
    _errors,
    _json,
    _scope,
    _task_id,
)
from .console.audit import write_audit
from .console.routes import mount_console
from .feed import Feed
from .metrics import WebMetrics, measure
from .operator import (
    _bulk,
    _clear_limit,
    _delete_group,
    _group,
    _groups,
    _limits,
    _pause,
    _paused,
    _purge,
    _requeue,
    _resolve,
    _resume,
    _set_group,
    _set_limit,
)
from .schemas import (
    SubmitBody,
    openapi,
    public_task,
)
from .sse import events
from .tokens import RateLimiter, TokenCache

__all__ = ["ApiError", "WebSettings", "make_app"]

logger = logging.getLogger(__name__)


async def _submit(request: web.Request) -> web.Response:
    record = await _auth(request, _WRITERS)
    body: SubmitBody = await _body(request, SubmitBody)
    tenant = _scope(record)
    if tenant is not None and body.tenant not in (None, tenant):
        raise ApiError(403, "forbidden", f"this token submits for tenant {tenant!r} only")
    client = request.app[_CLIENT]
    key = request.headers.get("Idempotency-Key")
    # Redis's clock, as created_at is: a task created before this instant is a duplicate.
    # In whole ms, as the create script stores it: a task of the same ms counts as new.
    before_ms: int | None = None
    if key is not None or body.dedup is not None:
        seconds, micros = await client.redis.time()
        before_ms = int(seconds) * 1000 + int(micros) // 1000
    task = await client.submit(
        body.handler, body.params, tracking_timeout=body.tracking_timeout,
        tenant=tenant if tenant is not None else body.tenant, account=body.account,
        provider=body.provider, priority=body.priority, dedup_key=key,
        metadata=body.metadata, not_before=body.not_before, delay=body.delay,
        strict=body.strict, route_key=body.route_key, dedup=body.dedup,
        trace=from_headers(request.headers),
    )  # fmt: skip
    existing = before_ms is not None and round(task.created_at * 1000) < before_ms
    return _json(200 if existing else 201, public_task(task),
                 Location=f"{PREFIX}/tasks/{task.id}")  # fmt: skip


async def _get(request: web.Request) -> web.Response:
    record = await _auth(request, _ANY)
    task_id = _task_id(request)
    task = await request.app[_CLIENT].get(task_id, _scope(record))
    if task is None:
        raise ApiError(404, "not_found", f"no task {task_id}")
    return _json(200, public_task(task))


async def _cancel(request: web.Request) -> web.Response:
    record = await _auth(request, _WRITERS)
    task_id = _task_id(request)
    if not await request.app[_CLIENT].cancel(task_id, _scope(record)):
        raise ApiError(409, "already_finished", f"task {task_id} had already finished")
    if record.role == "operator":  # a producer's cancel of its own task is not audited
        await write_audit(request, record, "cancel", task_id)
    return _json(202, {"id": task_id, "cancel": "requested"})


def _query_int(request: web.Request, name: str, default: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ApiError(422, "invalid", f"{name} must be an integer, got {text!r:.40}") from None


async def _list(request: web.Request) -> web.Response:
    record = await _auth(request, _ANY)
    q = request.query
    unknown = set(q) - {"status", "handler", "cursor", "limit", "tenant"}
    if unknown:
        raise ApiError(422, "invalid", f"unknown query parameter(s): {', '.join(sorted(unknown))}")
    tenant = _scope(record)
    if tenant is not None and q.get("tenant") not in (None, tenant):
        raise ApiError(403, "forbidden", f"this token lists tenant {tenant!r} only")
    page = await request.app[_CLIENT].list(
        status=q.get("status"), handler=q.get("handler"),
        tenant=tenant if tenant is not None else q.get("tenant"),
        limit=_query_int(request, "limit", 100), cursor=q.get("cursor"),
    )  # fmt: skip
    return _json(200, {"tasks": [public_task(t) for t in page.tasks], "cursor": page.cursor})


async def _stats(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    return _json(200, msgspec.to_builtins(await request.app[_CLIENT].stats()))


async def _openapi(request: web.Request) -> web.Response:
    return _json(200, openapi(request.app[_SETTINGS].version))


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n", headers={"Cache-Control": "no-store"})


async def redis_ready(client: AsyncClient) -> tuple[bool, str]:
    """Ready while Redis answers a PING within 2 s: /readyz here and on the metrics listener."""
    try:
        await asyncio.wait_for(client.redis.ping(), 2.0)
    except Exception as exc:  # any failure means "not ready", with the reason
        return False, f"Redis unreachable: {exc}"
    return True, "ready"


async def _readyz(request: web.Request) -> web.Response:
    ok, why = await redis_ready(request.app[_CLIENT])
    if not ok:
        return web.Response(status=503, text=f"{why}\n")
    return web.Response(text=f"{why}\n", headers={"Cache-Control": "no-store"})


async def _end_streams(app: web.Application) -> None:
    """On shutdown, end open event streams cleanly rather than wait for them: the clients
    reconnect (to another instance) with Last-Event-ID and miss nothing."""
    await app[_FEED].close()


def make_app(
    client: AsyncClient, settings: WebSettings, metrics: WebMetrics | None = None
) -> web.Application:
    """The API as an aiohttp Application on `client` (left open: the caller owns it),
    counted in `metrics` (a registry of its own when not given; `app[_METRICS]`)."""
    metrics = metrics or WebMetrics()
    app = web.Application(middlewares=[measure(metrics), _errors],
                          client_max_size=settings.max_body)  # fmt: skip
    app[_CLIENT] = client
    app[_SETTINGS] = settings
    app[_METRICS] = metrics
    app[_KEYS] = Keys(settings.namespace, settings.shards)
    app[_FEED] = metrics.feed = Feed(client.redis, app[_KEYS])
    app.on_shutdown.append(_end_streams)
    app[_TOKENS] = TokenCache(client.redis, settings.namespace, settings.token_cache)
    app[_RATES] = RateLimiter()
    p = PREFIX
    app.router.add_post(f"{p}/tasks", _submit)
    app.router.add_get(f"{p}/tasks", _list, allow_head=False)
    app.router.add_post(f"{p}/tasks/bulk", _bulk)
    app.router.add_get(f"{p}/tasks/{{id}}", _get, allow_head=False)
    app.router.add_post(f"{p}/tasks/{{id}}/cancel", _cancel)
    app.router.add_get(f"{p}/tasks/{{id}}/events", events, allow_head=False)
    app.router.add_post(f"{p}/tasks/{{id}}/resolve", _resolve)
    app.router.add_post(f"{p}/tasks/{{id}}/requeue", _requeue)
    app.router.add_get(f"{p}/stats", _stats, allow_head=False)
    app.router.add_get(f"{p}/pause", _paused, allow_head=False)
    app.router.add_post(f"{p}/pause", _pause)
    app.router.add_post(f"{p}/resume", _resume)
    app.router.add_get(f"{p}/limits", _limits, allow_head=False)
    app.router.add_put(f"{p}/limits", _set_limit)
    app.router.add_delete(f"{p}/limits", _clear_limit)
    app.router.add_get(f"{p}/groups", _groups, allow_head=False)
    app.router.add_get(f"{p}/groups/{{name}}", _group, allow_head=False)
    app.router.add_put(f"{p}/groups/{{name}}", _set_group)
    app.router.add_delete(f"{p}/groups/{{name}}", _delete_group)
    app.router.add_post(f"{p}/purge", _purge)
    app.router.add_get(f"{p}/openapi.json", _openapi, allow_head=False)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    mount_console(app)  # the browser console at /, on the same tokens (docs/console.md)
    return app
