"""The reaper's grace after Redis was away: `Grace` with plain numbers, then `run_reaper`."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest
import redis.asyncio

from asynctaskd.config import parse_config
from asynctaskd.errors import StoreUnavailable
from asynctaskd.keys import Keys
from asynctaskd.metrics import Metrics
from asynctaskd.model import Status
from asynctaskd.reaper import Grace, reap_once, run_reaper
from asynctaskd.store import Code, Lease, Store
from tests.conftest import wait_until
from tests.lua.helpers import claim_one, create, lease_expired, status_of

A = ("10.0.0.1", 6379)
B = ("10.0.0.2", 6379)


def test_no_hold_while_redis_stays_up() -> None:
    grace = Grace(10, A)
    assert grace.reaping(0, A)
    grace.succeeded(0)
    assert grace.reaping(1, A)


def test_a_failed_pass_holds_reaping_until_a_lease_after_redis_is_back() -> None:
    grace = Grace(10)
    grace.failed(0)
    assert not grace.reaping(1, None)
    grace.failed(1)
    assert not grace.reaping(30, None)  # however long the outage
    grace.succeeded(30)
    assert not grace.reaping(39.9, None)
    assert grace.reaping(40, None)


def test_a_new_master_holds_reaping_as_an_outage_does() -> None:
    grace = Grace(10, A)
    assert grace.reaping(0, A)
    grace.succeeded(0)
    assert not grace.reaping(5, B)
    grace.succeeded(5)
    assert not grace.reaping(14.9, B)
    assert grace.reaping(15, B)
    # the first master a client finds is no change
    assert Grace(10, None).reaping(0, A)


def test_a_redis_failing_on_and_off_still_has_leases_reaped() -> None:
    grace = Grace(10)
    grace.failed(0)
    grace.succeeded(1)  # held until 11; no new hold for an outage beginning before 21
    grace.failed(5)
    assert not grace.reaping(6, None)
    grace.succeeded(6)
    assert grace.reaping(11, None)
    grace.failed(12)
    assert grace.reaping(13, None)  # away again, but no hold: this pass may reap
    grace.succeeded(13)
    grace.failed(21)
    assert not grace.reaping(22, None)


@pytest.mark.anyio
async def test_a_lease_that_expired_while_redis_was_away_is_left_to_its_holder(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """A started submit whose holder could not renew while Redis was away: its holder
    renews once Redis is back, before the reaper parks the task in SUBMIT_UNKNOWN."""
    await create(store)
    c = await claim_one(store, lease_ms=100)
    started = await store.start(c.lease, False)
    assert started.code is Code.OK
    holder = Lease(c.lease.task_id, c.lease.fence, started.version)
    await wait_until(lambda: lease_expired(redis_client, keys, holder.task_id), "lease expiry")

    real_reap, real_time_out = store.reap, store.time_out
    failed = anyio.Event()
    passes_after = 0

    async def reap(*args: Any) -> Any:
        if not failed.is_set():
            failed.set()
            raise StoreUnavailable("reap: Redis is unavailable (injected)")
        return await real_reap(*args)

    async def time_out(*args: Any) -> Any:
        nonlocal passes_after
        passes_after += failed.is_set()
        return await real_time_out(*args)

    store.reap = reap  # type: ignore[method-assign]  # the reaper's first pass fails
    store.time_out = time_out  # type: ignore[method-assign]  # counts the passes after

    async def passes(n: int) -> bool:
        return passes_after >= n

    config = parse_config("[worker]\nlease = 1\n[reaper]\ninterval = 0.05\n")
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_reaper, store, config, Metrics())
        with anyio.fail_after(10):
            await wait_until(lambda: passes(2), "two passes after the failed one")
            assert await status_of(redis_client, keys, holder.task_id) is Status.SUBMITTING
            assert await store.renew(100, [holder]) == {holder.task_id: Code.OK}
            # a holder that does not renew is reaped once the grace is over
            await wait_until(
                lambda: _parked(redis_client, keys, holder.task_id), "the reaper to act", 5
            )
        tg.cancel_scope.cancel()


async def _parked(r: redis.asyncio.Redis, keys: Keys, task_id: str) -> bool:
    return await status_of(r, keys, task_id) is Status.SUBMIT_UNKNOWN


@pytest.mark.anyio
async def test_a_create_request_the_deadline_sweep_drops_is_counted_and_logged(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    """The sweep takes requests in while every worker is busy: a forged create it drops is
    reported as a claim reports one (metric and warning), not lost without a word."""
    created = await create(store, take_in=False)
    request = f"{keys.tag(0)}:new:{created.task_id}"
    await redis_client.set(request, b"not a request")  # what a producer's bug could leave
    metrics = Metrics()
    config = parse_config("[reaper]\nbatch = 100\n")
    with caplog.at_level(logging.WARNING, logger="asynctaskd.reaper"):
        await reap_once(store, config, metrics, reap=False)
    assert await redis_client.exists(request) == 0 and await store.get(created.task_id) is None
    assert metrics.registry.get_sample_value("asynctaskd_requests_dropped_total") == 1
    [record] = [r for r in caplog.records if "dropped a create request" in r.getMessage()]
    assert record.task_id == created.task_id  # type: ignore[attr-defined]
    assert "cmsgpack" in record.getMessage()
