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

The package holds `server` (`Behaviour`, `FakeVendor`, `run_server`, `serve`), `cli` (the
command line, `main`) and `process` (`FakeVendorProcess`).
"""

from __future__ import annotations

from .cli import main
from .process import FakeVendorProcess
from .server import Behaviour, FakeVendor, run_server, serve

__all__ = [
    "Behaviour",
    "FakeVendor",
    "FakeVendorProcess",
    "main",
    "run_server",
    "serve",
]
