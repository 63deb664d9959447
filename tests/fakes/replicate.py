"""A fake of Replicate's predictions API: the request and response shapes of its HTTP docs.

Endpoints (all need ``Authorization: Bearer <token>``; otherwise 401 with a problem body
``{"title", "detail", "status"}``):

``POST /v1/predictions``
    Body ``{"version", "input", "webhook"?, "webhook_events_filter"?}``; answers 201 with a
    prediction in status ``starting`` (``urls.get`` and ``urls.cancel`` included), 422 with
    ``{"title": "Input validation failed", "detail", "status", "invalid_fields"}`` for a
    bad body. A ``Cancel-After`` header (``30s``, ``1m``, ``1h30m``) is a deadline: a
    prediction still ``starting`` when it passes ends ``aborted``, one running ends
    ``canceled``.
``POST /v1/models/{owner}/{name}/predictions``
    The same for an official model (body ``{"input"}``, no version).
``GET /v1/predictions/{id}``
    The prediction. Each answered poll of a live one moves it on: ``processing`` (``logs``
    grow) until poll ``polls_to_done``, which ends it ``succeeded`` with ``output`` a list
    of file URLs under ``/delivery/`` and ``metrics.predict_time``; an input with
    ``"fail": true`` ends ``failed`` with ``error`` a string, and one with ``"removed":
    true`` ends ``succeeded`` as a poll after Replicate's retention hour sees it
    (``output`` null, ``data_removed`` true); ``"named_outputs": true`` makes the output an
    object with the file URLs inside it.
``GET /v1/predictions?cursor=``
    The predictions, newest first, ``page_size`` a page, as Replicate pages them:
    ``{"previous", "next", "results"}``, ``next`` the next page's whole URL (an opaque
    ``cursor``) or null on the last. ``others`` predictions made elsewhere on the account
    come before ours (newer). ``next_origin`` puts the next URLs on another origin, as a hostile or
    broken listing could.
``POST /v1/predictions/{id}/cancel``
    Moves a live prediction to ``canceled``; answers the prediction.
``GET /delivery/{id}/{name}``
    A file output, on another origin than the API (``delivery_app()``, served by
    ``serving()``), without auth, as on replicate.delivery. Each download's Authorization
    header (None without one) is kept in ``download_auth``.

Faults: the next ``lose_creates`` creates make their prediction and then answer 500;
``throttle`` is a list of header sets, one per request to come, each answered 429
(``{"title": "Request was throttled", ...}``) with those headers; ``stuck`` keeps every
prediction ``starting`` (no capacity), so only a Cancel-After deadline ends it.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
from aiohttp import web

from tests.fakes import serve

__all__ = ["PNG", "ReplicatePredictions"]

PNG = b"\x89PNG\r\n\x1a\n" + b"fake image bytes" * 8
LIVE = frozenset({"starting", "processing"})


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _problem(status: int, title: str, detail: str, headers: dict[str, str] | None = None,
             **extra: Any) -> web.Response:  # fmt: skip
    body = {"title": title, "detail": detail, "status": status, **extra}
    return web.json_response(body, status=status, content_type="application/problem+json",
                             headers=headers)  # fmt: skip


def _seconds(duration: str) -> float | None:
    parts = re.findall(r"(\d+)(ms|h|m|s)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        return None
    unit = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(int(n) * unit[u] for n, u in parts)


@dataclass
class _Prediction:
    obj: dict[str, Any]
    polls: int = 0
    deadline: float | None = None  # time.monotonic() when Cancel-After ends it


@dataclass
class ReplicatePredictions:
    """The fake's state; `app()` builds the aiohttp application."""

    token: str
    polls_to_done: int = 3
    predictions: dict[str, _Prediction] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    downloads: list[str] = field(default_factory=list)
    download_auth: list[str | None] = field(default_factory=list)
    file_host_requests: list[str] = field(default_factory=list)  # every path it was asked
    throttle: list[dict[str, str]] = field(default_factory=list)
    stuck: bool = False
    lose_creates: int = 0
    others: int = 0
    page_size: int = 100
    next_origin: str = ""
    listed: list[int] = field(default_factory=list)  # predictions per list request
    delivery_origin: str = ""  # the file host's origin, set by serving()
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.add_routes(
            [
                web.post("/v1/predictions", self._create),
                web.post("/v1/models/{owner}/{name}/predictions", self._create),
                web.get("/v1/predictions", self._list),
                web.get("/v1/predictions/{id}", self._get),
                web.post("/v1/predictions/{id}/cancel", self._cancel),
            ]
        )
        return app

    def delivery_app(self) -> web.Application:
        """The file host (replicate.delivery): another origin, no auth."""
        app = web.Application(middlewares=[self._file_host_log])
        app.add_routes([web.get("/delivery/{id}/{name}", self._deliver)])
        return app

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        """Serve the API and its file host on two ports; yields the API's base URL."""
        async with serve(self.delivery_app()) as files, serve(self.app()) as api:
            self.delivery_origin = files
            yield api

    @web.middleware
    async def _file_host_log(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.file_host_requests.append(request.path_qs)
        response: web.StreamResponse = await handler(request)
        return response

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _problem(401, "Unauthenticated",
                            "You did not pass a valid authentication token")  # fmt: skip
        if self.throttle:
            return _problem(429, "Request was throttled",
                            "Request was throttled. Expected available in 1 second.",
                            headers=self.throttle.pop(0))  # fmt: skip
        response: web.StreamResponse = await handler(request)
        return response

    async def _create(self, request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError:
            return _problem(400, "Bad request", "The request body is not valid JSON.")
        invalid = []
        official = "owner" in request.match_info  # /v1/models/{owner}/{name}/predictions
        if not official and (
            not isinstance(body, dict) or not isinstance(body.get("version"), str)
        ):
            invalid.append({"type": "required", "field": "version", "description": "required"})
        if not isinstance(body, dict) or not isinstance(body.get("input"), dict):
            invalid.append({"type": "required", "field": "input", "description": "required"})
        if invalid:
            return _problem(422, "Input validation failed", "- version or input is missing",
                            invalid_fields=invalid)  # fmt: skip
        deadline = None
        if (cancel_after := request.headers.get("Cancel-After")) is not None:
            seconds = _seconds(cancel_after)
            if seconds is None:
                return _problem(400, "Invalid Cancel-After", f"cannot parse {cancel_after!r}")
            deadline = time.monotonic() + seconds
        n = next(self._ids)
        pid = f"q{n:04d}fakepredictionid{n:04d}"
        base = f"{request.url.origin()}/v1/predictions/{pid}"
        obj: dict[str, Any] = {
            "id": pid, "version": None if official else body["version"],
            "model": "/".join(request.match_info.get(k, "") for k in ("owner", "name"))
            if official else "acme/fake-model",
            "input": body["input"], "logs": "", "output": None, "data_removed": False,
            "error": None, "status": "starting", "created_at": _now(), "started_at": None,
            "completed_at": None, "source": "api",
            "urls": {"get": base, "cancel": f"{base}/cancel",
                     "web": f"https://replicate.com/p/{pid}"},
        }  # fmt: skip
        self.predictions[pid] = _Prediction(obj, deadline=deadline)
        if self.lose_creates > 0:
            self.lose_creates -= 1
            return _problem(500, "Internal server error", "Something went wrong.")
        return web.json_response(obj, status=201)

    async def _list(self, request: web.Request) -> web.Response:
        ours = [p.obj for p in reversed(self.predictions.values())]
        theirs = [{"id": f"other{k:04d}", "version": "v0", "input": {}, "status": "succeeded",
                   "model": "someone/else"} for k in range(self.others)]  # fmt: skip
        listing = theirs + ours
        try:
            start = int(request.query.get("cursor", "0"))
        except ValueError:
            return _problem(400, "Bad request", "Invalid cursor.")
        page = listing[start : start + self.page_size]
        self.listed.append(len(page))
        origin = self.next_origin or str(request.url.origin())
        after = start + self.page_size
        return web.json_response({
            "previous": f"{origin}/v1/predictions?cursor={max(0, start - self.page_size)}"
            if start else None,
            "next": f"{origin}/v1/predictions?cursor={after}" if after < len(listing) else None,
            "results": page,
        })  # fmt: skip

    async def _get(self, request: web.Request) -> web.Response:
        prediction = self.predictions.get(request.match_info["id"])
        if prediction is None:
            return _problem(404, "Not found", "Not found.")
        obj = prediction.obj
        if obj["status"] in LIVE and (prediction.deadline or float("inf")) <= time.monotonic():
            ended = "aborted" if obj["status"] == "starting" else "canceled"
            obj.update(status=ended, completed_at=_now())
        if obj["status"] in LIVE and self.stuck:
            pass  # no capacity: it stays starting
        elif obj["status"] in LIVE:
            prediction.polls += 1
            p = prediction.polls
            obj["logs"] += f"step {p}/{self.polls_to_done}\n"
            obj["started_at"] = obj["started_at"] or _now()
            if p < self.polls_to_done:
                obj["status"] = "processing"
            elif obj["input"].get("removed"):  # polled after Replicate's retention hour
                obj.update(status="succeeded", output=None, data_removed=True,
                           completed_at=_now())  # fmt: skip
            elif obj["input"].get("fail"):
                obj.update(status="failed", error="CUDA out of memory", completed_at=_now(),
                           metrics={"predict_time": 0.5})  # fmt: skip
            else:
                origin = self.delivery_origin
                files = [f"{origin}/delivery/{obj['id']}/out-{i}.png" for i in range(2)]
                output: Any = files
                if obj["input"].get("named_outputs"):  # models whose output is an object
                    output = {"image": files[0], "extra": {"mask": files[1]}, "seed": 42}
                obj.update(
                    status="succeeded",
                    output=output,
                    completed_at=_now(),
                    metrics={"predict_time": 1.25},
                )
        return web.json_response(obj)

    async def _cancel(self, request: web.Request) -> web.Response:
        prediction = self.predictions.get(request.match_info["id"])
        if prediction is None:
            return _problem(404, "Not found", "Not found.")
        self.cancels.append(prediction.obj["id"])
        if prediction.obj["status"] in LIVE:
            prediction.obj.update(status="canceled", completed_at=_now())
        return web.json_response(prediction.obj)

    async def _deliver(self, request: web.Request) -> web.Response:
        self.downloads.append(request.path)
        self.download_auth.append(request.headers.get("Authorization"))
        if request.match_info["id"] not in self.predictions:
            return web.Response(status=404, text="not found")
        return web.Response(body=PNG, content_type="image/png")
