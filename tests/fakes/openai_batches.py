"""A fake of OpenAI's Batch API: the request and response shapes of its public reference.

Endpoints (all need ``Authorization: Bearer <api_key>``; otherwise 401 with OpenAI's error
shape ``{"error": {"message", "type", "param", "code"}}``):

``POST /v1/batches``
    Body ``{"input_file_id", "endpoint", "completion_window": "24h", "metadata"?}``; answers
    200 with a batch object in status ``validating``; 400 ``invalid_request_error`` for a
    bad body.
``GET /v1/batches?limit=&after=``
    The batches, newest first, as OpenAI lists them: ``{"object": "list", "data": [...],
    "first_id", "last_id", "has_more"}``, ``limit`` (1..100, default 20) per page, ``after``
    a batch id the page starts after. ``list_lag`` (seconds) leaves out batches created less
    than that long ago: a listing that lags behind its creates. ``others`` batches of other
    clients (no metadata) are listed before all of ours, as on a busy account.
``GET /v1/batches/{batch_id}``
    The batch object. Every answered poll moves a live batch on: ``in_progress`` (with
    ``request_counts.completed`` growing) until poll ``polls_to_done - 1`` (``finalizing``),
    then ``completed`` with ``output_file_id``. An ``input_file_id`` starting ``file-fail``
    ends ``failed`` at the first poll with ``errors.data[0]`` set; one starting
    ``file-expire`` ends ``expired`` at poll ``polls_to_done`` with partial counts, an
    output file of the completed requests and an error file of the rest.
``POST /v1/batches/{batch_id}/cancel``
    Moves a live batch to ``cancelling``; the next poll reads ``cancelled``. 400 when the
    batch has already ended.
``GET /v1/files/{file_id}/content``
    The output file: one JSON line per request.

Faults for the lookup tests: the next ``lose_creates`` creates make their batch and then
answer 500 (the caller cannot know it exists), the next ``refuse_creates`` answer 500
without making one (checked first).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

__all__ = ["OpenAIBatches"]

ENDPOINTS = frozenset(
    {"/v1/responses", "/v1/chat/completions", "/v1/embeddings", "/v1/completions",
     "/v1/moderations"}
)  # fmt: skip
LIVE = frozenset({"validating", "in_progress", "finalizing", "cancelling"})


def _error(status: int, message: str, code: str | None = None, param: str | None = None,
           kind: str = "invalid_request_error") -> web.Response:  # fmt: skip
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status)


@dataclass
class _Batch:
    obj: dict[str, Any]
    polls: int = 0
    total: int = 4


@dataclass
class OpenAIBatches:
    """The fake's state; `app()` builds the aiohttp application."""

    api_key: str
    polls_to_done: int = 3
    batches: dict[str, _Batch] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    cancels: list[str] = field(default_factory=list)
    list_lag: float = 0.0
    others: int = 0
    lose_creates: int = 0
    refuse_creates: int = 0
    created: list[tuple[float, str]] = field(default_factory=list)  # (at, batch id)
    listed: list[int] = field(default_factory=list)  # batches listed per list request
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.add_routes(
            [
                web.post("/v1/batches", self._create),
                web.get("/v1/batches", self._list),
                web.get("/v1/batches/{id}", self._retrieve),
                web.post("/v1/batches/{id}/cancel", self._cancel),
                web.get("/v1/files/{id}/content", self._file_content),
            ]
        )
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        if request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return _error(401, "Incorrect API key provided.", code="invalid_api_key")
        response: web.StreamResponse = await handler(request)
        return response

    async def _create(self, request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError:
            return _error(400, "We could not parse the JSON body of your request.")
        if not isinstance(body, dict):
            return _error(400, "The body must be a JSON object.")
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(name), str):
                return _error(400, f"Missing required parameter: '{name}'.", param=name)
        if body["endpoint"] not in ENDPOINTS:
            return _error(400, f"Invalid value: '{body['endpoint']}'.", param="endpoint")
        if body["completion_window"] != "24h":
            return _error(400, "Invalid completion_window.", param="completion_window")
        if self.refuse_creates > 0:
            self.refuse_creates -= 1
            return _error(500, "The server had an error.", kind="server_error")
        now = int(time.time())
        batch_id = f"batch_{next(self._ids):06d}"
        obj: dict[str, Any] = {
            "id": batch_id, "object": "batch", "endpoint": body["endpoint"], "errors": None,
            "input_file_id": body["input_file_id"], "completion_window": "24h",
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None, "expires_at": now + 86400,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": body.get("metadata"),
        }  # fmt: skip
        self.batches[batch_id] = _Batch(obj)
        self.created.append((time.time(), batch_id))
        if self.lose_creates > 0:
            self.lose_creates -= 1
            return _error(500, "The server had an error.", kind="server_error")
        return web.json_response(obj)

    async def _list(self, request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", "20"))
        except ValueError:
            return _error(400, "Invalid limit.", param="limit")
        if not 1 <= limit <= 100:
            return _error(400, "Invalid limit.", param="limit")
        listed_before = time.time() - self.list_lag
        objs = {f"batch_other_{k}": {"id": f"batch_other_{k}", "object": "batch",
                                     "metadata": None} for k in range(self.others)}  # fmt: skip
        objs.update((i, self.batches[i].obj) for at, i in self.created if at <= listed_before)
        ids = [*(f"batch_other_{k}" for k in range(self.others)),
               *(i for at, i in reversed(self.created) if at <= listed_before)]  # fmt: skip
        after = request.query.get("after")
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page = [objs[i] for i in ids[:limit]]
        self.listed.append(len(page))
        return web.json_response({
            "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ids) > limit,
        })  # fmt: skip

    def _advance(self, batch: _Batch) -> None:
        obj = batch.obj
        if obj["status"] not in LIVE:
            return
        now = int(time.time())
        if obj["status"] == "cancelling":
            obj.update(status="cancelled", cancelled_at=now)
            return
        batch.polls += 1
        p, k = batch.polls, self.polls_to_done
        counts = obj["request_counts"]
        counts["total"] = batch.total
        if obj["input_file_id"].startswith("file-fail"):
            obj.update(status="failed", failed_at=now, errors={"object": "list", "data": [
                {"code": "invalid_json_line", "message": "Line 1 is not valid JSON.",
                 "param": None, "line": 1}]})  # fmt: skip
            return
        if obj["input_file_id"].startswith("file-expire"):
            counts["completed"] = batch.total * min(p, k - 1) // k
            if p >= k:  # the completed requests stay in the output file, billed; the rest
                # are written to the error file (code batch_expired)
                obj.update(status="expired", expired_at=now,
                           output_file_id=f"file-out-{obj['id']}",
                           error_file_id=f"file-err-{obj['id']}")  # fmt: skip
            else:
                obj.update(status="in_progress", in_progress_at=obj["in_progress_at"] or now)
            return
        if p >= k:
            counts["completed"] = batch.total
            obj.update(status="completed", completed_at=now, output_file_id=f"file-out-{obj['id']}")
        elif p == k - 1:
            counts["completed"] = batch.total
            obj.update(status="finalizing", finalizing_at=now)
        else:
            counts["completed"] = batch.total * p // k
            obj.update(status="in_progress", in_progress_at=obj["in_progress_at"] or now)

    async def _retrieve(self, request: web.Request) -> web.Response:
        batch = self.batches.get(request.match_info["id"])
        if batch is None:
            return _error(404, "No batch found with that id.", kind="invalid_request_error")
        self._advance(batch)
        return web.json_response(batch.obj)

    async def _cancel(self, request: web.Request) -> web.Response:
        batch = self.batches.get(request.match_info["id"])
        if batch is None:
            return _error(404, "No batch found with that id.")
        self.cancels.append(batch.obj["id"])
        if batch.obj["status"] not in LIVE:
            return _error(400, f"Cannot cancel a batch with status {batch.obj['status']}.")
        batch.obj.update(status="cancelling", cancelling_at=int(time.time()))
        return web.json_response(batch.obj)

    async def _file_content(self, request: web.Request) -> web.Response:
        file_id = request.match_info["id"]
        if not file_id.startswith("file-out-"):
            return _error(404, "No such File object.")
        lines = [
            msgspec.json.encode({"id": f"batch_req_{i}", "custom_id": f"request-{i}",
                                 "response": {"status_code": 200, "body": {}}, "error": None})
            for i in range(4)
        ]  # fmt: skip
        return web.Response(body=b"\n".join(lines) + b"\n", content_type="application/jsonl")
