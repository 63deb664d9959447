"""What every route of the API shares: settings, errors and their status codes, the
application keys, authentication and body decoding."""

from __future__ import annotations

import hmac
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
import redis.exceptions
from aiohttp import web

from asynctaskd.client import AsyncClient
from asynctaskd.errors import (
    AsyncTaskdError,
    IllegalTransition,
    InvalidTask,
    NotPermitted,
    PayloadTooLarge,
    QuotaExceeded,
    StoreUnavailable,
    TaskNotFound,
    UnknownHandler,
)
from asynctaskd.keys import Keys

from .console.session import COOKIE, CSRF_HEADER, Sessions
from .feed import Feed
from .metrics import WebMetrics
from .tokens import RateLimiter, Role, TokenCache, TokenRecord

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
    if isinstance(exc, NotPermitted):  # a deployment to fix, not the caller's mistake
        logger.error("request refused by Redis (ACL): %s", exc)
        return ApiError(503, "redis_not_permitted", "this web process's Redis user may not "
                        "do this: operator routes need the operators' Redis user (docs/api.md, "
                        "Running it)")  # fmt: skip
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
# The shared readers of the events streams, and the open event streams they feed.
_FEED: Final = web.AppKey("feed", Feed)
_METRICS: Final = web.AppKey("metrics", WebMetrics)
# Console sessions (set when the console is mounted: web.console.routes).
_SESSIONS: Final = web.AppKey("sessions", Sessions)
_SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})


async def _session_record(request: web.Request) -> TokenRecord:
    """The token record behind the session cookie; a change needs the session's CSRF token."""
    session = None
    if _SESSIONS in request.app:
        session = await request.app[_SESSIONS].load(request.cookies[COOKIE])
    if session is None:
        raise _refused(request, "session_ended",
                       ApiError(401, "unauthorized", "the console session has ended: log in "
                                "again"))  # fmt: skip
    record = await request.app[_TOKENS].record(session.token_id)
    if record is None or not hmac.compare_digest(record.sha256, session.sha256):
        raise _refused(request, "session_revoked",
                       ApiError(401, "unauthorized", "the token of this session was revoked: "
                                "log in with another"))  # fmt: skip
    if request.method not in _SAFE_METHODS:
        sent = request.headers.get(CSRF_HEADER, "")
        if not hmac.compare_digest(sent.encode(), session.csrf.encode()):
            raise _refused(request, "csrf",
                           ApiError(403, "csrf", f"send this session's {CSRF_HEADER} header "
                                    "with every change (the console does)"))  # fmt: skip
    return record


async def _auth(request: web.Request, roles: tuple[Role, ...]) -> TokenRecord:
    """The caller's token record: from `Authorization: Bearer`, or else from a console
    session cookie (docs/console.md); 401, 403 or 429 if it may not go on."""
    if _via(request) == "console":
        record = await _session_record(request)
    else:
        record = await _bearer_record(request)
    wait = request.app[_RATES].take(record)
    if wait > 0:
        request.app[_METRICS].rate_limited.inc()
        raise ApiError(429, "rate_limited",
                       f"this token may make {record.rate:g} requests per second "
                       f"(bursts of {record.burst}); try again in {wait:.2f} s",
                       **{"Retry-After": str(max(1, math.ceil(wait)))})  # fmt: skip
    if record.role not in roles:
        needs = " or ".join(roles)
        raise _refused(request, "role", ApiError(403, "forbidden", f"a {record.role} token "
                                                 f"may not do this; needs {needs}"))  # fmt: skip
    return record


def _refused(request: web.Request, reason: str, error: ApiError) -> ApiError:
    """`error`, counted as an authentication failure for `reason` (WebMetrics)."""
    request.app[_METRICS].auth_failures.labels(reason).inc()
    return error


def _via(request: web.Request) -> str:
    """How the request authenticates: "api" (a bearer token) or "console" (a session)."""
    if "Authorization" not in request.headers and COOKIE in request.cookies:
        return "console"
    return "api"


async def _bearer_record(request: web.Request) -> TokenRecord:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _refused(request, "missing",
                       ApiError(401, "unauthorized", "send Authorization: Bearer <token>",
                                **{"WWW-Authenticate": "Bearer"}))  # fmt: skip
    record = await request.app[_TOKENS].check(token.strip())
    if record is None:
        challenge = {"WWW-Authenticate": 'Bearer error="invalid_token"'}
        raise _refused(request, "invalid_token",
                       ApiError(401, "unauthorized", "the token is unknown or revoked",
                                **challenge))  # fmt: skip
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
