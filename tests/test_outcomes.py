"""Outcome mapping as tables: a vendor call's result or exception in, a save out.

No Redis, no sockets, no event loop: `asynctaskd.worker.outcomes` is pure. Jitter is off
(the policy's `jitter` and `poll_jitter` are 0) except where a test draws from a seeded rng.
"""

from __future__ import annotations

import logging
import math
import random
from typing import Any

import httpx
import pytest

from asynctaskd.codec import encode_json
from asynctaskd.config import parse_config
from asynctaskd.errors import HandlerError, InvalidTask, NotSent, PermanentError, RetryableError
from asynctaskd.handlers import Failed, Resubmit, Running, Submitted, Succeeded
from asynctaskd.model import Status, Task
from asynctaskd.worker.outcomes import Outcomes, Reconcile, Save, canceled, timed_out

NOW = 1_000_000.0
POLL = 2.0
RETRY = (
    '[retry]\nfirst_error_delay = "1s"\nmax_error_delay = "300s"\n'
    "max_consecutive_errors = 3\nmax_submit_retries = 2\njitter = 0\npoll_jitter = 0\n"
)


def rules(extra: str = "", seed: int = 0) -> Outcomes:
    return Outcomes(parse_config(RETRY + extra).retry, random.Random(seed))


def task(**kw: Any) -> Task:
    base: dict[str, Any] = {
        "id": "t1",
        "handler": "h",
        "status": Status.RUNNING,
        "deadline_at": NOW + 3600,
        "poll_count": 4,
        "external_id": "ext-1",
    }
    return Task(**{**base, **kw})


def check(save: Save, status: Status, delay: float, fields: dict[str, Any]) -> None:
    assert save.status is status
    assert save.delay == pytest.approx(delay)
    assert save.fields is not None
    assert {k: save.fields.get(k) for k in fields} == fields


# --- submit ---------------------------------------------------------------------------------

SUBMIT_FAILURES = [
    # (exception, task fields, idempotent, status, delay, fields)
    (PermanentError("no", code="BAD"), {}, False, Status.FAILED, 0,
     {"error_code": "BAD", "error_message": "no"}),
    (NotSent("down"), {}, False, Status.PENDING_SUBMIT, 1, {"error_code": "NotSent"}),
    (NotSent("down"), {"submit_attempts": 1}, False, Status.PENDING_SUBMIT, 2, {}),
    (NotSent("down"), {"submit_attempts": 2}, False, Status.FAILED, 0,
     {"error_code": "SUBMIT_RETRIES_EXHAUSTED",
      "error_message": "3 submit attempts never reached the vendor; last: down"}),
    (httpx.ConnectError("refused"), {}, False, Status.PENDING_SUBMIT, 1,
     {"error_code": "ConnectError"}),
    (NotSent("x", retry_after=30), {}, False, Status.PENDING_SUBMIT, 30, {}),
    (NotSent("x", retry_after=10_000), {}, False, Status.PENDING_SUBMIT, 300, {}),
    (NotSent("x", retry_after=30), {"deadline_at": NOW + 5}, False, Status.PENDING_SUBMIT, 5, {}),
    # throttled: no attempt spent, each throttle in a row waits twice as long
    (RetryableError("busy", throttled=True), {}, False, Status.PENDING_SUBMIT, 1,
     {"throttles": 1}),
    (RetryableError("busy", throttled=True), {"throttles": 2, "submit_attempts": 9}, False,
     Status.PENDING_SUBMIT, 4, {"throttles": 3}),
    # ambiguous: the vendor may have the job; unless it dedups (idempotent), park it
    (RetryableError("timeout"), {}, False, Status.SUBMIT_UNKNOWN, 0,
     {"error_code": "RetryableError", "error_message": "timeout"}),
    (RetryableError("timeout"), {}, True, Status.PENDING_SUBMIT, 1,
     {"error_code": "RetryableError"}),
    (RuntimeError("bug"), {}, False, Status.SUBMIT_UNKNOWN, 0, {"error_code": "RuntimeError"}),
    (RuntimeError("bug"), {"submit_attempts": 2}, True, Status.FAILED, 0,
     {"error_code": "SUBMIT_RETRIES_EXHAUSTED"}),
]  # fmt: skip


@pytest.mark.parametrize(("exc", "kw", "idempotent", "status", "delay", "fields"), SUBMIT_FAILURES)
def test_submit_failures(
    exc: BaseException,
    kw: dict[str, Any],
    idempotent: bool,
    status: Status,
    delay: float,
    fields: dict[str, Any],
) -> None:
    save = rules().submit_failed(exc, task(**kw), idempotent=idempotent, now=NOW)
    check(save, status, delay, fields)
    assert save.must_land  # the vendor was called: the outcome must not be lost
    assert save.failure is exc
    ambiguous = status is Status.SUBMIT_UNKNOWN
    assert (save.note is not None and save.note[0] == logging.WARNING) is ambiguous


def test_submitted_lands_the_handle_due_in_one_poll() -> None:
    save = rules().submitted(
        Submitted("ext-9", {"cursor": 1}), task(), poll=POLL, idempotent=False, now=NOW
    )
    check(save, Status.SUBMITTED, POLL, {
        "external_id": "ext-9",
        "handle": encode_json({"external_id": "ext-9", "query": {"cursor": 1}}),
        "error_code": "", "error_message": "", "throttles": "",
    })  # fmt: skip
    assert save.must_land and save.note is None and save.failure is None


@pytest.mark.parametrize(
    ("out", "kw", "expect"),
    [
        (Submitted("e" * 600), {}, {"external_id": "e" * 512}),  # stored at most 512 long
        (Submitted("ext"), {"deadline_at": NOW + 0.5}, {}),  # due no later than the deadline
    ],
)
def test_submitted_bounds(out: Submitted, kw: dict[str, Any], expect: dict[str, Any]) -> None:
    save = rules().submitted(out, task(**kw), poll=POLL, idempotent=False, now=NOW)
    check(save, Status.SUBMITTED, min(POLL, task(**kw).deadline_at - NOW), expect)


def test_a_submitted_query_that_is_not_json_is_dropped_with_a_note() -> None:
    out = Submitted("ext", {"x": object()})
    save = rules().submitted(out, task(), poll=POLL, idempotent=False, now=NOW)
    check(save, Status.SUBMITTED, POLL, {
        "handle": encode_json({"external_id": "ext", "query": {}}),
    })  # fmt: skip
    assert save.note is not None and save.note[0] == logging.ERROR


@pytest.mark.parametrize("out", [None, Submitted(""), Running(), "ext-1", Submitted(123)])  # type: ignore[arg-type]
@pytest.mark.parametrize(
    ("idempotent", "status"), [(False, Status.SUBMIT_UNKNOWN), (True, Status.PENDING_SUBMIT)]
)
def test_a_submit_that_returns_no_handle_is_a_bug_of_unknown_outcome(
    out: Any, idempotent: bool, status: Status
) -> None:
    save = rules().submitted(out, task(), poll=POLL, idempotent=idempotent, now=NOW)
    assert save.status is status
    assert save.fields is not None and save.fields["error_code"] == "InvalidTask"
    assert isinstance(save.failure, InvalidTask)
    assert save.must_land


# --- query ----------------------------------------------------------------------------------

KEPT = {"poll_count": 5, "consecutive_errors": "", "throttles": ""}
QUERIES = [
    # (query() returned, task fields, status, delay, fields)
    (Running(), {}, Status.RUNNING, POLL, KEPT),
    (Running(progress=0.5, stage="s", message="m"), {}, Status.RUNNING, POLL,
     {**KEPT, "progress": "0.5", "stage": "s", "message": "m"}),
    (Running(progress=2, stage="x" * 2000), {}, Status.RUNNING, POLL,
     {"progress": "1.0", "stage": "x" * 1000}),
    (Running(progress=math.nan, stage=3), {}, Status.RUNNING, POLL,  # type: ignore[arg-type]
     {"progress": None, "stage": None}),
    (Running(next_poll=0.25), {}, Status.RUNNING, 0.25, {}),  # a hint is kept exact
    (Running(next_poll=10_000), {}, Status.RUNNING, 300, {}),  # up to max_error_delay
    (Running(next_poll=-1), {}, Status.RUNNING, POLL, {}),
    (Running(next_poll=math.nan), {}, Status.RUNNING, POLL, {}),
    (Running(next_poll=100), {"deadline_at": NOW + 10}, Status.RUNNING, 10, {}),
    (Running(handle={"c": 2}), {}, Status.RUNNING, POLL,
     {"handle": encode_json({"external_id": "ext-1", "query": {"c": 2}})}),
    (Failed("E", "boom"), {}, Status.FAILED, 0,
     {"error_code": "E", "error_message": "boom", "poll_count": 5, "throttles": ""}),
    (Failed("", "x"), {}, Status.FAILED, 0, {"error_code": "VENDOR_FAILED", "result": None}),
    (Failed("E", result={"a": 1}), {}, Status.FAILED, 0, {"result": encode_json({"a": 1})}),
    # a job that did nothing: submitted again, its handle and progress dropped, after the
    # handler's wait (bounded as next_poll) or the backoff of the submits made; past
    # max_submit_retries (2 here) it fails with the handler's code
    (Resubmit(code="Q", message="full", after=30), {"submit_attempts": 1},
     Status.PENDING_SUBMIT, 30, {"error_code": "Q", "error_message": "full",
     "external_id": "", "handle": "", "poll_count": "", "progress": ""}),
    (Resubmit(code="Q"), {"submit_attempts": 2}, Status.PENDING_SUBMIT, 2, {}),
    (Resubmit(code="Q", after=10_000), {"submit_attempts": 1}, Status.PENDING_SUBMIT, 300, {}),
    (Resubmit(code="Q", after=100), {"submit_attempts": 1, "deadline_at": NOW + 10},
     Status.PENDING_SUBMIT, 10, {}),
    (Resubmit(code="Q", message="full"), {"submit_attempts": 3}, Status.FAILED, 0,
     {"error_code": "Q", "error_message": "full; 3 submits made, no more "
      "(retry.max_submit_retries)"}),
    # not Running/Succeeded/Failed: a query error (the handler's bug)
    ("junk", {}, Status.RUNNING, 1, {"error_code": "InvalidTask", "consecutive_errors": 1}),
    (None, {"status": Status.SUBMITTED}, Status.SUBMITTED, 1, {"consecutive_errors": 1}),
]  # fmt: skip


@pytest.mark.parametrize(("out", "kw", "status", "delay", "fields"), QUERIES)
def test_query_results(
    out: Any, kw: dict[str, Any], status: Status, delay: float, fields: dict[str, Any]
) -> None:
    save = rules().queried(out, task(**kw), poll=POLL, now=NOW)
    assert isinstance(save, Save)
    check(save, status, delay, fields)
    assert not save.must_land and save.note is None
    answered = isinstance(out, Running | Resubmit)
    assert isinstance(save.failure, InvalidTask) is (status is not Status.FAILED and not answered)


@pytest.mark.parametrize(
    "out", [Running(handle={"c": object()}), Failed("E", result={"a": object()})]
)
def test_what_is_not_json_data_is_dropped_with_a_note(out: Any) -> None:
    save = rules().queried(out, task(), poll=POLL, now=NOW)
    assert isinstance(save, Save)
    assert save.fields is not None and "handle" not in save.fields and "result" not in save.fields
    assert save.note is not None and save.note[0] == logging.ERROR


def test_succeeded_is_handed_back_for_finalize() -> None:
    out = Succeeded({"a": 1})
    assert rules().queried(out, task(), poll=POLL, now=NOW) is out


@pytest.mark.parametrize(
    ("result", "status", "fields"),
    [
        ({"a": 1}, Status.SUCCEEDED,
         {"result": encode_json({"a": 1}), "poll_count": 5, "progress": "1.0", "throttles": ""}),
        (None, Status.SUCCEEDED, {"result": encode_json(None)}),
        ({"a": object()}, Status.FAILED, {"error_code": "INVALID_RESULT"}),
    ],
)  # fmt: skip
def test_succeeded(result: Any, status: Status, fields: dict[str, Any]) -> None:
    save = rules().succeeded(result, task())
    check(save, status, 0, fields)
    assert save.failure is None


QUERY_FAILURES = [
    # (exception, task fields, status, delay, fields)
    (PermanentError("gone", code="GONE"), {}, Status.FAILED, 0,
     {"error_code": "GONE", "error_message": "gone"}),
    (RetryableError("5xx"), {}, Status.RUNNING, 1,
     {"error_code": "RetryableError", "consecutive_errors": 1}),
    (RetryableError("5xx"), {"consecutive_errors": 1}, Status.RUNNING, 2,
     {"consecutive_errors": 2}),
    (RetryableError("5xx"), {"consecutive_errors": 2}, Status.FAILED, 0,
     {"error_code": "QUERY_ERRORS", "consecutive_errors": 3,
      "error_message": "3 query errors in a row; last: RetryableError: 5xx"}),
    (RuntimeError("bug"), {"status": Status.SUBMITTED}, Status.SUBMITTED, 1,
     {"error_code": "RuntimeError", "consecutive_errors": 1}),
    (RetryableError("x", retry_after=50), {}, Status.RUNNING, 50, {}),
    (RetryableError("x", retry_after=50), {"deadline_at": NOW + 7}, Status.RUNNING, 7, {}),
    # throttled: no error budget spent, each throttle in a row waits twice as long
    (RetryableError("429", throttled=True), {}, Status.RUNNING, 1,
     {"throttles": 1, "consecutive_errors": None}),
    (RetryableError("429", throttled=True), {"throttles": 3, "consecutive_errors": 2},
     Status.RUNNING, 8, {"throttles": 4}),
    (RetryableError("429", throttled=True, retry_after=1000), {}, Status.RUNNING, 300, {}),
]  # fmt: skip


@pytest.mark.parametrize(("exc", "kw", "status", "delay", "fields"), QUERY_FAILURES)
def test_query_failures(
    exc: BaseException, kw: dict[str, Any], status: Status, delay: float, fields: dict[str, Any]
) -> None:
    save = rules().query_failed(exc, task(**kw), now=NOW)
    check(save, status, delay, fields)
    assert save.failure is exc and not save.must_land


def test_an_unknown_handler_fails_a_submit_and_counts_a_query_error() -> None:
    submit = rules().unknown_handler(task(status=Status.PENDING_SUBMIT), "submit", "d1", now=NOW)
    check(submit, Status.FAILED, 0, {
        "error_code": "UNKNOWN_HANDLER",
        "error_message": "no handler 'h' is registered in daemon d1",
    })  # fmt: skip
    assert submit.failure is None  # nothing was sent: not a handler's failure
    for phase in ("query", "find"):
        query = rules().unknown_handler(task(), phase, "d1", now=NOW)
        check(query, Status.RUNNING, 1, {"error_code": "UNKNOWN_HANDLER", "consecutive_errors": 1})
        assert isinstance(query.failure, HandlerError)


def test_deadline_and_cancel() -> None:
    # A query cut at the deadline saves the task as it is, due now: the save script sees
    # the deadline passed and times it out. A cancel requested settles as CANCELED.
    assert timed_out(task(status=Status.SUBMITTED)) == Save(Status.SUBMITTED)
    assert canceled() == Save(Status.CANCELED)


# --- find -----------------------------------------------------------------------------------

FINDS = [
    # (find() returned, raised, lookups so far, expected)
    (None, None, 1, Reconcile("none", retry_ms=1000, max_lookups=5)),
    (None, None, 3, Reconcile("none", retry_ms=4000, max_lookups=5)),
    (Submitted("ext", {"q": 1}), None, 1, Reconcile(
        "found", retry_ms=1000, max_lookups=5, external_id="ext",
        handle_json=encode_json({"external_id": "ext", "query": {"q": 1}}))),
    (Submitted("ext", {"q": object()}), None, 1, Reconcile(
        "found", retry_ms=1000, max_lookups=5, external_id="ext",
        handle_json=encode_json({"external_id": "ext", "query": {}}))),
    (None, RetryableError("down", retry_after=40), 1, Reconcile(
        "error", retry_ms=40_000, max_lookups=5, message="RetryableError: down")),
    (None, PermanentError("no", code="NOPE"), 2, Reconcile(  # an operator decides now
        "error", retry_ms=2000, max_lookups=1, message="NOPE: no")),
]  # fmt: skip


@pytest.mark.parametrize(("found", "raised", "lookups", "expect"), FINDS)
def test_find_results(
    found: Any, raised: BaseException | None, lookups: int, expect: Reconcile
) -> None:
    answer = rules().found(found, raised, lookups=lookups, max_lookups=5)
    assert answer.failure is raised
    assert answer == Reconcile(**{**_fields(expect), "failure": raised})


@pytest.mark.parametrize(
    "progress", [0.5, 1.0, 1e-300, 0.0, -0.0, -0.5, 1.5, 1, 0, True, math.inf, math.nan, "0.5"]
)
def test_running_progress_is_stored_as_valid_progress_says(progress: Any) -> None:
    """The common case (a float in (0, 1]) is stored as it is without a helper call; every
    other value exactly as `valid_progress` has it (-0.0 as 0.0, 1.5 as 1.0, NaN dropped)."""
    from asynctaskd.handlers import valid_progress

    save = rules().queried(Running(progress=progress), task(), poll=POLL, now=NOW)
    assert isinstance(save, Save) and save.fields is not None
    valid = valid_progress(progress)
    assert save.fields.get("progress") == (None if valid is None else repr(valid))


def test_poll_jitter_draws_as_rng_uniform_did() -> None:
    """The jitter inlines `rng.uniform(-j, j)`: the same delays from the same seed."""
    rng = random.Random(7)
    jittery = rules("", seed=7)
    jittery.poll_jitter = 0.05
    for _ in range(20):
        save = jittery.queried(Running(), task(), poll=POLL, now=NOW)
        assert isinstance(save, Save)
        assert save.delay == POLL * (1.0 + rng.uniform(-0.05, 0.05))


@pytest.mark.parametrize("found", [Submitted(""), "junk", Running(), Submitted(7)])  # type: ignore[arg-type]
def test_a_find_that_returns_no_handle_is_an_error(found: Any) -> None:
    answer = rules().found(found, None, lookups=1, max_lookups=5)
    assert answer.result == "error" and isinstance(answer.failure, InvalidTask)
    assert answer.message.startswith("InvalidTask: find() returned")
    assert answer.external_id == "" and answer.handle_json == b""


def _fields(r: Reconcile) -> dict[str, Any]:
    return {name: getattr(r, name) for name in Reconcile.__slots__}


# --- jitter ---------------------------------------------------------------------------------


def test_jitter_spreads_polls_and_backoffs_within_bounds() -> None:
    jittery = rules("", seed=7)
    jittery.poll_jitter = 0.1
    delays = {jittery.jittered(POLL) for _ in range(50)}
    assert len(delays) > 1 and all(0.9 * POLL <= d <= 1.1 * POLL for d in delays)
    spread = Outcomes(parse_config(RETRY.replace("jitter = 0\n", "jitter = 0.5\n", 1)).retry,
                      random.Random(7))  # fmt: skip
    waits = {spread.retry_delay(RetryableError(), 3, task(), NOW) for _ in range(50)}
    assert len(waits) > 1 and all(2 <= w <= 6 for w in waits)


@pytest.mark.parametrize("left", [3600.0, 2.5, 2.0, 1.0, 0.0, -5.0])
@pytest.mark.parametrize("next_poll", [None, 0.0, 1.5, 100.0])
def test_a_running_poll_is_due_as_clamp_delay_says(left: float, next_poll: float | None) -> None:
    # a poll's delay: the jittered interval or the handler's hint, clamped to the deadline
    from asynctaskd.retry import clamp_delay

    for seed in range(5):
        retry = parse_config(RETRY.replace("poll_jitter = 0", "poll_jitter = 0.3")).retry
        jittery, plain = Outcomes(retry, random.Random(seed)), Outcomes(retry, random.Random(seed))
        save = jittery.queried(Running(next_poll=next_poll), task(deadline_at=NOW + left),
                               poll=POLL, now=NOW)  # fmt: skip
        assert isinstance(save, Save)
        hint = (
            next_poll if next_poll is not None else POLL * (1.0 + (-0.3 + 0.6 * plain.rng.random()))
        )
        if next_poll is not None:
            hint = min(next_poll, max(POLL, float(plain.retry.max_error_delay)))
        assert save.delay == clamp_delay(hint, NOW, NOW + left)
