"""Durations in config: `Duration` (seconds, from 30, 2.5, "250ms", "5m", ...; always
positive) and `Delay` (0 allowed), and the msgspec hooks that decode and encode them."""

from __future__ import annotations

import math
import re
from typing import ClassVar, Final

__all__ = ["Delay", "Duration", "decode_hook"]

_DURATION: Final = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)")


class Duration(float):
    """Seconds. Config accepts 30, 2.5, "250ms", "30s", "5m", "1h", "7d"; always positive."""

    _UNITS: ClassVar[dict[str, float]] = {
        "ms": 0.001,
        "s": 1.0,
        "m": 60.0,
        "h": 3600.0,
        "d": 86400.0,
    }

    @classmethod
    def parse(cls, value: object) -> Duration:
        """Build a Duration from a number of seconds or a string with a unit; ValueError if not."""
        seconds = cls._seconds(value)
        if seconds is None:
            raise ValueError(f"expected seconds or a duration like '30s' or '5m', got {value!r}")
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"expected a positive duration, got {value!r}")
        return cls(seconds)

    @classmethod
    def _seconds(cls, value: object) -> float | None:
        """The seconds `value` says (a number, or a string with a unit), or None."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and (m := _DURATION.fullmatch(value.strip())):
            return float(m[1]) * cls._UNITS[m[2]]
        return None


class Delay(Duration):
    """A Duration that may also be 0, which turns off what it delays."""

    @classmethod
    def parse(cls, value: object) -> Delay:
        seconds = cls._seconds(value)
        if seconds is None or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"expected 0 or a duration like '2ms' or '1s', got {value!r}")
        return cls(seconds)


def decode_hook(type_: type, value: object) -> object:
    """msgspec dec_hook for the config types (Duration, Delay), for every decoder of config
    data."""
    if type_ is Duration or type_ is Delay:
        return type_.parse(value)
    raise NotImplementedError(f"no decoder for {type_!r}")


def _encode_custom(value: object) -> object:
    if isinstance(value, Duration):
        return float(value)
    raise NotImplementedError(f"no encoder for {type(value)!r}")
