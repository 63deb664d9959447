"""The OpenAI Batch example's find table against the local fake (a real socket): parked
tasks are settled by listing batches, and a listing that lags never causes a resubmit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from asynctaskd.model import Status
from asynctaskd.store import Store
from tests.conftest import wait_until
from tests.fakes import serve
from tests.fakes.openai_batches import OpenAIBatches
from tests.test_http_handler import BATCH, load_example, make_config, run_tasks

pytestmark = pytest.mark.anyio

KEY = "sk-test-openai-0123456789"
# A lookup settles "none" only at least visible_after + timeouts.total after the create
# started: 2 s here, against a listing that lags 1 s behind the creates.
FAST_FIND: dict[str, Any] = {
    "find": {"visible_after": "1500ms"},
    "timeouts": {"connect": "1s", "read": "500ms", "total": "500ms"},
}


@pytest.fixture
async def openai(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[OpenAIBatches, str]]:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    fake = OpenAIBatches(api_key=KEY, polls_to_done=2, list_lag=1.0)
    async with serve(fake.app()) as url:
        yield fake, url


async def test_a_lost_create_is_found_and_a_lagging_listing_never_resubmits(
    store: Store, openai: tuple[OpenAIBatches, str]
) -> None:
    fake, url = openai
    fake.lose_creates = 3  # each makes its batch, then answers 500: the tasks park
    handler = load_example("openai-batch.toml", url, **FAST_FIND)
    assert handler.find_visible_after == 2.0
    tasks = await run_tasks(store, handler, [BATCH] * 3, make_config())
    assert [t.status for t in tasks] == [Status.SUCCEEDED] * 3, tasks
    assert len(fake.created) == 3, "a task was submitted twice"
    assert {t.external_id for t in tasks} == {i for _, i in fake.created}
    assert all(t.submit_attempts == 1 for t in tasks)
    # the listing answered without the batches at first (they were not listed yet): those
    # lookups asked again later instead of resubmitting
    assert 0 in fake.listed, fake.listed
    assert ("GET", "/v1/batches") in fake.requests


async def test_a_create_that_made_nothing_is_submitted_again_after_the_window(
    store: Store, openai: tuple[OpenAIBatches, str]
) -> None:
    fake, url = openai
    fake.refuse_creates = 1  # answers 500 without making a batch: the task parks
    handler = load_example("openai-batch.toml", url, **FAST_FIND)
    [task] = await run_tasks(store, handler, [BATCH], make_config())
    assert task.status is Status.SUCCEEDED, task
    assert len(fake.created) == 1
    assert task.submit_attempts == 2  # the lost one and the one after the lookups


async def test_a_batch_further_back_than_the_pages_read_is_no_none(
    store: Store, openai: tuple[OpenAIBatches, str]
) -> None:
    """A listing read only in part is an error, never a "none": the task stays parked."""
    fake, url = openai
    fake.list_lag, fake.others, fake.lose_creates = 0.0, 4, 1
    find = {"visible_after": "1ms", "max_pages": 2, "max_tries": 2,
            "url": "{base_url}/v1/batches?limit=2",
            "next_url": "{base_url}/v1/batches?limit=2&after={value}"}  # fmt: skip
    options = {**FAST_FIND, "find": find}  # 2 pages of 2: 4 of the 3 others and ours
    handler = load_example("openai-batch.toml", url, **options)
    [task] = await run_tasks(store, handler, [BATCH], make_config())
    assert task.status is Status.SUBMIT_UNKNOWN and len(fake.created) == 1
    assert task.error is not None and task.error.code == "LOOKUP_GAVE_UP"
    assert "FIND_INCOMPLETE" in task.error.message
    # and with pages enough, the same listing finds it
    fake.others = 150
    handler = load_example("openai-batch.toml", url, **FAST_FIND)
    fake.lose_creates = 1
    [task] = await run_tasks(store, handler, [BATCH], make_config())
    assert task.status is Status.SUCCEEDED and len(fake.created) == 2


async def test_a_resubmitted_task_never_takes_its_earlier_batch_for_a_lost_one(
    store: Store, openai: tuple[OpenAIBatches, str]
) -> None:
    """The first batch fails for a full token queue (the task is submitted again), and the
    second create's answer is lost while the listing lags: only the first batch is listed
    at first. It names the task too, but another submit of it: the lookup waits for the
    second instead of taking the first (which would leave the second running, orphaned)."""
    fake, url = openai
    fake.list_lag, fake.token_limit_failures, fake.lose_creates = 0.8, 1, 0
    handler = load_example("openai-batch.toml", url, **FAST_FIND, query={"resubmit_after": "1s"})

    async def one_batch() -> bool:
        return len(fake.created) == 1

    async def lose_the_second_create() -> None:
        await wait_until(one_batch, "the first batch")
        fake.lose_creates = 1  # long before the second create: resubmit_after is 1 s

    async with anyio.create_task_group() as tg:
        tg.start_soon(lose_the_second_create)
        [task] = await run_tasks(store, handler, [BATCH], make_config(max_error_delay="2s"))
    first, second = (i for _, i in fake.created)
    assert task.status is Status.SUCCEEDED, task.error
    assert task.external_id == second and task.submit_attempts == 2
    assert fake.batches[first].obj["metadata"]["asynctaskd_submit"] == f"{task.id}/1"
    assert 1 in fake.listed  # a lookup saw the first batch alone, and did not take it
