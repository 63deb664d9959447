"""The console's routes: the page and its static files, login and logout, and the reads
the pages need that `/api/v1` has no route for. Actions are the `/api/v1` routes.

Roles: an operator sees and acts on everything; a viewer sees its tenant's tasks and acts
on nothing (the API answers 403); a producer token cannot log in (it is an app's, not a
person's). Every route but login needs the session; the overview and the audit stream
are for operators, as `/stats` is; a tenant's overview is its viewers' (and operators').
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import msgspec
import redis.exceptions
from aiohttp import web

from asynctaskd.keys import HANDLER_KEY_RE
from asynctaskd.model import LEGAL_TRANSITIONS, Status
from asynctaskd.web.common import (
    _ANY,
    _CLIENT,
    _KEYS,
    _OPERATOR,
    _SESSIONS,
    _SETTINGS,
    _TOKENS,
    ApiError,
    _auth,
    _body,
    _json,
    _scope,
)
from asynctaskd.web.replay import missed_events
from asynctaskd.web.schemas import public_task
from asynctaskd.web.tokens import Role

from .audit import read_audit
from .browse import Filter, browse, find, sealing_key
from .overview import overview
from .session import COOKIE, Sessions
from .tenant import tenant_overview

__all__ = ["mount_console"]

STATIC: Final = Path(__file__).with_name("static")
API: Final = "/console/api"
_CONSOLE_ROLES: Final[tuple[Role, ...]] = ("viewer", "operator")
_INDEX_HEADERS: Final = {
    "Cache-Control": "no-store",
    # Everything is served from here: no inline script, no other origin, no framing.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


class LoginBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    token: str


def _secure(request: web.Request) -> bool:
    """The cookie gets Secure when the browser reached us over HTTPS: directly, or through
    a TLS proxy that says so (X-Forwarded-Proto). Trusting the header can only make the
    cookie stricter, never weaker."""
    return request.secure or request.headers.get("X-Forwarded-Proto", "") == "https"


async def _index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html", headers=_INDEX_HEADERS)


async def _login(request: web.Request) -> web.Response:
    body: LoginBody = await _body(request, LoginBody)
    record = await request.app[_TOKENS].check(body.token.strip())
    if record is None:
        raise ApiError(401, "unauthorized", "the token is unknown or revoked")
    if record.role not in _CONSOLE_ROLES:
        raise ApiError(403, "forbidden", f"a {record.role} token cannot log in to the "
                       "console: use a viewer or operator token")  # fmt: skip
    try:
        session_id, session = await request.app[_SESSIONS].create(record)
    except redis.exceptions.NoPermissionError:
        raise ApiError(503, "no_sessions", "this web process's Redis user may not keep console "
                       "sessions: serve the console from the operators' asynctaskd web "
                       "(docs/console.md)") from None  # fmt: skip
    response = _json(200, _me(record.role, record.tenant, record.note, session.csrf))
    response.set_cookie(COOKIE, session_id, max_age=request.app[_SESSIONS].ttl, path="/",
                        httponly=True, samesite="Strict", secure=_secure(request))  # fmt: skip
    return response


def _me(role: str, tenant: str, note: str, csrf: str) -> dict[str, Any]:
    return {"role": role, "tenant": tenant or None, "note": note, "csrf": csrf}


async def _logout(request: web.Request) -> web.Response:
    await _auth(request, _ANY)  # the session, and its CSRF header: a page cannot log us out
    await request.app[_SESSIONS].end(request.cookies[COOKIE])
    response = web.Response(status=204, headers={"Cache-Control": "no-store"})
    response.del_cookie(COOKIE, path="/")
    return response


async def _whoami(request: web.Request) -> web.Response:
    if COOKIE not in request.cookies:
        raise ApiError(401, "unauthorized", "log in with a viewer or operator token")
    record = await _auth(request, _CONSOLE_ROLES)
    session = await request.app[_SESSIONS].load(request.cookies[COOKIE])
    assert session is not None  # _auth just read it
    return _json(200, _me(record.role, record.tenant, record.note, session.csrf))


async def _session_key(request: web.Request) -> bytes:
    session = await request.app[_SESSIONS].load(request.cookies.get(COOKIE, ""))
    if session is None:  # a bearer token: its cursors are sealed with the token's id
        return sealing_key(request.headers.get("Authorization", ""))
    return sealing_key(session.cursor_seed)


async def _overview(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    return _json(200, await overview(request.app[_CLIENT], request.app[_KEYS]))


async def _tenant(request: web.Request) -> web.Response:
    """A tenant's overview: a viewer's own tenant's, or the one an operator names."""
    record = await _auth(request, _CONSOLE_ROLES)
    _known(request, {"tenant"})
    tenant = _scope(record)
    asked = request.query.get("tenant", "").strip()
    if tenant is not None and asked not in ("", tenant):
        raise ApiError(403, "forbidden", f"this token sees tenant {tenant!r} only")
    tenant = tenant or asked
    if not HANDLER_KEY_RE.fullmatch(tenant):
        raise ApiError(422, "invalid", "tenant must be 1-64 characters from letters, digits, "
                       f"'_', '.', ':' and '-', got {tenant!r:.40}")  # fmt: skip
    page = await tenant_overview(request.app[_CLIENT], request.app[_KEYS], tenant,
                                 operator=record.role == "operator")  # fmt: skip
    return _json(200, page)


def _epoch_s(request: web.Request, name: str) -> float | None:
    text = request.query.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ApiError(422, "invalid", f"{name} must be epoch seconds, got {text!r:.40}") from None
    if not 0 <= value < 1e11:
        raise ApiError(422, "invalid", f"{name} must be epoch seconds, got {text!r:.40}")
    return value


def _limit(request: web.Request, default: int, top: int) -> int:
    text = request.query.get("limit", str(default))
    if not text.isdigit() or not 1 <= int(text) <= top:
        raise ApiError(422, "invalid", f"limit must be an integer from 1 to {top}, got "
                       f"{text!r:.40}")  # fmt: skip
    return int(text)


def _known(request: web.Request, allowed: set[str]) -> None:
    unknown = set(request.query) - allowed
    if unknown:
        raise ApiError(422, "invalid", f"unknown query parameter(s): {', '.join(sorted(unknown))}")


async def _tasks(request: web.Request) -> web.Response:
    record = await _auth(request, _CONSOLE_ROLES)
    q = request.query
    _known(request, {"status", "handler", "tenant", "account", "since", "until", "limit",
                     "cursor"})  # fmt: skip
    status = q.get("status") or None
    if status is not None and status not in Status.__members__:
        raise ApiError(422, "invalid", f"status must be one of {', '.join(Status)}, got "
                       f"{status!r:.40}")  # fmt: skip
    tenant = _scope(record)
    if tenant is not None and q.get("tenant") not in (None, "", tenant):
        raise ApiError(403, "forbidden", f"this token sees tenant {tenant!r} only")
    f = Filter(
        status=None if status is None else Status(status),
        handler=q.get("handler") or None,
        tenant=tenant if tenant is not None else (q.get("tenant") or None),
        account=q.get("account") or None,
        since=_epoch_s(request, "since"), until=_epoch_s(request, "until"),
    )  # fmt: skip
    if f.since is not None and f.until is not None and f.since > f.until:
        raise ApiError(422, "invalid", "since must not be after until")
    page = await browse(request.app[_CLIENT], f, _limit(request, 50, 500),
                        await _session_key(request), q.get("cursor") or None)  # fmt: skip
    return _json(200, page)


async def _find(request: web.Request) -> web.Response:
    record = await _auth(request, _CONSOLE_ROLES)
    _known(request, {"by", "q", "tenant", "start"})
    text = request.query.get("q", "").strip()
    if not text or len(text) > 512:
        raise ApiError(422, "invalid", "give q: what to find (1 to 512 characters)")
    start = request.query.get("start", "0")
    if not start.isdigit():
        raise ApiError(422, "invalid", f"start must be a whole number, got {start!r:.40}")
    tenant = _scope(record)
    if tenant is None:
        tenant = request.query.get("tenant") or None
    by = request.query.get("by", "id")
    found = await find(request.app[_CLIENT], request.app[_KEYS], by, text, tenant, int(start))
    return _json(200, found)


def _actions(task_status: Status) -> dict[str, Any]:
    """What an operator may do to a task in this status (the model's operator moves)."""
    resolve = sorted({t.target.value for t in LEGAL_TRANSITIONS
                      if t.source is task_status and "O" in t.actors
                      and task_status is Status.SUBMIT_UNKNOWN})  # fmt: skip
    return {
        "cancel": not task_status.is_settled,
        "requeue": task_status in (Status.FAILED, Status.TRACKING_TIMED_OUT),
        "resolve": resolve,
    }


async def _task(request: web.Request) -> web.Response:
    record = await _auth(request, _CONSOLE_ROLES)
    task_id = request.match_info["id"]
    client = request.app[_CLIENT]
    task = await client.get(task_id, _scope(record), internals=record.role == "operator")
    if task is None:
        raise ApiError(404, "not_found", f"no task {task_id}")
    events = await missed_events(client.redis, request.app[_KEYS], task_id, 0)
    body = public_task(task)
    if record.role == "operator":  # the worker's bookkeeping, for operators only
        body.update(fence=task.fence, owner=task.owner, started_fence=task.started_fence,
                    reclaims=task.reclaims, idempotent=task.idempotent)  # fmt: skip
    return _json(200, {
        "task": body,
        "timeline": None if events is None else msgspec.to_builtins(events),
        "actions": _actions(task.status) if record.role == "operator" else None,
    })  # fmt: skip


async def _audit(request: web.Request) -> web.Response:
    await _auth(request, _OPERATOR)
    _known(request, {"limit", "before"})
    before = request.query.get("before") or None
    if before is not None and not all(part.isdigit() for part in before.split("-", 1)):
        raise ApiError(422, "invalid", f"before must be an entry id, got {before!r:.40}")
    settings = request.app[_SETTINGS]
    page = await read_audit(request.app[_CLIENT].redis, settings.namespace,
                            _limit(request, 100, 1000), before)  # fmt: skip
    return _json(200, page)


def mount_console(app: web.Application) -> None:
    settings = app[_SETTINGS]
    app[_SESSIONS] = Sessions(app[_CLIENT].redis, settings.namespace)
    app.router.add_get("/", _index)
    app.router.add_static("/console/static", STATIC, append_version=False)
    app.router.add_post(f"{API}/login", _login)
    app.router.add_post(f"{API}/logout", _logout)
    app.router.add_get(f"{API}/session", _whoami, allow_head=False)
    app.router.add_get(f"{API}/overview", _overview, allow_head=False)
    app.router.add_get(f"{API}/tenant", _tenant, allow_head=False)
    app.router.add_get(f"{API}/tasks", _tasks, allow_head=False)
    app.router.add_get(f"{API}/find", _find, allow_head=False)
    app.router.add_get(f"{API}/tasks/{{id}}", _task, allow_head=False)
    app.router.add_get(f"{API}/audit", _audit, allow_head=False)
