"""Corrupt task hashes in Redis: the store and the worker quarantine or skip, never crash.

Hypothesis writes random field values (wrong types, missing fields, truncated JSON blobs,
garbage statuses, huge numbers, negative fences) into the hashes of real tasks (created
and, for the query phase, driven to SUBMITTED by the real scripts) that sit in the ready
or the due set, as a buggy producer or a hand edit would leave them. Then:

- `Store.claim` returns without raising, claims every healthy task, and each corrupt one
  is either claimed (its corruption did not matter), quarantined, or dropped;
- `Store.get` returns a Task or raises `CorruptTask`, nothing else;
- a Worker finishes the healthy tasks, does not crash and does not hot-loop.

Corruptions that crash a script half-way (a non-integer `version` or `fence`, a `nan`
priority, a task key of another type) are known bugs: they are excluded from the broad
strategies and pinned by the `xfail(strict=True)` regression tests at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import httpx
import pytest
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asynctaskd.codec import encode_json
from asynctaskd.config import parse_config
from asynctaskd.errors import CorruptTask
from asynctaskd.handlers import HandlerContext, HandlerEntry, Submitted, Succeeded
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Phase, Status, Task
from asynctaskd.store import Code, Lease, Store
from asynctaskd.worker import Worker
from tests.conftest import wait_until

pytestmark = pytest.mark.anyio

KEYS = Keys()
TAG = KEYS.tag(0)
FUZZ = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Fields the scripts increment with HINCRBY: a non-integer there makes the script fail
# half-way (see the xfail tests below), so the broad strategy only gives them integers.
HINCR_FIELDS = ("version", "fence", "submit_attempts", "reclaims")
FIELDS = (
    "id",
    "handler",
    "status",
    "priority",
    "params",
    "metadata",
    "created_ms",
    "updated_ms",
    "deadline_ms",
    "timeout_ms",
    "due_ms",
    "owner",
    "started_fence",
    "idempotent",
    "poll_count",
    "consecutive_errors",
    "cancel_requested",
    "cancel_version",
    "external_id",
    "handle",
    "result",
    "error_code",
    "progress",
    "stage",
    "dedup",
    "tenant",
)
NASTY = [
    b"",
    b"-nan",
    b"inf",
    b"-inf",
    b"1e999",
    b"-1",
    b"-9223372036854775809",
    b"9" * 30,
    b"9" * 5000,
    b"0x10",
    b"1.5",
    b" 7 ",
    b"{",
    b"[1,",
    b'{"external_id":',
    b"null",
    b"[]",
    b'"text"',
    b"\xff\xfe\x00",
    b"RUNNING ",
    b"succeeded",
    b"SUBMIT_UNKNOWN",
    b"TRACKING_TIMED_OUT",
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=10,
)


@st.composite
def truncated_json(draw: st.DrawFn) -> bytes:
    blob = encode_json(draw(json_values))
    return blob[: draw(st.integers(0, max(0, len(blob) - 1)))]


def _no_nan(value: bytes) -> bool:
    # 'nan' in `priority` breaks claim's promotion (xfail test below); keep it out here.
    return b"nan" not in value.lower()


garbage = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.sampled_from(NASTY),
    st.integers(-(2**70), 2**70).map(lambda i: str(i).encode()),
    st.floats(allow_nan=False).map(lambda f: repr(f).encode()),
    truncated_json(),
    json_values.map(encode_json),
).filter(_no_nan)

corruption = st.one_of(
    st.tuples(st.sampled_from(FIELDS), st.none() | garbage),
    st.tuples(
        st.sampled_from(HINCR_FIELDS),
        st.none() | st.integers(-(2**62), 2**62).map(lambda i: str(i).encode()),
    ),
)
corrupt_tasks = st.lists(
    st.tuples(st.lists(corruption, min_size=1, max_size=4), st.sampled_from(["ready", "due"])),
    min_size=1,
    max_size=3,
)


class Echo:
    """A handler that always succeeds at once: only the corrupt data can go wrong."""

    key = "demo"
    idempotent_submit = False

    async def submit(self, params: Any, ctx: HandlerContext) -> Submitted:
        return Submitted("x-" + ctx.task_id)

    async def query(self, handle: dict[str, Any], ctx: HandlerContext) -> Succeeded:
        return Succeeded({"ok": True})


async def make_tasks(store: Store, n: int, phase: Phase) -> list[str]:
    """n tasks due now in `phase`: created, and for 'query' claimed, started, submitted."""
    ids = [new_task_id() for _ in range(n)]
    for i, tid in enumerate(ids):
        await store.run(store.ops.create(tid, "demo", encode_json({"i": i}), timeout_ms=60_000))
    if phase == "query":
        batch = await store.claim(0, "submit", n, 10_000, "setup")
        assert {c.task.id for c in batch.claimed} == set(ids)
        for c in batch.claimed:
            r = await store.start(c.lease, False)
            lease = Lease(c.lease.task_id, c.lease.fence, r.version)
            handle = encode_json({"external_id": "x-" + c.task.id, "query": {}})
            fields: dict[str, str | bytes | int | float] = {
                "external_id": "x-" + c.task.id,
                "handle": handle,
            }
            saved = await store.save(lease, Status.SUBMITTED, fields=fields)
            assert saved.code is Code.OK
    return ids


async def corrupt(
    r: redis.asyncio.Redis, task_id: str, changes: Sequence[tuple[str, bytes | None]]
) -> None:
    key = KEYS.task(0, task_id)
    for name, value in changes:
        if value is None:
            await r.hdel(key, name)
        else:
            await r.hset(key, name, value)


async def move_to_due(r: redis.asyncio.Redis, task_id: str, phase: Phase) -> None:
    """As if the task had been scheduled for later and that time has come."""
    await r.zrem(KEYS.ready(0, phase), task_id)
    await r.zadd(KEYS.scheduled(0, phase), {task_id: 1})


async def get_or_corrupt(store: Store, task_id: str) -> Task | CorruptTask | None:
    try:
        return await store.get(task_id)
    except CorruptTask as exc:
        return exc


async def seed(
    store: Store,
    r: redis.asyncio.Redis,
    phase: Phase,
    bad: Sequence[tuple[Sequence[tuple[str, bytes | None]], str]],
    healthy: int = 3,
) -> tuple[list[str], list[str]]:
    await r.flushdb()
    ids = await make_tasks(store, healthy + len(bad), phase)
    good, broken = ids[:healthy], ids[healthy:]
    for tid, (changes, where) in zip(broken, bad, strict=True):
        await corrupt(r, tid, changes)
        if where == "due":
            await move_to_due(r, tid, phase)
    return good, broken


@FUZZ
@given(bad=corrupt_tasks, phase=st.sampled_from(["submit", "query"]))
async def test_claim_quarantines_or_skips_corrupt_tasks(
    store: Store,
    redis_client: redis.asyncio.Redis,
    bad: list[tuple[list[tuple[str, bytes | None]], str]],
    phase: Phase,
) -> None:
    good, broken = await seed(store, redis_client, phase, bad)
    claimed: list[str] = []
    for _ in range(5):
        batch = await store.claim(0, phase, 100, 10_000, "w")  # never raises
        claimed += [c.task.id for c in batch.claimed]
        if not batch.claimed and not batch.ready_left:
            break
    assert set(good) <= set(claimed), "a healthy task was not claimed"
    assert len(claimed) == len(set(claimed)), "a task was claimed twice"
    members: list[Any] = await redis_client.zrange(KEYS.quarantine(0), 0, -1)
    quarantined = {m.decode() for m in members}
    for tid in broken:
        got = await get_or_corrupt(store, tid)  # a Task or CorruptTask, nothing else
        if tid in claimed:
            assert isinstance(got, Task)
        elif isinstance(got, CorruptTask):
            assert tid in quarantined or not await _claimable(redis_client, tid, phase)


async def _claimable(r: redis.asyncio.Redis, task_id: str, phase: Phase) -> bool:
    """Still sitting in a due or ready set of the phase: it was neither dropped nor seen."""
    for key in (KEYS.ready(0, phase), KEYS.scheduled(0, phase)):
        if await r.zscore(key, task_id) is not None:
            return True
    return False


@FUZZ
@given(changes=st.lists(corruption, min_size=1, max_size=6))
async def test_get_raises_corrupt_task_or_returns_a_task(
    store: Store,
    redis_client: redis.asyncio.Redis,
    changes: list[tuple[str, bytes | None]],
) -> None:
    await redis_client.flushdb()
    [tid] = await make_tasks(store, 1, "submit")
    await corrupt(redis_client, tid, changes)
    got = await get_or_corrupt(store, tid)
    assert isinstance(got, Task | CorruptTask)
    if isinstance(got, CorruptTask):
        assert got.task_id and got.reason, "the error names the task and the field"


def worker_config() -> Any:
    return parse_config(
        "[worker]\nlease = 2\nmax_inflight = 50\nshutdown_grace = 1\n"
        "[retry]\npoll_interval = 0.01\nfirst_error_delay = 0.01\nmax_error_delay = 0.05\n"
    )


async def run_worker(store: Store) -> Worker:
    async with httpx.AsyncClient() as http:
        entries = {"demo": HandlerEntry(key="demo", handler=Echo(), provider="demo")}
        worker = Worker(store, entries, worker_config(), http=http)
        with anyio.fail_after(20):
            await worker.run_until_idle()
    return worker


@settings(FUZZ, max_examples=20)
@given(bad=corrupt_tasks, phase=st.sampled_from(["submit", "query"]))
async def test_worker_finishes_healthy_tasks_beside_corrupt_ones(
    store: Store,
    redis_client: redis.asyncio.Redis,
    bad: list[tuple[list[tuple[str, bytes | None]], str]],
    phase: Phase,
) -> None:
    good, _ = await seed(store, redis_client, phase, bad)
    store.round_trips.clear()
    await run_worker(store)  # does not raise, returns once nothing is due
    for tid in good:
        task = await store.get(tid)
        assert task is not None and task.status is Status.SUCCEEDED, task
    claims = store.round_trips.get("claim", 0)
    assert claims < 200, f"{claims} claim calls for {len(good) + len(bad)} tasks: a hot loop"


# --- Known bugs, pinned (see the module docstring) ----------------------------------------


async def test_nan_priority_in_due_set_does_not_block_claims(
    store: Store, redis_client: redis.asyncio.Redis
) -> None:
    good, [bad] = await seed(store, redis_client, "submit", [([("priority", b"nan")], "due")])
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    assert {c.task.id for c in batch.claimed} == set(good)
    assert await redis_client.zscore(KEYS.quarantine(0), bad) is not None


@pytest.mark.parametrize("field", ["version", "fence"])
async def test_non_integer_counter_is_quarantined_at_claim(
    store: Store, redis_client: redis.asyncio.Redis, field: str
) -> None:
    good, [bad] = await seed(store, redis_client, "submit", [([(field, b"x")], "ready")])
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    assert {c.task.id for c in batch.claimed} == set(good)
    assert await redis_client.zscore(KEYS.quarantine(0), bad) is not None


async def test_corrupt_version_does_not_block_the_deadline_sweep(
    store: Store, redis_client: redis.asyncio.Redis
) -> None:
    await redis_client.flushdb()
    ids = []
    for i in range(3):
        tid = new_task_id()
        await store.run(store.ops.create(tid, "demo", encode_json({"i": i}), timeout_ms=1))
        ids.append(tid)
    await redis_client.hset(KEYS.task(0, ids[0]), "version", "x")

    async def past_deadlines() -> bool:
        deadline_ms = int(await redis_client.hget(KEYS.task(0, ids[-1]), "deadline_ms") or 0)
        return await store.server_time() * 1000 > deadline_ms

    await wait_until(past_deadlines, "the 1 ms deadlines to pass")
    try:
        timed_out = await store.time_out(0, 100)
    except Exception as exc:  # the bug: ScriptError, and the other two never time out
        pytest.fail(f"time_out raised {exc!r}")
    assert set(ids[1:]) <= set(timed_out)


async def test_task_key_of_the_wrong_type(store: Store, redis_client: redis.asyncio.Redis) -> None:
    good, [bad] = await seed(store, redis_client, "submit", [([], "due")])
    key = KEYS.task(0, bad)
    await redis_client.delete(key)
    await redis_client.set(key, "not a hash")
    with pytest.raises(CorruptTask):
        await store.get(bad)
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    assert {c.task.id for c in batch.claimed} == set(good)


async def test_worker_survives_a_task_that_breaks_the_claim_script(
    store: Store, redis_client: redis.asyncio.Redis
) -> None:
    good, _ = await seed(store, redis_client, "submit", [([("version", b"x")], "ready")])
    await run_worker(store)
    for tid in good:
        task = await store.get(tid)
        assert task is not None and task.status is Status.SUCCEEDED, task
