"""What the worker does with an exception a handler raised: describe it, log it, count it.

A `HandlerError` is the handler speaking (a code and a message it chose). Network trouble
(`httpx.HTTPError`, `OSError`, `TimeoutError`) is the vendor or the network. Anything else
is a bug in the handler, and its traceback is what the person fixing it needs: it is
logged once per task and attempt, at most `LOG_BURST` per handler in any `LOG_WINDOW_S`
(a handler that breaks on every call cannot flood the journal; the next line that gets
through says how many were held back), and the task keeps the exception type as its
error code and the last frames of the traceback in its error message (`asynctaskd get`).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from typing import Final

import httpx

from .errors import HandlerError
from .metrics import Metrics

__all__ = ["Crashes", "describe", "is_bug"]

logger = logging.getLogger("asynctaskd.worker")

MAX_MESSAGE: Final = 1000  # a HandlerError's message, or a bug's text, stored this long
MAX_TRACE: Final = 3000  # the traceback kept after a bug's text
LOG_BURST: Final = 5
LOG_WINDOW_S: Final = 60.0
MAX_TYPES: Final = 20  # exception labels per handler; more are counted as "other"

_NETWORK: Final = (httpx.HTTPError, OSError, TimeoutError)


def is_bug(exc: BaseException) -> bool:
    """Whether `exc` is neither the handler's own verdict nor network trouble."""
    return not isinstance(exc, (HandlerError, *_NETWORK))


def describe(exc: BaseException) -> tuple[str, str]:
    """The error code and message a task stores for `exc`."""
    if isinstance(exc, HandlerError):
        return exc.code[:200], (exc.message or str(exc))[:MAX_MESSAGE]
    code, text = type(exc).__name__[:200], str(exc)[:MAX_MESSAGE]
    if not is_bug(exc):
        return code, text
    frames = "".join(traceback.format_exception(exc))
    if len(frames) > MAX_TRACE:  # the innermost frames say where it broke
        frames = "...\n" + frames[-MAX_TRACE:]
    return code, f"{text}\n{frames}".strip()


class Crashes:
    """Logs and counts the bugs handlers raise (see the module docstring)."""

    def __init__(self, metrics: Metrics, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self._monotonic = monotonic
        self._logged: dict[str, list[float]] = {}  # handler -> times of recent log lines
        self._held: dict[str, int] = {}  # handler -> lines held back since the last one
        self._types: dict[str, set[str]] = {}  # handler -> exception labels in use

    def report(self, handler: str, task_id: str, op: str, attempt: int, exc: BaseException) -> None:
        """Count `exc` and, if it is a bug and the handler's budget allows, log it."""
        name = type(exc).__name__
        seen = self._types.setdefault(handler, set())
        if name not in seen and len(seen) >= MAX_TYPES:
            name = "other"
        seen.add(name)
        self.metrics.handler_exceptions.labels(handler, op, name).inc()
        if not is_bug(exc):
            return
        now = self._monotonic()
        recent = [t for t in self._logged.get(handler, ()) if now - t < LOG_WINDOW_S]
        if len(recent) >= LOG_BURST:
            self._logged[handler] = recent
            self._held[handler] = self._held.get(handler, 0) + 1
            return
        recent.append(now)
        self._logged[handler] = recent
        held = self._held.pop(handler, 0)
        logger.error(
            "handler %s raised %s in %s (task %s, attempt %d)%s",
            handler,
            name,
            op,
            task_id,
            attempt,
            f"; {held} more like it were not logged" if held else "",
            exc_info=exc,
            extra={"task_id": task_id, "handler": handler},
        )
