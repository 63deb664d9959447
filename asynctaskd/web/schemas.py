"""Request and response bodies of the HTTP API, and the OpenAPI document made from them.

The bodies are msgspec Structs, so one definition decodes requests (unknown fields are
refused), encodes responses, and yields the JSON Schema in /api/v1/openapi.json: the
document cannot drift from what the server accepts. Types are checked here; ranges and
formats (names, priority, durations, payload size) are checked by AsyncClient, whose
messages the API returns as they are.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec

from asynctaskd.client import Stats, TaskEvent, TaskPage
from asynctaskd.model import Status, Task

__all__ = [
    "INTERNALS",
    "BulkBody",
    "BulkFilter",
    "BulkResult",
    "ErrorBody",
    "ErrorDetail",
    "GroupBody",
    "GroupMember",
    "LimitBody",
    "PauseBody",
    "PurgeBody",
    "ResolveBody",
    "SubmitBody",
    "openapi",
    "public_task",
]

# Task fields only a worker's or operator's read fills in: never shown by the API.
INTERNALS: Final = ("fence", "owner", "started_fence", "reclaims", "idempotent")


class SubmitBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """POST /tasks. A dedup key is the `Idempotency-Key` header, not a field; `dedup`
    "content" makes one from the handler and params instead (not both).

    `tenant` is for operator tokens only: a producer's tasks are its token's tenant's.
    `tracking_timeout`, `delay` are seconds; `not_before` is epoch seconds."""

    handler: str
    params: Any
    tracking_timeout: int | float
    priority: int = 0
    not_before: int | float | None = None
    delay: int | float | None = None
    metadata: Any = None
    account: str | None = None
    provider: str | None = None
    route_key: str | None = None
    tenant: str | None = None
    strict: bool = True
    # "content": the dedup key is a hash of handler and params (client.content_dedup_key).
    dedup: Literal["content"] | None = None


class ResolveBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """POST /tasks/{id}/resolve (operators): settle a SUBMIT_UNKNOWN task."""

    status: Status
    external_id: str | None = None
    query: dict[str, Any] | None = None
    message: str = ""


class PauseBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """POST /pause and POST /resume (operators): exactly one dimension; `note` for pause."""

    handler: str | None = None
    provider: str | None = None
    tenant: str | None = None
    account: str | None = None
    note: str = ""


class LimitBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """PUT /limits (operators): one `[[limits]]` table (asynctaskd.config.LimitConfig).

    Documentation only: the server hands the JSON object to AsyncClient.set_limit, which
    checks it (a test keeps these fields equal to LimitConfig's)."""

    provider: str = ""
    account: str = ""
    tenant: str = ""
    submit_rate: float | None = None
    submit_burst: int | None = None
    query_rate: float | None = None
    query_burst: int | None = None
    max_in_flight: int | None = None
    quota: int | None = None
    quota_period: float | str = 86400.0
    note: str = ""


class GroupMember(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    handler: str
    weight: int = 1


class GroupBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """PUT /groups/{name} (operators): a member is a handler key or {handler, weight}."""

    policy: str
    members: list[str | GroupMember]


class PurgeBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """POST /purge (operators): delete up to `limit` tasks finished over `older_than` s ago."""

    older_than: int | float
    limit: int = 1000


class BulkFilter(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which tasks a bulk action is for; a producer's tenant is its token's."""

    status: Status | None = None
    handler: str | None = None
    tenant: str | None = None


class BulkBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """POST /tasks/bulk: `dry_run` only counts; otherwise acts on at most `limit` tasks.

    `requeue` (operators) runs FAILED and TRACKING_TIMED_OUT tasks again; `cancel`
    (operators; producers for their own tenant) cancels tasks that have not settled."""

    action: Literal["requeue", "cancel"]
    filter: BulkFilter = msgspec.field(default_factory=BulkFilter)
    dry_run: bool = False
    limit: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 1000


class BulkResult(msgspec.Struct, frozen=True, kw_only=True):
    """`matched`: tasks the filter found (a dry run counts up to 100000, `capped` beyond);
    without dry_run, `acted` + `failed` = the tasks tried, at most `limit`; `errors` are
    the first few failures."""

    matched: int
    capped: bool = False
    acted: int | None = None
    failed: int | None = None
    errors: list[dict[str, str]] = msgspec.field(default_factory=list)


class ErrorDetail(msgspec.Struct, frozen=True):
    code: str
    message: str


class ErrorBody(msgspec.Struct, frozen=True):
    """Every 4xx and 5xx answer: a stable machine `code` and a message a person can act on."""

    error: ErrorDetail


def public_task(task: Task) -> dict[str, Any]:
    """A task as the API shows it: without the worker's internals."""
    data: dict[str, Any] = msgspec.to_builtins(task)
    for name in INTERNALS:
        data.pop(name, None)
    return data


def _err(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
    }


def _ok(description: str, schema: str | None) -> dict[str, Any]:
    if schema is None:
        return {"description": description}
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }


_CANCELED = {
    "type": "object",
    "properties": {"id": {"type": "string"}, "cancel": {"const": "requested"}},
    "required": ["id", "cancel"],
}
_LIMIT = {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}
_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
_AUTH = {
    "401": _err("no valid bearer token"),
    "403": _err("the token's role may not do this"),
    "429": _err("over the token's rate (or, on a submit, the tenant's quota); see Retry-After"),
    "503": _err("Redis is unreachable"),
}
# A route that reads a JSON body.
_BODY_ERRORS = {
    "400": _err("malformed JSON"),
    "413": _err("body over the configured limit"),
    "415": _err("not application/json"),
}
_TASK_ERRORS = {
    **_AUTH,
    "404": _err("no such task (or another tenant's)"),
    "422": _err("not a task id"),
}


def openapi(version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of /api/v1, its schemas generated from the Structs."""
    _, components = msgspec.json.schema_components(
        [
            SubmitBody,
            ResolveBody,
            ErrorBody,
            Task,
            TaskPage,
            TaskEvent,
            Stats,
            PauseBody,
            LimitBody,
            GroupBody,
            PurgeBody,
            BulkBody,
            BulkResult,
        ],
        ref_template="#/components/schemas/{name}",
    )
    task_schema = components["Task"]
    for name in INTERNALS:
        task_schema["properties"].pop(name, None)
    submit_body = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SubmitBody"}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "asynctaskd HTTP API", "version": version},
        "servers": [{"url": "/api/v1"}],
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": {
            "/tasks": {
                "post": {
                    "summary": "Submit a task (producer, operator)",
                    "parameters": [
                        {
                            "name": "Idempotency-Key",
                            "in": "header",
                            "required": False,
                            "schema": {"type": "string", "maxLength": 200},
                            "description": "dedup key: a live task of the tenant with this "
                            "key is returned (200) instead of a new one",
                        },
                    ],
                    "requestBody": submit_body,
                    "responses": {
                        "201": _ok("created", "Task"),
                        "200": _ok(
                            "a live task with this Idempotency-Key (or, with "
                            '"dedup": "content", this handler and params) exists',
                            "Task",
                        ),
                        **_BODY_ERRORS,
                        "422": _err(
                            'invalid input (an Idempotency-Key and "dedup" '
                            "together too); the message is the Python client's"
                        ),
                        **_AUTH,
                    },
                },
                "get": {
                    "summary": "List tasks, newest first per status (every role)",
                    "parameters": [
                        {"name": n, "in": "query", "required": False, "schema": schema}
                        for n, schema in (
                            ("status", {"$ref": "#/components/schemas/Status"}),
                            ("handler", {"type": "string"}),
                            ("cursor", {"type": "string"}),
                            ("limit", _LIMIT),
                            ("tenant", {"type": "string"}),
                        )
                    ],
                    "responses": {
                        "200": _ok("a page; continue with its cursor", "TaskPage"),
                        "422": _err("bad filter or cursor"),
                        **_AUTH,
                    },
                },
            },
            "/tasks/bulk": {
                "post": {
                    "summary": "Requeue or cancel the tasks a filter matches; dry_run counts "
                    "(operators; producers may cancel their own tenant's)",
                    "requestBody": _body_of("BulkBody"),
                    "responses": {
                        "200": _ok("what matched, and what was done", "BulkResult"),
                        **_BODY_ERRORS,
                        "422": _err("bad action, filter or limit"),
                        **_AUTH,
                    },
                }
            },
            "/tasks/{id}": {
                "get": {
                    "summary": "One task (every role)",
                    "parameters": [_ID],
                    "responses": {"200": _ok("the task", "Task"), **_TASK_ERRORS},
                }
            },
            "/tasks/{id}/cancel": {
                "post": {
                    "summary": "Cancel a task (producer, operator)",
                    "parameters": [_ID],
                    "responses": {
                        "202": {
                            "description": "canceled, or its worker was asked to",
                            "content": {"application/json": {"schema": _CANCELED}},
                        },
                        "409": _err("the task had already finished"),
                        **_TASK_ERRORS,
                    },
                }
            },
            "/tasks/{id}/events": {
                "get": {
                    "summary": "Server-Sent Events of the task's changes until it settles",
                    "description": "Each event is `event: task`, `id: <version>`, `data: "
                    "<TaskEvent JSON>`; the first is the current state. Reconnect with "
                    "`Last-Event-ID` to receive only what is newer. 204 when the task is "
                    "settled and the client has seen its last state.",
                    "parameters": [_ID],
                    "responses": {
                        "200": {
                            "description": "an event stream",
                            "content": {"text/event-stream": {}},
                        },
                        "204": _ok("settled, nothing newer than Last-Event-ID", None),
                        **_TASK_ERRORS,
                    },
                }
            },
            "/tasks/{id}/resolve": {
                "post": {
                    "summary": "Operators: settle a SUBMIT_UNKNOWN task",
                    "parameters": [_ID],
                    "requestBody": _body_of("ResolveBody"),
                    "responses": {
                        "200": _ok("the task", "Task"),
                        **_BODY_ERRORS,
                        "409": _err("the lifecycle forbids it"),
                        **_TASK_ERRORS,
                    },
                }
            },
            "/tasks/{id}/requeue": {
                "post": {
                    "summary": "Operators: run a FAILED or TRACKING_TIMED_OUT task again",
                    "parameters": [_ID],
                    "responses": {
                        "200": _ok("the task", "Task"),
                        "409": _err("the lifecycle forbids it"),
                        **_TASK_ERRORS,
                    },
                }
            },
            "/stats": {
                "get": {
                    "summary": "Counts by status and handler, live daemons (operators)",
                    "responses": {"200": _ok("the counts", "Stats"), **_AUTH},
                }
            },
            **_operator_paths(),
        },
    }


def _body_of(schema: str) -> dict[str, Any]:
    return {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }


_INVALID = {"422": _err("invalid input; the message is the Python client's"), **_AUTH}
_INVALID_BODY = {**_BODY_ERRORS, **_INVALID}


def _operator_paths() -> dict[str, Any]:
    """Operators' runtime controls: AsyncClient's pause, limits, groups and purge."""
    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "/pause": {
            "get": {
                "summary": "Operators: the paused dimensions, with when and note",
                "responses": {"200": _ok("{paused: {dimension: {at, note}}}", None), **_AUTH},
            },
            "post": {
                "summary": "Operators: hold back new vendor submits of one handler, "
                "provider, tenant or account (exactly one)",
                "requestBody": _body_of("PauseBody"),
                "responses": {"200": _ok("{dimension, newly_paused}", None), **_INVALID_BODY},
            },
        },
        "/resume": {
            "post": {
                "summary": "Operators: lift a pause; held tasks go back in their order",
                "requestBody": _body_of("PauseBody"),
                "responses": {"200": _ok("{dimension, moved}", None), **_INVALID_BODY},
            }
        },
        "/limits": {
            "get": {
                "summary": "Operators: the admission limits stored in Redis",
                "responses": {"200": _ok("{limits: [{scope, source, limit}]}", None), **_AUTH},
            },
            "put": {
                "summary": "Operators: set one scope's limits at runtime (replaces its entry)",
                "requestBody": _body_of("LimitBody"),
                "responses": {"200": _ok("{scope, source, limit}", None), **_INVALID_BODY},
            },
            "delete": {
                "summary": "Operators: delete one scope's limits",
                "parameters": [
                    {"name": "scope", "in": "query", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": _ok("{scope, cleared: true}", None),
                    "404": _err("no limits for that scope"),
                    **_INVALID,
                },
            },
        },
        "/groups": {
            "get": {
                "summary": "Operators: every handler group",
                "responses": {"200": _ok("{groups: [{name, policy, members}]}", None), **_AUTH},
            }
        },
        "/groups/{name}": {
            "get": {
                "summary": "Operators: one handler group",
                "parameters": [name],
                "responses": {
                    "200": _ok("{name, policy, members}", None),
                    "404": _err("no such group"),
                    **_AUTH,
                },
            },
            "put": {
                "summary": "Operators: define or replace a handler group",
                "parameters": [name],
                "requestBody": _body_of("GroupBody"),
                "responses": {"200": _ok("{name, policy, members}", None), **_INVALID_BODY},
            },
            "delete": {
                "summary": "Operators: delete a handler group",
                "parameters": [name],
                "responses": {
                    "204": _ok("deleted", None),
                    "404": _err("no such group"),
                    **_INVALID,
                },
            },
        },
        "/purge": {
            "post": {
                "summary": "Operators: delete up to `limit` tasks finished over "
                "`older_than` seconds ago",
                "requestBody": _body_of("PurgeBody"),
                "responses": {"200": _ok("{purged}", None), **_INVALID_BODY},
            }
        },
    }
