"""The /api/v1 routes on aiohttp.web, with AsyncClient doing every Redis call.

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
import contextlib
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Final, cast

import msgspec
import redis.exceptions
from aiohttp import web

from asynctaskd.client import AsyncClient, TaskEvent
from asynctaskd.errors import (
    AsyncTaskdError,
    IllegalTransition,
    InvalidTask,
    PayloadTooLarge,
    QuotaExceeded,
    StoreUnavailable,
    TaskNotFound,
    UnknownHandler,
)
from asynctaskd.keys import Keys
from asynctaskd.model import Status

from .replay import missed_events
from .schemas import (
    BulkBody,
    BulkResult,
    GroupBody,
    PauseBody,
    PurgeBody,
    ResolveBody,
    SubmitBody,
    openapi,
    public_task,
)
from .tokens import RateLimiter, Role, TokenCache, TokenRecord

__all__ = ["ApiError", "WebSettings", "make_app"]

logger = logging.getLogger(__name__)

PREFIX: Final = "/api/v1"
_JSON: Final = "application/json"
_ANY: Final[tuple[Role, ...]] = ("producer", "viewer", "operator")
_WRITERS: Final[tuple[Role, ...]] = ("producer", "operator")
_OPERATOR: Final[tuple[Role, ...]] = ("operator",)


class WebSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the routes need from `[web]` (asynctaskd.config.WebConfig) and `[redis]`."""

    namespace: str = "atd"
    shards: int = 1
    max_body: int = 1024 * 1024
    token_cache: float = 5.0
    keepalive: float = 15.0
    version: str = "0"


class ApiError(Exception):
    """An answer other than success: HTTP status, machine code, message; extra headers."""

    def __init__(self, status: int, code: str, message: str, **headers: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


def _json(status: int, body: Any, **headers: str) -> web.Response:
    return web.Response(
        status=status,
        body=msgspec.json.encode(body),
        content_type=_JSON,
        headers={"Cache-Control": "no-store", **headers},
    )


def _error(status: int, code: str, message: str, **headers: str) -> web.Response:
    return _json(status, {"error": {"code": code, "message": message}}, **headers)


def _translate(exc: AsyncTaskdError) -> ApiError:
    """The client's exceptions as HTTP answers, their messages unchanged."""
    if isinstance(exc, QuotaExceeded):
        retry = str(max(1, math.ceil(exc.retry_after)))
        return ApiError(429, "quota_exceeded", str(exc), **{"Retry-After": retry})
    if isinstance(exc, PayloadTooLarge):
        return ApiError(422, "payload_too_large", str(exc))
    if isinstance(exc, UnknownHandler):
        return ApiError(422, "unknown_handler", str(exc))
    if isinstance(exc, InvalidTask):
        return ApiError(422, "invalid", str(exc))
    if isinstance(exc, TaskNotFound):
        return ApiError(404, "not_found", str(exc))
    if isinstance(exc, IllegalTransition):
        return ApiError(409, "illegal_transition", str(exc))
    if isinstance(exc, StoreUnavailable):
        return ApiError(503, "store_unavailable", "Redis is unreachable; try again later")
    logger.error("request failed: %s: %s", type(exc).__name__, exc)
    return ApiError(500, "internal", f"{type(exc).__name__}: the server logged the details")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as `{"error": {"code", "message"}}`, aiohttp's own ones included."""
    try:
        return await handler(request)
    except ApiError as exc:
        return _error(exc.status, exc.code, exc.message, **exc.headers)
    except AsyncTaskdError as exc:
        err = _translate(exc)
        return _error(err.status, err.code, err.message, **err.headers)
    except redis.exceptions.RedisError as exc:  # outside the client's calls: tokens, TIME
        logger.warning("Redis failed during %s %s: %s", request.method, request.path, exc)
        return _error(503, "store_unavailable", "Redis is unreachable; try again later")
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[_SETTINGS].max_body
        return _error(413, "body_too_large", f"the request body is over {limit} bytes")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "no_route", 405: "method_not_allowed"}.get(exc.status, "http_error")
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}
        return _error(exc.status, code, f"{exc.reason}: {request.method} {request.path}",
                      **headers)  # fmt: skip


_CLIENT: Final = web.AppKey("client", AsyncClient)
_TOKENS: Final = web.AppKey("tokens", TokenCache)
_SETTINGS: Final = web.AppKey("settings", WebSettings)
_RATES: Final = web.AppKey("rates", RateLimiter)
_KEYS: Final = web.AppKey("keys", Keys)
# The queues of the open event streams: a shutdown ends each one (a None) at once.
_STREAMS: Final = web.AppKey("streams", set[asyncio.Queue[TaskEvent | None]])


async def _auth(request: web.Request, roles: tuple[Role, ...]) -> TokenRecord:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "unauthorized", "send Authorization: Bearer <token>",
                       **{"WWW-Authenticate": "Bearer"})  # fmt: skip
    record = await request.app[_TOKENS].check(token.strip())
    if record is None:
        raise ApiError(401, "unauthorized", "the token is unknown or revoked",
                       **{"WWW-Authenticate": 'Bearer error="invalid_token"'})  # fmt: skip
    wait = request.app[_RATES].take(record)
    if wait > 0:
        raise ApiError(429, "rate_limited",
                       f"this token may make {record.rate:g} requests per second "
                       f"(bursts of {record.burst}); try again in {wait:.2f} s",
                       **{"Retry-After": str(max(1, math.ceil(wait)))})  # fmt: skip
    if record.role not in roles:
        needs = " or ".join(roles)
        raise ApiError(403, "forbidden", f"a {record.role} token may not do this; needs {needs}")
    return record


def _scope(record: TokenRecord) -> str | None:
    """The tenant the token is bound to, or None for an operator (every tenant)."""
    return None if record.role == "operator" else record.tenant


async def _body(request: web.Request, type_: type[Any]) -> Any:
    """The body decoded as `type_`, or a 4xx; nothing has been written yet."""
    media = request.content_type
    if media != _JSON:
        raise ApiError(415, "unsupported_media_type",
                       f"send Content-Type: application/json, not {media or 'none'}")  # fmt: skip
    limit = request.app[_SETTINGS].max_body
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, "body_too_large", f"the request body is over {limit} bytes")
    raw = await request.read()  # aiohttp refuses more than client_max_size (413)
    try:
        return msgspec.json.decode(raw, type=type_)
    except msgspec.ValidationError as exc:
        raise ApiError(422, "invalid", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, "malformed_json", f"the body is not JSON: {exc}") from None


def _task_id(request: web.Request) -> str:
    return request.match_info["id"]


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
    if key is not None:
        seconds, micros = await client.redis.time()
        before_ms = int(seconds) * 1000 + int(micros) // 1000
    task = await client.submit(
        body.handler, body.params, tracking_timeout=body.tracking_timeout,
        tenant=tenant if tenant is not None else body.tenant, account=body.account,
        provider=body.provider, priority=body.priority, dedup_key=key,
        metadata=body.metadata, not_before=body.not_before, delay=body.delay,
        strict=body.strict, route_key=body.route_key,
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


async def _resolve(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    body: ResolveBody = await _body(request, ResolveBody)
    task = await request.app[_CLIENT].resolve(
        _task_id(request), body.status, external_id=body.external_id, query=body.query,
        message=body.message,
    )  # fmt: skip
    return _json(200, public_task(task))


async def _requeue(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    return _json(200, public_task(await request.app[_CLIENT].requeue(_task_id(request))))


# Operators' runtime controls: each is one AsyncClient operator call, which checks its
# input before it writes (so its InvalidTask is a 422 and nothing is written).


def _plain(value: Any) -> Any:
    return msgspec.to_builtins(value, enc_hook=float)  # a limit's Duration is a float


def _dimension_of(body: PauseBody) -> dict[str, str]:
    named = {"handler": body.handler, "provider": body.provider, "tenant": body.tenant,
             "account": body.account}  # fmt: skip
    return {k: v for k, v in named.items() if v is not None}


async def _paused(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    return _json(200, {"paused": await request.app[_CLIENT].paused()})


async def _pause(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    body: PauseBody = await _body(request, PauseBody)
    which = _dimension_of(body)
    newly = await request.app[_CLIENT].pause(**which, note=body.note)
    dimension = ",".join(f"{k}:{v}" for k, v in which.items())
    return _json(200, {"dimension": dimension, "newly_paused": newly})


async def _resume(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    body: PauseBody = await _body(request, PauseBody)
    if body.note:
        raise ApiError(422, "invalid", "note is for pause only")
    which = _dimension_of(body)
    moved = await request.app[_CLIENT].resume(**which)
    dimension = ",".join(f"{k}:{v}" for k, v in which.items())
    return _json(200, {"dimension": dimension, "moved": moved})


async def _limits(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    entries = await request.app[_CLIENT].limits()
    return _json(200, {"limits": [_plain(e) for e in entries.values()]})


async def _set_limit(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    # A plain object: AsyncClient.set_limit checks the keys and values, in its words.
    options: dict[str, Any] = await _body(request, dict[str, Any])
    return _json(200, _plain(await request.app[_CLIENT].set_limit(**options)))


async def _clear_limit(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    unknown = set(request.query) - {"scope"}
    if unknown or "scope" not in request.query:
        raise ApiError(422, "invalid", "give exactly the query parameter scope, e.g. "
                       "?scope=provider:openai")  # fmt: skip
    scope = request.query["scope"]
    if not await request.app[_CLIENT].clear_limit(scope):
        raise ApiError(404, "not_found", f"no runtime or config limits for {scope!r:.80}")
    return _json(200, {"scope": scope, "cleared": True})


def _group_json(name: str, group: Any) -> dict[str, Any]:
    return {"name": name, **msgspec.to_builtins(group)}


async def _groups(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    groups = await request.app[_CLIENT].groups()
    return _json(200, {"groups": [_group_json(n, g) for n, g in groups.items()]})


async def _group(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    name = request.match_info["name"]
    group = (await request.app[_CLIENT].groups()).get(name)
    if group is None:
        raise ApiError(404, "not_found", f"no handler group {name!r:.80}")
    return _json(200, _group_json(name, group))


async def _set_group(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    body: GroupBody = await _body(request, GroupBody)
    name = request.match_info["name"]
    members = [m if isinstance(m, str) else (m.handler, m.weight) for m in body.members]
    group = await request.app[_CLIENT].set_group(name, body.policy, members)
    return _json(200, _group_json(name, group))


async def _delete_group(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    name = request.match_info["name"]
    if not await request.app[_CLIENT].delete_group(name):
        raise ApiError(404, "not_found", f"no handler group {name!r:.80}")
    return web.Response(status=204, headers={"Cache-Control": "no-store"})


async def _purge(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    body: PurgeBody = await _body(request, PurgeBody)
    purged = await request.app[_CLIENT].purge(body.older_than, limit=body.limit)
    return _json(200, {"purged": purged})


# Bulk actions: the tasks are found with the client's list paging, then each is one
# client call, as a request per task would be.

_REQUEUABLE: Final = (Status.FAILED, Status.TRACKING_TIMED_OUT)  # AsyncClient.requeue's
_CANCELABLE: Final = tuple(s for s in Status if not s.is_settled)
_COUNT_CAP: Final = 100_000  # a dry run stops counting here (and says so)
_BULK_CONCURRENCY: Final = 32
_BULK_ERRORS_SHOWN: Final = 10


async def _matching(
    client: AsyncClient, statuses: tuple[Status, ...], handler: str | None,
    tenant: str | None, upto: int,
) -> tuple[list[str], bool]:  # fmt: skip
    """Ids of up to `upto` tasks with one of `statuses`, and whether there were more."""
    ids: list[str] = []
    for status in statuses:
        cursor: str | None = None
        while True:
            page = await client.list(status=status, handler=handler, tenant=tenant,
                                     limit=1000, cursor=cursor)  # fmt: skip
            for task in page.tasks:
                if len(ids) == upto:
                    return ids, True
                ids.append(task.id)
            cursor = page.cursor
            if cursor is None:
                break
    return ids, False


async def _bulk(request: web.Request) -> web.Response:
    """POST /tasks/bulk: requeue (operators) or cancel (operators; producers, their own
    tenant's tasks only) what a filter matches, or with dry_run only count it."""
    record = await _auth(request, _WRITERS)
    body: BulkBody = await _body(request, BulkBody)
    tenant = _scope(record)
    if body.action == "requeue" and tenant is not None:
        raise ApiError(403, "forbidden", "a producer token may not requeue; needs operator")
    if tenant is not None and body.filter.tenant not in (None, tenant):
        raise ApiError(403, "forbidden", f"this token acts on tenant {tenant!r} only")
    allowed = _REQUEUABLE if body.action == "requeue" else _CANCELABLE
    wanted = body.filter.status
    if wanted is not None and wanted not in allowed:
        raise ApiError(422, "invalid", f"{body.action} acts on {', '.join(allowed)} tasks, "
                       f"not {wanted}")  # fmt: skip
    statuses = allowed if wanted is None else (wanted,)
    client = request.app[_CLIENT]
    ids, more = await _matching(
        client, statuses, body.filter.handler,
        tenant if tenant is not None else body.filter.tenant,
        _COUNT_CAP if body.dry_run else body.limit,
    )  # fmt: skip
    if body.dry_run:
        return _json(200, BulkResult(matched=len(ids), capped=more))
    errors: list[dict[str, str]] = []
    acted = 0
    gate = asyncio.Semaphore(_BULK_CONCURRENCY)

    async def act(task_id: str) -> None:
        nonlocal acted
        async with gate:
            try:
                if body.action == "requeue":
                    await client.requeue(task_id)
                elif not await client.cancel(task_id, tenant):
                    raise ApiError(409, "already_finished", f"task {task_id} had finished")
                acted += 1
            except (ApiError, AsyncTaskdError) as exc:
                err = exc if isinstance(exc, ApiError) else _translate(exc)
                errors.append({"id": task_id, "code": err.code, "message": err.message})

    await asyncio.gather(*(act(i) for i in ids))
    errors.sort(key=lambda e: e["id"])
    shown = errors[:_BULK_ERRORS_SHOWN]
    result = BulkResult(matched=len(ids), capped=more, acted=acted, failed=len(errors),
                        errors=shown)  # fmt: skip
    return _json(200, result)


def _last_event_id(request: web.Request) -> int:
    text = request.headers.get("Last-Event-ID", "").strip()
    if not text:
        return 0
    if not text.isdigit() or len(text) > 18:
        raise ApiError(422, "invalid", f"Last-Event-ID must be a task version, got {text!r:.40}")
    return int(text)


def _shows(event: TaskEvent) -> tuple[Any, ...]:
    return event.status, event.progress, event.stage, event.message


def _frame(event: TaskEvent) -> bytes:
    data = msgspec.json.encode(event)
    return b"event: task\nid: %d\ndata: %s\n\n" % (event.version, data)


async def _pump(events: AsyncIterator[TaskEvent], queue: asyncio.Queue[TaskEvent | None]) -> None:
    try:
        async for event in events:
            await queue.put(event)
    finally:
        await queue.put(None)


async def _events(request: web.Request) -> web.StreamResponse:
    """SSE of the task's changes (AsyncClient.watch), ids are versions: a reconnect with
    Last-Event-ID gets only newer states, the first of them the current one."""
    record = await _auth(request, _ANY)
    seen = _last_event_id(request)
    task_id, client = _task_id(request), request.app[_CLIENT]
    # An async generator (closed below, so that its Redis read ends with the stream).
    watch = cast(AsyncGenerator[TaskEvent, None], client.watch(task_id, _scope(record)))
    try:
        first = await anext(watch)  # raises TaskNotFound or InvalidTask before any byte
    except StopAsyncIteration:  # pragma: no cover - watch always yields the current state
        raise ApiError(404, "not_found", f"no task {task_id}") from None
    try:
        backlog = [first]
        if seen and first.version > seen:  # a reconnect that missed changes: replay them
            missed = await missed_events(client.redis, request.app[_KEYS], task_id, seen)
            if missed:
                # The current state closes the replay unless the last missed event shows it.
                last = missed[-1]
                same = _shows(last) == _shows(first) or last.version >= first.version
                backlog = missed if same else [*missed, first]
        if backlog[-1].status.is_settled and backlog[-1].version <= seen:
            await watch.aclose()
            return web.Response(status=204)  # tells an EventSource to stop reconnecting
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",  # nginx: pass each event on at once
            }
        )
        await response.prepare(request)
    except BaseException:
        await watch.aclose()  # its Redis read must not outlive the request
        raise
    queue: asyncio.Queue[TaskEvent | None] = asyncio.Queue()
    for missed_or_current in backlog:
        queue.put_nowait(missed_or_current)
    pump = asyncio.create_task(_pump(watch, queue))
    keepalive = request.app[_SETTINGS].keepalive
    streams = request.app[_STREAMS]
    streams.add(queue)
    try:
        await response.write(b"retry: 1000\n\n")
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), keepalive)
            except TimeoutError:
                await response.write(b": keep-alive\n\n")
                continue
            if event is None:
                break
            if event.version > seen:
                seen = event.version
                await response.write(_frame(event))
            if event.status.is_settled:
                break
    finally:
        streams.discard(queue)
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await pump
        with contextlib.suppress(Exception):
            await watch.aclose()
    if pump.done() and not pump.cancelled() and pump.exception() is not None:
        logger.warning("event stream of %s ended early: %s", task_id, pump.exception())
    await response.write_eof()
    return response


async def _openapi(request: web.Request) -> web.Response:
    return _json(200, openapi(request.app[_SETTINGS].version))


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n", headers={"Cache-Control": "no-store"})


async def _readyz(request: web.Request) -> web.Response:
    try:
        await asyncio.wait_for(request.app[_CLIENT].redis.ping(), 2.0)
    except Exception as exc:  # any failure means "not ready", with the reason
        return web.Response(status=503, text=f"Redis unreachable: {exc}\n")
    return web.Response(text="ready\n", headers={"Cache-Control": "no-store"})


async def _end_streams(app: web.Application) -> None:
    """On shutdown, end open event streams cleanly rather than wait for them: the clients
    reconnect (to another instance) with Last-Event-ID and miss nothing."""
    for queue in app[_STREAMS]:
        queue.put_nowait(None)


def make_app(client: AsyncClient, settings: WebSettings) -> web.Application:
    """The API as an aiohttp Application on `client` (left open: the caller owns it)."""
    app = web.Application(middlewares=[_errors], client_max_size=settings.max_body)
    app[_CLIENT] = client
    app[_SETTINGS] = settings
    app[_KEYS] = Keys(settings.namespace, settings.shards)
    app[_STREAMS] = set()
    app.on_shutdown.append(_end_streams)
    app[_TOKENS] = TokenCache(client.redis, settings.namespace, settings.token_cache)
    app[_RATES] = RateLimiter()
    p = PREFIX
    app.router.add_post(f"{p}/tasks", _submit)
    app.router.add_get(f"{p}/tasks", _list, allow_head=False)
    app.router.add_post(f"{p}/tasks/bulk", _bulk)
    app.router.add_get(f"{p}/tasks/{{id}}", _get, allow_head=False)
    app.router.add_post(f"{p}/tasks/{{id}}/cancel", _cancel)
    app.router.add_get(f"{p}/tasks/{{id}}/events", _events, allow_head=False)
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
    return app
