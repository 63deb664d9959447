"""Pure decisions: how a handler failure is classified, and when the next call happens."""

from __future__ import annotations

import enum
import math
import random
from typing import Final

import httpx

from .errors import NotSent, PermanentError, RetryableError

__all__ = [
    "MAX_DELAY_MS",
    "SubmitFailure",
    "backoff",
    "clamp_delay",
    "classify_submit_error",
    "delay_ms",
    "retry_after",
]

# The longest delay the save script takes (lua/_save.lua): 10 years, as the client's
# longest delay, so every due time is an integer a double holds exactly.
MAX_DELAY_MS: Final = 10 * 366 * 86_400_000

# Requests that provably never left this process (no connection was made to the vendor).
_NEVER_SENT: Final = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, NotSent)


class SubmitFailure(enum.Enum):
    """What a failed submit means for the task (docs/reliability.md)."""

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


def clamp_delay(
    delay: float, now: float, deadline_at: float, floor: float = 0.0, cap: float = math.inf
) -> float:
    """`delay`, but never past the deadline (a task due after it would only time out
    later) and never above `cap`; a NaN delay counts as `floor`.

    Delays can come from a vendor (Retry-After) or a handler (`next_poll`): a huge one
    must not park a task for good, nor reach Redis as a number it cannot store.

    `max(floor, min(delay, cap, max(0.0, deadline_at - now)))`, written as comparisons:
    every poll clamps its delay, and the three builtin calls were 4x the cost."""
    if not delay >= floor:  # also NaN
        return floor
    if delay > cap:
        delay = cap
    left = deadline_at - now
    if not left > 0.0:  # also NaN, as max(0.0, nan)
        left = 0.0
    if delay > left:
        delay = left
    return delay if delay >= floor else floor


def delay_ms(delay: float) -> int:
    """`delay` seconds as the save script's `delay_ms`: an integer from 0 to MAX_DELAY_MS."""
    if not delay > 0:  # also NaN
        return 0
    if delay >= MAX_DELAY_MS / 1000:  # also infinity, which round() refuses
        return MAX_DELAY_MS
    return round(delay * 1000)
