"""The fake vendor's server: its `Behaviour` (the fault knobs), its jobs and submit log,
and `FakeVendor.handle`, which answers each request; `run_server` and `serve` run it on
the running event loop. The protocol is in `asynctaskd.devtools.fakevendor`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Final, Literal

import msgspec

from asynctaskd.devtools.fakehttp import Answer, Request, error_body, serving

__all__ = ["Behaviour", "FakeVendor", "run_server", "serve"]

logger = logging.getLogger(__name__)

Seconds = Annotated[float, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]


class Behaviour(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the fake vendor misbehaves. Build with `msgspec.convert` to check the bounds."""

    submit_latency: Seconds = 0.0
    query_latency: Seconds = 0.0
    latency_jitter: Seconds = 0.0
    error_rate: Fraction = 0.0
    throttle_rate: Fraction = 0.0
    retry_after: Annotated[int, msgspec.Meta(ge=0)] = 1
    ambiguous_rate: Fraction = 0.0
    ambiguous_delay: Seconds = 30.0
    polls_to_done: Annotated[int, msgspec.Meta(ge=1)] = 3
    fail_fraction: Fraction = 0.0
    never_finish_fraction: Fraction = 0.0
    seed: int | None = None


_FIELD_HELP: Final = {
    "submit_latency": "seconds every submit waits before answering",
    "query_latency": "seconds every poll waits before answering",
    "latency_jitter": "up to this many extra random seconds on each submit and poll",
    "error_rate": "fraction of submits and polls answered 500, changing nothing",
    "throttle_rate": "fraction of submits and polls answered 429, changing nothing",
    "retry_after": "whole seconds sent in Retry-After with each 429",
    "ambiguous_rate": "fraction of creating submits that create the job but answer late or never",
    "ambiguous_delay": "seconds an ambiguous submit waits before answering",
    "polls_to_done": "the poll that ends a job",
    "fail_fraction": "fraction of jobs that end failed",
    "never_finish_fraction": "fraction of jobs that stay running forever",
    "seed": "seed for the random draws (repeatable runs)",
}

JobStatus = Literal["queued", "running", "succeeded", "failed", "canceled"]
Fate = Literal["succeed", "fail", "never"]
Outcome = Literal["created", "deduped", "error", "throttled", "ambiguous", "invalid"]

_TERMINAL: Final[frozenset[str]] = frozenset({"succeeded", "failed", "canceled"})
_JSON: Final = "application/json"


class _SubmitBody(msgspec.Struct, frozen=True):
    input: Any
    ref: str | None = None


class _Job(msgspec.Struct, kw_only=True):
    id: str
    status: JobStatus
    polls: int
    polls_to_done: int
    fate: Fate
    ref: str | None
    idempotency_key: str | None
    created_at: float
    input: Any


class _LogEntry(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str | None
    ref: str | None
    idempotency_key: str | None
    outcome: Outcome
    at: float


# A route answers at once, or with an awaitable when it has to wait (an injected latency
# or ambiguity): the server gives a request a task only then.
_Reply = Answer | Awaitable[Answer]
_Route = Callable[[Any], _Reply]
_encode = msgspec.json.Encoder().encode
_decode_submit = msgspec.json.Decoder(_SubmitBody).decode
_decode_object = msgspec.json.Decoder(dict[str, Any]).decode


def _json(body: object, status: int = 200, headers: dict[str, str] | None = None) -> Answer:
    return Answer(status, _encode(body), headers)


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Answer:
    return Answer(status, error_body(code, message), headers)


def _view(job: _Job) -> dict[str, Any]:
    if job.status == "succeeded":
        progress = 1.0
    elif job.fate == "never":
        progress = min(job.polls, job.polls_to_done - 1) / job.polls_to_done
    else:
        progress = min(job.polls, job.polls_to_done) / job.polls_to_done
    view: dict[str, Any] = {"id": job.id, "status": job.status, "progress": progress}
    if job.status == "succeeded":
        view["result"] = {"output": job.input, "ref": job.ref}
    elif job.status == "failed":
        view["error"] = {"code": "job_failed", "message": "the fake vendor failed this job"}
    return view


class FakeVendor:
    """The server's state and request handlers; `handle` answers each request."""

    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour if behaviour is not None else Behaviour()
        self._rng = random.Random(self.behaviour.seed)
        self._jobs: dict[str, _Job] = {}
        self._by_key: dict[str, str] = {}
        self._log: list[_LogEntry] = []
        self._next_number = 1
        # `_paths` has whole paths, `_job_paths` what follows /v1/jobs/<id> (None: nothing
        # follows); the route gets the request, or the job id.
        self._paths: dict[str, dict[str, _Route]] = {
            "/v1/jobs": {"POST": self._submit},
            "/_health": {"GET": self._health},
            "/_log": {"GET": self._get_log},
            "/_jobs": {"GET": self._get_jobs},
            "/_config": {"GET": self._get_config, "POST": self._set_config},
            "/_reset": {"POST": self._reset},
        }
        self._job_paths: dict[str | None, dict[str, _Route]] = {
            None: {"GET": self._query},
            "cancel": {"POST": self._cancel},
        }

    def handle(self, request: Request) -> _Reply:
        """Answer one request (the handler `fakehttp.serving` calls)."""
        path = request.path
        arg: Any = request
        routes = self._paths.get(path)
        if routes is None and path.startswith("/v1/jobs/"):
            arg, slash, action = path[len("/v1/jobs/") :].partition("/")
            routes = self._job_paths.get(action if slash else None) if arg else None
        if routes is None:
            return _error(404, "not_found", f"nothing is served at {path}")
        answer = routes.get("GET" if request.method == "HEAD" else request.method)
        if answer is None:
            allow = {"Allow": ", ".join(routes)}
            return _error(405, "method_not_allowed", f"{request.method} {path}", allow)
        return answer(arg)

    def configure(self, changes: dict[str, Any]) -> Behaviour:
        """Apply a partial update; raises `msgspec.ValidationError` and changes nothing if bad."""
        merged = msgspec.structs.asdict(self.behaviour) | changes
        self.behaviour = msgspec.convert(merged, Behaviour)
        if "seed" in changes:
            self._rng.seed(self.behaviour.seed)
        return self.behaviour

    def reset(self) -> None:
        """Forget jobs, idempotency keys and the log; re-seed the random source."""
        self._jobs.clear()
        self._by_key.clear()
        self._log.clear()
        self._rng.seed(self.behaviour.seed)

    def _after(self, latency: float, then: Callable[[], _Reply]) -> _Reply:
        """What `then` answers, after `latency` plus the drawn jitter (at once if none)."""
        jitter = self.behaviour.latency_jitter
        delay = latency + (self._rng.uniform(0.0, jitter) if jitter else 0.0)
        return self._later(delay, then) if delay > 0 else then()

    def _fault(self) -> Answer | None:
        b = self.behaviour
        if not (b.throttle_rate or b.error_rate):
            return None
        draw = self._rng.random()
        if draw < b.throttle_rate:
            retry_after = {"Retry-After": str(b.retry_after)}
            return _error(429, "rate_limited", "injected 429 (throttle_rate)", retry_after)
        if draw < b.throttle_rate + b.error_rate:
            return _error(500, "internal", "injected 500 (error_rate)")
        return None

    def _record(
        self, outcome: Outcome, job_id: str | None, ref: str | None, key: str | None
    ) -> None:
        self._log.append(
            _LogEntry(job_id=job_id, ref=ref, idempotency_key=key, outcome=outcome, at=time.time())
        )

    def _create(self, body: _SubmitBody, key: str | None) -> _Job:
        b = self.behaviour
        fate: Fate = "succeed"
        if b.fail_fraction or b.never_finish_fraction:
            draw = self._rng.random()
            if draw < b.fail_fraction:
                fate = "fail"
            elif draw < b.fail_fraction + b.never_finish_fraction:
                fate = "never"
        job = _Job(
            id=f"job_{self._next_number}",
            status="queued",
            polls=0,
            polls_to_done=b.polls_to_done,
            fate=fate,
            ref=body.ref,
            idempotency_key=key,
            created_at=time.time(),
            input=body.input,
        )
        self._next_number += 1
        self._jobs[job.id] = job
        if key is not None:
            self._by_key[key] = job.id
        return job

    def _submit(self, request: Request) -> _Reply:
        key = request.header("Idempotency-Key") or None
        try:
            body = _decode_submit(request.body)
        except msgspec.DecodeError as exc:
            self._record("invalid", None, None, key)
            return _error(400, "invalid_request", str(exc))
        return self._after(
            self.behaviour.submit_latency, lambda: self._submit_now(request, body, key)
        )

    def _submit_now(self, request: Request, body: _SubmitBody, key: str | None) -> _Reply:
        if (fault := self._fault()) is not None:
            self._record("throttled" if fault.status == 429 else "error", None, body.ref, key)
            return fault
        if key is not None and (job_id := self._by_key.get(key)) is not None:
            self._record("deduped", job_id, body.ref, key)
            job = self._jobs[job_id]
            return _json({"id": job.id, "status": job.status})
        job = self._create(body, key)
        answer = _json({"id": job.id, "status": job.status}, 201)
        b = self.behaviour
        if b.ambiguous_rate and self._rng.random() < b.ambiguous_rate:
            self._record("ambiguous", job.id, body.ref, key)
            if self._rng.random() < 0.5:
                request.abort()  # the client sees a reset or an EOF, never the answer
                return answer
            return self._later(b.ambiguous_delay, lambda: answer)
        self._record("created", job.id, body.ref, key)
        return answer

    async def _later(self, delay: float, then: Callable[[], _Reply]) -> Answer:
        """Wait `delay` seconds, then answer what `then` answers."""
        await asyncio.sleep(delay)
        reply = then()
        return reply if isinstance(reply, Answer) else await reply

    def _query(self, job_id: str) -> _Reply:
        return self._after(self.behaviour.query_latency, lambda: self._query_now(job_id))

    def _query_now(self, job_id: str) -> Answer:
        job = self._jobs.get(job_id)
        if job is None:
            return _error(404, "not_found", "no such job")
        if (fault := self._fault()) is not None:
            return fault
        if job.status not in _TERMINAL:
            job.polls += 1
            job.status = "running"
            if job.polls >= job.polls_to_done:
                if job.fate == "succeed":
                    job.status = "succeeded"
                elif job.fate == "fail":
                    job.status = "failed"
        return _json(_view(job))

    def _cancel(self, job_id: str) -> Answer:
        job = self._jobs.get(job_id)
        if job is None:
            return _error(404, "not_found", "no such job")
        if job.status not in _TERMINAL:
            job.status = "canceled"
        return _json(_view(job))

    def _health(self, request: Request) -> Answer:
        return _json({"ok": True})

    def _get_log(self, request: Request) -> Answer:
        return _json(self._log)

    def _get_jobs(self, request: Request) -> Answer:
        return _json(list(self._jobs.values()))

    def _get_config(self, request: Request) -> Answer:
        return _json(self.behaviour)

    def _set_config(self, request: Request) -> Answer:
        try:
            return _json(self.configure(_decode_object(request.body)))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _error(400, "invalid_config", str(exc))

    def _reset(self, request: Request) -> Answer:
        self.reset()
        return _json({"ok": True})


@contextlib.asynccontextmanager
async def run_server(
    behaviour: Behaviour | None = None, *, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[str]:
    """Serve a fake vendor on the running asyncio loop; yields its base URL."""
    vendor = FakeVendor(behaviour)
    async with serving(vendor.handle, host, port) as bound_port:
        yield f"http://{host}:{bound_port}"


async def serve(
    behaviour: Behaviour | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT; `on_ready` receives the base URL once bound."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with run_server(behaviour, host=host, port=port) as url:
        if on_ready is not None:
            on_ready(url)
        await stop.wait()
