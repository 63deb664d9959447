"""Corrupt task hashes in Redis: the store and the worker quarantine or skip, never crash.

Hypothesis writes random field values (wrong types, missing fields, truncated JSON blobs,
garbage statuses, `nan` and huge numbers, negative fences, non-integer counters) into the
hashes of real tasks (created and, for the query phase, driven to SUBMITTED by the real
scripts) that sit in the ready or the due set, as a buggy producer or a hand edit would
leave them, or replaces a task's hash by a key of another Redis type. Then:

- `Store.claim` returns without raising, claims every healthy task, and each corrupt one
  is either claimed (its corruption did not matter), quarantined, or dropped;
- `Store.get` returns a Task or raises `CorruptTask`, nothing else;
- a Worker finishes the healthy tasks, does not crash and does not hot-loop.

The tests at the end are regression tests for bugs this fuzzing found (fixed, see
docs/reliability.md section 6): a `nan` priority, a non-integer `version` or `fence`, a
task key of another type, and counter text that looks like an integer but that HINCRBY
refuses ('007', '-0', beyond 64 bits, 2**63 - 1) each used to crash the claim, time_out,
reap or start script half-way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import anyio
import httpx
import pytest
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asynctaskd.codec import encode_json
from asynctaskd.config import parse_config
from asynctaskd.errors import CorruptTask, ScriptError
from asynctaskd.handlers import HandlerContext, HandlerEntry, Submitted, Succeeded
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Phase, Status, Task
from asynctaskd.store import Code, Lease, Store
from asynctaskd.worker import Worker
from tests.conftest import wait_until
from tests.lua.helpers import ingest

pytestmark = pytest.mark.anyio

KEYS = Keys()
TAG = KEYS.tag(0)
FUZZ = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Fields the scripts increment with HINCRBY: a value HINCRBY refuses must get the task
# quarantined, never make a script fail half-way. They get the same garbage as the other
# fields, plus more integers.
HINCR_FIELDS = ("version", "fence", "submit_attempts", "reclaims")
# The counters the scripts check with the Lua prelude's `int_field` before incrementing.
GUARDED = ("version", "fence", "reclaims")
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
    b"nan",
    b"inf",
    b"-inf",
    b"1e999",
    b"-1",
    b"-nan",
    b"NaN",
    b"nan(0x1)",
    b"9223372036854775807",
    b"9223372036854775808",
    b"-9223372036854775808",
    b"-9223372036854775809",
    b"007",
    b"-0",
    b"+1",
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


garbage = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.sampled_from(NASTY),
    st.integers(-(2**70), 2**70).map(lambda i: str(i).encode()),
    st.floats(allow_nan=False).map(lambda f: repr(f).encode()),
    truncated_json(),
    json_values.map(encode_json),
)


# The whole hash replaced by a key of another Redis type (WRONGTYPE for HGET and friends).
RETYPE = "<key type>"
KEY_TYPES = [b"string", b"list", b"set", b"zset", b"stream"]

corruption = st.one_of(
    st.tuples(st.sampled_from((*FIELDS, "submit_attempts")), st.none() | garbage),
    st.tuples(st.sampled_from(GUARDED), st.none() | garbage),
    st.tuples(
        st.sampled_from(HINCR_FIELDS),
        st.integers(-(2**63), 2**63 - 2).map(lambda i: str(i).encode()),
    ),
    st.tuples(st.just(RETYPE), st.sampled_from(KEY_TYPES)),
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
    await ingest(store)  # a daemon takes the requests in: the tasks exist as hashes
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
        if name == RETYPE:
            assert value is not None
            await retype(r, key, value)
            return  # not a hash any more: the field changes after this one cannot apply
        if value is None:
            await r.hdel(key, name)
        else:
            await r.hset(key, name, value)


async def retype(r: redis.asyncio.Redis, key: str, kind: bytes) -> None:
    """Replace the task's hash by a key of another type, as a colliding writer would."""
    await r.delete(key)
    if kind == b"string":
        await r.set(key, "not a hash")
    elif kind == b"list":
        await r.rpush(key, "status", "PENDING_SUBMIT")
    elif kind == b"set":
        await r.sadd(key, "status")
    elif kind == b"zset":
        await r.zadd(key, {"status": 1})
    else:
        await r.xadd(key, {"status": "PENDING_SUBMIT"})


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
            # A query claim does not read params (only the submit call uses them): a task
            # whose params alone are corrupt is polled, and get() still reports them.
            assert isinstance(got, Task) or (
                phase == "query" and got is not None and got.reason.startswith("field params ")
            ), got
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


# --- Regression tests for bugs found by this fuzzing (see the module docstring) ------------

# Counter text that looks like an integer but that HINCRBY refuses: not canonical (x2),
# beyond int64, and 2**63 - 1 (the increment overflows). The Lua prelude's `int_field`
# used to take it for an integer; claim, time_out, reap and start then failed half-way.
TRAPS = [b"007", b"-0", b"9223372036854775808", b"9223372036854775807"]
FEW_TRAPS = [b"007", b"9223372036854775807"]


def counter_values(fixed: Sequence[bytes], traps: Sequence[bytes] = FEW_TRAPS) -> list[bytes]:
    """The values each fixed bug was found with."""
    return [*fixed, *traps]


T = TypeVar("T")


async def short(call: Awaitable[T]) -> T:
    """Await a store call; a ScriptError is raised again from here, without redis-py's
    frames: pytest would spend ~0.5 s formatting them for a failing case."""
    try:
        return await call
    except ScriptError as exc:
        raise ScriptError(str(exc)) from None


async def test_nan_priority_in_due_set_does_not_block_claims(
    store: Store, redis_client: redis.asyncio.Redis
) -> None:
    good, [bad] = await seed(store, redis_client, "submit", [([("priority", b"nan")], "due")])
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    assert {c.task.id for c in batch.claimed} == set(good)
    assert await redis_client.zscore(KEYS.quarantine(0), bad) is not None


# 16 digits: an integer HINCRBY takes, but beyond what the scripts add 1 to in Lua
@pytest.mark.parametrize("value", counter_values([b"x", b"1.5", b" 7 ", b"1" + b"0" * 15], TRAPS))
@pytest.mark.parametrize("field", ["version", "fence"])
async def test_non_integer_counter_is_quarantined_at_claim(
    store: Store, redis_client: redis.asyncio.Redis, field: str, value: bytes
) -> None:
    good, [bad] = await seed(store, redis_client, "submit", [([(field, value)], "ready")])
    batch = await short(store.claim(0, "submit", 10, 10_000, "w"))
    assert {c.task.id for c in batch.claimed} == set(good)
    assert await redis_client.zscore(KEYS.quarantine(0), bad) is not None


@pytest.mark.parametrize("value", counter_values([b"x"]))
async def test_corrupt_version_does_not_block_the_deadline_sweep(
    store: Store, redis_client: redis.asyncio.Redis, value: bytes
) -> None:
    await redis_client.flushdb()
    ids = []
    for i in range(3):
        tid = new_task_id()
        await store.run(store.ops.create(tid, "demo", encode_json({"i": i}), timeout_ms=1))
        ids.append(tid)
    await ingest(store)
    await redis_client.hset(KEYS.task(0, ids[0]), "version", value)

    async def past_deadlines() -> bool:
        deadline_ms = int(await redis_client.hget(KEYS.task(0, ids[-1]), "deadline_ms") or 0)
        return await store.server_time() * 1000 > deadline_ms

    await wait_until(past_deadlines, "the 1 ms deadlines to pass")
    # the bug was: ScriptError, and no later deadline on the shard is enforced
    sweep = await short(store.time_out(0, 100))
    assert set(ids[1:]) <= set(sweep.timed_out)
    assert await redis_client.zscore(KEYS.quarantine(0), ids[0]) is not None


@pytest.mark.parametrize("value", counter_values([b"x"]))
@pytest.mark.parametrize("field", ["version", "reclaims"])
async def test_corrupt_counter_does_not_block_the_reaper(
    store: Store, redis_client: redis.asyncio.Redis, field: str, value: bytes
) -> None:
    good, [bad] = await seed(store, redis_client, "query", [([], "ready")])
    batch = await store.claim(0, "query", 10, 10_000, "w")
    assert len(batch.claimed) == len(good) + 1
    await redis_client.hset(KEYS.task(0, bad), field, value)
    await redis_client.zadd(KEYS.leases(0), {c.task.id: 1 for c in batch.claimed})  # expired
    reaped = await short(store.reap(0, 100, 5))  # was: ScriptError, all leases stayed
    assert {tid for tid, _ in reaped} == set(good)
    assert await redis_client.zscore(KEYS.quarantine(0), bad) is not None


async def test_task_key_of_the_wrong_type(store: Store, redis_client: redis.asyncio.Redis) -> None:
    good, [bad] = await seed(store, redis_client, "submit", [([], "due")])
    key = KEYS.task(0, bad)
    await redis_client.delete(key)
    await redis_client.set(key, "not a hash")
    with pytest.raises(CorruptTask):
        await store.get(bad)
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    assert {c.task.id for c in batch.claimed} == set(good)


@pytest.mark.parametrize("value", counter_values([b"x"], [b"9223372036854775807"]))
async def test_worker_survives_a_task_that_breaks_the_claim_script(
    store: Store, redis_client: redis.asyncio.Redis, value: bytes
) -> None:
    # the bug was: the aborted claim had already leased the healthy tasks before it (they
    # sort first), and they stayed in SUBMITTING, never returned to any worker
    good, _ = await seed(store, redis_client, "submit", [([("version", value)], "ready")])
    await run_worker(store)
    for tid in good:
        task = await store.get(tid)
        assert task is not None and task.status is Status.SUCCEEDED, task


# start.lua HSETs started_fence, then HINCRBYs submit_attempts: a value HINCRBY refuses
# failed start half-way, marking a submit that never happened. The claim quarantines it now.
@pytest.mark.parametrize("value", FEW_TRAPS)
async def test_start_does_not_fail_half_way_on_a_corrupt_submit_attempts(
    store: Store, redis_client: redis.asyncio.Redis, value: bytes
) -> None:
    # (a non-numeric value such as b"x" is quarantined by the claim: codec._int refuses it)
    _, [bad] = await seed(
        store, redis_client, "submit", [([("submit_attempts", value)], "ready")], healthy=0
    )
    batch = await store.claim(0, "submit", 10, 10_000, "w")
    if not batch.claimed:  # quarantined at the claim: fine
        assert await redis_client.zscore(KEYS.quarantine(0), bad) is not None
        return
    [claimed] = batch.claimed
    key = KEYS.task(0, bad)
    before = await redis_client.hgetall(key)
    try:
        result = await store.start(claimed.lease, False)
    except ScriptError:
        result = None
    if result is None or result.code is not Code.OK:
        after = await redis_client.hgetall(key)
        assert after == before, f"start failed half-way: {before} -> {after}"
