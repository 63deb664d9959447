"""What the worker does with a handler's exceptions: describe, log (rate-limited), count."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client import generate_latest

from asynctaskd.crashes import LOG_BURST, LOG_WINDOW_S, MAX_TRACE, MAX_TYPES, Crashes, describe
from asynctaskd.errors import PermanentError
from asynctaskd.metrics import Metrics
from asynctaskd.model import Status
from asynctaskd.store import Store
from asynctaskd.worker import Worker
from tests.conftest import wait_until
from tests.test_worker import Scripted, entry, make_config, submit_many


def vendor_answer(body: dict[str, Any]) -> str:
    return body["state"]  # the README example's bug: a 404 body has no "state"


def raised(fn: Any, *args: Any) -> BaseException:
    try:
        fn(*args)
    except BaseException as exc:
        return exc
    raise AssertionError("did not raise")


def test_a_bug_keeps_its_type_and_where_it_broke() -> None:
    code, message = describe(raised(vendor_answer, {"error": "not found"}))
    assert code == "KeyError"
    assert message.startswith("'state'\nTraceback (most recent call last):")
    assert "in vendor_answer" in message and 'return body["state"]' in message


def test_a_deep_traceback_keeps_its_innermost_frames_within_bounds() -> None:
    def deep(n: int) -> None:
        if n == 0:
            raise ValueError("at the bottom")
        deep(n - 1)

    code, message = describe(raised(deep, 200))
    assert code == "ValueError"
    assert len(message) <= len("at the bottom\n...\n") + MAX_TRACE
    assert message.rstrip().endswith("ValueError: at the bottom")


def test_handler_errors_and_network_trouble_carry_no_traceback() -> None:
    assert describe(PermanentError("model gone", code="NO_MODEL")) == ("NO_MODEL", "model gone")
    request = httpx.Request("GET", "https://vendor.example/jobs/1")
    assert describe(httpx.ReadTimeout("timed out", request=request)) == (
        "ReadTimeout",
        "timed out",
    )


def test_bugs_are_logged_at_most_a_burst_a_minute_per_handler(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [1000.0]
    metrics = Metrics()
    crashes = Crashes(metrics, monotonic=lambda: now[0])
    bug = raised(vendor_answer, {})
    with caplog.at_level(logging.ERROR, "asynctaskd.worker"):
        for i in range(LOG_BURST + 3):
            crashes.report("ocr", f"t{i}", "query", 1, bug)
        crashes.report("other", "t-other", "submit", 2, bug)  # a budget of its own
        now[0] += LOG_WINDOW_S
        crashes.report("ocr", "t-late", "query", 4, bug)
        crashes.report("ocr", "t-net", "query", 1, httpx.ConnectError("refused"))  # no log
    lines = [r for r in caplog.records if r.name == "asynctaskd.worker"]
    assert [r.getMessage().split(" (task ")[1].split(",")[0] for r in lines] == [
        *(f"t{i}" for i in range(LOG_BURST)),
        "t-other",
        "t-late",
    ]
    assert all(r.exc_info and r.exc_info[0] is KeyError for r in lines)
    assert lines[-1].getMessage().endswith("; 3 more like it were not logged")
    text = generate_latest(metrics.registry).decode()
    key = 'asynctaskd_handler_exceptions_total{exception="KeyError",handler="ocr",op="query"}'
    assert f"{key} {LOG_BURST + 4}.0" in text
    assert 'exception="ConnectError",handler="ocr",op="query"} 1.0' in text


def test_exception_labels_are_bounded_per_handler() -> None:
    metrics = Metrics()
    crashes = Crashes(metrics)
    for i in range(MAX_TYPES + 5):
        crashes.report("ocr", "t", "query", 1, type(f"Odd{i}", (Exception,), {})())
    text = generate_latest(metrics.registry).decode()
    labels = {line.split('exception="')[1].split('"')[0]
              for line in text.splitlines()
              if line.startswith("asynctaskd_handler_exceptions_total{")}  # fmt: skip
    assert len(labels) == MAX_TYPES + 1 and "other" in labels


async def test_a_buggy_query_is_logged_counted_and_kept_on_the_task(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    h = Scripted()
    h.on_query = lambda ctx: vendor_answer({"error": "not found"})
    [tid] = await submit_many(store, 1)
    async with httpx.AsyncClient() as http:
        worker = Worker(store, entry(h), make_config(), http=http)

        async def errored() -> bool:
            task = await store.get(tid)
            return task is not None and task.consecutive_errors >= 2

        with caplog.at_level(logging.ERROR, "asynctaskd.worker"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(worker.run)
                await wait_until(errored, "two failed polls")
                worker.stop(now=True)
    task = await store.get(tid)
    assert task is not None and task.status is Status.SUBMITTED and task.error is not None
    assert task.error.code == "KeyError"
    assert "Traceback" in task.error.message and "in vendor_answer" in task.error.message
    logged = [r for r in caplog.records if "raised KeyError in query" in r.getMessage()]
    assert len(logged) >= 2 and all(r.exc_info for r in logged)
    assert getattr(logged[0], "task_id", None) == tid
