"""Outcome mapping: what a vendor call returned or raised, in; what to save, out.

Pure: no Redis, no I/O, no clock (the caller passes `now`) and no randomness of its own
(the caller's `rng`). `Vendor` runs the handler, reports crashes, calls these, then saves
the `Save` (or reconciles the `Reconcile`) and logs its `note`, if any.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import msgspec

from asynctaskd.codec import check_json_like, encode_json
from asynctaskd.config import RetryConfig
from asynctaskd.crashes import describe
from asynctaskd.errors import HandlerError, InvalidTask, PermanentError
from asynctaskd.handlers import Failed, Resubmit, Running, Submitted, Succeeded, valid_progress
from asynctaskd.model import Status, Task
from asynctaskd.retry import (
    SubmitFailure,
    backoff,
    clamp_delay,
    classify_submit_error,
    delay_ms,
    retry_after,
)

MAX_TEXT = 1000  # stage/message stored at most this long


class Save(msgspec.Struct):
    """One save: the task's next status, the fields it sets, and when it comes due.

    A msgspec Struct (not frozen, not validated): one is built per poll, and its C
    constructor costs a quarter of a dataclass's Python `__init__`."""

    status: Status
    fields: dict[str, Any] | None = None
    delay: float = 0.0
    must_land: bool = False  # a started submit's outcome: a fact the task must not lose
    note: tuple[int, str] | None = None  # (logging level, message) for the caller to log
    failure: BaseException | None = None  # the handler's exception, for crash accounting


@dataclass(frozen=True, slots=True)
class Reconcile:
    """What a lookup of a parked task found, as `reconcile` (lua/reconcile.lua) takes it."""

    result: str  # "found", "none" or "error"
    retry_ms: int
    max_lookups: int
    external_id: str = ""
    handle_json: bytes = b""
    message: str = ""
    failure: BaseException | None = None  # what made it an error, for crash accounting


class Outcomes:
    """The rules, with the retry policy and the random source they draw jitter from."""

    def __init__(self, retry: RetryConfig, rng: random.Random) -> None:
        self.retry = retry
        self.rng = rng
        self.poll_jitter = retry.poll_jitter

    # --- delays -----------------------------------------------------------------------------

    def jittered(self, poll: float) -> float:
        """A scheduled poll's delay: `poll` times a random factor in [1 - j, 1 + j].

        A claim takes due tasks together and their saves land together, so tasks submitted
        (or recovered after a crash) in one burst would stay in lockstep for good: the
        vendor would see bursts instead of a steady rate, and the burst's last tasks would
        wait behind the rest on every poll. A little jitter spreads them within a few polls.
        A handler's own `next_poll` hint is kept exact (within bounds: see `queried`)."""
        j = self.poll_jitter
        if not j:
            return poll
        # rng.uniform(-j, j), its own formula inline (a Python call fewer on every poll)
        return poll * (1.0 + (-j + (j - -j) * self.rng.random()))

    def retry_delay(self, exc: BaseException, failures: int, task: Task, now: float) -> float:
        """Backoff for the n-th failure in a row, but never sooner than a Retry-After; and
        never later than `max_error_delay` or the task's deadline, whatever it asked for."""
        r = self.retry
        most = float(r.max_error_delay)
        wait = backoff(failures, float(r.first_error_delay), most, r.jitter, self.rng)
        delay = max(retry_after(exc) or 0.0, wait)
        return clamp_delay(delay, now, task.deadline_at, cap=most)

    # --- submit -----------------------------------------------------------------------------

    def submitted(self, out: Any, task: Task, *, poll: float, idempotent: bool, now: float) -> Save:
        """What submit() returned: a vendor handle to land, or a submit failure."""
        if (
            not isinstance(out, Submitted)
            or not isinstance(out.external_id, str)
            or not out.external_id
        ):
            bad = InvalidTask(f"submit() returned {type(out).__name__}, not Submitted(external_id)")
            return self.submit_failed(bad, task, idempotent=idempotent, now=now)
        note = None
        try:
            handle = encode_json({"external_id": out.external_id, "query": out.query})
            check_json_like(out.query, "Submitted.query")
        except (InvalidTask, TypeError) as exc:
            handle = encode_json({"external_id": out.external_id, "query": {}})
            note = (logging.ERROR, f"Submitted.query is not JSON data, dropped: {exc}")
        return Save(
            Status.SUBMITTED,
            delay=clamp_delay(self.jittered(poll), now, task.deadline_at),
            fields={
                "external_id": out.external_id[:512],
                "handle": handle,
                "error_code": "",
                "error_message": "",
                "throttles": "",
            },
            must_land=True,
            note=note,
        )

    def submit_failed(
        self, exc: BaseException, task: Task, *, idempotent: bool, now: float
    ) -> Save:
        """What submit() raised, by kind: every outcome must land (the vendor was called)."""
        kind = classify_submit_error(exc)
        code, message = describe(exc)
        retry = self.retry
        attempts = task.submit_attempts + 1
        if kind is SubmitFailure.AMBIGUOUS and idempotent:
            kind = SubmitFailure.NEVER_SENT  # the vendor dedups on the idempotency key
        error = {"error_code": code, "error_message": message}
        if kind is SubmitFailure.PERMANENT:
            return Save(Status.FAILED, fields=error, must_land=True, failure=exc)
        if kind is SubmitFailure.AMBIGUOUS:
            note = (logging.WARNING, f"submit outcome unknown: {message}")
            return Save(Status.SUBMIT_UNKNOWN, fields=error, must_land=True, note=note, failure=exc)
        if kind is SubmitFailure.THROTTLED:
            throttles = task.throttles + 1
            return Save(
                Status.PENDING_SUBMIT,
                delay=self.retry_delay(exc, throttles, task, now),
                fields={**error, "throttles": throttles},
                must_land=True,
                failure=exc,
            )
        if attempts > retry.max_submit_retries:
            return Save(
                Status.FAILED,
                fields={
                    "error_code": "SUBMIT_RETRIES_EXHAUSTED",
                    "error_message": (
                        f"{attempts} submit attempts never reached the vendor; last: {message}"
                    ),
                },
                must_land=True,
                failure=exc,
            )
        return Save(
            Status.PENDING_SUBMIT,
            delay=self.retry_delay(exc, attempts, task, now),
            fields=error,
            must_land=True,
            failure=exc,
        )

    # --- query ------------------------------------------------------------------------------

    def queried(self, out: Any, task: Task, *, poll: float, now: float) -> Save | Succeeded:
        """What query() returned; a Succeeded comes back as it is (finalize runs first)."""
        if isinstance(out, Running):  # the common case, inline: it runs on every poll
            hint = out.next_poll  # a handler's own hint is kept exact (not NaN, not < 0)...
            if hint is not None and hint >= 0:
                # ...within what the config would ever wait: it may come from a vendor.
                delay = min(float(hint), max(poll, float(self.retry.max_error_delay)))
            elif j := self.poll_jitter:  # jittered(poll), inline
                delay = poll * (1.0 + (-j + (j - -j) * self.rng.random()))
            else:
                delay = poll
            fields: dict[str, Any] = {
                "poll_count": task.poll_count + 1,
                "consecutive_errors": "",
                "throttles": "",
            }
            progress = out.progress
            if progress is not None:
                # a float in (0, 1] (most): as it is; anything else as valid_progress says
                if type(progress) is not float or not 0.0 < progress <= 1.0:
                    progress = valid_progress(progress)
                if progress is not None:
                    fields["progress"] = repr(progress)
            if isinstance(out.stage, str):
                fields["stage"] = out.stage[:MAX_TEXT]
            if isinstance(out.message, str):
                fields["message"] = out.message[:MAX_TEXT]
            note = None
            if isinstance(out.handle, dict):
                try:
                    check_json_like(out.handle, "Running.handle")
                    fields["handle"] = encode_json(
                        {"external_id": task.external_id, "query": out.handle}
                    )
                except InvalidTask as exc:
                    note = (logging.ERROR, f"ignoring a replacement handle: {exc}")
            return Save(
                Status.RUNNING,
                delay=clamp_delay(delay, now, task.deadline_at),
                fields=fields,
                note=note,
            )
        if isinstance(out, Succeeded):
            return out
        if isinstance(out, Failed):
            return self.failed(out, task)
        if isinstance(out, Resubmit):
            return self.resubmit(out, task, poll=poll, now=now)
        bad = InvalidTask(
            f"query() returned {type(out).__name__}, not Running/Succeeded/Failed/Resubmit"
        )
        return self.query_failed(bad, task, now=now)

    def failed(self, out: Failed, task: Task) -> Save:
        code = out.code if isinstance(out.code, str) and out.code else "VENDOR_FAILED"
        fields: dict[str, Any] = {
            "error_code": code[:200],
            "error_message": str(out.message)[:MAX_TEXT],
            "poll_count": task.poll_count + 1,
            "throttles": "",
        }
        note = None
        if out.result is not None:  # what the job made before it failed
            try:
                check_json_like(out.result, "Failed.result")
                fields["result"] = encode_json(out.result)
            except InvalidTask as exc:
                note = (logging.ERROR, f"Failed.result is not JSON data, dropped: {exc}")
        return Save(Status.FAILED, fields=fields, note=note)

    def resubmit(self, out: Resubmit, task: Task, *, poll: float, now: float) -> Save:
        """A job that ended having done nothing: back to PENDING_SUBMIT, handle dropped."""
        code = out.code[:200] if isinstance(out.code, str) and out.code else "RESUBMIT"
        message = str(out.message)[:MAX_TEXT]
        retry = self.retry
        if task.submit_attempts > retry.max_submit_retries:
            note = f"; {task.submit_attempts} submits made, no more (retry.max_submit_retries)"
            error = {"error_code": code, "error_message": (message + note)[:MAX_TEXT]}
            return Save(Status.FAILED, fields=error)
        after = out.after
        if isinstance(after, int | float) and not isinstance(after, bool) and after >= 0:
            delay = min(float(after), max(poll, float(retry.max_error_delay)))  # as next_poll
        else:
            delay = backoff(max(1, task.submit_attempts), float(retry.first_error_delay),
                            float(retry.max_error_delay), retry.jitter, self.rng)  # fmt: skip
        # The next submit starts afresh: no handle, no progress of the job that ended.
        fields: dict[str, Any] = dict.fromkeys(
            ("external_id", "handle", "progress", "stage", "message", "poll_count",
             "consecutive_errors", "throttles"), "")  # fmt: skip
        fields.update(error_code=code, error_message=message)
        return Save(
            Status.PENDING_SUBMIT, delay=clamp_delay(delay, now, task.deadline_at), fields=fields
        )

    def succeeded(self, result: Any, task: Task) -> Save:
        """The job's result (after finalize): SUCCEEDED, or FAILED if it is not JSON data."""
        try:
            check_json_like(result, "result")
            blob = encode_json(result)
        except InvalidTask as exc:
            return Save(
                Status.FAILED,
                fields={"error_code": "INVALID_RESULT", "error_message": str(exc)[:MAX_TEXT]},
            )
        return Save(
            Status.SUCCEEDED,
            fields={
                "result": blob,
                "poll_count": task.poll_count + 1,
                "progress": "1.0",
                "throttles": "",
            },
        )

    def query_failed(self, exc: BaseException, task: Task, *, now: float) -> Save:
        """What query() (or finalize) raised: permanent, throttled, or one more error."""
        retry = self.retry
        code, message = describe(exc)
        if isinstance(exc, PermanentError):
            error = {"error_code": code, "error_message": message}
            return Save(Status.FAILED, fields=error, failure=exc)
        if getattr(exc, "throttled", False):
            # No error budget spent, but each throttle in a row waits twice as long (with
            # jitter, up to max_error_delay), or what the vendor asked for if longer.
            throttles = task.throttles + 1
            return Save(
                task.status,
                delay=self.retry_delay(exc, throttles, task, now),
                fields={"error_code": code, "error_message": message, "throttles": throttles},
                failure=exc,
            )
        errors = task.consecutive_errors + 1
        if errors >= retry.max_consecutive_errors:
            return Save(
                Status.FAILED,
                fields={
                    "error_code": "QUERY_ERRORS",
                    "error_message": f"{errors} query errors in a row; last: {code}: {message}"[
                        :MAX_TEXT
                    ],
                    "consecutive_errors": errors,
                },
                failure=exc,
            )
        return Save(
            task.status,
            delay=self.retry_delay(exc, errors, task, now),
            fields={"consecutive_errors": errors, "error_code": code, "error_message": message},
            failure=exc,
        )

    # --- the rest ---------------------------------------------------------------------------

    def unknown_handler(self, task: Task, phase: str, daemon_id: str, *, now: float) -> Save:
        message = f"no handler {task.handler!r} is registered in daemon {daemon_id}"
        if phase == "submit":
            # Nothing was sent: the task cannot run anywhere that lacks the handler.
            return Save(
                Status.FAILED, fields={"error_code": "UNKNOWN_HANDLER", "error_message": message}
            )
        return self.query_failed(HandlerError(message, code="UNKNOWN_HANDLER"), task, now=now)

    def found(
        self,
        found: Any,
        failure: BaseException | None,
        *,
        lookups: int,
        max_lookups: int,
    ) -> Reconcile:
        """What find() returned (a Submitted or None) or raised (`failure`)."""
        result = "none"
        if failure is None and found is not None:
            if (
                not isinstance(found, Submitted)
                or not isinstance(found.external_id, str)
                or not found.external_id
            ):
                failure = InvalidTask(
                    f"find() returned {type(found).__name__}, not Submitted(external_id) or None"
                )
            else:
                result = "found"
        if failure is not None:
            result = "error"
        retry = self.retry
        retry_s = backoff(
            lookups, float(retry.first_error_delay), float(retry.max_error_delay), retry.jitter,
            self.rng,
        )  # fmt: skip
        message = ""
        handle = b""
        external_id = ""
        if failure is not None:
            code, message = describe(failure)
            message = f"{code}: {message}"[:MAX_TEXT]
            if isinstance(failure, PermanentError):
                max_lookups = 1  # the vendor cannot answer this: an operator decides now
            retry_s = max(retry_after(failure) or 0.0, retry_s)
        elif isinstance(found, Submitted):
            external_id = found.external_id[:512]
            try:
                check_json_like(found.query, "Submitted.query")
                handle = encode_json({"external_id": found.external_id, "query": found.query})
            except (InvalidTask, TypeError):
                handle = encode_json({"external_id": found.external_id, "query": {}})
        return Reconcile(
            result,
            retry_ms=delay_ms(retry_s),
            max_lookups=max_lookups,
            external_id=external_id,
            handle_json=handle,
            message=message,
            failure=failure,
        )


def timed_out(task: Task) -> Save:
    """A query cut at the task's deadline: saved as it is and due now; the save times the
    task out (its deadline has passed)."""
    return Save(task.status)


def canceled() -> Save:
    """A task whose cancel was requested, met in its query phase (after a remote cancel)."""
    return Save(Status.CANCELED)
