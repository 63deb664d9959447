"""The shipped examples against fakes that behave like their vendors where the happy path
ends: uploads before the create, lost and throttled steps, 429s with each header style,
quota refusals, completed batches with failed requests, batches cancelled elsewhere,
Cancel-After deadlines, official-model endpoints, a file host on another origin. Also the
submit steps' own options, checked when the config is loaded."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from asynctaskd.errors import ConfigError
from asynctaskd.model import Status
from asynctaskd.store import Store
from tests.fakes import serve
from tests.fakes.openai_batches import OpenAIBatches, requests_for
from tests.fakes.replicate import PNG, ReplicatePredictions
from tests.fakes.scripted import Scripted, json
from tests.test_http_handler import (
    BATCH,
    LOOPBACK_FAKE,
    Whole,
    error_of,
    handler_for,
    load_example,
    make_config,
    run_one,
    run_tasks,
    scripted_options,
)

pytestmark = pytest.mark.anyio

OPENAI_KEY = "sk-test-openai-0123456789"
REPLICATE_TOKEN = "r8_test_token_0123456789"


@pytest.fixture
async def openai(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("OPENAI_API_KEY", OPENAI_KEY)
    fake = OpenAIBatches(api_key=OPENAI_KEY, polls_to_done=2)
    async with serve(fake.app()) as url:
        yield fake, url


@pytest.fixture
async def replicate(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("REPLICATE_API_TOKEN", REPLICATE_TOKEN)
    fake = ReplicatePredictions(token=REPLICATE_TOKEN, polls_to_done=2)
    async with fake.serving() as url:
        yield fake, url


def posts(fake: OpenAIBatches, path: str) -> int:
    return sum(1 for m, p in fake.requests if m == "POST" and p == path)


# ---- OpenAI: the upload step ---------------------------------------------------------------------


async def test_the_requests_are_uploaded_as_jsonl_and_the_batch_names_the_file(
    store: Store, openai: tuple[OpenAIBatches, str]
) -> None:
    fake, url = openai
    [task] = await run_tasks(store, load_example("openai-batch.toml", url), [BATCH])
    assert task.status is Status.SUCCEEDED, task.error
    batch = fake.batches[task.external_id or ""].obj
    uploaded = fake.files[batch["input_file_id"]]
    assert [msgspec.json.decode(line) for line in uploaded.splitlines()] == BATCH["requests"]
    assert task.result is not None and task.result["request_counts"]["total"] == 4
    assert (posts(fake, "/v1/files"), posts(fake, "/v1/batches")) == (1, 1)


async def test_a_lost_upload_is_sent_again_and_never_parks_the_task(
    store: Store, openai: tuple[OpenAIBatches, str]
) -> None:
    """The upload's answer is lost (it stored the file, then answered 500): no batch exists,
    so the submit runs again from the upload instead of parking in SUBMIT_UNKNOWN."""
    fake, url = openai
    fake.fail_uploads = 1
    [task] = await run_tasks(store, load_example("openai-batch.toml", url), [BATCH])
    assert task.status is Status.SUCCEEDED, task.error
    assert task.submit_attempts == 2
    assert (posts(fake, "/v1/files"), posts(fake, "/v1/batches")) == (2, 1)
    assert len(fake.files) == 2 + 1  # the unused first upload stays; plus the output file


async def test_a_lost_create_after_the_upload_still_parks_and_is_found(
    store: Store, openai: tuple[OpenAIBatches, str]
) -> None:
    fake, url = openai
    fake.lose_creates = 1  # the create makes its batch, then answers 500
    fast = {"find": {"visible_after": "100ms"},
            "timeouts": {"connect": "1s", "read": "500ms", "total": "500ms"}}  # fmt: skip
    [task] = await run_tasks(store, load_example("openai-batch.toml", url, **fast), [BATCH])
    assert task.status is Status.SUCCEEDED, task.error
    assert ("GET", "/v1/batches") in fake.requests and task.submit_attempts == 1
    assert (posts(fake, "/v1/files"), posts(fake, "/v1/batches")) == (1, 1)


async def test_requests_that_are_not_a_list_fail_before_anything_is_sent(
    store: Store, openai: tuple[OpenAIBatches, str]
) -> None:
    fake, url = openai
    bad = [{**BATCH, "requests": {"custom_id": "r1"}}, {**BATCH, "requests": []}]
    tasks = await run_tasks(store, load_example("openai-batch.toml", url), bad)
    assert [error_of(t)[0] for t in tasks] == ["INVALID_PARAMS"] * 2
    assert "must be a non-empty list" in error_of(tasks[0])[1]
    assert fake.requests == []


# ---- OpenAI: throttles and refusals --------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "wait"),
    [
        ({"retry-after": "1"}, 1.0),
        ({"retry-after-ms": "600"}, 0.6),
        ({"x-ratelimit-reset-requests": "0.8s", "x-ratelimit-reset-tokens": "20ms"}, 0.8),
    ],
)
async def test_a_throttled_step_waits_as_long_as_the_vendor_says(
    store: Store, openai: tuple[OpenAIBatches, str], headers: dict[str, str], wait: float
) -> None:
    fake, url = openai
    fake.throttle = [headers]  # the upload, the first request, is throttled
    started = time.monotonic()
    [task] = await run_tasks(store, load_example("openai-batch.toml", url), [BATCH],
                             make_config(max_error_delay="5s"))  # fmt: skip
    assert task.status is Status.SUCCEEDED, task.error
    assert time.monotonic() - started >= wait
    assert (posts(fake, "/v1/files"), posts(fake, "/v1/batches")) == (2, 1)


async def test_insufficient_quota_fails_at_once(
    store: Store, openai: tuple[OpenAIBatches, str]
) -> None:
    fake, url = openai
    fake.quota_exhausted = True
    [task] = await run_tasks(store, load_example("openai-batch.toml", url), [BATCH])
    assert task.status is Status.FAILED
    assert error_of(task)[0] == "INSUFFICIENT_QUOTA"
    assert posts(fake, "/v1/batches") == 1 and not fake.batches  # asked once, nothing made


# ---- OpenAI: what a batch that ends leaves -------------------------------------------------------


async def test_a_completed_batch_with_failed_requests_succeeds_with_both_files(
    store: Store, openai: tuple[OpenAIBatches, str], tmp_path: Path
) -> None:
    _, url = openai
    finalize = {"files": ["/output_file_id", "/error_file_id"], "dir": str(tmp_path),
                "download": "{base_url}/v1/files/{value}/content", **LOOPBACK_FAKE}  # fmt: skip
    handler = load_example("openai-batch.toml", url, finalize=finalize)
    some, only = await run_tasks(store, handler, [
        {**BATCH, "requests": requests_for("r1", "bad-2", "r3")},
        {**BATCH, "requests": requests_for("bad-1", "bad-2")},
    ])  # fmt: skip
    assert some.status is Status.SUCCEEDED and only.status is Status.SUCCEEDED
    assert some.result["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    out = await anyio.Path(some.result["output_file_id"]).read_bytes()
    err = await anyio.Path(some.result["error_file_id"]).read_bytes()
    assert [msgspec.json.decode(x)["custom_id"] for x in out.splitlines()] == ["r1", "r3"]
    assert [msgspec.json.decode(x)["custom_id"] for x in err.splitlines()] == ["bad-2"]
    # only failures: no output file at all, the error file says why
    assert only.result["output_file_id"] is None
    assert only.result["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    assert (await anyio.Path(only.result["error_file_id"]).read_bytes()).count(b"\n") == 2


async def test_a_batch_cancelled_elsewhere_fails_and_keeps_its_partial_output(
    store: Store, openai: tuple[OpenAIBatches, str]
) -> None:
    """Cancelled on the dashboard (not through the task): the task fails `cancelled` and
    keeps the file and counts of the requests done before (billed)."""
    fake, url = openai
    fake.polls_to_done, fake.cancel_elsewhere_at = 4, 2  # two of four requests done by then
    [task] = await run_tasks(store, load_example("openai-batch.toml", url), [BATCH])
    assert task.status is Status.FAILED and error_of(task)[0] == "cancelled"
    assert task.result is not None
    counts = task.result["request_counts"]
    assert counts == {"total": 4, "completed": 2, "failed": 0}
    out = fake.files[task.result["output_file_id"]]
    assert out.count(b"\n") == counts["completed"]


# ---- Replicate -----------------------------------------------------------------------------------


async def test_a_throttled_create_honours_retry_after_and_creates_once(
    store: Store, replicate: tuple[ReplicatePredictions, str], tmp_path: Path
) -> None:
    fake, url = replicate
    fake.throttle = [{"Retry-After": "1"}]
    handler = load_example("replicate-predictions.toml", url,
                           finalize={"dir": str(tmp_path), **LOOPBACK_FAKE})  # fmt: skip
    started = time.monotonic()
    [task] = await run_tasks(store, handler, [{"version": "v1", "input": {"text": "a"}}],
                             make_config(max_error_delay="5s"))  # fmt: skip
    assert task.status is Status.SUCCEEDED, task.error
    assert time.monotonic() - started >= 1.0
    assert len(fake.predictions) == 1


async def test_cancel_after_aborts_a_prediction_that_never_started(
    store: Store, replicate: tuple[ReplicatePredictions, str]
) -> None:
    fake, url = replicate
    fake.stuck = True  # no capacity: the prediction stays queued
    handler = load_example("replicate-predictions.toml", url,
                           submit={"headers": {"Cancel-After": "1s"}})  # fmt: skip
    [task] = await run_tasks(store, handler, [{"version": "v1", "input": {}}])
    assert task.status is Status.FAILED and error_of(task)[0] == "aborted"
    [prediction] = fake.predictions.values()
    assert prediction.obj["status"] == "aborted" and prediction.polls == 0


async def test_the_documented_official_model_submit_works(
    store: Store, replicate: tuple[ReplicatePredictions, str], tmp_path: Path
) -> None:
    fake, url = replicate
    handler = load_example(
        "replicate-predictions.toml", url, finalize={"dir": str(tmp_path), **LOOPBACK_FAKE},
        # the submit table as the example's comment says, body replaced whole
        submit={"url": "{base_url}/v1/models/{params.owner}/{params.name}/predictions",
                "body": Whole({"input": "{params.input}"})},
    )  # fmt: skip
    params = {"owner": "black-forest-labs", "name": "flux-schnell", "input": {"prompt": "a"}}
    [task] = await run_tasks(store, handler, [params])
    assert task.status is Status.SUCCEEDED, task.error
    assert [await anyio.Path(p).read_bytes() for p in task.result] == [PNG, PNG]
    [prediction] = fake.predictions.values()
    assert prediction.obj["model"] == "black-forest-labs/flux-schnell"
    assert prediction.obj["version"] is None
    assert fake.download_auth == [None, None]  # another origin: no token


# ---- submit steps: options and behaviour ---------------------------------------------------------


def step_options(base: str, **step: Any) -> dict[str, Any]:
    upload = {"name": "upload", "url": "{base_url}/uploads",
              "multipart": {"file": {"filename": "in.txt", "content": "{params.doc}"}},
              "keep": {"id": "/id"}, **step}  # fmt: skip
    return scripted_options(base, submit={"before": [upload],
                                         "body": {"file": "{steps.upload.id}"}})  # fmt: skip


@pytest.mark.parametrize(
    ("step", "submit", "message"),
    [
        ({}, {"body": {"file": "{steps.nope.id}"}}, "no step 'nope' comes before"),
        ({}, {"body": {"file": "{steps.upload.name}"}}, "step 'upload' keeps no 'name'"),
        ({"body": {"a": 1}}, {}, "set body (JSON) or multipart, not both"),
        ({"multipart": {"f": {"filename": "x", "jsonl": "[{params.x}]"}}}, {},
         "exactly one placeholder"),
        ({"multipart": {"f": {"filename": "x"}}}, {}, "set content (text) or jsonl"),
        ({"multipart": {'a"b': "x"}}, {}, "cannot be a multipart field name"),
        ({"name": "up load"}, {}, "expected a name of letters"),
        ({"url": "{base_url}/x/{handle.id}"}, {}, "{handle.id} is not available here"),
    ],
)  # fmt: skip
def test_step_options_are_checked(step: dict[str, Any], submit: dict[str, Any],
                                  message: str) -> None:  # fmt: skip
    options = step_options("http://127.0.0.1:9", **step)
    options["submit"].update(submit)
    with pytest.raises(ConfigError, match="submit") as info:
        handler_for(options)
    assert message in str(info.value)


async def test_a_step_refused_fails_the_task_and_no_job_is_created(store: Store) -> None:
    script = Scripted(uploads=[json({"error": "too large"}, 413)])
    async with serve(script.app()) as url:
        task = await run_one(store, handler_for(step_options(url)))
    assert task.status is Status.FAILED and error_of(task)[0] == "HTTP_413"
    assert "submit step upload" in error_of(task)[1]
    assert script.calls("POST", "/jobs") == []


async def test_a_step_answer_without_what_it_keeps_is_sent_again(store: Store) -> None:
    script = Scripted(uploads=[json({"no": "id"}), json({"id": "f-9"})])
    async with serve(script.app()) as url:
        task = await run_one(store, handler_for(step_options(url)))
    assert task.status is Status.SUCCEEDED, task.error
    [upload, again] = script.calls("POST", "/uploads")
    assert b'filename="in.txt"' in upload.body and b"a.pdf" in upload.body
    assert again.body.count(b"a.pdf") == 1  # the whole submit ran again
    assert upload.headers["Content-Type"].startswith("multipart/form-data; boundary=")
    [create] = script.calls("POST", "/jobs")
    assert msgspec.json.decode(create.body)["file"] == "f-9"


# ---- a job that did nothing is submitted again (Resubmit) ----------------------------------------


async def test_a_batch_refused_for_a_full_token_queue_is_submitted_again(
    store: Store, openai: tuple[OpenAIBatches, str]
) -> None:
    fake, url = openai
    fake.token_limit_failures = 2  # the queue is full for the first two batches
    handler = load_example("openai-batch.toml", url, query={"resubmit_after": "500ms"})
    started = time.monotonic()
    [task] = await run_tasks(store, handler, [BATCH], make_config(max_error_delay="1s"))
    assert task.status is Status.SUCCEEDED, task.error
    first, second, third = (i for _, i in fake.created)
    assert [fake.batches[i].obj["status"] for i in (first, second)] == ["failed"] * 2
    assert task.external_id == third and task.submit_attempts == 3
    assert task.result is not None and task.result["request_counts"]["completed"] == 4
    # waited resubmit_after, twice (the backoff without it: 10 ms, then 20 ms)
    assert time.monotonic() - started >= 1.0
    assert (posts(fake, "/v1/files"), posts(fake, "/v1/batches")) == (3, 3)


async def test_resubmits_stop_at_max_submit_retries(
    store: Store, openai: tuple[OpenAIBatches, str]
) -> None:
    fake, url = openai
    fake.token_limit_failures = 100
    handler = load_example("openai-batch.toml", url, query={"resubmit_after": "10ms"})
    [task] = await run_tasks(store, handler, [BATCH], make_config(max_submit_retries=2))
    assert task.status is Status.FAILED
    code, message = error_of(task)
    assert code == "token_limit_exceeded" and "3 submits made, no more" in message
    assert len(fake.created) == 3


def test_resubmit_is_refused_for_an_idempotent_vendor() -> None:
    options = scripted_options("http://127.0.0.1:9", idempotent=True,
                               query={"resubmit": ["queue_full"]})  # fmt: skip
    with pytest.raises(ConfigError, match=r"query\.resubmit: an idempotent vendor"):
        handler_for(options)


# ---- find: a listing paged by next-page URLs (Replicate's shape) ---------------------------------

# Replicate's predictions carry nothing of ours, so the example has no find table (see
# examples/README.md); this test-only table puts the task id into the input to exercise a
# listing paged the way Replicate pages it.
REF_BODY = Whole({"version": "{params.version}", "input": {"ref": "{task_id}"}})
NEXT_FIND: dict[str, Any] = {
    "find": {"url": "{base_url}/v1/predictions", "items": "/results", "match": "/input/ref",
             "equals": "{task_id}", "id": "/id", "next": "/next", "visible_after": "100ms",
             "max_pages": 5, "max_tries": 3},
    "timeouts": {"connect": "1s", "read": "500ms", "total": "500ms"},
    "submit": {"body": REF_BODY},
}  # fmt: skip


async def test_a_lost_create_is_found_on_a_later_page_by_following_next(
    store: Store, replicate: tuple[ReplicatePredictions, str], tmp_path: Path
) -> None:
    fake, url = replicate
    fake.page_size, fake.others, fake.lose_creates = 2, 5, 1  # ours is on the third page
    handler = load_example("replicate-predictions.toml", url, **NEXT_FIND,
                           finalize={"dir": str(tmp_path), **LOOPBACK_FAKE})  # fmt: skip
    [task] = await run_tasks(store, handler, [{"version": "v1"}])
    assert task.status is Status.SUCCEEDED, task.error
    assert len(fake.predictions) == 1 and task.submit_attempts == 1
    assert fake.listed[:3] == [2, 2, 2]
    assert fake.predictions[task.external_id or ""].obj["input"] == {"ref": task.id}


async def test_a_next_page_on_another_origin_is_never_requested(
    store: Store, replicate: tuple[ReplicatePredictions, str]
) -> None:
    fake, url = replicate
    fake.page_size, fake.others, fake.lose_creates = 2, 5, 1
    fake.next_origin = fake.delivery_origin  # a listing that points elsewhere
    handler = load_example("replicate-predictions.toml", url, **NEXT_FIND)
    [task] = await run_tasks(store, handler, [{"version": "v1"}])
    assert task.status is Status.SUBMIT_UNKNOWN and len(fake.predictions) == 1
    assert task.error is not None and task.error.code == "LOOKUP_GAVE_UP"
    assert "FIND_REFUSED" in task.error.message
    assert fake.listed == [2, 2, 2]  # the first page of each of the 3 lookups, no more
    assert fake.file_host_requests == []  # nothing was asked of the other origin


def test_a_next_page_pointer_replaces_the_cursor_options() -> None:
    options = scripted_options("http://127.0.0.1:9", find={
        "url": "{base_url}/jobs", "items": "", "match": "/ref", "equals": "{task_id}",
        "id": "/id", "visible_after": "1s", "next": "/next", "more": "/has_more"})  # fmt: skip
    with pytest.raises(ConfigError, match=r"find\.next: a next-page URL replaces"):
        handler_for(options)
