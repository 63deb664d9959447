"""Every exception asynctaskd raises on purpose, and the two your handlers raise.

AsyncTaskdError                  catch this to catch everything we raise
├── ConfigError                  config file unreadable or invalid; message names key and line
├── InvalidTask                  client input rejected before anything was written
│   ├── PayloadTooLarge          params or metadata over the size limit
│   └── UnknownHandler           no live daemon serves the handler key (strict submit)
├── TaskNotFound                 no such task (or it belongs to another tenant)
├── IllegalTransition            an operator asked for a move the lifecycle forbids
├── StoreUnavailable             Redis unreachable after retries (wraps redis errors)
├── ScriptError                  a Lua reply broke its documented contract: a bug
├── CorruptTask                  a task hash in Redis cannot be decoded; it is quarantined
└── HandlerError                 raised by your handler to classify a failure
    ├── RetryableError           timeouts, 429, 5xx: try again later; retry_after honoured
    │   └── NotSent              the request provably never reached the vendor
    └── PermanentError           4xx, validation: the task fails
"""

from __future__ import annotations

__all__ = [
    "AsyncTaskdError",
    "ConfigError",
    "CorruptTask",
    "HandlerError",
    "IllegalTransition",
    "InvalidTask",
    "NotPermitted",
    "NotSent",
    "PayloadTooLarge",
    "PermanentError",
    "QuotaExceeded",
    "RetryableError",
    "ScriptError",
    "StoreUnavailable",
    "TaskNotFound",
    "UnknownHandler",
]


class AsyncTaskdError(Exception):
    """Base of every exception asynctaskd raises on purpose."""


class ConfigError(AsyncTaskdError):
    """The config file is unreadable or invalid; the message names the key and line."""


class InvalidTask(AsyncTaskdError, ValueError):
    """Client input was rejected before anything was written to Redis."""


class PayloadTooLarge(InvalidTask):
    """Params or metadata encode to more bytes than the configured limit."""


class UnknownHandler(InvalidTask):
    """No live daemon has registered the handler key (submit with strict=True)."""


class QuotaExceeded(AsyncTaskdError):
    """The tenant has used its submit quota for now; nothing was written.

    `retry_after` is how many seconds until the quota allows the next submit.
    """

    def __init__(self, tenant: str, retry_after: float) -> None:
        super().__init__(
            f"tenant {tenant!r} has used its submit quota; the next submit is allowed in "
            f"{retry_after:.1f}s (see `asynctaskd limits`)"
        )
        self.tenant = tenant
        self.retry_after = retry_after


class TaskNotFound(AsyncTaskdError, LookupError):
    """No such task, or it belongs to another tenant."""


class IllegalTransition(AsyncTaskdError):
    """The lifecycle does not allow the requested move from the task's current status."""


class StoreUnavailable(AsyncTaskdError):
    """Redis could not be reached or answered with a server-side error we cannot act on."""


class NotPermitted(AsyncTaskdError):
    """The Redis user may not run this command or touch these keys (ACL NOPERM)."""


class ScriptError(AsyncTaskdError):
    """A Lua script's reply broke its documented contract. This is a bug: please report it."""


class CorruptTask(AsyncTaskdError):
    """A task hash read back from Redis cannot be decoded. The worker quarantines it."""

    def __init__(self, task_id: str, reason: str) -> None:
        super().__init__(f"task {task_id} is corrupt in Redis: {reason}")
        self.task_id = task_id
        self.reason = reason


class HandlerError(AsyncTaskdError):
    """Raised by a handler to say how a failed vendor call should be treated.

    `code` is a short machine-readable reason stored with the task; `retry_after`
    (seconds) delays the next call at least that long, but at most `retry.max_error_delay`
    and never past the task's deadline.
    """

    def __init__(
        self, message: str = "", *, code: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or type(self).__name__
        self.retry_after = retry_after


class RetryableError(HandlerError):
    """A transient failure (timeout, 5xx, 429): the call is tried again after a backoff.

    With `throttled=True` (429, vendor busy) the retry does not consume the error budget.
    In submit, a plain RetryableError is ambiguous unless the handler is idempotent:
    raise `NotSent` when the request provably never reached the vendor.
    """

    def __init__(
        self,
        message: str = "",
        *,
        code: str | None = None,
        retry_after: float | None = None,
        throttled: bool = False,
    ) -> None:
        super().__init__(message, code=code, retry_after=retry_after)
        self.throttled = throttled


class NotSent(RetryableError):
    """The submit request provably never reached the vendor (connect refused, DNS, pool)."""


class PermanentError(HandlerError):
    """The vendor refused for good (4xx, validation): the task fails with this code."""
