"""Pure decisions: how a handler failure is classified, and when the next call happens."""

from __future__ import annotations

import enum
import random
from typing import Final

import httpx

from .errors import NotSent, PermanentError, RetryableError

__all__ = ["SubmitFailure", "backoff", "clamp_delay", "classify_submit_error", "retry_after"]

# Requests that provably never left this process (no connection was made to the vendor).
_NEVER_SENT: Final = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, NotSent)


class SubmitFailure(enum.Enum):
    """What a failed submit means for the task (SPEC section 4)."""

    NEVER_SENT = "never_sent"  # back to PENDING_SUBMIT with backoff, up to a limit
    THROTTLED = "throttled"  # the vendor refused for now (429): retry, no budget spent
    PERMANENT = "permanent"  # FAILED
    AMBIGUOUS = "ambiguous"  # SUBMIT_UNKNOWN, unless the handler is idempotent


def classify_submit_error(exc: BaseException) -> SubmitFailure:
    """Classify an exception raised by `Handler.submit`. Unknown means ambiguous."""
    if isinstance(exc, PermanentError):
        return SubmitFailure.PERMANENT
    if isinstance(exc, _NEVER_SENT):
        return SubmitFailure.NEVER_SENT
    if isinstance(exc, RetryableError) and exc.throttled:
        return SubmitFailure.THROTTLED
    return SubmitFailure.AMBIGUOUS


def backoff(
    attempt: int,
    first: float,
    cap: float,
    jitter: float,
    rng: random.Random | None = None,
) -> float:
    """Exponential backoff in seconds for the n-th consecutive failure (1-based).

    `first * 2**(attempt-1)`, capped, then spread by +-`jitter` (a fraction) so a
    burst of failures does not come back as a burst.
    """
    attempt = max(1, attempt)
    base = float(min(cap, first * (2.0 ** min(attempt - 1, 62))))
    if jitter <= 0:
        return base
    r = (rng or random).uniform(-jitter, jitter)
    return float(max(0.0, min(cap, base * (1 + r))))


def retry_after(exc: BaseException) -> float | None:
    """The delay a handler error asked for (Retry-After), if any."""
    value = getattr(exc, "retry_after", None)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


def clamp_delay(delay: float, now: float, deadline_at: float, floor: float = 0.0) -> float:
    """Never schedule past the deadline: a task due after it would only time out later."""
    return max(floor, min(delay, max(0.0, deadline_at - now)))
