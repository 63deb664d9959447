"""The declarative HTTP handler over real sockets: the shipped examples against local fakes of
their vendors, every HTTP error class mapped to its lifecycle outcome through the worker and
a real Redis, config errors named by key and line, and credentials that never leak."""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
import redis.asyncio

from asynctaskd.client import AsyncClient
from asynctaskd.codec import encode_json
from asynctaskd.config import Config, HandlerConfig, parse_config
from asynctaskd.embedded import ServerProcess, find_binary
from asynctaskd.errors import ConfigError, NotSent, PermanentError, RetryableError
from asynctaskd.handlers import HandlerContext, HandlerEntry, Running, load_handlers
from asynctaskd.http_handler import (
    HttpHandler,
    build,
    builders,
    parse_reset,
    parse_retry_after,
    throttle_wait,
)
from asynctaskd.keys import new_task_id
from asynctaskd.model import Status, Task
from asynctaskd.store import Store
from asynctaskd.transport import make_http_client
from asynctaskd.worker import Worker
from tests.conftest import wait_until
from tests.fakes import serve
from tests.fakes.openai_batches import OpenAIBatches, requests_for
from tests.fakes.replicate import PNG, ReplicatePredictions
from tests.fakes.scripted import Scripted, echo, garbage, json, reset, slow, status

pytestmark = pytest.mark.anyio

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One private server for this module: the handler never talks to Redis itself, and
    test_worker.py already runs the worker against both redis-server and valkey-server."""
    binary = find_binary("redis-server") or find_binary("valkey-server")
    if binary is None:
        pytest.skip("no redis-server or valkey-server")
    proc = ServerProcess(binary).start()
    try:
        yield proc
    finally:
        proc.stop()


# ---- helpers ---------------------------------------------------------------------------------


def make_config(**retry: Any) -> Config:
    values = {"poll_interval": "20ms", "first_error_delay": "10ms", "max_error_delay": "50ms",
              "jitter": 0, **retry}  # fmt: skip
    lines = ["[worker]", 'lease = "5s"', "max_inflight = 50", "[retry]"]
    lines += [f"{k} = {encode_json(v).decode()}" for k, v in values.items()]
    return parse_config("\n".join(lines))


class Whole(dict[str, Any]):
    """A table merge() puts in place as it is, instead of merging it into the one there."""


def merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, Whole):
            out[key] = dict(value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def scripted_options(url: str, **changes: Any) -> dict[str, Any]:
    base = {
        "base_url": url,
        "timeouts": {"connect": "1s", "read": "300ms", "total": "5s"},
        "submit": {"url": "{base_url}/jobs", "body": {"input": "{params}"}, "id": "/id"},
        "query": {
            "url": "{base_url}/jobs/{external_id}", "status": "/status",
            "running": ["queued", "running"], "succeeded": ["done"], "failed": ["error"],
            "progress": "/progress", "result": "/output",
            "error_code": "/error/code", "error_message": "/error/message",
        },
        "cancel": {"url": "{base_url}/jobs/{external_id}/cancel"},
    }  # fmt: skip
    return merge(base, changes)


def handler_for(options: dict[str, Any], key: str = "h", **config: Any) -> HttpHandler:
    return build(HandlerConfig(key=key, type="http", options=options, **config))


def ctx_for(http: Any, task_id: str = "task-1") -> HandlerContext:
    return HandlerContext(
        task_id=task_id, idempotency_key=task_id, handler="h", tenant="", account="",
        provider="h", submit_attempt=1, poll_count=0, deadline_at=time.time() + 60,
        cancel_requested=False, http=http,
        logger=logging.LoggerAdapter(logging.getLogger("test.http_handler"), {}),
    )  # fmt: skip


async def create(store: Store, key: str, params: list[Any]) -> list[str]:
    ids = [new_task_id() for _ in params]
    await store.run_many(
        [store.ops.create(i, key, encode_json(p), timeout_ms=60_000)
         for i, p in zip(ids, params, strict=True)]
    )  # fmt: skip
    return ids


async def run_worker(store: Store, handler: HttpHandler, config: Config | None = None) -> None:
    http = make_http_client()
    entry = HandlerEntry(key=handler.key, handler=handler, provider=handler.key)
    try:
        worker = Worker(store, {handler.key: entry}, config or make_config(), http=http)
        with anyio.fail_after(30):
            await worker.run_until_idle()
    finally:
        await http.aclose()


async def run_tasks(
    store: Store, handler: HttpHandler, params: list[Any], config: Config | None = None
) -> list[Task]:
    ids = await create(store, handler.key, params)
    try:
        await run_worker(store, handler, config)
    finally:
        await handler.aclose()
    tasks = [await store.get(i) for i in ids]
    assert all(t is not None for t in tasks)
    return [t for t in tasks if t is not None]


async def run_one(store: Store, handler: HttpHandler, config: Config | None = None) -> Task:
    [task] = await run_tasks(store, handler, [{"doc": "a.pdf"}], config)
    return task


def error_of(task: Task) -> tuple[str, str]:
    assert task.error is not None, task
    return task.error.code, task.error.message


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def vendor() -> AsyncIterator[tuple[Scripted, str]]:
    script = Scripted()
    async with serve(script.app()) as url:
        yield script, url


def load_example(name: str, base_url: str, **option_changes: Any) -> HttpHandler:
    """Build an example exactly as shipped (checked by parse_config and load_handlers),
    pointed at a local fake."""
    text = (EXAMPLES / name).read_text()
    config = parse_config(text, name)
    [hc] = config.handlers
    load_handlers([hc], entry_points=False, builders=builders(config.handlers, text=text))
    options = merge(hc.options, {"base_url": base_url, **option_changes})
    return build(msgspec.structs.replace(hc, options=options))


# ---- the examples against their vendors' fakes --------------------------------------------------


@pytest.fixture
async def openai(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[OpenAIBatches, str]]:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-openai-0123456789")
    fake = OpenAIBatches(api_key="sk-test-openai-0123456789", polls_to_done=3)
    async with serve(fake.app()) as url:
        yield fake, url


@pytest.fixture
async def replicate(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[tuple[ReplicatePredictions, str]]:
    monkeypatch.setenv("REPLICATE_API_TOKEN", "r8_test_token_0123456789")
    fake = ReplicatePredictions(token="r8_test_token_0123456789", polls_to_done=3)
    async with fake.serving() as url:  # the API, and its file host on another origin
        yield fake, url


BATCH = {"endpoint": "/v1/chat/completions", "requests": requests_for("r1", "r2", "r3", "r4")}
# The fakes serve files on 127.0.0.1, which finalize refuses unless told: opt in, visibly.
LOOPBACK_FAKE: dict[str, Any] = {"hosts": ["127.0.0.1"], "allow_private_addresses": True}


async def test_openai_example_succeeds_with_metadata_and_counts(
    store: Store, openai: tuple[OpenAIBatches, str]
) -> None:
    fake, url = openai
    tasks = await run_tasks(store, load_example("openai-batch.toml", url), [BATCH, BATCH])
    assert [t.status for t in tasks] == [Status.SUCCEEDED] * 2
    for task in tasks:
        batch = fake.batches[task.external_id or ""].obj
        assert batch["metadata"] == {
            "asynctaskd_task_id": task.id,
            "asynctaskd_submit": f"{task.id}/1",  # the first submit of the task
        }
        assert task.result == {
            "output_file_id": f"file-out-{batch['id']}", "error_file_id": None,
            "request_counts": {"total": 4, "completed": 4, "failed": 0},
        }  # fmt: skip
        assert task.poll_count == 3
    assert sum(1 for m, p in fake.requests if m == "POST" and p == "/v1/batches") == 2


async def test_openai_example_reports_progress_while_running(
    openai: tuple[OpenAIBatches, str],
) -> None:
    _, url = openai
    handler = load_example("openai-batch.toml", url)
    async with make_http_client() as http:
        ctx = ctx_for(http)
        try:
            submitted = await handler.submit(BATCH, ctx)
            first = await handler.query({"external_id": submitted.external_id}, ctx)
            second = await handler.query({"external_id": submitted.external_id}, ctx)
        finally:
            await handler.aclose()  # the example sets concurrency: the handler has a client
    assert first == Running(progress=0.25, stage="in_progress")
    assert second == Running(progress=1.0, stage="finalizing")


async def test_openai_example_failed_and_expired_batches(
    store: Store, openai: tuple[OpenAIBatches, str]
) -> None:
    fake, url = openai
    # The example's documented variant for a file uploaded beforehand (no upload step, the
    # file id in the params), with a line that is not JSON: the batch fails validating.
    file_id = fake.upload(b'{"custom_id": "r1"}\nnot json\n')
    body = {"input_file_id": "{params.input_file_id}", "endpoint": "{params.endpoint}",
            "completion_window": "24h"}  # fmt: skip
    handler = load_example("openai-batch.toml", url, submit={"before": [], "body": Whole(body)})
    [failed] = await run_tasks(store, handler, [{**BATCH, "input_file_id": file_id}])
    assert failed.status is Status.FAILED
    assert error_of(failed) == ("invalid_json_line", "Line 2 is not valid JSON.")
    # nothing ran, and the result says so: the ids and counts are kept for every end
    assert failed.result == {
        "output_file_id": None,
        "error_file_id": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
    }
    params = [{**BATCH, "requests": requests_for("expire-1", "r2", "r3", "r4")}]
    [expired] = await run_tasks(store, load_example("openai-batch.toml", url), params)
    assert expired.status is Status.FAILED
    assert error_of(expired)[0] == "expired"
    assert expired.progress == 0.5
    assert expired.stage == "in_progress"
    # the half it completed was billed: its files are kept with the failed task
    assert expired.result is not None
    assert expired.result["output_file_id"] == f"file-out-{expired.external_id}"
    assert expired.result["error_file_id"] == f"file-err-{expired.external_id}"
    assert (
        expired.result["request_counts"]["completed"]
        == expired.result["request_counts"]["total"] // 2
    )


async def test_openai_example_refusals_fail_for_good(
    store: Store, openai: tuple[OpenAIBatches, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = openai
    [bad] = await run_tasks(store, load_example("openai-batch.toml", url),
                            [{**BATCH, "endpoint": "/v1/nope"}])  # fmt: skip
    assert bad.status is Status.FAILED
    assert error_of(bad)[0] == "HTTP_400"
    assert "Invalid value" in error_of(bad)[1]
    monkeypatch.setenv("OPENAI_API_KEY", "sk-wrong-key-9999")
    [denied] = await run_tasks(store, load_example("openai-batch.toml", url), [BATCH])
    assert denied.status is Status.FAILED
    assert error_of(denied)[0] == "HTTP_401"
    assert "sk-wrong-key-9999" not in error_of(denied)[1]


async def cancel_mid_flight(store: Store, handler: HttpHandler, params: Any,
                            polled: Any) -> Task:  # fmt: skip
    [tid] = await create(store, handler.key, [params])
    http = make_http_client()
    entry = {handler.key: HandlerEntry(key=handler.key, handler=handler, provider=handler.key)}
    try:
        async with anyio.create_task_group() as tg:
            worker = Worker(store, entry, make_config(), http=http)
            tg.start_soon(worker.run_until_idle)
            with anyio.fail_after(10):
                await wait_until(polled, "the vendor to be polled")
                await store.cancel(tid)
    finally:
        await http.aclose()
        await handler.aclose()
    task = await store.get(tid)
    assert task is not None
    return task


async def test_openai_example_cancel(store: Store, openai: tuple[OpenAIBatches, str]) -> None:
    fake, url = openai
    fake.polls_to_done = 10_000

    async def polled() -> bool:
        return any(m == "GET" for m, _ in fake.requests)

    task = await cancel_mid_flight(store, load_example("openai-batch.toml", url), BATCH, polled)
    assert task.status is Status.CANCELED
    assert fake.cancels == [task.external_id]
    assert fake.batches[task.external_id or ""].obj["status"] == "cancelling"


async def test_openai_example_finalize_downloads_output_files(
    store: Store, openai: tuple[OpenAIBatches, str], tmp_path: Path
) -> None:
    _, url = openai
    finalize = {"files": ["/output_file_id", "/error_file_id"], "dir": str(tmp_path),
                "download": "{base_url}/v1/files/{value}/content",
                **LOOPBACK_FAKE}  # fmt: skip
    handler = load_example("openai-batch.toml", url, finalize=finalize)
    [task] = await run_tasks(store, handler, [BATCH])
    assert task.status is Status.SUCCEEDED
    path = Path(task.result["output_file_id"])
    assert path.parent == tmp_path
    assert path.name.startswith(f"{task.id}-0")
    content = await anyio.Path(path).read_bytes()
    assert content.count(b"\n") == 4  # the JSONL output, fetched with the API key
    assert task.result["error_file_id"] is None


async def run_replicate(store: Store, url: str, results: Path, model_input: Any) -> Task:
    """One prediction through the Replicate example, its outputs finalized to `results`."""
    handler = load_example("replicate-predictions.toml", url,
                           finalize={"dir": str(results), **LOOPBACK_FAKE})  # fmt: skip
    params = {"version": "5c7d5dc6dd8bf75c1acaa8565735e7986bc5b66206b55cca93cb72c9bf15ccaa",
              "input": model_input}  # fmt: skip
    [task] = await run_tasks(store, handler, [params])
    return task


async def test_replicate_example_succeeds_and_copies_outputs(
    store: Store, replicate: tuple[ReplicatePredictions, str], tmp_path: Path
) -> None:
    fake, url = replicate
    task = await run_replicate(store, url, tmp_path, {"text": "Alice", "steps": 4})
    assert task.status is Status.SUCCEEDED, task.error
    assert task.result == [str(tmp_path / f"{task.id}-0.png"), str(tmp_path / f"{task.id}-1.png")]
    assert [await anyio.Path(p).read_bytes() for p in task.result] == [PNG, PNG]
    prediction = fake.predictions[task.external_id or ""].obj
    assert prediction["input"] == {"text": "Alice", "steps": 4}  # the object kept its type
    assert len(fake.downloads) == 2
    # the file host is another origin than the API: the token never goes there
    assert fake.download_auth == [None, None]


async def test_finalize_copies_urls_anywhere_in_an_object_output(
    store: Store, replicate: tuple[ReplicatePredictions, str], tmp_path: Path
) -> None:
    fake, url = replicate
    task = await run_replicate(store, url, tmp_path, {"text": "Alice", "named_outputs": True})
    assert task.status is Status.SUCCEEDED, task.error
    assert task.result == {
        "image": str(tmp_path / f"{task.id}-0.png"),
        "extra": {"mask": str(tmp_path / f"{task.id}-1.png")},
        "seed": 42,  # not a URL: left as it was
    }
    assert len(fake.downloads) == 2


async def test_a_replicate_prediction_polled_after_its_data_was_removed_fails(
    store: Store, replicate: tuple[ReplicatePredictions, str], tmp_path: Path
) -> None:
    _, url = replicate
    task = await run_replicate(store, url, tmp_path, {"text": "Alice", "removed": True})
    assert task.status is Status.FAILED and task.result is None
    assert task.error is not None and task.error.code == "RESULT_REMOVED"


async def test_replicate_example_reports_stage(
    replicate: tuple[ReplicatePredictions, str],
) -> None:
    _, url = replicate
    handler = load_example("replicate-predictions.toml", url)
    async with make_http_client() as http:
        ctx = ctx_for(http)
        try:
            submitted = await handler.submit({"version": "v1", "input": {}}, ctx)
            running = await handler.query({"external_id": submitted.external_id}, ctx)
        finally:
            await handler.aclose()
    assert running == Running(stage="processing")


async def test_replicate_example_failure_refusal_and_cancel(
    store: Store, replicate: tuple[ReplicatePredictions, str], tmp_path: Path
) -> None:
    fake, url = replicate
    handler = load_example("replicate-predictions.toml", url, finalize={"dir": str(tmp_path)})
    failed, refused = await run_tasks(
        store, handler, [{"version": "v1", "input": {"fail": True}}, {"input": {}}]
    )
    assert failed.status is Status.FAILED
    assert error_of(failed) == ("failed", "CUDA out of memory")
    assert refused.status is Status.FAILED
    assert error_of(refused)[0] == "MISSING_VALUE"
    fake.polls_to_done = 10_000
    fake.requests.clear()

    async def polled() -> bool:
        return any(m == "GET" for m, _ in fake.requests)

    handler = load_example("replicate-predictions.toml", url, finalize={"dir": str(tmp_path)})
    task = await cancel_mid_flight(store, handler, {"version": "v1", "input": {}}, polled)
    assert task.status is Status.CANCELED
    assert fake.cancels == [task.external_id]
    assert fake.predictions[task.external_id or ""].obj["status"] == "canceled"


async def test_replicate_example_422_fails_for_good(
    store: Store, replicate: tuple[ReplicatePredictions, str]
) -> None:
    _, url = replicate
    # A version that is not a string passes templating but not Replicate's validation.
    [task] = await run_tasks(store, load_example("replicate-predictions.toml", url),
                             [{"version": 7, "input": {}}])  # fmt: skip
    assert task.status is Status.FAILED
    assert error_of(task)[0] == "HTTP_422"
    assert "Input validation failed" in error_of(task)[1]


# ---- every HTTP error class, produced by a real server, mapped to its outcome ---------------


async def test_submit_400_fails(store: Store, vendor: tuple[Scripted, str]) -> None:
    script, url = vendor
    script.submit = [status(400, text="bad document")]
    task = await run_one(store, handler_for(scripted_options(url)))
    assert task.status is Status.FAILED
    code, message = error_of(task)
    assert code == "HTTP_400"
    assert "bad document" in message


async def test_submit_reset_after_request_is_ambiguous(
    store: Store, vendor: tuple[Scripted, str]
) -> None:
    script, url = vendor
    script.submit = [reset()]
    task = await run_one(store, handler_for(scripted_options(url)))
    assert task.status is Status.SUBMIT_UNKNOWN
    assert "may have reached the vendor" in error_of(task)[1]
    assert len(script.calls("POST", "/jobs")) == 1  # parked, never resent


async def test_submit_reset_with_idempotent_handler_resends_same_key(
    store: Store, vendor: tuple[Scripted, str]
) -> None:
    script, url = vendor
    script.submit = [reset(), json({"id": "job-9"}, 201)]
    task = await run_one(store, handler_for(scripted_options(url, idempotent=True)))
    assert task.status is Status.SUCCEEDED
    assert task.external_id == "job-9"
    keys = [r.headers["Idempotency-Key"] for r in script.calls("POST", "/jobs")]
    assert keys == [task.id, task.id]


async def test_submit_slow_beyond_read_timeout_is_ambiguous(
    store: Store, vendor: tuple[Scripted, str]
) -> None:
    script, url = vendor
    script.submit = [slow(1.0, json({"id": "late"}, 201))]
    task = await run_one(store, handler_for(scripted_options(url)))
    assert task.status is Status.SUBMIT_UNKNOWN
    assert error_of(task)[0] == "READ_TIMEOUT"


async def test_submit_total_timeout_is_ambiguous(
    store: Store, vendor: tuple[Scripted, str]
) -> None:
    script, url = vendor
    script.submit = [slow(1.0, json({"id": "late"}, 201))]
    timeouts = {"connect": "1s", "read": "10s", "total": "200ms"}
    task = await run_one(store, handler_for(scripted_options(url, timeouts=timeouts)))
    assert task.status is Status.SUBMIT_UNKNOWN
    assert error_of(task)[0] == "TOTAL_TIMEOUT"


async def test_connect_refused_is_never_sent_then_exhausted(store: Store) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    task = await run_one(store, handler_for(scripted_options(url)),
                         make_config(max_submit_retries=2))  # fmt: skip
    assert task.status is Status.FAILED
    code, message = error_of(task)
    assert code == "SUBMIT_RETRIES_EXHAUSTED"
    assert "never sent" in message
    assert task.submit_attempts == 3


async def test_submit_429_retry_after_is_honoured_then_succeeds(
    store: Store, vendor: tuple[Scripted, str]
) -> None:
    script, url = vendor
    script.submit = [status(429, {"Retry-After": "1"}), json({"id": "job-1"}, 201)]
    task = await run_one(store, handler_for(scripted_options(url)),
                         make_config(max_submit_retries=0, max_error_delay="2s"))  # fmt: skip
    assert task.status is Status.SUCCEEDED
    first, second = script.calls("POST", "/jobs")
    assert second.at - first.at >= 0.95


@pytest.mark.parametrize("phase", ["submit", "query"])
async def test_throttles_in_a_row_wait_longer_each_time_and_a_success_resets_them(
    store: Store, vendor: tuple[Scripted, str], phase: str
) -> None:
    """No Retry-After: each 429 in a row waits twice as long as the one before (here 0.1,
    0.2, 0.4 s, no jitter), instead of first_error_delay every time."""
    script, url = vendor
    throttled = [status(429), status(429), status(429)]
    if phase == "submit":
        script.submit = [*throttled, json({"id": "job-1"}, 201)]
    else:
        script.query = [*throttled, json({"status": "done", "output": {"ok": 1}})]
    config = make_config(first_error_delay="100ms", max_error_delay="5s", poll_interval="20ms")
    task = await run_one(store, handler_for(scripted_options(url)), config)
    assert task.status is Status.SUCCEEDED and task.throttles == 0
    calls = script.calls("POST", "/jobs") if phase == "submit" else script.calls("GET", "/jobs/")
    gaps = [b.at - a.at for a, b in itertools.pairwise(calls[:4])]
    # each wait is at least its doubled delay (a loaded host only adds lateness, which a
    # ratio of measured gaps would not survive); without doubling the third is ~0.1 s
    assert gaps[0] >= 0.09 and gaps[1] >= 0.19 and gaps[2] >= 0.38, gaps


async def test_a_rate_limit_reset_header_and_retry_after_ms_are_honoured(
    store: Store, vendor: tuple[Scripted, str]
) -> None:
    script, url = vendor
    script.submit = [
        status(429, {"x-ratelimit-reset-requests": "1s", "retry-after-ms": "200"}),
        json({"id": "job-1"}, 201),
    ]
    options = scripted_options(url, errors={"reset_headers": ["x-ratelimit-reset-requests"]})
    task = await run_one(store, handler_for(options), make_config(max_error_delay="5s"))
    assert task.status is Status.SUCCEEDED
    first, second = script.calls("POST", "/jobs")
    assert second.at - first.at >= 0.95  # the longest of the two


def test_throttle_waits_read_every_header_style() -> None:
    assert parse_reset("6m0s") == 360.0
    assert parse_reset("1.5s") == 1.5
    assert parse_reset("20ms") == pytest.approx(0.02)
    assert parse_reset("1h2m") == 3720.0
    assert parse_reset("12") == 12.0
    for bad in ("soon", "5x", "1s2", "", "-1s", None):
        assert parse_reset(bad) is None, bad
    headers = {"retry-after-ms": "2500", "retry-after": "1", "x-reset": "3s"}
    assert throttle_wait(headers.get) == 2.5
    assert throttle_wait(headers.get, ("x-reset",)) == 3.0
    assert throttle_wait({}.get) is None


async def test_a_429_that_is_no_rate_limit_fails_the_task_at_once(
    store: Store, vendor: tuple[Scripted, str]
) -> None:
    """OpenAI answers 429 insufficient_quota when the account is out of credit: waiting
    does not help, and retrying until the deadline only delays the bad news."""
    script, url = vendor
    body = {"error": {"code": "insufficient_quota", "message": "check your plan"}}
    script.submit = [json(body, 429), json({"id": "job-1"}, 201)]
    options = scripted_options(url, errors={"permanent_codes": ["insufficient_quota"]})
    task = await run_one(store, handler_for(options), make_config(max_error_delay="5s"))
    assert task.status is Status.FAILED
    assert task.error is not None and task.error.code == "INSUFFICIENT_QUOTA"
    assert len(script.calls("POST", "/jobs")) == 1
    with pytest.raises(ConfigError, match=r"errors\.code_pointer"):
        handler_for(scripted_options(url, errors={"code_pointer": "error.code"}))


@pytest.mark.parametrize("phase", ["submit", "query"])
async def test_a_huge_retry_after_is_clamped_and_the_task_stays_readable(
    store: Store, vendor: tuple[Scripted, str], redis_client: redis.asyncio.Redis, phase: str
) -> None:
    # Stored as due_ms 1.0e+17 it made the task unreadable (CorruptTask) and unlisted.
    script, url = vendor
    throttled = status(429, {"Retry-After": "100000000000000"})
    if phase == "submit":
        script.submit = [throttled, json({"id": "job-1"}, 201)]
    else:
        script.query = [throttled, json({"status": "done", "output": {"ok": True}})]
    task = await run_one(store, handler_for(scripted_options(url)),
                         make_config(max_submit_retries=0, max_error_delay="100ms"))  # fmt: skip
    assert task.status is Status.SUCCEEDED
    first, second = (
        script.calls("POST", "/jobs") if phase == "submit" else script.calls("GET", "/jobs/")
    )
    assert 0.09 <= second.at - first.at < 5  # max_error_delay, not 3 million years
    page = await AsyncClient(redis_client).list()
    assert [t.id for t in page.tasks] == [task.id]


async def test_submit_503_with_retry_after_date_throttles(
    store: Store, vendor: tuple[Scripted, str]
) -> None:
    script, url = vendor
    date = email.utils.formatdate(time.time(), usegmt=True)
    script.submit = [status(503, {"Retry-After": date}), json({"id": "job-1"}, 201)]
    task = await run_one(store, handler_for(scripted_options(url)),
                         make_config(max_submit_retries=0))  # fmt: skip
    assert task.status is Status.SUCCEEDED  # neither parked (ambiguous) nor failed


async def test_submit_500_is_ambiguous_unless_idempotent(
    store: Store, vendor: tuple[Scripted, str]
) -> None:
    script, url = vendor
    script.submit = [status(500)]
    task = await run_one(store, handler_for(scripted_options(url)))
    assert task.status is Status.SUBMIT_UNKNOWN
    assert error_of(task)[0] == "HTTP_500"
    script.submit = [status(502), json({"id": "job-2"}, 201)]
    task = await run_one(store, handler_for(scripted_options(url, idempotent=True)))
    assert task.status is Status.SUCCEEDED


@pytest.mark.parametrize(
    ("answer", "found"),
    [
        (garbage(b"<html><body>" + b"x" * 500 + b"</body></html>"), "not JSON"),
        (json({"job": {"id": "j"}}, 201), "found nothing"),
        (json({"id": {"nested": 1}}, 201), "found dict"),
        (json({"id": True}, 201), "found bool"),
        (json(["j-1"], 201), "found nothing"),
    ],
    ids=["html", "missing-id", "object-id", "bool-id", "list-body"],
)
async def test_submit_vendor_garbage_is_ambiguous_and_quoted(
    store: Store, vendor: tuple[Scripted, str], answer: Any, found: str
) -> None:
    script, url = vendor
    script.submit = [answer]
    task = await run_one(store, handler_for(scripted_options(url)))
    assert task.status is Status.SUBMIT_UNKNOWN
    code, message = error_of(task)
    assert code == "VENDOR_GARBAGE"
    assert found in message
    if "html" in message:
        excerpt = message.split("body: ", 1)[1]
        assert excerpt.startswith("'<html><body>xxx")
        assert len(excerpt) <= 200 + 5


async def test_submit_garbage_with_4xx_status_is_still_permanent(
    store: Store, vendor: tuple[Scripted, str]
) -> None:
    script, url = vendor
    script.submit = [garbage(b"<h1>Forbidden</h1>", 403)]
    task = await run_one(store, handler_for(scripted_options(url)))
    assert task.status is Status.FAILED
    assert error_of(task)[0] == "HTTP_403"


async def test_query_5xx_are_retried_and_reset_on_success(
    store: Store, vendor: tuple[Scripted, str]
) -> None:
    script, url = vendor
    script.query = [status(500), status(502), json({"status": "running"}), status(500),
                    json({"status": "done", "output": {"text": "ok"}})]  # fmt: skip
    task = await run_one(store, handler_for(scripted_options(url)),
                         make_config(max_consecutive_errors=3))  # fmt: skip
    assert task.status is Status.SUCCEEDED
    assert task.result == {"text": "ok"}


async def test_query_errors_spend_the_budget(store: Store, vendor: tuple[Scripted, str]) -> None:
    script, url = vendor
    script.query = [status(500)]
    task = await run_one(store, handler_for(scripted_options(url)),
                         make_config(max_consecutive_errors=3))  # fmt: skip
    assert task.status is Status.FAILED
    code, message = error_of(task)
    assert code == "QUERY_ERRORS"
    assert "HTTP_500" in message
    assert len(script.calls("GET", "/jobs/")) == 3


async def test_query_429_does_not_spend_the_budget(
    store: Store, vendor: tuple[Scripted, str]
) -> None:
    script, url = vendor
    script.query = [status(429, {"Retry-After": "0"})] * 4 + [json({"status": "done"})]
    task = await run_one(store, handler_for(scripted_options(url)),
                         make_config(max_consecutive_errors=2))  # fmt: skip
    assert task.status is Status.SUCCEEDED


@pytest.mark.parametrize(
    "answer",
    [garbage(b"Service Unavailable"), json({"status": 2.5}), json({"status": None}),
     json({"state": "done"}), json([{"status": "done"}])],
    ids=["text", "float-status", "null-status", "missing-status", "list-body"],
)  # fmt: skip
async def test_query_vendor_garbage_spends_the_budget(
    store: Store, vendor: tuple[Scripted, str], answer: Any
) -> None:
    script, url = vendor
    script.query = [answer]
    task = await run_one(store, handler_for(scripted_options(url)),
                         make_config(max_consecutive_errors=2))  # fmt: skip
    assert task.status is Status.FAILED
    code, message = error_of(task)
    assert code == "QUERY_ERRORS"
    assert "VENDOR_GARBAGE" in message


async def test_query_slow_answer_is_retried(store: Store, vendor: tuple[Scripted, str]) -> None:
    script, url = vendor
    script.query = [slow(1.0, json({"status": "done"})), json({"status": "done"})]
    task = await run_one(store, handler_for(scripted_options(url)))
    assert task.status is Status.SUCCEEDED
    assert len(script.calls("GET", "/jobs/")) == 2


async def test_query_404_fails_for_good(store: Store, vendor: tuple[Scripted, str]) -> None:
    script, url = vendor
    script.query = [json({"error": "no such job"}, 404)]
    task = await run_one(store, handler_for(scripted_options(url)))
    assert task.status is Status.FAILED
    assert error_of(task)[0] == "HTTP_404"


async def test_configured_statuses_override_the_defaults(
    store: Store, vendor: tuple[Scripted, str]
) -> None:
    script, url = vendor
    script.submit = [status(409), json({"id": "j"}, 201)]
    script.query = [status(500)]
    options = scripted_options(url, idempotent=True,
                               errors={"permanent": [500], "retryable": [409]})  # fmt: skip
    task = await run_one(store, handler_for(options))
    assert task.status is Status.FAILED
    assert error_of(task)[0] == "HTTP_500"
    assert len(script.calls("POST", "/jobs")) == 2


async def test_progress_stage_and_vendor_failure(
    store: Store, vendor: tuple[Scripted, str]
) -> None:
    script, url = vendor
    script.query = [
        json({"status": "running", "progress": 25, "phase": "ocr", "note": "page 1"}),
        json({"status": "error", "error": {"code": "bad_pdf", "message": "page 2 is empty"}}),
    ]
    options = scripted_options(url, query={"progress_scale": 100, "stage": "/phase",
                                           "message": "/note"})  # fmt: skip
    task = await run_one(store, handler_for(options))
    assert task.status is Status.FAILED
    assert error_of(task) == ("bad_pdf", "page 2 is empty")
    assert (task.progress, task.stage, task.message) == (0.25, "ocr", "page 1")


@pytest.mark.parametrize(
    ("unknown", "expected", "code"),
    [("running", Status.SUCCEEDED, None), ("error", Status.FAILED, "QUERY_ERRORS"),
     ("failed", Status.FAILED, "UNKNOWN_STATUS")],
)  # fmt: skip
async def test_unmapped_vendor_status(
    store: Store, vendor: tuple[Scripted, str], unknown: str, expected: Status, code: str | None
) -> None:
    script, url = vendor
    script.query = [json({"status": "warming-up"})] * 3 + [json({"status": "done"})]
    handler = handler_for(scripted_options(url, query={"unknown": unknown}))
    task = await run_one(store, handler, make_config(max_consecutive_errors=2))
    assert task.status is expected
    assert (task.error.code if task.error else None) == code


async def test_own_client_sized_by_concurrency(vendor: tuple[Scripted, str]) -> None:
    _, url = vendor
    handler = handler_for(scripted_options(url), concurrency=4)
    async with make_http_client() as shared:
        ctx = ctx_for(shared)
        submitted = await handler.submit({"a": 1}, ctx)
        assert handler._http is not None
        assert handler._http is not shared
        own = handler._http
        await handler.aclose()
        assert vars(handler)["_http"] is None  # (vars: mypy still narrows the attribute)
        assert own.is_closed
    assert submitted.external_id == "job-1"
    shared_only = handler_for(scripted_options(url))
    async with make_http_client() as shared:
        await shared_only.submit({"a": 1}, ctx_for(shared))
        assert shared_only._http is None


# ---- templates, handle fields, pointers ----------------------------------------------------------


async def test_templates_keep_json_types_and_never_expand_params(
    vendor: tuple[Scripted, str],
) -> None:
    script, url = vendor
    script.submit = [json({"id": 42, "meta": {"region": "eu west"}}, 201)]
    script.query = [json({"status": "done", "output": [1, 2]})]
    body = {"n": "{params.n}", "text": "n={params.n}!", "obj": "{params.o}",
            "first": "{params.o.items.0}", "opt": "{params.missing?}",
            "list": ["{params.n}", "{params.missing?}"], "braces": "{{literal}}",
            "raw": "{params.tpl}", "task": "{task_id}"}  # fmt: skip
    options = scripted_options(
        url,
        submit={"url": "{base_url}/jobs?q={params.q}", "body": body,
                "handle": {"region": "/meta/region"}},
        query={"url": "{base_url}/jobs/{external_id}?region={handle.region}"},
    )  # fmt: skip
    handler = handler_for(options)
    params = {"n": 3, "o": {"items": ["a", "b"]}, "tpl": "{env:HOME}", "q": "a b/c"}
    async with make_http_client() as http:
        ctx = ctx_for(http, "t-1")
        submitted = await handler.submit(params, ctx)
        handle = {"external_id": submitted.external_id, **submitted.query}
        assert (await handler.query(handle, ctx)).result == [1, 2]  # type: ignore[union-attr]
    assert submitted.external_id == "42"
    assert submitted.query == {"region": "eu west"}
    [sent] = script.calls("POST", "/jobs")
    assert sent.path == "/jobs?q=a%20b%2Fc"
    assert sent.headers["Content-Type"] == "application/json"
    assert msgspec.json.decode(sent.body) == {
        "n": 3, "text": "n=3!", "obj": {"items": ["a", "b"]}, "first": "a",
        "list": [3, None], "braces": "{literal}", "raw": "{env:HOME}", "task": "t-1",
        "input": params,  # the default body of scripted_options: the whole params
    }  # fmt: skip
    [polled] = script.calls("GET", "/jobs/")
    assert polled.path == "/jobs/42?region=eu%20west"


async def test_missing_param_fails_the_task_without_a_call(vendor: tuple[Scripted, str]) -> None:
    script, url = vendor
    handler = handler_for(scripted_options(url, submit={"body": {"doc": "{params.doc}"}}))
    async with make_http_client() as http:
        with pytest.raises(PermanentError, match=r"\{params\.doc\} has no value") as info:
            await handler.submit({"other": 1}, ctx_for(http))
    assert info.value.code == "MISSING_VALUE"
    assert script.seen == []


def test_parse_retry_after() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("120", now) == 120.0
    assert parse_retry_after(" 1.5 ", now) == 1.5
    assert parse_retry_after(email.utils.formatdate(now + 30, usegmt=True), now) == 30.0
    assert parse_retry_after(email.utils.formatdate(now - 30, usegmt=True), now) == 0.0
    assert parse_retry_after("soon", now) is None
    assert parse_retry_after("-5", now) is None
    assert parse_retry_after(None, now) is None


# ---- finalize ------------------------------------------------------------------------------------


async def test_finalize_puts_files_and_keeps_vendor_credentials_home(
    store: Store, vendor: tuple[Scripted, str], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:  # fmt: skip
    script, url = vendor
    files = Scripted(files=[status(500), garbage(b'{"rows": 3}', content_type="application/json")])
    (tmp_path / "store.key").write_text("store-secret-123\n")
    monkeypatch.setenv("VENDOR_TOKEN", "vendor-secret-456")
    async with serve(files.app()) as files_url:
        output = {"data": f"{files_url}/files/out.json", "n": 1}
        script.query = [json({"status": "done", "output": output})]
        store_auth = "Bearer {file:" + str(tmp_path / "store.key") + "}"
        options = scripted_options(
            url,
            headers={"Authorization": "Bearer {env:VENDOR_TOKEN}"},
            finalize={"files": ["/data"], "put": files_url + "/store/{task_id}/{name}",
                      "headers": {"Authorization": store_auth}, **LOOPBACK_FAKE},
        )  # fmt: skip
        task = await run_one(store, handler_for(options))
    assert task.status is Status.SUCCEEDED
    target = f"{files_url}/store/{task.id}/{task.id}-0.json"
    assert task.result == {"data": target, "n": 1}
    downloads = files.calls("GET", "/files/")
    assert len(downloads) == 2  # one 500, retried inside the same finalize
    assert all("Authorization" not in d.headers for d in downloads)  # not the vendor's host
    [put] = files.calls("PUT", "/store/")
    assert put.path == f"/store/{task.id}/{task.id}-0.json"
    assert put.body == b'{"rows": 3}'
    assert put.headers["Authorization"] == "Bearer store-secret-123"
    assert put.headers["Content-Type"] == "application/json"
    assert script.calls("GET", "/jobs/")[0].headers["Authorization"] == "Bearer vendor-secret-456"


async def test_finalize_failure_keeps_the_task_running_until_a_copy_lands(
    store: Store, vendor: tuple[Scripted, str], tmp_path: Path
) -> None:
    script, url = vendor
    script.files = [status(503)] * 2 + [garbage(b"%PDF-1.7 ...", content_type="application/pdf")]
    script.query = [json({"status": "done", "output": {"pdf": f"{url}/files/doc"}})]
    options = scripted_options(url, finalize={"files": ["/pdf"], "dir": str(tmp_path),
                                              "attempts": 2, **LOOPBACK_FAKE})  # fmt: skip
    handler = handler_for(options)
    async with make_http_client() as http:
        with pytest.raises(RetryableError, match="failed 2 times") as info:
            await handler.finalize({"pdf": f"{url}/files/doc"}, ctx_for(http))
    assert info.value.code == "FINALIZE_FAILED"
    assert not info.value.throttled
    script.files = [status(503)] * 2 + [garbage(b"%PDF-1.7 ...", content_type="application/pdf")]
    task = await run_one(store, handler)
    assert task.status is Status.SUCCEEDED
    assert len(script.calls("GET", "/jobs/")) == 2  # the first finalize failed: polled again
    path = Path(task.result["pdf"])
    assert path == tmp_path / f"{task.id}-0.pdf"
    assert await anyio.Path(path).read_bytes() == b"%PDF-1.7 ..."
    assert [p async for p in anyio.Path(tmp_path).glob(".*partial")] == []


def files_server() -> tuple[Scripted, Any]:
    """Another local server answering GET /files/...: a host that is not the vendor's."""
    files = Scripted(files=[garbage(b"%PDF-1.7 internal", content_type="application/pdf")])
    return files, serve(files.app())


@pytest.mark.parametrize(
    ("finalize", "why"),
    [
        ({}, "'127.0.0.1' is not among the hosts"),
        ({"hosts": ["example.com", "*.example.com"]}, "'127.0.0.1' is not among the hosts"),
        ({"hosts": ["127.0.0.1"]}, "127.0.0.1 is a loopback address"),
    ],
    ids=["no-hosts", "other-hosts", "loopback-not-allowed"],
)
async def test_finalize_downloads_only_from_declared_public_hosts(
    store: Store, vendor: tuple[Scripted, str], tmp_path: Path, finalize: dict[str, Any],
    why: str,
) -> None:  # fmt: skip
    # A vendor's result named an internal address, and finalize fetched it.
    script, url = vendor
    files, serving = files_server()
    async with serving as files_url:
        script.query = [json({"status": "done", "output": {"pdf": f"{files_url}/files/x.pdf"}})]
        options = scripted_options(
            url, finalize={"files": ["/pdf"], "dir": str(tmp_path), **finalize}
        )
        task = await run_one(store, handler_for(options))
    assert task.status is Status.FAILED
    code, message = error_of(task)
    assert code == "FINALIZE_REFUSED"
    assert why in message and "nothing was sent" in message
    assert files.seen == []
    assert [p async for p in anyio.Path(tmp_path).iterdir()] == []


async def test_a_file_host_echoing_a_credential_never_puts_it_in_the_task(
    vendor: tuple[Scripted, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the fuzz suite: the credential is read only when a request sends it, so a
    finalize in a process that had not sent one yet could not mask it in the text of a
    download error (aiohttp quotes a garbled status line): the vendor's file host answering
    the token verbatim put it into the task's error message."""
    secret = "echoed-secret-4f9Qz2Lm8Xw1"
    monkeypatch.setenv("ECHO_VENDOR_TOKEN", secret)
    _, url = vendor

    async def garbled(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(secret.encode() + b"\r\n\r\n")  # no status line: just the token
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(garbled, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    options = scripted_options(
        url,
        headers={"Authorization": "Bearer {env:ECHO_VENDOR_TOKEN}"},
        finalize={"files": ["/pdf"], "dir": str(tmp_path), **LOOPBACK_FAKE},
    )
    handler = handler_for(options)  # a fresh handler: nothing sent, nothing read yet
    async with server, httpx.AsyncClient() as http:
        with pytest.raises(RetryableError) as info:
            await handler.finalize({"pdf": f"http://127.0.0.1:{port}/x.pdf"}, ctx_for(http))
    assert secret not in str(info.value) and "***" in str(info.value)


@pytest.mark.parametrize(
    "address", ["169.254.169.254", "10.1.2.3", "[fd00::1]", "[::ffff:127.0.0.1]", "[fe80::1]"]
)
async def test_finalize_refuses_a_private_address_literal_without_connecting(
    vendor: tuple[Scripted, str], tmp_path: Path, address: str
) -> None:
    _, url = vendor
    options = scripted_options(url, finalize={"files": ["/f"], "dir": str(tmp_path),
                                              "hosts": [address]})  # fmt: skip
    handler = handler_for(options)
    async with make_http_client() as http:
        with anyio.fail_after(5), pytest.raises(PermanentError) as info:
            await handler.finalize({"f": f"http://{address}/latest/meta-data/"}, ctx_for(http))
    assert info.value.code == "FINALIZE_REFUSED"
    assert "finalize.allow_private_addresses is off" in info.value.message


async def test_finalize_refuses_a_declared_name_that_resolves_to_a_private_address(
    vendor: tuple[Scripted, str], tmp_path: Path
) -> None:
    # A public-looking name is only as public as the addresses it resolves to.
    _, url = vendor
    files, serving = files_server()
    async with serving as files_url, make_http_client() as http:
        name_url = files_url.replace("127.0.0.1", "localhost") + "/files/x.pdf"
        finalize = {"files": ["/f"], "dir": str(tmp_path), "hosts": ["localhost"]}
        handler = handler_for(scripted_options(url, finalize=finalize))
        with pytest.raises(PermanentError) as info:
            await handler.finalize({"f": name_url}, ctx_for(http))
        assert info.value.code == "FINALIZE_REFUSED"
        assert re.search(r"'localhost' resolves to (127\.0\.0\.1|::1), a loopback address",
                         info.value.message)  # fmt: skip
        assert files.seen == []
        # The same name, allowed to be private: then it is the address that decided.
        allowed = handler_for(
            scripted_options(url, finalize={**finalize, "allow_private_addresses": True})
        )
        copied = await allowed.finalize({"f": name_url}, ctx_for(http, "t-2"))
    assert copied == {"f": str(tmp_path / "t-2-0.pdf")}
    assert len(files.seen) == 1


async def test_finalize_sends_vendor_credentials_only_with_its_own_download_template(
    vendor: tuple[Scripted, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Any URL on the vendor's origin used to get the vendor's credentials: a result could
    # point them at any path of the vendor's API (and store what it answered).
    script, url = vendor
    monkeypatch.setenv("VENDOR_TOKEN", "vendor-secret-789")
    script.files = [garbage(b"file bytes", content_type="application/octet-stream")]
    headers = {"Authorization": "Bearer {env:VENDOR_TOKEN}"}
    finalize = {"files": ["/f"], "dir": str(tmp_path), **LOOPBACK_FAKE}
    async with make_http_client() as http:
        as_given = handler_for(scripted_options(url, headers=headers, finalize=finalize))
        await as_given.finalize({"f": f"{url}/files/a.bin"}, ctx_for(http, "t-1"))
        templated = handler_for(scripted_options(
            url, headers=headers, finalize={**finalize, "download": "{base_url}/files/{value}"}
        ))  # fmt: skip
        await templated.finalize({"f": "b.bin"}, ctx_for(http, "t-2"))
    first, second = script.calls("GET", "/files/")
    assert first.path == "/files/a.bin" and "Authorization" not in first.headers
    assert second.path == "/files/b.bin"
    assert second.headers["Authorization"] == "Bearer vendor-secret-789"


async def test_finalize_download_template_refuses_a_value_that_climbs(
    vendor: tuple[Scripted, str], tmp_path: Path
) -> None:
    script, url = vendor
    finalize = {"files": ["/f"], "dir": str(tmp_path), "download": "{base_url}/files/{value}",
                **LOOPBACK_FAKE}  # fmt: skip
    handler = handler_for(scripted_options(url, finalize=finalize))
    async with make_http_client() as http:
        with pytest.raises(PermanentError, match=r"\{value\} is or holds a dot segment") as info:
            await handler.finalize({"f": "../jobs/j-1"}, ctx_for(http))
    assert info.value.code == "UNSAFE_VALUE"
    assert script.seen == []


@pytest.mark.parametrize(
    ("finalize", "key", "message"),
    [
        ({"hosts": ["https://files.example.com"]}, "finalize.hosts[0]", "no scheme, port or path"),
        ({"hosts": ["ok.example.com", "a.example.com:8443"]}, "finalize.hosts[1]", "no scheme"),
        ({"hosts": ["*"]}, "finalize.hosts[0]", "expected a host name"),
        ({"hosts": ["127.1"]}, "finalize.hosts[0]", "or an IP address"),
        ({"allow_private_addresses": "yes"}, "finalize.allow_private_addresses", "bool"),
    ],
)
def test_finalize_host_options_are_checked(
    finalize: dict[str, Any], key: str, message: str
) -> None:
    options = scripted_options("http://127.0.0.1:9", finalize={"files": ["/f"], "dir": "/srv/out",
                                                               **finalize})  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(f"options.{key}: ")) as info:
        handler_for(options)
    assert message in str(info.value)


# ---- config errors: key path and line ----------------------------------------------------------

CONFIG = """\
[[handlers]]
key = "demo"
factory = "asynctaskd.devtools.demo:make_handler"
options = { base_url = "http://127.0.0.1:9" }

[[handlers]]
key = "ocr:acme"
type = "http"
[handlers.options]
base_url = "https://api.acme.example"
headers = { Authorization = "Bearer {env:ACME_TOKEN}" }
timeouts = { connect = "5s", read = "30s" }
[handlers.options.submit]
url = "{base_url}/v1/jobs"
body = { input = "{params.url}" }
id = "/id"
handle = { region = "/region" }
[handlers.options.query]
url = "{base_url}/v1/jobs/{external_id}"
status = "/status"
succeeded = ["done"]
failed = ["error"]
"""


@pytest.mark.parametrize(
    ("old", "new", "line", "key", "message"),
    [
        ('url = "{base_url}/v1/jobs/{external_id}"', 'url = "{base_url}/v1/jobs/{params.id}"',
         19, "query.url", "task params exist only in submit"),
        ('url = "{base_url}/v1/jobs/{external_id}"', 'url = "{base_url}/v1/{external_idd}"',
         19, "query.url", "did you mean {external_id}"),
        ('url = "{base_url}/v1/jobs/{external_id}"', 'url = "{base_url}/v1/{handle.zone}"',
         19, "query.url", "submit.handle has no 'zone'"),
        ('url = "{base_url}/v1/jobs/{external_id}"', 'url = "{base_url}/v1/{"',
         19, "query.url", "unclosed '{'"),
        ('body = { input = "{params.url}" }', 'body = { input = "{env:ACME_TOKEN}" }',
         15, "submit.body.input", "credentials may appear only in headers and base_url"),
        ('"Bearer {env:ACME_TOKEN}"', '"Bearer {env:ACME-TOKEN}"',
         11, "headers.Authorization", "expected an environment variable name"),
        ('read = "30s"', 'read = "soon"', 12, "timeouts.read", "got 'soon'"),
        ('read = "30s"', 'raed = "30s"', 12, "timeouts.raed", "did you mean 'read'"),
        ('id = "/id"', 'id = "id"', 16, "submit.id", "starts with '/'"),
        ('failed = ["error"]', 'failed = ["done"]', 22, "query.failed[0]", "already listed"),
        ('status = "/status"', 'state = "/status"', 20, "query.state", "unknown key"),
        ('url = "{base_url}/v1/jobs"', 'url = "/v1/jobs"', 14, "submit.url", "http(s)://"),
    ],
    ids=["params-in-query", "typo", "unknown-handle", "unclosed", "credential-in-body",
         "env-name", "duration", "unknown-key", "pointer", "overlap", "missing-key", "url"],
)  # fmt: skip
def test_config_errors_name_key_and_line(
    old: str, new: str, line: int, key: str, message: str
) -> None:
    assert old in CONFIG
    text = CONFIG.replace(old, new, 1)
    config = parse_config(text, "c.toml")
    with pytest.raises(ConfigError) as info:
        load_handlers(list(config.handlers), entry_points=False,
                      builders=builders(config.handlers, text=text, source="c.toml"))  # fmt: skip
    assert f"c.toml:{line}: handlers[1].options.{key}: " in str(info.value)
    assert message in str(info.value)


def test_config_errors_from_a_file_path(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(CONFIG.replace("/status", "status"))
    config = parse_config(path.read_text(), str(path))
    pattern = re.escape(f"{path}:20: handlers[1].options.query.status")
    with pytest.raises(ConfigError, match=pattern):
        load_handlers(list(config.handlers), entry_points=False,
                      builders=builders(config.handlers, path))  # fmt: skip
    with pytest.raises(ConfigError, match=r"handler 'ocr:acme': options\.query\.status"):
        build(config.handlers[1])  # no source: the key path alone


def test_every_example_builds() -> None:
    for path in sorted(EXAMPLES.glob("*.toml")):
        config = parse_config(path.read_text(), str(path))
        handlers = load_handlers(list(config.handlers), entry_points=False,
                                 builders=builders(config.handlers, path))  # fmt: skip
        assert handlers
        assert all(isinstance(e.handler, HttpHandler) for e in handlers.values())


# ---- credentials never leak ---------------------------------------------------------------------

SECRETS = ("env-secret-AAAA1111", "cred-secret-BBBB2222", "file-secret-CCCC3333")


async def redis_text(client: redis.asyncio.Redis) -> bytes:
    """Every key and every value in the database, concatenated."""
    r: Any = client  # redis-py's reply types are unions of bytes and str
    out: list[bytes] = []
    async for key in r.scan_iter(count=1000):
        out.append(key)
        kind = (await r.type(key)).decode()
        if kind == "string":
            out.append(await r.get(key) or b"")
        elif kind == "hash":
            out += [b for kv in (await r.hgetall(key)).items() for b in kv]
        elif kind == "list":
            out += await r.lrange(key, 0, -1)
        elif kind == "set":
            out += list(await r.smembers(key))
        elif kind == "zset":
            out += [m for m, _ in await r.zrange(key, 0, -1, withscores=True)]
        elif kind == "stream":
            for _, fields in await r.xrange(key):
                out += [b for kv in fields.items() for b in kv]
        else:
            raise AssertionError(f"unexpected key type {kind}")
    return b"\n".join(out)


async def test_secrets_never_reach_redis_logs_or_errors(
    store: Store, vendor: tuple[Scripted, str], redis_client: redis.asyncio.Redis,
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    script, url = vendor
    env_secret, cred_secret, file_secret = SECRETS
    monkeypatch.setenv("ACME_TOKEN", env_secret)
    (tmp_path / "creds").mkdir()
    (tmp_path / "creds" / "acme").write_text(cred_secret + "\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path / "creds"))
    (tmp_path / "sig").write_text(file_secret)
    options = scripted_options(url, headers={
        "Authorization": "Bearer {env:ACME_TOKEN}",
        "X-Api-Key": "{credential:acme}",
        "X-Signature": "sig={file:" + str(tmp_path / "sig") + "}",
    })  # fmt: skip
    caplog.set_level(logging.DEBUG)
    # 1: the vendor echoes the token in a refusal; 2: in a garbage submit answer;
    # 3: in garbage query answers until the error budget is spent; 4: all goes well.
    script.submit = [echo(400), echo(200, "X-Api-Key"), json({"id": "j3"}, 201),
                     json({"id": "j4"}, 201)]  # fmt: skip
    script.query = [echo(200, "X-Signature"), echo(200, "X-Signature"),
                    json({"status": "done", "output": {"ok": True}})]  # fmt: skip
    config = make_config(max_consecutive_errors=2)
    tasks = [await run_one(store, handler_for(options), config) for _ in range(4)]
    assert [t.status for t in tasks] == [Status.FAILED, Status.SUBMIT_UNKNOWN, Status.FAILED,
                                         Status.SUCCEEDED]  # fmt: skip
    for task in tasks[:3]:
        assert "***" in error_of(task)[1], error_of(task)
    sent = script.calls("POST", "/jobs")[0].headers
    assert sent["Authorization"] == f"Bearer {env_secret}"
    assert sent["X-Api-Key"] == cred_secret
    assert sent["X-Signature"] == f"sig={file_secret}"
    stored = await redis_text(redis_client)
    assert b"***" in stored  # the redacted messages are there...
    messages = " ".join(str(error_of(t)) for t in tasks[:3])
    for secret in SECRETS:
        assert secret.encode() not in stored  # ...and no secret
        assert secret not in caplog.text
        assert secret not in messages


async def test_missing_credential_is_never_sent(
    vendor: tuple[Scripted, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script, url = vendor
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    handler = handler_for(scripted_options(url, headers={"X-Api-Key": "{credential:acme}"}))
    async with make_http_client() as http:
        with pytest.raises(NotSent, match=r"CREDENTIALS_DIRECTORY is not set") as info:
            await handler.submit({}, ctx_for(http))
        with pytest.raises(RetryableError, match="CREDENTIALS_DIRECTORY") as query_info:
            await handler.query({"external_id": "j"}, ctx_for(http))
    assert info.value.code == "CREDENTIAL_MISSING"
    assert script.seen == []
    assert not isinstance(query_info.value, NotSent)


async def test_credentials_in_base_url_stay_out_of_httpx_logs(
    vendor: tuple[Scripted, str], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    script, url = vendor
    monkeypatch.setenv("URL_PASSWORD", "url-secret-DDDD4444")
    base_url = url.replace("http://", "http://bob:{env:URL_PASSWORD}@")
    handler = handler_for(scripted_options(url, base_url=base_url))
    caplog.set_level(logging.DEBUG)
    # httpx's own transport: ours does not take credentials in URLs (aiohttp refuses them
    # next to the Authorization header httpx derives from them).
    async with httpx.AsyncClient() as http:
        await handler.submit({}, ctx_for(http))
    [sent] = script.calls("POST", "/jobs")
    assert sent.headers["Authorization"].startswith("Basic ")  # httpx sent the userinfo
    assert "HTTP Request: POST" in caplog.text
    assert "url-secret-DDDD4444" not in caplog.text


async def test_unsendable_header_fails_for_good_without_a_call(
    vendor: tuple[Scripted, str],
) -> None:
    script, url = vendor
    options = scripted_options(url, submit={"headers": {"X-Title": "{params.title}"}})
    handler = handler_for(options)
    async with make_http_client() as http:
        for title in ("naïve", "two\r\nX-Injected: 1", "nul\x00", "tab\there", "bell\x07",
                      "del\x7f", "c1\x85"):  # fmt: skip
            with pytest.raises(PermanentError, match="X-Title") as info:
                await handler.submit({"title": title}, ctx_for(http))
            assert info.value.code == "INVALID_HEADER"
    assert script.seen == []


UNSAFE = ["..", ".", "../jobs", "a/../..", "..\\jobs", "nul\x00", "lf\n", "tab\t", "del\x7f",
          "c1\x85"]  # fmt: skip


@pytest.mark.parametrize("value", UNSAFE)
@pytest.mark.parametrize(
    "url", ["{base_url}/v1/{params.space}/jobs", "{base_url}/jobs?space={params.space}"],
    ids=["path", "query"],
)  # fmt: skip
async def test_a_url_value_with_a_dot_segment_or_control_character_is_never_sent(
    vendor: tuple[Scripted, str], url: str, value: str
) -> None:
    # "{base_url}/v1/{params.space}/jobs" with space ".." went to /jobs: a producer's value
    # climbed the vendor's API with our credentials.
    script, base = vendor
    handler = handler_for(scripted_options(base, submit={"url": url}))
    async with make_http_client() as http:
        with pytest.raises(PermanentError, match=r"\{params\.space\}") as info:
            await handler.submit({"space": value}, ctx_for(http))
    assert info.value.code == "UNSAFE_VALUE"
    assert "nothing was sent" in info.value.message
    assert script.seen == []


async def test_a_vendor_id_that_would_climb_the_query_url_fails_the_task(
    store: Store, vendor: tuple[Scripted, str]
) -> None:
    script, url = vendor
    script.submit = [json({"id": ".."}, 201)]
    task = await run_one(store, handler_for(scripted_options(url)))
    assert task.status is Status.FAILED
    code, message = error_of(task)
    assert code == "UNSAFE_VALUE"
    assert message.startswith("query: the value of {external_id} is or holds a dot segment")
    assert script.calls("GET", "/") == []
