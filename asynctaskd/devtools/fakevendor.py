"""A fake vendor: a local HTTP server speaking submit-once, poll-many, for demo, tests and bench.

Protocol (JSON bodies everywhere, encoded compactly with msgspec):

``POST /v1/jobs``
    Body ``{"input": <any JSON>, "ref": <optional string, the caller's task id>}``, optional
    header ``Idempotency-Key``. Answers 201 ``{"id": "job_<n>", "status": "queued"}``. A key
    seen before answers 200 with that same job and creates nothing. A body that is not such
    an object answers 400 ``{"error": {"code": "invalid_request", ...}}``.
``GET /v1/jobs/{id}``
    Answers 200 ``{"id", "status", "progress"}``, plus ``"result"`` only when the status is
    ``succeeded`` and ``"error": {"code", "message"}`` only when it is ``failed``; 404
    ``{"error": {"code": "not_found", ...}}`` for an unknown id. Statuses: ``queued``,
    ``running``, ``succeeded``, ``failed``, ``canceled``. Every answered poll of a live job
    counts: poll ``p < k`` says ``running`` with progress ``p / k``, and poll ``k``
    (``polls_to_done``, fixed when the job is created) ends it.
``POST /v1/jobs/{id}/cancel``
    Answers 200 with the job, now ``canceled`` unless it had already ended; 404 if unknown.

Admin endpoints, never subject to injected faults: ``GET /_health`` (200); ``GET /_log``,
every submit attempt that reached the server as ``{"job_id", "ref", "idempotency_key",
"outcome", "at"}`` (``outcome`` is ``created``, ``deduped``, ``error``, ``throttled``,
``ambiguous`` or ``invalid``; ``at`` is epoch seconds); ``GET /_jobs``, every job with its
poll count; ``GET /_config`` and ``POST /_config`` (a partial `Behaviour` object; answers
the whole new one, or 400); ``POST /_reset``, which forgets jobs, keys and the log (job
numbers keep counting, so an old id never names a new job) and re-seeds the random source.

Faults (the `Behaviour` knobs). Every submit and poll first waits its latency
(``submit_latency`` or ``query_latency``, plus up to ``latency_jitter``), then one random
draw decides, in this order: ``throttle_rate`` of them answer 429 with ``Retry-After:
<retry_after>``; the next ``error_rate`` answer 500; neither creates, changes or counts
anything. Of the remaining submits that would create a job, ``ambiguous_rate`` create it
(logged ``ambiguous``) and then either answer only after ``ambiguous_delay`` seconds or
drop the connection without answering, half each: the caller cannot know it succeeded.
Each new job ends ``failed`` with probability ``fail_fraction``, never ends (stays
``running``) with probability ``never_finish_fraction``, and otherwise ``succeeded``.
``seed`` makes the draws repeatable.

Run it with ``python -m asynctaskd.devtools.fakevendor --port 0`` (``--help`` lists the knobs), in
process with `run_server`, or from sync code and tests with `FakeVendorProcess`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any, Final, Literal, Self

import msgspec

from .fakehttp import Answer, Request, error_body, serving

__all__ = [
    "Behaviour",
    "FakeVendor",
    "FakeVendorProcess",
    "main",
    "run_server",
    "serve",
]

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


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m asynctaskd.devtools.fakevendor",
        description="A fake vendor HTTP server: submit once, poll until done.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--port-file", type=Path, help="write the bound port to this file")
    for field in msgspec.structs.fields(Behaviour):
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            type=_number,
            default=None,
            help=f"{_FIELD_HELP[field.name]} (default: {field.default})",
        )
    return parser


def _announce(url: str, port_file: Path | None) -> None:
    if port_file is not None:
        # Write then rename, so a reader never sees a half-written port; and before the
        # line, so whoever reads the line can read the file too.
        partial = port_file.with_name(port_file.name + ".partial")
        partial.write_text(url.rsplit(":", 1)[1])
        partial.replace(port_file)
    print(f"fakevendor listening on {url}", flush=True)  # noqa: T201 - the CLI's one contract line


def _run(main_coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:  # uvloop is optional (not on Windows)
        asyncio.run(main_coro)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main_coro)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: parse knobs, serve until signalled, return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    knobs = {
        field.name: getattr(args, field.name)
        for field in msgspec.structs.fields(Behaviour)
        if getattr(args, field.name) is not None
    }
    try:
        behaviour = msgspec.convert(knobs, Behaviour)
    except msgspec.ValidationError as exc:
        parser.error(str(exc))
    port_file: Path | None = args.port_file
    _run(
        serve(
            behaviour,
            host=args.host,
            port=args.port,
            on_ready=lambda url: _announce(url, port_file),
        )
    )
    return 0


class FakeVendorProcess:
    """A fake vendor in a child process, driven from sync code (tests, the demo)."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, workdir: Path) -> None:
        self.process = process
        self.url = url
        self._workdir = workdir
        # Never route admin calls through a proxy from the environment.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @classmethod
    def start(
        cls, behaviour: Behaviour | None = None, *, host: str = "127.0.0.1"
    ) -> FakeVendorProcess:
        """Start `python -m asynctaskd.devtools.fakevendor` on a free port; wait until healthy."""
        workdir = Path(tempfile.mkdtemp(prefix="fakevendor-"))
        port_file = workdir / "port"
        stderr_path = workdir / "stderr"
        argv = [
            sys.executable,
            "-m",
            "asynctaskd.devtools.fakevendor",
            "--host",
            host,
            "--port",
            "0",
        ]
        argv += ["--port-file", str(port_file), *_behaviour_args(behaviour or Behaviour())]
        with stderr_path.open("wb") as stderr:
            process = subprocess.Popen(  # own session: see ServerProcess.start
                argv,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=_child_env(),
                start_new_session=True,
            )
        vendor = cls(process, "", workdir)
        try:
            vendor._wait_until_healthy(port_file, host, deadline=time.monotonic() + 10.0)
        except BaseException:
            vendor.stop()
            raise
        return vendor

    def _wait_until_healthy(self, port_file: Path, host: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"fake vendor exited with status {self.process.returncode}; "
                    f"stderr:\n{self.stderr()}"
                )
            if not self.url and port_file.exists():
                self.url = f"http://{host}:{port_file.read_text()}"
            if self.url:
                with contextlib.suppress(OSError):
                    self._call("GET", "/_health")
                    return
            time.sleep(0.01)
        raise RuntimeError(f"fake vendor not healthy after 10 s; stderr:\n{self.stderr()}")

    def stderr(self) -> str:
        """What the child process has written to stderr so far."""
        with contextlib.suppress(OSError):
            return (self._workdir / "stderr").read_text(errors="replace")
        return ""

    def _call(self, method: str, path: str, body: object = None) -> Any:
        data = None if body is None else _encode(body)
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", _JSON)
        with self._opener.open(request, timeout=5.0) as response:
            return msgspec.json.decode(response.read())

    def configure(self, **changes: Any) -> Behaviour:
        """Change some knobs at runtime; returns the whole new behaviour."""
        try:
            answer = self._call("POST", "/_config", changes)
        except urllib.error.HTTPError as exc:
            raise ValueError(exc.read().decode(errors="replace")) from exc
        return msgspec.convert(answer, Behaviour)

    def submit_log(self) -> list[dict[str, Any]]:
        """Every submit attempt that reached the server, oldest first."""
        log: list[dict[str, Any]] = self._call("GET", "/_log")
        return log

    def jobs(self) -> list[dict[str, Any]]:
        """Every job the server holds, with its poll count and fate."""
        jobs: list[dict[str, Any]] = self._call("GET", "/_jobs")
        return jobs

    def reset(self) -> None:
        """Forget jobs, idempotency keys and the log."""
        self._call("POST", "/_reset")

    def stop(self) -> None:
        """Terminate the process; kill it if it has not exited after 5 s."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _behaviour_args(behaviour: Behaviour) -> list[str]:
    default = Behaviour()
    args: list[str] = []
    for field in msgspec.structs.fields(Behaviour):
        value = getattr(behaviour, field.name)
        if value != getattr(default, field.name):
            args += ["--" + field.name.replace("_", "-"), repr(value)]
    return args


def _child_env() -> dict[str, str]:
    # Let the child import this very package even when the parent found it through
    # sys.path tweaks (pytest rootdir, PYTHONPATH) rather than an install.
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the directory that holds asynctaskd/
    if Path(root).name != "site-packages":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


if __name__ == "__main__":
    sys.exit(main())
