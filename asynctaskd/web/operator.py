"""The operator routes: resolve, requeue, pauses, limits, handler groups, purge and bulk
actions by filter. Operator tokens only, except that a producer may bulk-cancel its own
tenant's tasks (docs/api.md)."""

from __future__ import annotations

import asyncio
from typing import Any, Final

import msgspec
from aiohttp import web

from asynctaskd.client import AsyncClient
from asynctaskd.errors import (
    AsyncTaskdError,
)
from asynctaskd.model import Status

from .common import (
    _CLIENT,
    _OPERATOR,
    _WRITERS,
    ApiError,
    _auth,
    _body,
    _json,
    _scope,
    _task_id,
    _translate,
)
from .console.audit import write_audit
from .schemas import (
    BulkBody,
    BulkResult,
    GroupBody,
    PauseBody,
    PurgeBody,
    ResolveBody,
    public_task,
)


async def _resolve(request: web.Request) -> web.Response:
    record = await _auth(request, _OPERATOR)
    body: ResolveBody = await _body(request, ResolveBody)
    task = await request.app[_CLIENT].resolve(
        _task_id(request), body.status, external_id=body.external_id, query=body.query,
        message=body.message,
    )  # fmt: skip
    await write_audit(request, record, "resolve", task.id, _plain(body))
    return _json(200, public_task(task))


async def _requeue(request: web.Request) -> web.Response:
    record = await _auth(request, _OPERATOR)
    task = await request.app[_CLIENT].requeue(_task_id(request))
    await write_audit(request, record, "requeue", task.id)
    return _json(200, public_task(task))


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
    record = await _auth(request, _OPERATOR)
    body: PauseBody = await _body(request, PauseBody)
    which = _dimension_of(body)
    newly = await request.app[_CLIENT].pause(**which, note=body.note)
    dimension = ",".join(f"{k}:{v}" for k, v in which.items())
    await write_audit(request, record, "pause", dimension, {"note": body.note, "newly": newly})
    return _json(200, {"dimension": dimension, "newly_paused": newly})


async def _resume(request: web.Request) -> web.Response:
    record = await _auth(request, _OPERATOR)
    body: PauseBody = await _body(request, PauseBody)
    if body.note:
        raise ApiError(422, "invalid", "note is for pause only")
    which = _dimension_of(body)
    moved = await request.app[_CLIENT].resume(**which)
    dimension = ",".join(f"{k}:{v}" for k, v in which.items())
    await write_audit(request, record, "resume", dimension, {"moved": moved})
    return _json(200, {"dimension": dimension, "moved": moved})


async def _limits(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    entries = await request.app[_CLIENT].limits()
    return _json(200, {"limits": [_plain(e) for e in entries.values()]})


async def _set_limit(request: web.Request) -> web.Response:
    record = await _auth(request, _OPERATOR)
    # A plain object: AsyncClient.set_limit checks the keys and values, in its words.
    options: dict[str, Any] = await _body(request, dict[str, Any])
    entry = _plain(await request.app[_CLIENT].set_limit(**options))
    await write_audit(request, record, "set_limit", str(entry.get("scope", "")), options)
    return _json(200, entry)


async def _clear_limit(request: web.Request) -> web.Response:
    record = await _auth(request, _OPERATOR)
    unknown = set(request.query) - {"scope"}
    if unknown or "scope" not in request.query:
        raise ApiError(422, "invalid", "give exactly the query parameter scope, e.g. "
                       "?scope=provider:openai")  # fmt: skip
    scope = request.query["scope"]
    if not await request.app[_CLIENT].clear_limit(scope):
        raise ApiError(404, "not_found", f"no runtime or config limits for {scope!r:.80}")
    await write_audit(request, record, "clear_limit", scope)
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
    record = await _auth(request, _OPERATOR)
    body: GroupBody = await _body(request, GroupBody)
    name = request.match_info["name"]
    members = [m if isinstance(m, str) else (m.handler, m.weight) for m in body.members]
    group = await request.app[_CLIENT].set_group(name, body.policy, members)
    await write_audit(request, record, "set_group", name, _plain(body))
    return _json(200, _group_json(name, group))


async def _delete_group(request: web.Request) -> web.Response:
    record = await _auth(request, _OPERATOR)
    name = request.match_info["name"]
    if not await request.app[_CLIENT].delete_group(name):
        raise ApiError(404, "not_found", f"no handler group {name!r:.80}")
    await write_audit(request, record, "delete_group", name)
    return web.Response(status=204, headers={"Cache-Control": "no-store"})


async def _purge(request: web.Request) -> web.Response:
    record = await _auth(request, _OPERATOR)
    body: PurgeBody = await _body(request, PurgeBody)
    purged = await request.app[_CLIENT].purge(body.older_than, limit=body.limit)
    await write_audit(request, record, "purge", f"older_than={body.older_than}", {"purged": purged})
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
    if record.role == "operator":  # a producer's own cancels are not operator actions
        summary = {"filter": _plain(body.filter), "matched": len(ids), "acted": acted,
                   "failed": len(errors)}  # fmt: skip
        await write_audit(request, record, f"bulk_{body.action}", "filter", summary)
    return _json(200, result)
