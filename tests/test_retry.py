"""Pure schedule decisions: delays stay within the deadline, the cap and what Redis stores."""

from __future__ import annotations

import math

import httpx
import pytest

from asynctaskd.errors import NotSent, PermanentError, RetryableError
from asynctaskd.retry import (
    MAX_DELAY_MS,
    SubmitFailure,
    clamp_delay,
    classify_submit_error,
    delay_ms,
)

NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("delay", "cap", "expected"),
    [
        (5.0, math.inf, 5.0),
        (5.0, 2.0, 2.0),  # the cap
        (1e14, 300.0, 300.0),  # a vendor's Retry-After of three million years
        (math.inf, 300.0, 300.0),
        (1e14, math.inf, 3600.0),  # the deadline, an hour away
        (math.nan, 300.0, 0.5),  # the floor
        (0.1, 300.0, 0.5),
    ],
)
def test_clamp_delay_keeps_within_floor_cap_and_deadline(
    delay: float, cap: float, expected: float
) -> None:
    assert clamp_delay(delay, NOW, NOW + 3600, floor=0.5, cap=cap) == expected


def test_clamp_delay_is_its_min_max_definition_for_every_kind_of_value() -> None:
    """clamp_delay is written as comparisons for speed; it must stay what its docstring
    defines, NaNs and infinities included."""
    values = [-1.0, 0.0, 0.5, 1.0, 2.5, 100.0, math.inf, -math.inf, math.nan]

    def defined(delay: float, now: float, deadline: float, floor: float, cap: float) -> float:
        if not delay >= floor:
            return floor
        return max(floor, min(delay, cap, max(0.0, deadline - now)))

    for delay in values:
        for deadline in values:
            for floor in (0.0, 1.0):
                for cap in (math.inf, 2.0, math.nan):
                    got = clamp_delay(delay, 10.0, deadline, floor=floor, cap=cap)
                    want = defined(delay, 10.0, deadline, floor, cap)
                    assert got == want or (math.isnan(got) and math.isnan(want)), (
                        delay, deadline, floor, cap, got, want)  # fmt: skip


def test_clamp_delay_after_the_deadline_is_the_floor() -> None:
    assert clamp_delay(10.0, NOW, NOW - 5) == 0.0
    assert clamp_delay(10.0, NOW, NOW - 5, floor=0.5) == 0.5


@pytest.mark.parametrize(
    ("delay", "expected"),
    [
        (0.0, 0),
        (1.2344, 1234),
        (-3.0, 0),
        (math.nan, 0),
        (1e14, MAX_DELAY_MS),
        (math.inf, MAX_DELAY_MS),
        (MAX_DELAY_MS / 1000, MAX_DELAY_MS),
    ],
)
def test_delay_ms_is_always_an_integer_the_save_script_takes(delay: float, expected: int) -> None:
    ms = delay_ms(delay)
    assert ms == expected and type(ms) is int
    assert 0 <= ms <= 10 * 366 * 86_400_000  # lua/_save.lua's MAX_DELAY_MS


REQUEST = httpx.Request("POST", "https://vendor.example/jobs")


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        # raised only while obtaining a connection: nothing reached the vendor
        (httpx.ConnectError("refused", request=REQUEST), SubmitFailure.NEVER_SENT),
        (httpx.ConnectTimeout("slow", request=REQUEST), SubmitFailure.NEVER_SENT),
        (httpx.PoolTimeout("busy", request=REQUEST), SubmitFailure.NEVER_SENT),
        (NotSent("refused before sending"), SubmitFailure.NEVER_SENT),
        # anything after the first byte may have arrived: never blindly resubmitted
        (httpx.ReadTimeout("no answer", request=REQUEST), SubmitFailure.AMBIGUOUS),
        (httpx.WriteTimeout("stuck", request=REQUEST), SubmitFailure.AMBIGUOUS),
        (httpx.ReadError("reset", request=REQUEST), SubmitFailure.AMBIGUOUS),
        (httpx.WriteError("reset", request=REQUEST), SubmitFailure.AMBIGUOUS),
        (httpx.RemoteProtocolError("cut", request=REQUEST), SubmitFailure.AMBIGUOUS),
        (OSError("anything else"), SubmitFailure.AMBIGUOUS),
        (RetryableError("busy", throttled=True), SubmitFailure.THROTTLED),
        (RetryableError("busy"), SubmitFailure.AMBIGUOUS),
        (PermanentError("no"), SubmitFailure.PERMANENT),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_only_errors_raised_before_any_byte_left_are_never_sent(
    exc: BaseException, expected: SubmitFailure
) -> None:
    assert classify_submit_error(exc) is expected
