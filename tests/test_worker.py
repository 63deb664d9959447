"""The worker against real Redis and the fake vendor over real sockets, in one process."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest
import redis.asyncio

from asynctaskd.client import AsyncClient
from asynctaskd.codec import encode_json
from asynctaskd.config import Config, parse_config
from asynctaskd.devtools.demo import DemoHandler
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.errors import NotSent, PermanentError, RetryableError
from asynctaskd.handlers import (
    Failed,
    HandlerContext,
    HandlerEntry,
    Running,
    Submitted,
    Succeeded,
)
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.store import ClaimBatch, Gate, Store
from asynctaskd.worker import Worker
from tests.conftest import statuses_async, wait_until
from tests.lua.helpers import check_invariants

pytestmark = pytest.mark.anyio


def make_config(**sections: dict[str, Any]) -> Config:
    base: dict[str, dict[str, Any]] = {
        "worker": {"lease": "2s", "max_inflight": 100, "shutdown_grace": "5s"},
        "retry": {
            "poll_interval": "50ms",
            "first_error_delay": "20ms",
            "max_error_delay": "200ms",
            "jitter": 0,
        },
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    lines = []
    for name, values in base.items():
        lines.append(f"[{name}]")
        for k, v in values.items():
            lines.append(f"{k} = {encode_json(v).decode()}")
    return parse_config("\n".join(lines))


@pytest.fixture(scope="module")
def vendor() -> Iterator[FakeVendorProcess]:
    with FakeVendorProcess.start(Behaviour(polls_to_done=2)) as v:
        yield v


@pytest.fixture
def fresh_vendor(vendor: FakeVendorProcess) -> FakeVendorProcess:
    vendor.reset()
    defaults = {f: getattr(Behaviour(), f) for f in Behaviour.__struct_fields__}
    vendor.configure(**{**defaults, "polls_to_done": 2})
    return vendor


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as client:
        yield client


async def submit_many(store: Store, n: int, handler: str = "demo", **kw: Any) -> list[str]:
    ids = [new_task_id() for _ in range(n)]
    calls = [
        store.ops.create(i, handler, encode_json({"i": k}), timeout_ms=kw.get("timeout_ms", 60_000))
        for k, i in enumerate(ids)
    ]
    for start in range(0, n, 500):
        await store.run_many(calls[start : start + 500])
    return ids


def entry(handler: Any, key: str = "demo", **kw: Any) -> dict[str, HandlerEntry]:
    return {key: HandlerEntry(key=key, handler=handler, provider=key, **kw)}


async def test_end_to_end_500_tasks_each_submitted_once(
    store: Store,
    fresh_vendor: FakeVendorProcess,
    http: httpx.AsyncClient,
    redis_client: redis.asyncio.Redis,
    keys: Keys,
) -> None:
    ids = await submit_many(store, 500)
    worker = Worker(store, entry(DemoHandler("demo", fresh_vendor.url)), make_config(), http=http)
    with anyio.fail_after(60):
        await worker.run_until_idle()
    assert await statuses_async(store, ids) == Counter({Status.SUCCEEDED: 500})
    refs = Counter(e["ref"] for e in fresh_vendor.submit_log() if e["outcome"] == "created")
    assert set(refs) == set(ids) and max(refs.values()) == 1
    await check_invariants(redis_client, keys)


class Scripted:
    """A handler whose behaviour each test sets; records every call."""

    def __init__(self, key: str = "demo", idempotent: bool = False) -> None:
        self.key = key
        self.idempotent_submit = idempotent
        self.submits: list[str] = []
        self.queries: list[str] = []
        self.cancels: list[str] = []
        self.on_submit: Any = lambda ctx: Submitted("x-" + ctx.task_id)
        self.on_query: Any = lambda ctx: Succeeded({"ok": True})

    async def submit(self, params: Any, ctx: HandlerContext) -> Submitted:
        self.submits.append(ctx.task_id)
        out = self.on_submit(ctx)
        if isinstance(out, BaseException):
            raise out
        return await out if hasattr(out, "__await__") else out  # type: ignore[no-any-return]

    async def query(self, handle: dict[str, Any], ctx: HandlerContext) -> Any:
        self.queries.append(ctx.task_id)
        out = self.on_query(ctx)
        if isinstance(out, BaseException):
            raise out
        return await out if hasattr(out, "__await__") else out

    async def cancel(self, handle: dict[str, Any], ctx: HandlerContext) -> None:
        self.cancels.append(handle["external_id"])


async def run(store: Store, handler: Any, config: Config | None = None) -> Worker:
    async with httpx.AsyncClient() as http:
        worker = Worker(store, entry(handler), config or make_config(), http=http)
        with anyio.fail_after(30):
            await worker.run_until_idle()
    return worker


async def test_one_slot_takes_submit_work_when_no_query_work_is_due(store: Store) -> None:
    # With a single free slot a claim round cannot ask both phases for a task at once:
    # query work goes first, and submit work must still be claimed when there is none.
    h = Scripted()
    ids = await submit_many(store, 3)
    worker = await run(store, h, make_config(worker={"max_inflight": 1}))
    assert await statuses_async(store, ids) == Counter({Status.SUCCEEDED: 3})
    assert sorted(h.submits) == sorted(ids)
    assert worker.completed == 6  # three submits and three queries, one at a time


async def test_a_handler_concurrency_limit_holds_its_calls_in_flight(store: Store) -> None:
    h = Scripted()
    running = 0
    most = 0

    def call(out: Any) -> Any:
        async def held(ctx: HandlerContext) -> Any:
            nonlocal running, most
            running += 1
            most = max(most, running)
            for _ in range(20):  # the claim loop runs meanwhile and launches the other calls
                await anyio.lowlevel.checkpoint()
            running -= 1
            return out

        return held

    h.on_submit = lambda ctx: call(Submitted("x-" + ctx.task_id))(ctx)
    h.on_query = lambda ctx: call(Succeeded({"ok": True}))(ctx)
    ids = await submit_many(store, 8)
    async with httpx.AsyncClient() as http:
        worker = Worker(store, entry(h, concurrency=2), make_config(), http=http)
        with anyio.fail_after(30):
            await worker.run_until_idle()
    assert await statuses_async(store, ids) == Counter({Status.SUCCEEDED: 8})
    assert most == 2  # two at a time: never more, and the limit is not one


async def test_permanent_submit_error_fails(store: Store) -> None:
    h = Scripted()
    h.on_submit = lambda ctx: PermanentError("bad input", code="HTTP_400")
    [tid] = await submit_many(store, 1)
    await run(store, h)
    task = await store.get(tid)
    assert task is not None and task.status is Status.FAILED
    assert task.error is not None and task.error.code == "HTTP_400"


async def test_ambiguous_submit_parks_and_is_never_resubmitted(store: Store) -> None:
    h = Scripted()
    h.on_submit = lambda ctx: httpx.ReadTimeout("read timed out")
    [tid] = await submit_many(store, 1)
    await run(store, h)
    task = await store.get(tid)
    assert task is not None and task.status is Status.SUBMIT_UNKNOWN
    assert h.submits == [tid]
    await run(store, h)  # another round: still parked, not resubmitted
    assert h.submits == [tid]


async def test_ambiguous_submit_with_idempotent_handler_is_retried(store: Store) -> None:
    h = Scripted(idempotent=True)
    calls = iter([httpx.ReadTimeout("t"), Submitted("x-1")])
    h.on_submit = lambda ctx: next(calls)
    [tid] = await submit_many(store, 1)
    await run(store, h)
    task = await store.get(tid)
    assert task is not None and task.status is Status.SUCCEEDED and len(h.submits) == 2


async def test_never_sent_retries_up_to_the_limit(store: Store) -> None:
    h = Scripted()
    h.on_submit = lambda ctx: NotSent("connect refused")
    [tid] = await submit_many(store, 1)
    await run(store, h, make_config(retry={"max_submit_retries": 2}))
    task = await store.get(tid)
    assert task is not None and task.status is Status.FAILED
    assert task.error is not None and task.error.code == "SUBMIT_RETRIES_EXHAUSTED"
    assert len(h.submits) == 3


async def test_error_budget_resets_on_success_and_fails_when_spent(store: Store) -> None:
    h = Scripted()
    script = iter([RetryableError("e")] * 2 + [Running(progress=0.5)] + [RetryableError("e")] * 3)
    h.on_query = lambda ctx: next(script)
    [tid] = await submit_many(store, 1)
    await run(store, h, make_config(retry={"max_consecutive_errors": 3}))
    task = await store.get(tid)
    assert task is not None and task.status is Status.FAILED
    assert task.error is not None and task.error.code == "QUERY_ERRORS"
    assert len(h.queries) == 6  # 2 errors, 1 good (reset), 3 errors


async def test_throttling_does_not_spend_the_error_budget(store: Store) -> None:
    h = Scripted()
    throttles = [RetryableError("429", throttled=True, retry_after=0.05) for _ in range(5)]
    script = iter([*throttles, Succeeded(1)])
    h.on_query = lambda ctx: next(script)
    [tid] = await submit_many(store, 1)
    await run(store, h, make_config(retry={"max_consecutive_errors": 2}))
    task = await store.get(tid)
    assert task is not None and task.status is Status.SUCCEEDED


async def test_retry_after_is_respected(store: Store) -> None:
    h = Scripted()
    seen: list[float] = []
    script = iter([RetryableError("429", throttled=True, retry_after=0.4), Succeeded(1)])

    def on_query(ctx: HandlerContext) -> Any:
        seen.append(anyio.current_time())
        return next(script)

    h.on_query = on_query
    await submit_many(store, 1)
    await run(store, h, make_config(retry={"max_error_delay": "1s"}))
    assert len(seen) == 2 and seen[1] - seen[0] >= 0.39


HUGE = 100_000_000_000_000.0  # seconds: a Retry-After a vendor really sent


@pytest.mark.parametrize(
    ("phase", "first"),
    [
        ("submit", RetryableError("429", throttled=True, retry_after=HUGE)),
        ("submit", NotSent("refused", retry_after=HUGE)),
        ("query", RetryableError("429", throttled=True, retry_after=HUGE)),
        ("query", RetryableError("429", throttled=True, retry_after=math.inf)),
        ("query", RetryableError("503", retry_after=HUGE)),
        ("query", Running(next_poll=HUGE)),
        ("query", Running(next_poll=math.inf)),
    ],
    ids=["submit-throttled", "submit-never-sent", "query-throttled", "query-throttled-inf",
         "query-error", "next-poll", "next-poll-inf"],
)  # fmt: skip
async def test_a_huge_delay_is_clamped_to_max_error_delay(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys, phase: str, first: Any
) -> None:
    # A Retry-After of 1e14 s was saved as due_ms 1e17 (a float in Redis: the task could not
    # be read or listed); an infinite one broke the save; a huge one that was clamped only
    # by the deadline left the task waiting that long. Each is capped at max_error_delay.
    h = Scripted()
    seen: list[float] = []
    script = iter([first])

    def call(ctx: HandlerContext) -> Any:
        seen.append(anyio.current_time())
        default = Submitted("x-" + ctx.task_id) if phase == "submit" else Succeeded(1)
        return next(script, default)

    if phase == "submit":
        h.on_submit = call
    else:
        h.on_query = call
    [tid] = await submit_many(store, 1, timeout_ms=3_600_000)
    async with httpx.AsyncClient() as http:
        worker = Worker(store, entry(h), make_config(), http=http)
        with anyio.fail_after(10):
            await worker.run_until_idle()
    task = await store.get(tid)
    assert task is not None and task.status is Status.SUCCEEDED
    # Called again after max_error_delay (200 ms): not sooner (as after a failed save,
    # which releases the task), nor much later (a slow host only adds a little).
    assert len(seen) == 2 and 0.19 <= seen[1] - seen[0] < 2.0
    page = await AsyncClient(redis_client, namespace=keys.namespace).list()
    assert [t.id for t in page.tasks] == [tid]
    await check_invariants(redis_client, keys)


async def test_vendor_failure_and_progress(store: Store) -> None:
    h = Scripted()
    script = iter([Running(progress=0.3, stage="ocr", message="page 1"), Failed("bad_pdf", "x")])
    h.on_query = lambda ctx: next(script)
    [tid] = await submit_many(store, 1)
    await run(store, h)
    task = await store.get(tid)
    assert task is not None and task.status is Status.FAILED and task.progress == 0.3
    assert task.stage == "ocr" and task.error is not None and task.error.code == "bad_pdf"


async def test_garbage_and_base_exceptions_from_handlers_are_contained(store: Store) -> None:
    h = Scripted()
    script = iter([KeyboardInterrupt(), "garbage", Succeeded({"x": 1})])
    h.on_query = lambda ctx: next(script)
    [tid] = await submit_many(store, 1)
    await run(store, h)
    task = await store.get(tid)
    assert task is not None and task.status is Status.SUCCEEDED


async def test_non_json_result_fails_clearly(store: Store) -> None:
    h = Scripted()
    h.on_query = lambda ctx: Succeeded({b"bytes-key": 1})
    [tid] = await submit_many(store, 1)
    await run(store, h)
    task = await store.get(tid)
    assert task is not None and task.status is Status.FAILED
    assert task.error is not None and task.error.code == "INVALID_RESULT"


async def test_deadline_times_out_a_running_task(store: Store) -> None:
    h = Scripted()
    h.on_query = lambda ctx: Running(progress=0.1)
    [tid] = await submit_many(store, 1, timeout_ms=400)
    await run(store, h)
    task = await store.get(tid)
    assert task is not None and task.status is Status.TRACKING_TIMED_OUT


def call_count(worker: Worker, op: str, outcome: str) -> float:
    value = worker.metrics.registry.get_sample_value(
        "asynctaskd_handler_call_seconds_count",
        {"handler": "demo", "op": op, "outcome": outcome},
    )
    return value or 0.0


async def test_a_query_hanging_past_the_deadline_is_cut_and_times_out(store: Store) -> None:
    h = Scripted()

    async def hang(ctx: HandlerContext) -> Running:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    h.on_query = hang
    # 1.5 s: the submit must land and the first query start before the deadline, which a
    # loaded machine did not always manage within 400 ms (the query never ran).
    [tid] = await submit_many(store, 1, timeout_ms=1500)
    worker = await run(store, h)
    task = await store.get(tid)
    assert task is not None and task.status is Status.TRACKING_TIMED_OUT
    assert h.queries == [tid]
    assert call_count(worker, "query", "deadline") == 1


async def test_a_deadline_beyond_the_lease_is_armed_as_it_comes_near(store: Store) -> None:
    # A query whose deadline is further off than a lease starts with no timer; the
    # renewal loop arms it in time, and the cut still lands at the deadline itself.
    h = Scripted()
    cut_at: list[float] = []

    async def hang(ctx: HandlerContext) -> Running:
        try:
            await anyio.sleep_forever()
        finally:
            cut_at.append(time.time())
        raise AssertionError("unreachable")

    h.on_query = hang
    [tid] = await submit_many(store, 1, timeout_ms=2500)
    created = await store.get(tid)
    assert created is not None and created.deadline_at is not None
    worker = await run(store, h, make_config(worker={"lease": "1s"}))
    task = await store.get(tid)
    assert task is not None and task.status is Status.TRACKING_TIMED_OUT
    assert call_count(worker, "query", "deadline") == 1
    assert created.deadline_at <= cut_at[0] < created.deadline_at + 2.0  # not 30 s: cut, not hung


async def test_a_timeout_error_raised_by_the_handler_is_a_query_error(store: Store) -> None:
    """Only the task's deadline cuts a query; a handler's own TimeoutError (a vendor read
    timeout) is an ordinary query error with its backoff."""
    h = Scripted()
    h.on_query = lambda ctx: (
        TimeoutError("read timed out") if len(h.queries) == 1 else Succeeded({"ok": True})
    )
    [tid] = await submit_many(store, 1)
    worker = await run(store, h)
    task = await store.get(tid)
    assert task is not None and task.status is Status.SUCCEEDED
    assert len(h.queries) == 2
    assert call_count(worker, "query", "error") == 1
    assert call_count(worker, "query", "deadline") == 0


async def test_cancel_in_flight_calls_remote_cancel(store: Store) -> None:
    h = Scripted()
    inside = anyio.Event()
    release = anyio.Event()

    async def slow(ctx: HandlerContext) -> Running:
        inside.set()
        await release.wait()
        return Running(progress=0.2)

    h.on_query = slow
    [tid] = await submit_many(store, 1)
    async with httpx.AsyncClient() as http, anyio.create_task_group() as tg:
        worker = Worker(store, entry(h), make_config(), http=http)
        tg.start_soon(worker.run_until_idle)
        with anyio.fail_after(10):
            await inside.wait()
            await store.cancel(tid)
            release.set()
    task = await store.get(tid)
    assert task is not None and task.status is Status.CANCELED
    assert h.cancels == ["x-" + tid]


async def test_unknown_handler_fails_in_submit_phase(store: Store) -> None:
    [tid] = await submit_many(store, 1, handler="nobody")
    await run(store, Scripted())
    task = await store.get(tid)
    assert task is not None and task.status is Status.FAILED
    assert task.error is not None and task.error.code == "UNKNOWN_HANDLER"


def _hang() -> tuple[Callable[[HandlerContext], Awaitable[Any]], anyio.Event, anyio.Event]:
    """A handler call that waits until cancelled; events for "inside" and "cancelled"."""
    inside = anyio.Event()
    cancelled = anyio.Event()

    async def hang(ctx: HandlerContext) -> Any:
        inside.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    return hang, inside, cancelled


async def test_lost_lease_cancels_the_query_call(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    h = Scripted()
    h.on_query, inside, cancelled = _hang()
    [tid] = await submit_many(store, 1)
    async with httpx.AsyncClient() as http, anyio.create_task_group() as tg:
        worker = Worker(store, entry(h), make_config(worker={"lease": "1s"}), http=http)
        tg.start_soon(worker.run)
        with anyio.fail_after(10):
            await inside.wait()
            # an operator-like intervention: the lease vanishes under the worker
            await redis_client.zrem(keys.leases(0), tid)
            await cancelled.wait()
        assert worker.metrics.leases_lost._value.get() == 1
        worker.stop(now=True)


async def test_a_newer_fence_cancels_a_started_submit(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys
) -> None:
    """A started submit survives a lease that merely expired (the late save may land),
    but not a newer fence: someone else holds the task now."""
    h = Scripted()
    h.on_submit, inside, cancelled = _hang()
    [tid] = await submit_many(store, 1)
    async with httpx.AsyncClient() as http, anyio.create_task_group() as tg:
        worker = Worker(store, entry(h), make_config(worker={"lease": "1s"}), http=http)
        tg.start_soon(worker.run)
        with anyio.fail_after(10):
            await inside.wait()
            await redis_client.hincrby(keys.task(0, tid), "fence", 1)
            await cancelled.wait()
        assert worker.metrics.leases_lost._value.get() == 1
        await wait_until(lambda: _no_calls(worker), "the call to end")
        worker.stop(now=True)


async def _no_calls(worker: Worker) -> bool:
    return worker.inflight == 0


async def _blocked_in_wait(r: redis.asyncio.Redis) -> bool:
    return any(c.get("cmd") == "wait" for c in await r.client_list())


async def _history(r: redis.asyncio.Redis, keys: Keys, task_id: str) -> list[str]:
    events = await r.xrange(keys.events(0))
    return [e[b"status"].decode() for _, e in events if e[b"task"] == task_id.encode()]


async def test_a_start_whose_reply_is_lost_is_taken_back_not_parked(
    store: Store, redis_client: redis.asyncio.Redis, keys: Keys, redis_url: str
) -> None:
    """The master dies with a start done (a replica had it) and its reply on the way, or a
    drain stops a call waiting for it: the worker knows the vendor was not called, so the
    task must go back to PENDING_SUBMIT, not wait in SUBMIT_UNKNOWN for an operator. Here
    the durability gate's WAIT, for a replica that does not exist, holds the reply back."""
    h = Scripted()
    [tid] = await submit_many(store, 1)
    gate = Gate("WAIT", 0, 1, 30_000)
    killer = redis.asyncio.Redis.from_url(redis_url)
    try:
        async with httpx.AsyncClient() as http, anyio.create_task_group() as tg:
            worker = Worker(store, entry(h), make_config(), http=http, gate=gate)
            tg.start_soon(worker.run)
            with anyio.fail_after(20):
                await wait_until(lambda: _blocked_in_wait(killer), "the start's gate")
                task = await store.get(tid)
                assert task is not None and task.started_fence == 1  # the start ran
                assert await killer.client_kill_filter(_type="normal", skipme=True) >= 1

                async def claimed_again() -> bool:
                    history = await _history(killer, keys, tid)  # its connection lives
                    return history[:4] == ["PENDING_SUBMIT", "SUBMITTING"] * 2

                await wait_until(claimed_again, "the task back and claimed again")
                # and a drain that stops the call in its gate gives the task back too
                await wait_until(lambda: _blocked_in_wait(killer), "the next start's gate")
                worker.stop(now=True)
        assert "SUBMIT_UNKNOWN" not in await _history(killer, keys, tid)
    finally:
        await killer.aclose()
    task = await store.get(tid)
    assert task is not None and task.status is Status.PENDING_SUBMIT, task
    assert task.error is not None and task.error.code == "INTERRUPTED_BEFORE_SUBMIT"
    assert h.submits == []
    await check_invariants(redis_client, keys)


async def test_stop_drains_in_flight_calls(store: Store) -> None:
    h = Scripted()
    started = 0
    all_in = anyio.Event()
    gate = anyio.Event()

    async def slow(ctx: HandlerContext) -> Succeeded:
        nonlocal started
        started += 1
        if started == 50:
            all_in.set()
        await gate.wait()
        return Succeeded(1)

    h.on_query = slow
    ids = await submit_many(store, 50)
    async with httpx.AsyncClient() as http, anyio.create_task_group() as tg:
        worker = Worker(store, entry(h), make_config(), http=http)
        tg.start_soon(worker.run)
        with anyio.fail_after(10):
            await all_in.wait()
            worker.stop()
            await anyio.lowlevel.checkpoint()
            gate.set()
    assert await statuses_async(store, ids) == Counter({Status.SUCCEEDED: 50})


async def test_hard_stop_releases_leases_for_peers(store: Store) -> None:
    h = Scripted()
    all_in = anyio.Event()

    async def hang(ctx: HandlerContext) -> Succeeded:
        if len(h.queries) == 20:
            all_in.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    h.on_query = hang
    ids = await submit_many(store, 20)
    async with httpx.AsyncClient() as http, anyio.create_task_group() as tg:
        worker = Worker(store, entry(h), make_config(worker={"lease": "30s"}), http=http)
        tg.start_soon(worker.run)
        with anyio.fail_after(10):
            await all_in.wait()
            worker.stop(now=True)
    # every lease was given back: a peer claims them all at once, long before 30 s
    batch = await store.claim(0, "query", 100, 10_000, "peer")
    assert {c.lease.task_id for c in batch.claimed} == set(ids)


async def test_new_work_wakes_an_idle_worker_fast(store: Store) -> None:
    h = Scripted()
    submitted_at: list[float] = []
    done = anyio.Event()

    def on_submit(ctx: HandlerContext) -> Submitted:
        submitted_at.append(anyio.current_time())
        done.set()
        return Submitted("x")

    h.on_submit = on_submit
    async with httpx.AsyncClient() as http, anyio.create_task_group() as tg:
        worker = Worker(store, entry(h), make_config(), http=http)
        tg.start_soon(worker.run)
        await wait_until(lambda: _true_after_idle(worker), "the worker to go idle")
        t0 = anyio.current_time()
        await submit_many(store, 1)
        with anyio.fail_after(2):
            await done.wait()
        worker.stop(now=True)
    # an idle worker blocks on the wake marker; 1 s would mean it slept instead
    assert submitted_at[0] - t0 < 1.0


async def _poll_delays_ms(store: Store, ids: list[str]) -> list[int]:
    """Each task's scheduled delay: its save set due_ms and updated_ms from one clock read."""
    delays = []
    for tid in ids:
        raw = await store.redis.hmget(store.ops._task(tid)[1], "due_ms", "updated_ms")
        delays.append(int(raw[0]) - int(raw[1]))
    return delays


async def _run_until(worker: Worker, done: Callable[[], Awaitable[bool]], what: str) -> None:
    """Run `worker` until `done()` holds (tasks that poll for hours never let it go idle)."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run)
        with anyio.fail_after(10):
            await wait_until(done, what)
        worker.stop(now=True)


async def _all_polled(store: Store, ids: list[str], polls: int) -> bool:
    for tid in ids:
        task = await store.get(tid)
        if task is None or task.poll_count < polls:
            return False
        if task.status is not (Status.RUNNING if polls else Status.SUBMITTED):
            return False
    return True


async def _poll_now(store: Store, ids: list[str]) -> None:
    """Make each task's next poll due at once, as if its interval had passed."""
    await store.redis.zadd(store.keys.scheduled(0, "query"), dict.fromkeys(ids, 0))


@pytest.mark.parametrize("jitter", [0.2, 0.0])
async def test_scheduled_polls_are_jittered_so_tasks_of_one_burst_spread(
    store: Store, jitter: float
) -> None:
    h = Scripted()
    h.on_query = lambda ctx: Running()  # no hint: the configured interval, jittered
    ids = await submit_many(store, 60)
    config = make_config(retry={"poll_interval": "10s", "poll_jitter": jitter})
    async with httpx.AsyncClient() as http:
        worker = Worker(store, entry(h), config, http=http)
        await _run_until(worker, lambda: _all_polled(store, ids, 0), "every submit saved")
        after_submit = await _poll_delays_ms(store, ids)
        await _poll_now(store, ids)
        worker = Worker(store, entry(h), config, http=http)
        await _run_until(worker, lambda: _all_polled(store, ids, 1), "every first poll saved")
        after_poll = await _poll_delays_ms(store, ids)
    for delays in (after_submit, after_poll):
        assert all(10_000 * (1 - jitter) <= d <= 10_000 * (1 + jitter) + 1 for d in delays)
        if jitter:
            # 60 draws of +-20%: a spread of under 2 s would mean no jitter at all
            assert max(delays) - min(delays) > 2_000, delays
        else:
            assert set(delays) == {10_000}


async def test_a_handlers_next_poll_hint_is_kept_exact(store: Store) -> None:
    h = Scripted()
    h.on_query = lambda ctx: Running(next_poll=3.0)
    ids = await submit_many(store, 20)
    config = make_config(retry={"poll_interval": "10s", "poll_jitter": 0.5})
    async with httpx.AsyncClient() as http:
        worker = Worker(store, entry(h), config, http=http)
        await _run_until(worker, lambda: _all_polled(store, ids, 0), "every submit saved")
        await _poll_now(store, ids)
        worker = Worker(store, entry(h), config, http=http)
        await _run_until(worker, lambda: _all_polled(store, ids, 1), "every first poll saved")
    assert await _poll_delays_ms(store, ids) == [3_000] * 20


async def _claimed_at(store: Store, task_id: str) -> float | None:
    task = await store.get(task_id)
    return None if task is None or task.status is Status.PENDING_SUBMIT else anyio.current_time()


async def test_after_a_partial_claim_round_the_next_waits_the_linger(store: Store) -> None:
    h = Scripted()
    h.on_query = lambda ctx: Running()
    first = (await submit_many(store, 1))[0]
    config = make_config(worker={"claim_linger": "1s"}, retry={"poll_interval": "1h"})
    async with httpx.AsyncClient() as http, anyio.create_task_group() as tg:
        worker = Worker(store, entry(h), config, http=http)
        tg.start_soon(worker.run)
        with anyio.fail_after(5):
            # One task found where up to 50 were asked for: a partial round, then the linger.
            first_at = await wait_until(lambda: _claimed_at(store, first), "the first claim")
            second = (await submit_many(store, 1))[0]
            second_at = await wait_until(lambda: _claimed_at(store, second), "the second")
        worker.stop(now=True)
    # Due at once, yet claimed only when the linger ended (a lower bound: a slow host only
    # makes it later). Without the linger the wake-up would have claimed it within ms.
    assert second_at - first_at >= 0.8


async def test_full_claim_rounds_claim_again_at_once(store: Store) -> None:
    h = Scripted()
    h.on_query = lambda ctx: Running()
    ids = await submit_many(store, 250)
    config = make_config(
        worker={"claim_linger": "1s", "batch_size": 50, "max_inflight": 1000},
        retry={"poll_interval": "1h"},
    )
    lingers: list[float] = []

    class Linger(float):
        """The worker asks `bool(claim_linger)` exactly when a round found less than it
        asked for and nothing more is ready, right before it lingers: count those."""

        def __bool__(self) -> bool:
            lingers.append(anyio.current_time())
            return True

    async with httpx.AsyncClient() as http:
        worker = Worker(store, entry(h), config, http=http)
        worker.claim_linger = Linger(worker.claim_linger)
        await _run_until(worker, lambda: _all_polled(store, ids, 0), "all 250 submitted")
    # Five full rounds of 50 went back to back: no round lingered before the last one
    # (which may find the set empty), whatever the machine's speed.
    assert len(lingers) <= 1, lingers


async def test_a_drain_cuts_the_claim_linger_short(store: Store) -> None:
    h = Scripted()
    h.on_query = lambda ctx: Running()
    task_id = (await submit_many(store, 1))[0]
    config = make_config(worker={"claim_linger": "1s"}, retry={"poll_interval": "1h"})
    async with httpx.AsyncClient() as http:
        worker = Worker(store, entry(h), config, http=http)
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            with anyio.fail_after(5):
                await wait_until(lambda: _claimed_at(store, task_id), "the claim")
                await wait_until(lambda: _saved(store, task_id), "the submit's save")
            stopped_at = anyio.current_time()
            worker.stop()
        # The loop was lingering (one task of 50 asked for); stop() ends that wait at once.
        assert anyio.current_time() - stopped_at < 0.5


async def _saved(store: Store, task_id: str) -> bool:
    task = await store.get(task_id)
    return task is not None and task.status is Status.SUBMITTED


async def _true_after_idle(worker: Worker) -> bool:
    return worker.last_claim_at > 0 and worker.claimer.sleep_until != float("inf")


async def test_a_poll_saved_during_a_claim_round_is_not_slept_through(store: Store) -> None:
    """Each query saves the next poll (50 ms) while the claim loop is still in a round that
    found nothing due; that nudge had nobody to wake and the loop slept its full 5 s cap.
    Five polls of one task must take about a second and a half here, not 25 s."""
    h = Scripted()
    polls = [Running(), Running(), Running(), Running(), Succeeded({"ok": True})]

    empty_round = [anyio.Event()]

    async def answer(outcome: Any) -> Any:
        empty_round[0] = anyio.Event()
        await empty_round[0].wait()  # saves during a round that has found nothing due
        return outcome

    h.on_query = lambda ctx: answer(polls[len(h.queries) - 1])
    [tid] = await submit_many(store, 1)
    real_claim_each = store.claim_each

    async def slow_claim_round(calls: Any) -> Any:
        # The worker claims through claim_each. The claims read Redis first, then the
        # round goes on for 100 ms: a poll saved then is after what the claims saw, and
        # the loop must still wake for it.
        results = await real_claim_each(calls)
        if not any(isinstance(r, ClaimBatch) and r.claimed for r in results):
            empty_round[0].set()
        await anyio.sleep(0.1)
        return results

    store.claim_each = slow_claim_round  # type: ignore[method-assign]
    async with httpx.AsyncClient() as http, anyio.create_task_group() as tg:
        worker = Worker(store, entry(h), make_config(), http=http)
        tg.start_soon(worker.run)

        async def done() -> bool:
            task = await store.get(tid)
            return task is not None and task.status is Status.SUCCEEDED

        await wait_until(done, "five polls 50 ms apart", timeout=4)
        worker.stop(now=True)
    assert len(h.queries) == 5
