"""Trace context across the hop: the W3C trace context a producer's `submit()` stores on
its task, and a span around each vendor call a daemon makes for it (docs/tracing.md).

OpenTelemetry is an optional extra (`asynctaskd[otel]`) and costs nothing when absent or
off: this module never imports it at load time. A producer captures the caller's
context only when its process has imported the OpenTelemetry trace API already (the
application traces; a dict lookup per submit otherwise). A daemon makes spans only with
`[telemetry] otel = true`; with it off, a vendor call pays one `is None` test.

The stored form is one text field, `trace`: the traceparent, then one space and the
tracestate when there is one (a traceparent holds no space). lua/_trace.lua checks its
shape where a daemon takes the request in; the daemon then reads it with OpenTelemetry's
own parser, which ignores a value it cannot use.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any, Final, TypeVar

from asynctaskd.errors import ConfigError, InvalidTask

if TYPE_CHECKING:
    from asynctaskd.model import Task

__all__ = ["MAX_TRACESTATE", "VendorSpans", "captured", "from_headers", "stored", "vendor_spans"]

# W3C Trace Context: version, trace id, parent id, flags; version ff and all-zero ids are
# invalid. A later version may append fields after a dash, which we keep as they are.
_TRACEPARENT: Final = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-.*)?")
MAX_TRACESTATE: Final = 512  # W3C: a carrier may cut tracestate to 512 characters
_MAX_TRACEPARENT: Final = 87  # with MAX_TRACESTATE and a space: lua/_trace.lua's 600 bytes
_PRINTABLE: Final = re.compile(r"[\x20-\x7e]*")
_OTEL_TRACE: Final = "opentelemetry.trace"
_ANSWERS: Final = frozenset({"Submitted", "Running", "Succeeded", "Failed"})  # handlers' outcomes

T = TypeVar("T")

_injector: Any = None  # the W3C propagator, made on the first submit that can use it


def _traceparent_problem(value: object) -> str | None:
    if not isinstance(value, str):
        return f"traceparent must be a str, got {type(value).__name__}"
    m = _TRACEPARENT.fullmatch(value)
    if (
        m is None
        or len(value) > _MAX_TRACEPARENT
        or m[1] == "ff"
        or (m[1] == "00" and m[4] is not None)
        or not _PRINTABLE.fullmatch(value)
        or m[2] == "0" * 32
        or m[3] == "0" * 16
    ):
        return (
            "traceparent must be a W3C traceparent such as "
            f"'00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>', got {value!r:.80}"
        )
    return None


def _tracestate_problem(value: object) -> str | None:
    if not isinstance(value, str):
        return f"tracestate must be a str, got {type(value).__name__}"
    if len(value) > MAX_TRACESTATE or not _PRINTABLE.fullmatch(value):
        return (
            f"tracestate must be printable ASCII of at most {MAX_TRACESTATE} characters, "
            f"got {value!r:.80}"
        )
    return None


def _join(traceparent: str, tracestate: str | None) -> str:
    return f"{traceparent} {tracestate}" if tracestate else traceparent


def stored(trace: object) -> str:
    """What `submit(trace=...)` stores: '' for none; a mapping with `traceparent` (and
    optionally `tracestate`), the W3C headers as a propagator's carrier holds them, is
    checked (InvalidTask) and joined; None captures the caller's current context."""
    if trace is None:
        return captured()
    if not isinstance(trace, Mapping):
        raise InvalidTask(
            "trace must be a mapping of W3C trace context headers ({'traceparent': ..., "
            f"'tracestate': ...}}) or None, got {type(trace).__name__}"
        )
    if not trace:
        return ""  # {}: store no context, not even the current one
    unknown = set(trace) - {"traceparent", "tracestate"}
    if unknown:
        names = ", ".join(sorted(map(repr, unknown)))
        raise InvalidTask(f"trace takes 'traceparent' and 'tracestate' only, got {names:.80}")
    if "traceparent" not in trace:
        raise InvalidTask("trace needs a 'traceparent'")
    traceparent, tracestate = trace["traceparent"], trace.get("tracestate")
    problem = _traceparent_problem(traceparent)
    if problem is None and tracestate is not None:
        problem = _tracestate_problem(tracestate)
    if problem is not None:
        raise InvalidTask(problem)
    return _join(traceparent, tracestate)


def captured() -> str:
    """The caller's current span context in the stored form, or '' when there is none,
    or when this process never imported the OpenTelemetry trace API (then nothing can
    have started a span, and importing it here would cost every producer its load)."""
    if _OTEL_TRACE not in sys.modules:
        return ""
    global _injector
    if _injector is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _injector = TraceContextTextMapPropagator()
    carrier: dict[str, str] = {}
    _injector.inject(carrier)
    traceparent = carrier.get("traceparent")
    if traceparent is None or _traceparent_problem(traceparent) is not None:
        return ""  # no valid span is current
    tracestate = carrier.get("tracestate")
    if tracestate is not None and _tracestate_problem(tracestate) is not None:
        tracestate = None  # W3C lets a carrier drop a tracestate it cannot pass on
    return _join(traceparent, tracestate)


def from_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace context of an incoming HTTP request as `submit(trace=...)` takes it,
    or None (then `submit` captures the server's own current context, if it traces).
    A malformed traceparent is ignored, as W3C asks of a receiver, and so is a malformed
    tracestate (the traceparent is kept)."""
    traceparent = headers.get("traceparent")
    if traceparent is None or _traceparent_problem(traceparent) is not None:
        return None
    tracestate = headers.get("tracestate")
    if tracestate is None or _tracestate_problem(tracestate) is not None:
        return {"traceparent": traceparent}
    return {"traceparent": traceparent, "tracestate": tracestate}


def vendor_spans(enabled: bool) -> VendorSpans | None:
    """The daemon's spans (`[telemetry] otel`), or None when off: nothing is imported."""
    if not enabled:
        return None
    try:
        return VendorSpans()
    except ImportError as exc:
        raise ConfigError(
            f"[telemetry] otel = true needs the OpenTelemetry API ({exc}): install "
            "'asynctaskd[otel]', or set otel = false"
        ) from None


class VendorSpans:
    """A span around each vendor call (submit, query, cancel, find, finalize), a child of
    the trace context its task was submitted with (a root span when it has none).

    Child, not a link: a task is one request of one producer, and its calls are the work
    that request asked for, so its trace shows them under the producer's span however
    long the task lives. The handler runs inside the span's context, so spans made by an
    instrumented HTTP client (`ctx.http` under httpx's instrumentation) nest under it.
    The spans go to the global TracerProvider, whatever set it up (the OpenTelemetry SDK
    in a handler's factory, or `opentelemetry-instrument asynctaskd run`).
    """

    def __init__(self) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._context = context
        self._trace = trace
        self._tracer = trace.get_tracer("asynctaskd")
        self._propagator = TraceContextTextMapPropagator()
        self._root = context.Context()
        self._error = trace.Status(trace.StatusCode.ERROR)

    def _parent(self, trace: str | None) -> Any:
        if not trace:
            return self._root
        traceparent, _, tracestate = trace.partition(" ")
        carrier = {"traceparent": traceparent}
        if tracestate:
            carrier["tracestate"] = tracestate
        return self._propagator.extract(carrier, context=self._root)

    async def call(self, what: str, task: Task, attempt: int, call: Awaitable[T]) -> T:
        """Await a handler's `call` inside a span named `<what> <handler>`, whose
        attributes say which task, which attempt, and what came of it: the handler's
        answer (`submitted`, `running`, `succeeded`, `failed`; `none` for a `find` that
        found nothing, `ok` for a cancel or a finalize), `error` (the exception recorded,
        the span's status ERROR) or `canceled` (cut: the task's deadline, a lost lease, a
        drain)."""
        span = self._tracer.start_span(
            f"{what} {task.handler}",
            context=self._parent(task.trace),
            attributes={
                "asynctaskd.call": what,
                "asynctaskd.task.id": task.id,
                "asynctaskd.handler": task.handler,
                "asynctaskd.attempt": attempt,
            },
        )
        token = self._context.attach(self._trace.set_span_in_context(span))
        outcome = "error"
        try:
            out = await call
        except asyncio.CancelledError:
            outcome = "canceled"
            raise
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(self._error)
            raise
        else:
            if out is None:
                outcome = "none" if what == "find" else "ok"
            else:
                name = type(out).__name__
                outcome = name.lower() if name in _ANSWERS else "ok"
            return out
        finally:
            span.set_attribute("asynctaskd.outcome", outcome)
            self._context.detach(token)
            span.end()
