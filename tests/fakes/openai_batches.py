"""A fake of OpenAI's Files and Batch APIs: the request and response shapes of its public
reference and of the official SDK's types (`Batch`, `FileObject`, `BatchRequestCounts`).

Endpoints (all need ``Authorization: Bearer <api_key>``; otherwise 401 with OpenAI's error
shape ``{"error": {"message", "type", "param", "code"}}``):

``POST /v1/files``
    multipart/form-data with ``purpose`` and ``file``; answers a File object (``id``,
    ``bytes``, ``filename``, ``purpose``, ...). ``purpose`` must be ``batch`` here.
``POST /v1/batches``
    Body ``{"input_file_id", "endpoint", "completion_window": "24h", "metadata"?}``; answers
    200 with a batch object in status ``validating``; 400 ``invalid_request_error`` for a
    bad body or an input file that was never uploaded.
``GET /v1/batches?limit=&after=``
    The batches, newest first, as OpenAI lists them: ``{"object": "list", "data": [...],
    "first_id", "last_id", "has_more"}``, ``limit`` (1..100, default 20) per page, ``after``
    a batch id the page starts after. ``list_lag`` (seconds) leaves out batches created less
    than that long ago: a listing that lags behind its creates. ``others`` batches of other
    clients (no metadata) are listed before all of ours, as on a busy account.
``GET /v1/batches/{batch_id}``
    The batch object. Every answered poll moves a live batch on. The first poll validates
    the input file: a line that is not JSON fails the batch (``invalid_json_line``), and
    while ``token_limit_failures`` is positive a batch fails with ``token_limit_exceeded``
    (the organisation's queue of enqueued tokens is full) and nothing runs. Then
    ``in_progress``, the requests done in input order (``request_counts`` growing), until
    poll ``polls_to_done - 1`` (``finalizing``), then ``completed``. A request whose
    ``custom_id`` starts with ``bad`` fails on its own (counted in ``failed``, written to the
    error file): a completed batch may have failed requests, or only failed ones (then
    ``output_file_id`` is null). A batch whose first ``custom_id`` starts with ``expire``
    ends ``expired`` at poll ``polls_to_done``, its done requests in the output file
    (billed) and the rest in the error file (``batch_expired``).
``POST /v1/batches/{batch_id}/cancel``
    Moves a live batch to ``cancelling``; the next poll reads ``cancelled``, with the
    requests done by then in its output file. 400 when the batch has already ended.
    ``cancel_elsewhere_at`` (a poll number) does the same to a batch at that poll, as
    someone cancelling it on the dashboard would.
``GET /v1/files/{file_id}/content``
    A file's bytes: uploaded input, output (``{"id", "custom_id", "response": {"status_code",
    "request_id", "body"}, "error": null}`` per line) or error file (``response`` null,
    ``error`` ``{"code", "message"}``).

Faults: the next ``lose_creates`` creates make their batch and then answer 500 (the caller
cannot know it exists), the next ``refuse_creates`` answer 500 without making one (checked
first); ``throttle`` is a list of header sets, one per request to come, each answered 429
``rate_limit_exceeded`` with those headers; ``quota_exhausted`` answers every create 429
``insufficient_quota``; ``fail_uploads`` answers that many uploads 500 after storing the file.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

__all__ = ["OpenAIBatches", "requests_for"]

ENDPOINTS = frozenset(
    {"/v1/responses", "/v1/chat/completions", "/v1/embeddings", "/v1/completions",
     "/v1/moderations"}
)  # fmt: skip
LIVE = frozenset({"validating", "in_progress", "finalizing", "cancelling"})


def requests_for(*custom_ids: str, url: str = "/v1/chat/completions") -> list[dict[str, Any]]:
    """Batch request lines as a producer writes them, one per custom id."""
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hello"}]}
    return [{"custom_id": c, "method": "POST", "url": url, "body": body} for c in custom_ids]


def _error(status: int, message: str, code: str | None = None, param: str | None = None,
           kind: str = "invalid_request_error",
           headers: dict[str, str] | None = None) -> web.Response:  # fmt: skip
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


@dataclass
class _Batch:
    obj: dict[str, Any]
    lines: list[bytes]
    polls: int = 0
    done: int = 0  # requests processed, in input order


@dataclass
class OpenAIBatches:
    """The fake's state; `app()` builds the aiohttp application."""

    api_key: str
    polls_to_done: int = 3
    batches: dict[str, _Batch] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    cancels: list[str] = field(default_factory=list)
    list_lag: float = 0.0
    others: int = 0
    lose_creates: int = 0
    refuse_creates: int = 0
    fail_uploads: int = 0
    token_limit_failures: int = 0
    cancel_elsewhere_at: int = 0
    quota_exhausted: bool = False
    throttle: list[dict[str, str]] = field(default_factory=list)
    created: list[tuple[float, str]] = field(default_factory=list)  # (at, batch id)
    listed: list[int] = field(default_factory=list)  # batches listed per list request
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.add_routes(
            [
                web.post("/v1/files", self._upload),
                web.post("/v1/batches", self._create),
                web.get("/v1/batches", self._list),
                web.get("/v1/batches/{id}", self._retrieve),
                web.post("/v1/batches/{id}/cancel", self._cancel),
                web.get("/v1/files/{id}/content", self._file_content),
            ]
        )
        return app

    def upload(self, content: bytes) -> str:
        """Store an input file as an upload would; returns its id."""
        file_id = f"file-{next(self._ids):06d}"
        self.files[file_id] = content
        return file_id

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        if request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return _error(401, "Incorrect API key provided.", code="invalid_api_key")
        if self.throttle:
            return _error(429, "Rate limit reached for requests.", code="rate_limit_exceeded",
                          kind="requests", headers=self.throttle.pop(0))  # fmt: skip
        response: web.StreamResponse = await handler(request)
        return response

    async def _upload(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/form-data"):
            return _error(400, "Expected multipart/form-data.")
        form = await request.post()
        upload = form.get("file")
        if form.get("purpose") != "batch":
            return _error(400, "Invalid purpose: expected 'batch'.", param="purpose")
        if not isinstance(upload, web.FileField):
            return _error(400, "Missing required parameter: 'file'.", param="file")
        content = upload.file.read()
        file_id = self.upload(content)
        if self.fail_uploads > 0:
            self.fail_uploads -= 1
            return _error(500, "The server had an error.", kind="server_error")
        return web.json_response({
            "id": file_id, "object": "file", "bytes": len(content),
            "created_at": int(time.time()), "filename": upload.filename, "purpose": "batch",
            "status": "processed", "expires_at": None, "status_details": None,
        })  # fmt: skip

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
        if body["input_file_id"] not in self.files:
            return _error(400, f"Invalid 'input_file_id': '{body['input_file_id']}'.",
                          param="input_file_id")  # fmt: skip
        if self.quota_exhausted:
            return _error(429, "You exceeded your current quota, please check your plan and "
                          "billing details.", code="insufficient_quota",
                          kind="insufficient_quota")  # fmt: skip
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
        lines = [line for line in self.files[body["input_file_id"]].split(b"\n") if line.strip()]
        self.batches[batch_id] = _Batch(obj, lines)
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

    def _validate(self, batch: _Batch, now: int) -> bool:
        """The validating step: False (and the batch failed) for a bad file or a full queue."""
        for n, line in enumerate(batch.lines, 1):
            try:
                msgspec.json.decode(line)
            except msgspec.DecodeError:
                return self._fail(batch, now, "invalid_json_line", f"Line {n} is not valid JSON.",
                                  line=n)  # fmt: skip
        if self.token_limit_failures > 0:
            self.token_limit_failures -= 1
            return self._fail(batch, now, "token_limit_exceeded",
                              "Enqueued token limit reached for gpt-4o-mini in organization "
                              "org-fake. Limit: 90,000 enqueued tokens. Please try again once "
                              "some in_progress batches have been completed.")  # fmt: skip
        batch.obj["request_counts"]["total"] = len(batch.lines)
        return True

    def _fail(self, batch: _Batch, now: int, code: str, message: str,
              line: int | None = None) -> bool:  # fmt: skip
        error = {"code": code, "message": message, "param": None, "line": line}
        batch.obj.update(status="failed", failed_at=now,
                         errors={"object": "list", "data": [error]})  # fmt: skip
        return False

    def _custom_id(self, line: bytes) -> str:
        return str(msgspec.json.decode(line).get("custom_id", ""))

    def _write_files(self, batch: _Batch, unfinished_code: str | None = None) -> None:
        """Output and error files of the requests done so far (and of the rest, if
        `unfinished_code`), and the counts, as a batch that ended leaves them."""
        obj, out, err = batch.obj, [], []
        for n, line in enumerate(batch.lines[: batch.done]):
            custom_id = self._custom_id(line)
            rid = f"batch_req_{obj['id']}_{n}"
            if custom_id.startswith("bad"):
                err.append({"id": rid, "custom_id": custom_id, "response": {
                    "status_code": 400, "request_id": f"req_{n}", "body": {"error": {
                        "message": "Invalid model.", "type": "invalid_request_error"}}},
                    "error": None})  # fmt: skip
            else:
                out.append({"id": rid, "custom_id": custom_id, "response": {
                    "status_code": 200, "request_id": f"req_{n}", "body": {"object":
                    "chat.completion", "choices": []}}, "error": None})  # fmt: skip
        if unfinished_code is not None:
            for n, line in enumerate(batch.lines[batch.done :], batch.done):
                err.append({"id": f"batch_req_{obj['id']}_{n}", "custom_id":
                            self._custom_id(line), "response": None, "error": {
                            "code": unfinished_code, "message": "This request could not be "
                            "executed before the completion window expired."}})  # fmt: skip
        counts = obj["request_counts"]
        counts["failed"] = sum(1 for e in err if e["response"] is not None)
        counts["completed"] = batch.done - counts["failed"]
        for kind, lines in (("output", out), ("error", err)):
            if lines:
                file_id = f"file-{kind[:3]}-{obj['id']}"
                self.files[file_id] = b"".join(msgspec.json.encode(x) + b"\n" for x in lines)
                obj[f"{kind}_file_id"] = file_id

    def _advance(self, batch: _Batch) -> None:
        obj = batch.obj
        if obj["status"] not in LIVE:
            return
        now = int(time.time())
        if obj["status"] == "cancelling":
            obj.update(status="cancelled", cancelled_at=now)
            self._write_files(batch)
            return
        if obj["status"] == "validating" and not self._validate(batch, now):
            return
        batch.polls += 1
        p, k, total = batch.polls, self.polls_to_done, len(batch.lines)
        expire = bool(batch.lines) and self._custom_id(batch.lines[0]).startswith("expire")
        batch.done = total * min(p, k - 1) // k if expire or p < k - 1 else total
        counts = obj["request_counts"]
        counts["completed"] = batch.done  # failed requests are counted once the batch ends
        if p >= k and expire:
            obj.update(status="expired", expired_at=now)
            self._write_files(batch, unfinished_code="batch_expired")
        elif p >= k:
            obj.update(status="completed", completed_at=now)
            self._write_files(batch)
        elif p == k - 1 and not expire:
            obj.update(status="finalizing", finalizing_at=now)
        else:
            obj.update(status="in_progress", in_progress_at=obj["in_progress_at"] or now)
        if p == self.cancel_elsewhere_at and obj["status"] in LIVE:
            obj.update(status="cancelling", cancelling_at=now)

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
        content = self.files.get(request.match_info["id"])
        if content is None:
            return _error(404, "No such File object.")
        return web.Response(body=content, content_type="application/jsonl")
