"""A vendor's answer classified: status codes, throttles (Retry-After and reset headers),
permanent refusals (`errors.permanent`, `errors.permanent_codes`), garbage bodies."""

from __future__ import annotations

import email.utils
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import msgspec

from asynctaskd.errors import PermanentError, RetryableError
from asynctaskd.transport import Reply

from .credentials import _Redacting
from .templates import _Pointer


def _code_of(exc: BaseException) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).upper()


_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")


_UNIT_SECONDS: Final = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def parse_reset(value: str | None) -> float | None:
    """Seconds from a rate-limit reset header: a duration as vendors write them ("6m0s",
    "1.5s", "20ms", "1h2m") or plain seconds; None when it is neither."""
    if value is None:
        return None
    text = value.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)


def throttle_wait(
    header: Callable[[str], str | None], reset_headers: Sequence[str] = ()
) -> float | None:
    """How long a throttled answer asks to wait: the longest of `retry-after-ms` (the
    OpenAI SDK reads it first), Retry-After and the handler's `reset_headers`."""
    waits = []
    ms = header("retry-after-ms")
    if ms is not None and re.fullmatch(r"\s*\d+(\.\d+)?\s*", ms):
        waits.append(float(ms) / 1000)
    if (after := parse_retry_after(header("retry-after"))) is not None:
        waits.append(after)
    waits += [w for name in reset_headers if (w := parse_reset(header(name))) is not None]
    return max(waits) if waits else None


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delay-seconds or an HTTP-date; else None."""
    if value is None:
        return None
    text = value.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        seconds = float(text)
        return seconds if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class _Classifying(_Redacting):
    """HttpHandler's reading of an answer's status and body (`errors` options)."""

    _permanent: frozenset[int] | None
    _retryable: frozenset[int]
    _reset_headers: tuple[str, ...]
    _permanent_codes: frozenset[str]
    _code_pointer: _Pointer

    def _check_status(self, response: Reply, what: str) -> None:
        status = response.status
        if 200 <= status < 300:
            return
        code = f"HTTP_{status}"
        body = self._excerpt(response.content)
        if status in self._retryable:
            raise RetryableError(f"{what}: vendor answered {status}: {body}", code=code)
        has_retry_after = response.header("retry-after") is not None
        if status == 429 and self._permanent_codes:
            vendor_code = self._vendor_code(response)
            if vendor_code in self._permanent_codes:
                raise PermanentError(
                    f"{what}: vendor refused ({status} {vendor_code}): {body}",
                    code=vendor_code.upper()[:200],
                )
        if status == 429 or (status == 503 and has_retry_after):
            raise RetryableError(
                f"{what}: throttled by the vendor ({status}): {body}",
                code=code,
                retry_after=throttle_wait(response.header, self._reset_headers),
                throttled=True,
            )
        if self._permanent is not None:
            permanent = status in self._permanent
        else:
            permanent = 400 <= status < 500 and status not in (408, 429)
        if permanent:
            raise PermanentError(f"{what}: vendor refused ({status}): {body}", code=code)
        raise RetryableError(f"{what}: vendor answered {status}: {body}", code=code)

    def _vendor_code(self, response: Reply) -> str:
        """The code at `errors.code_pointer` in a JSON error body, or ''."""
        try:
            value = self._code_pointer.get(msgspec.json.decode(response.content[:65536]))
        except (msgspec.DecodeError, RecursionError, ValueError, TypeError, KeyError):
            return ""
        return value if isinstance(value, str) else ""

    def _decode(self, response: Reply, what: str) -> Any:
        try:
            doc = msgspec.json.decode(response.content)
        except (msgspec.DecodeError, RecursionError) as exc:
            # msgspec raises RecursionError for arrays or objects nested deeper than the
            # interpreter's recursion limit allows: vendor garbage like any other.
            why = "nested too deeply" if isinstance(exc, RecursionError) else "not JSON"
            maybe = "; the job may exist" if what == "submit" else ""
            raise RetryableError(
                f"{what}: the vendor's {response.status} answer is {why}{maybe}; "
                f"body: {self._excerpt(response.content)}",
                code="VENDOR_GARBAGE",
            ) from None
        return self._secrets.scrub(doc, response.content)
