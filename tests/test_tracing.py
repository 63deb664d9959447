"""OpenTelemetry across the hop (docs/tracing.md): the trace context `submit()` stores on
a task, the span around each vendor call a worker makes for it, the HTTP client's spans
under those, and nothing of OpenTelemetry at all when it is off. Real Redis, the fake
vendor over real sockets, spans read back through the SDK's in-memory exporter."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import redis.asyncio
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, StatusCode

from asynctaskd.client import AsyncClient, Client
from asynctaskd.devtools.demo import DemoHandler
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.errors import InvalidTask, NotSent, PermanentError
from asynctaskd.handlers import HandlerContext, Running, Submitted
from asynctaskd.model import Status, Task
from asynctaskd.store import Store
from asynctaskd.tracing import from_headers
from asynctaskd.worker import Worker
from tests.conftest import wait_until
from tests.test_web import Api, api  # noqa: F401 - the `api` fixture: a real HTTP API server
from tests.test_worker import Scripted, entry, make_config

pytestmark = pytest.mark.anyio

_EXPORTER = InMemorySpanExporter()
_PROVIDER = TracerProvider()
_PROVIDER.add_span_processor(SimpleSpanProcessor(_EXPORTER))
_set = False


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The spans ended during the test. The global provider can be set once per process:
    only this module sets it (the daemon's spans go to the global one)."""
    global _set
    if not _set:
        trace.set_tracer_provider(_PROVIDER)
        _set = True
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


@pytest.fixture
async def client(redis_client: redis.asyncio.Redis) -> AsyncClient:
    return AsyncClient(redis_client, "atd")


@pytest.fixture(scope="module")
def vendor() -> Iterator[FakeVendorProcess]:
    with FakeVendorProcess.start(Behaviour(polls_to_done=2)) as v:
        yield v


def traceparent(ctx: SpanContext) -> str:
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def producer_span() -> Any:
    return trace.get_tracer("tests").start_as_current_span("POST /ocr")


TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


# --- the producer side ---------------------------------------------------------------------


async def test_submit_stores_the_callers_current_span(
    spans: InMemorySpanExporter, client: AsyncClient
) -> None:
    with producer_span() as span:
        task = await client.submit("demo", {}, tracking_timeout=60, strict=False)
    expected = traceparent(span.get_span_context())
    assert task.trace == expected
    stored = await client.get(task.id)
    assert stored is not None and stored.trace == expected


def test_the_blocking_client_stores_it_too(spans: InMemorySpanExporter, redis_url: str) -> None:
    with Client.from_url(redis_url) as client, producer_span() as span:
        task = client.submit("demo", {}, tracking_timeout=60, strict=False)
        stored = client.get(task.id)
    assert stored is not None and stored.trace == traceparent(span.get_span_context())


async def test_no_current_span_or_an_empty_trace_stores_none(
    spans: InMemorySpanExporter, client: AsyncClient
) -> None:
    outside = await client.submit("demo", {}, tracking_timeout=60, strict=False)
    with producer_span():
        opted_out = await client.submit("demo", {}, tracking_timeout=60, strict=False, trace={})
    for task in (outside, opted_out):
        stored = await client.get(task.id)
        assert stored is not None and stored.trace is None


async def test_an_explicit_trace_context_is_stored_with_its_tracestate(
    client: AsyncClient,
) -> None:
    given = {"traceparent": TP, "tracestate": "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7"}
    task = await client.submit("demo", {}, tracking_timeout=60, strict=False, trace=given)
    stored = await client.get(task.id)
    assert stored is not None and stored.trace == f"{TP} {given['tracestate']}"


@pytest.mark.parametrize(
    ("trace_arg", "message"),
    [
        ("00-abc", "mapping"),
        ({"tracestate": "a=b"}, "needs a 'traceparent'"),
        ({"traceparent": "00-xyz"}, "W3C traceparent"),
        ({"traceparent": TP.upper()}, "W3C traceparent"),  # W3C: lower-case hex only
        ({"traceparent": "00-" + "0" * 32 + TP[35:]}, "W3C traceparent"),  # all-zero trace id
        ({"traceparent": "ff" + TP[2:]}, "W3C traceparent"),  # version ff is invalid
        ({"traceparent": TP + "-x"}, "W3C traceparent"),  # version 00 has exactly 4 fields
        ({"traceparent": TP, "tracestate": "k=" + "v" * 600}, "at most 512"),
        ({"traceparent": TP, "tracestate": "k=\n"}, "printable"),
        ({"traceparent": TP, "baggage": "x"}, "'traceparent' and 'tracestate' only"),
    ],
)
async def test_a_malformed_trace_is_refused_before_anything_is_written(
    client: AsyncClient, redis_client: redis.asyncio.Redis, trace_arg: Any, message: str
) -> None:
    with pytest.raises(InvalidTask, match=message):
        await client.submit("demo", {}, tracking_timeout=60, strict=False, trace=trace_arg)
    assert [k async for k in redis_client.scan_iter("atd:*new:*")] == []


async def test_the_http_api_takes_the_incoming_traceparent(api: Api) -> None:  # noqa: F811
    auth = await api.token("producer", "t1")
    sent = await api.submit({**auth, "traceparent": TP, "tracestate": "rojo=1"})
    ignored = await api.submit({**auth, "traceparent": "00-not-a-traceparent"})
    assert (sent.status_code, ignored.status_code) == (201, 201), (sent.text, ignored.text)
    got = await api.client.get(sent.json()["id"])
    assert got is not None and got.trace == f"{TP} rojo=1"
    # a receiver ignores a traceparent it cannot parse (W3C), rather than refuse the request
    bad = await api.client.get(ignored.json()["id"])
    assert bad is not None and bad.trace is None


def test_from_headers_keeps_a_good_traceparent_without_a_bad_tracestate() -> None:
    assert from_headers({"traceparent": TP, "tracestate": "x" * 513}) == {"traceparent": TP}
    assert from_headers({}) is None


# --- the daemon side -----------------------------------------------------------------------


def by_name(exported: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return sorted((s for s in exported if s.name == name), key=lambda s: s.start_time or 0)


async def run_worker(store: Store, handler: Any, http: httpx.AsyncClient, otel: bool) -> Worker:
    config = make_config(telemetry={"otel": otel})
    worker = Worker(store, entry(handler), config, http=http)
    with anyio.fail_after(30):
        await worker.run_until_idle()
    return worker


async def test_every_vendor_call_is_a_child_span_of_the_submitters_context_and_the_http_client_spans_nest_under_it(  # noqa: E501
    spans: InMemorySpanExporter, client: AsyncClient, store: Store, vendor: FakeVendorProcess
) -> None:
    vendor.reset()
    http_tracer = trace.get_tracer("httpx-hooks")

    async def request_span(request: httpx.Request) -> None:
        # What httpx's instrumentation does: a span of its own, under the current one.
        http_tracer.start_span(f"HTTP {request.method}").end()

    with producer_span() as span:
        task = await client.submit("demo", {"n": 1}, tracking_timeout=60, strict=False)
    parent = span.get_span_context()
    spans.clear()
    handler = DemoHandler("demo", vendor.url, client="http")
    async with httpx.AsyncClient(event_hooks={"request": [request_span]}) as http:
        await run_worker(store, handler, http, otel=True)
    done = await client.get(task.id)
    assert done is not None and done.status is Status.SUCCEEDED
    exported = spans.get_finished_spans()
    [submit] = by_name(exported, "submit demo")
    queries = by_name(exported, "query demo")
    assert len(queries) == done.poll_count == 2  # the fake vendor answers done on poll 2
    for call in [submit, *queries]:
        assert call.parent is not None and call.parent.span_id == parent.span_id
        assert call.context is not None and call.context.trace_id == parent.trace_id
        assert call.attributes is not None
        assert call.attributes["asynctaskd.task.id"] == task.id
        assert call.attributes["asynctaskd.handler"] == "demo"
    assert submit.attributes is not None and queries[0].attributes is not None
    assert (submit.attributes["asynctaskd.attempt"], submit.attributes["asynctaskd.outcome"]) == (
        1,
        "submitted",
    )
    outcomes = [(q.attributes or {}).get("asynctaskd.outcome") for q in queries]
    assert outcomes == ["running", "succeeded"]
    assert [(q.attributes or {}).get("asynctaskd.attempt") for q in queries] == [1, 2]
    # each HTTP request's span is a child of the vendor call that made it
    calls = {s.context.span_id for s in [submit, *queries] if s.context is not None}
    http_spans = [s for s in exported if s.name.startswith("HTTP ")]
    assert len(http_spans) == 3
    assert all(s.parent is not None and s.parent.span_id in calls for s in http_spans)


async def test_failed_retried_and_cancel_calls_say_so(
    spans: InMemorySpanExporter, client: AsyncClient, store: Store
) -> None:
    h = Scripted()
    h.on_submit = lambda ctx: (
        NotSent("connection refused") if ctx.submit_attempt == 1 else Submitted("x-" + ctx.task_id)
    )

    async def ask_cancel(ctx: HandlerContext) -> Running:
        await client.cancel(ctx.task_id)  # the next claim of the task calls cancel()
        return Running()

    h.on_query = ask_cancel
    failing = Scripted()
    failing.on_submit = lambda ctx: PermanentError("bad input", code="HTTP_400")
    with producer_span() as producer:
        task = await client.submit("demo", {}, tracking_timeout=60, strict=False)
    async with httpx.AsyncClient() as http:
        await run_worker(store, h, http, otel=True)
        done = await client.get(task.id)
        assert done is not None and done.status is Status.CANCELED
        exported = spans.get_finished_spans()
        submits = by_name(exported, "submit demo")
        assert [(s.attributes or {}).get("asynctaskd.attempt") for s in submits] == [1, 2]
        assert [(s.attributes or {}).get("asynctaskd.outcome") for s in submits] == [
            "error",
            "submitted",
        ]
        assert submits[0].status.status_code is StatusCode.ERROR
        assert [e.attributes["exception.type"] for e in submits[0].events if e.attributes] == [
            "asynctaskd.errors.NotSent"
        ]
        [cancel] = by_name(exported, "cancel demo")
        assert (cancel.attributes or {}).get("asynctaskd.outcome") == "ok"
        assert {s.context.trace_id for s in exported if s.context is not None} == {
            producer.get_span_context().trace_id
        }
        spans.clear()
        failed = await client.submit("demo", {}, tracking_timeout=60, strict=False, trace={})
        await run_worker(store, failing, http, otel=True)
    [root] = by_name(spans.get_finished_spans(), "submit demo")
    assert root.parent is None  # a task submitted without a trace: a root span of its own
    assert (root.attributes or {}).get("asynctaskd.task.id") == failed.id
    assert (root.attributes or {}).get("asynctaskd.outcome") == "error"


class Findable(Scripted):
    """A handler whose submit's outcome is unknown (a read timeout after sending), and
    whose vendor listing finds the job the submit made."""

    find_visible_after = 0.0

    async def find(self, params: Any, ctx: HandlerContext) -> Submitted | None:
        return Submitted("x-" + ctx.task_id)


@pytest.mark.slow
async def test_a_lookup_of_a_parked_task_and_a_query_cut_at_the_deadline_are_spans_too(
    spans: InMemorySpanExporter, client: AsyncClient, store: Store
) -> None:
    h = Findable()
    request = httpx.Request("POST", "https://vendor.example/jobs")
    h.on_submit = lambda ctx: httpx.ReadTimeout("sent, no answer", request=request)

    async def hang(ctx: HandlerContext) -> Running:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    h.on_query = hang  # until the task's deadline cuts it
    with producer_span() as producer:
        # long enough for the submit, the park and the lookup on a loaded machine
        task = await client.submit("demo", {}, tracking_timeout=3, strict=False)
    async with httpx.AsyncClient() as http:
        worker = Worker(store, entry(h), make_config(telemetry={"otel": True}), http=http)

        async def settled() -> bool:
            got = await client.get(task.id)
            return got is not None and got.status.is_terminal

        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            await wait_until(settled, "the task timed out", timeout=30)
            worker.stop(now=True)
    done = await client.get(task.id)
    assert done is not None and done.status is Status.TRACKING_TIMED_OUT
    exported = spans.get_finished_spans()
    outcomes = {
        s.name: (s.attributes or {}).get("asynctaskd.outcome")
        for s in exported
        if s.parent is not None and s.parent.span_id == producer.get_span_context().span_id
    }
    assert outcomes == {"submit demo": "error", "find demo": "submitted", "query demo": "canceled"}
    [find] = by_name(exported, "find demo")
    assert (find.attributes or {}).get("asynctaskd.attempt") == 1  # the first lookup


async def test_off_the_worker_makes_no_span(
    spans: InMemorySpanExporter, client: AsyncClient, store: Store
) -> None:
    with producer_span():
        task: Task = await client.submit("demo", {}, tracking_timeout=60, strict=False)
    spans.clear()
    async with httpx.AsyncClient() as http:
        worker = await run_worker(store, Scripted(), http, otel=False)
    assert worker.vendor.spans is None
    done = await client.get(task.id)
    assert done is not None and done.status is Status.SUCCEEDED
    assert spans.get_finished_spans() == ()


# --- absent or off: nothing is imported ------------------------------------------------------


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.slow
def test_client_and_daemon_need_nothing_of_opentelemetry_when_off() -> None:
    # Blocked rather than looked for in sys.modules: redis-py 8 loads the API itself
    # when it is installed, whatever asynctaskd does.
    done = run_python(
        "import sys\n"
        "sys.modules['opentelemetry'] = None  # any import of it raises ImportError\n"
        "import asynctaskd, asynctaskd.client, asynctaskd.daemon, asynctaskd.worker\n"
        "from asynctaskd.tracing import captured, stored, vendor_spans\n"
        "assert captured() == '' and stored(None) == '' and vendor_spans(False) is None\n"
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_otel_on_without_the_extra_is_a_config_error_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[telemetry]\notel = true\n")
    checked = run_python(
        "import sys\n"
        "sys.modules['opentelemetry'] = None  # as if asynctaskd[otel] were not installed\n"
        "from asynctaskd.cli import main\n"
        f"raise SystemExit(main(['check-config', '--config', {str(config)!r}]))\n"
    )
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert "[telemetry] otel = true needs the OpenTelemetry API" in checked.stderr
    assert "asynctaskd[otel]" in checked.stderr
    done = run_python(
        "import sys\n"
        "sys.modules['opentelemetry'] = None  # as if asynctaskd[otel] were not installed\n"
        "from asynctaskd.errors import ConfigError\n"
        "from asynctaskd.tracing import vendor_spans\n"
        "try:\n"
        "    vendor_spans(True)\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "asynctaskd[otel]" in done.stdout and "otel = false" in done.stdout
