"""The history checker itself: it passes a clean history and catches each planted fault.

Synthetic histories need no Redis; the last tests read a real one written by the real
scripts (fast: no daemons), then tamper with it, and plant a secret in a real server,
in log files and in a run's report for the secret scan to find; one reads all 8 shards
of a local 3-master cluster and catches a count moved between shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
from redis import Redis

from asynctaskd.codec import encode_json
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.store import Lease, Store
from tests.chaos.checker import (
    Event,
    History,
    SecretScan,
    Submission,
    check,
    read_history,
    scan_files,
    scan_redis,
)
from tests.chaos.runner import ChaosConfig, RunOutcome, judge

T0 = 1_700_000_000_000  # ms


def ok_task(tid: str, *, handler: str = "demo", n: int = 1) -> dict[str, str]:
    params = {"n": n}
    return {
        "id": tid,
        "handler": handler,
        "status": "SUCCEEDED",
        "params": json.dumps(params),
        "result": json.dumps({"output": params, "ref": tid}),
        "external_id": f"job_{n}",
        "created_ms": str(T0),
        "deadline_ms": str(T0 + 30_000),
        "finished_ms": str(T0 + 900),
        "version": "8",
        "fence": "2",
        "submit_attempts": "1",
    }


def ok_events(tid: str, start_pos: int = 0) -> list[Event]:
    steps = [
        ("PENDING_SUBMIT", 1),
        ("SUBMITTING", 2),
        ("SUBMITTED", 4),
        ("RUNNING", 6),
        ("SUCCEEDED", 8),
    ]
    return [
        Event(start_pos + i, T0 + 100 * i, status, version, {"task": tid})
        for i, (status, version) in enumerate(steps)
    ]


def vendor_entry(tid: str, n: int, outcome: str = "created", at_ms: int = T0 + 150) -> Any:
    return {"job_id": f"job_{n}", "ref": tid, "idempotency_key": None, "outcome": outcome,
            "at": at_ms / 1000}  # fmt: skip


def clean(n_tasks: int = 2) -> History:
    tasks: dict[str, dict[str, str]] = {}
    events: dict[str, list[Event]] = {}
    log = []
    for n in range(1, n_tasks + 1):
        tid = new_task_id()
        tasks[tid] = ok_task(tid, n=n)
        events[tid] = ok_events(tid, start_pos=10 * n)
        log.append(vendor_entry(tid, n))
    return History(
        tasks=tasks,
        events=events,
        counts={"SUCCEEDED": n_tasks, "SUCCEEDED@demo": n_tasks},
        indexes={"idx:SUCCEEDED": {t: float(T0) for t in tasks}},
        stream_complete=True,
        vendor_log=log,
        submissions=[Submission(t) for t in tasks],
    )


def kinds(history: History) -> set[str]:
    return set(check(history).kinds())


def first(history: History) -> str:
    return next(iter(history.tasks))


def test_a_clean_history_passes() -> None:
    report = check(clean())
    assert report.ok, report.format()
    assert report.checked["tasks"] == 2 and report.checked["transitions"] == 10
    assert "OK" in report.format()


def test_catches_a_duplicate_vendor_job() -> None:
    h = clean()
    tid = first(h)
    h.vendor_log.append(vendor_entry(tid, 99, "ambiguous"))
    report = check(h)
    assert {"duplicate_vendor_job", "vendor_call_without_start_mark"} <= set(report.kinds())
    text = report.format()
    assert tid in text and "job_99" in text and "event @" in text, "the whole history is printed"


def test_a_second_job_is_no_duplicate_for_an_idempotent_handler() -> None:
    h = clean()
    tid = first(h)
    h.tasks[tid]["submit_attempts"] = "2"
    h.vendor_log.append(vendor_entry(tid, 99, "created"))
    h.idempotent_handlers = frozenset({"demo"})
    assert kinds(h) == set()


def test_catches_a_vendor_call_without_a_start_mark() -> None:
    h = clean()
    h.tasks[first(h)]["submit_attempts"] = "0"
    assert kinds(h) == {"vendor_call_without_start_mark"}


def test_catches_an_illegal_transition() -> None:
    h = clean()
    tid = first(h)
    evs = h.events[tid]
    # PENDING_SUBMIT straight to SUBMITTED: the claim (SUBMITTING) never happened.
    h.events[tid] = [evs[0], *evs[2:]]
    assert "illegal_transition" in kinds(h)
    h = clean()
    tid = first(h)
    h.events[tid].append(Event(99, T0 + 999, "RUNNING", 9, {"task": tid}))
    assert "illegal_transition" in kinds(h)  # SUCCEEDED -> RUNNING


def test_catches_a_version_going_backwards() -> None:
    h = clean()
    tid = first(h)
    evs = h.events[tid]
    evs[3] = Event(evs[3].pos, evs[3].ms, "RUNNING", 3, evs[3].fields)
    assert kinds(h) == {"version_not_increasing"}


def test_catches_a_repeated_version() -> None:
    h = clean()
    tid = first(h)
    evs = h.events[tid]
    evs.insert(4, Event(evs[3].pos, evs[3].ms, "RUNNING", 6, evs[3].fields))
    assert kinds(h) == {"version_not_increasing"}


def test_catches_counter_drift_and_index_disagreement() -> None:
    h = clean()
    h.counts["SUCCEEDED"] = 3
    h.counts["FAILED"] = -1
    h.indexes["idx:SUCCEEDED"].pop(first(h))
    assert kinds(h) == {"counter_drift", "index_disagrees"}


def test_catches_a_lease_left_behind_and_an_unsettled_task() -> None:
    h = clean()
    tid = first(h)
    h.indexes["leases"] = {tid: float(T0)}
    assert kinds(h) == {"lease_left"}
    h = clean()
    tid = first(h)
    h.tasks[tid]["status"] = "RUNNING"
    h.events[tid].pop()
    h.counts = {"SUCCEEDED": 1, "SUCCEEDED@demo": 1, "RUNNING": 1, "RUNNING@demo": 1}
    h.indexes["idx:SUCCEEDED"].pop(tid)
    h.indexes["idx:RUNNING"] = {tid: float(T0)}
    h.tasks[tid].pop("result")
    assert kinds(h) == {"unsettled"}


def test_catches_a_lost_task() -> None:
    h = clean()
    h.submissions.append(Submission(new_task_id()))
    assert kinds(h) == {"lost_task"}


def test_catches_a_late_settle() -> None:
    h = clean()
    tid = first(h)
    h.tasks[tid]["deadline_ms"] = str(T0 + 100)
    assert check(h, slack_s=10).ok
    h.events[tid][-1] = Event(14, T0 + 20_000, "SUCCEEDED", 8, {"task": tid})
    assert set(check(h, slack_s=10).kinds()) == {"settled_late"}


def test_submit_unknown_needs_a_started_submit() -> None:
    h = clean()
    tid = first(h)
    h.tasks[tid].update(status="SUBMIT_UNKNOWN", submit_attempts="0", version="4")
    del h.tasks[tid]["result"]
    h.events[tid] = [*h.events[tid][:2], Event(12, T0 + 300, "SUBMIT_UNKNOWN", 4, {"task": tid})]
    h.vendor_log = [e for e in h.vendor_log if e["ref"] != tid]
    h.counts = {"SUCCEEDED": 1, "SUCCEEDED@demo": 1, "SUBMIT_UNKNOWN": 1, "SUBMIT_UNKNOWN@demo": 1}
    h.indexes["idx:SUCCEEDED"].pop(tid)
    h.indexes["idx:SUBMIT_UNKNOWN"] = {tid: float(T0)}
    h.tasks[tid].pop("external_id")
    assert kinds(h) == {"parked_without_start"}
    h.tasks[tid]["submit_attempts"] = "1"
    report = check(h)
    assert report.ok, report.format()
    assert report.figures["SUBMIT_UNKNOWN breakdown"] == {"no request reached the vendor (-)": 1}


def test_catches_a_vendor_job_created_after_a_plain_cancel() -> None:
    h = clean(1)
    tid = first(h)
    h.tasks[tid].update(status="CANCELED", version="2", submit_attempts="1")
    for field in ("result", "external_id"):
        h.tasks[tid].pop(field)
    h.events[tid] = [h.events[tid][0], Event(11, T0 + 100, "CANCELED", 2, {"task": tid})]
    h.counts = {"CANCELED": 1, "CANCELED@demo": 1}
    h.indexes = {"idx:CANCELED": {tid: float(T0)}}
    h.vendor_log = [vendor_entry(tid, 1, at_ms=T0 + 50)]  # before the cancel: fine
    assert check(h).ok
    h.vendor_log = [vendor_entry(tid, 1, at_ms=T0 + 400)]
    assert kinds(h) == {"job_after_cancel"}


def test_catches_a_stale_result_and_a_foreign_handle() -> None:
    h = clean()
    a, b = list(h.tasks)
    h.tasks[a]["result"] = h.tasks[b]["result"]
    assert kinds(h) == {"wrong_result"}
    h = clean()
    a, b = list(h.tasks)
    h.tasks[a]["external_id"] = h.tasks[b]["external_id"]
    assert kinds(h) == {"wrong_external_id"}


def test_catches_two_live_tasks_with_one_dedup_key() -> None:
    h = clean()
    a, b = list(h.tasks)
    h.tasks[a]["dedup"] = h.tasks[b]["dedup"] = "2:t1:order-1"
    assert check(h).ok  # a finished before b was created
    h.events[b] = ok_events(b, start_pos=12)  # b created while a was live
    assert kinds(h) == {"dedup_overlap"}


# --- Against a real Redis, written by the real scripts --------------------------------------


async def drive(store: Store, outcome: Status) -> str:
    tid = new_task_id()
    await store.run(store.ops.create(tid, "demo", encode_json({"n": 1}), timeout_ms=60_000))
    [c] = (await store.claim(0, "submit", 1, 10_000, "w")).claimed
    r = await store.start(c.lease, False)
    lease = Lease(tid, c.lease.fence, r.version)
    handle = encode_json({"external_id": "job_1", "query": {}})
    fields: dict[str, str | bytes | int | float] = {"external_id": "job_1", "handle": handle}
    r = await store.save(lease, Status.SUBMITTED, fields=fields)
    [c] = (await store.claim(0, "query", 1, 10_000, "w")).claimed
    await store.save(c.lease, outcome, fields={"result": encode_json({"output": {"n": 1}})})
    return tid


@pytest.mark.anyio
async def test_reads_a_real_history_and_catches_tampering(
    store: Store, redis_client: redis.asyncio.Redis, redis_url: str, keys: Keys
) -> None:
    ids = [await drive(store, Status.SUCCEEDED), await drive(store, Status.FAILED)]
    sync = Redis.from_url(redis_url)
    try:
        history = read_history(sync)
        report = check(history, check_results=False)
        assert report.ok, report.format()
        assert set(history.tasks) == set(ids) and history.stream_complete
        assert [e.status for e in history.events[ids[0]]] == [
            "PENDING_SUBMIT",
            "SUBMITTING",
            "SUBMITTED",
            "SUCCEEDED",
        ]
        await redis_client.hincrby(keys.counts(0), "SUCCEEDED@demo", 1)
        await redis_client.xadd(keys.events(0), {"task": ids[0], "status": "RUNNING", "version": 2})
        await redis_client.zadd(keys.leases(0), {ids[1]: 1})
        found = set(check(read_history(sync), check_results=False).kinds())
        assert {"counter_drift", "version_not_increasing", "illegal_transition"} <= found
        assert {"stream_disagrees", "lease_left"} <= found
    finally:
        sync.close()


def test_catches_a_claim_of_a_paused_tenant_and_a_held_task_left_behind() -> None:
    h = clean()
    a, b = list(h.tasks)
    h.tasks[a]["tenant"] = "t3"
    h.pause_windows = [("tenant:t3", T0 + 50, T0 + 5_000)]  # a's claim is at T0 + 100
    report = check(h)
    assert set(report.kinds()) == {"claimed_while_paused"}
    assert report.figures["submit claims of other tenants during pauses"] == 1  # b's
    h.pause_windows = [("tenant:t3", T0 + 150, T0 + 5_000)]
    assert check(h).ok
    h.indexes["held:tenant:t3"] = {b: 1.0}
    assert kinds(h) == {"index_left"}


# --- Secrets: the scan finds what was planted, wherever it is --------------------------------

SECRET = "chaos-secret-5e1f0c3a9b7d2e4f6a8c0b1d"


def test_secret_scan_finds_a_secret_planted_anywhere_in_redis(sync_redis: Redis) -> None:
    r: Any = sync_redis
    task = "atd:{s0}:task:" + new_task_id()
    r.hset(task, mapping={"status": "FAILED", "error_code": "HTTP_401", "version": 3})
    r.xadd("atd:{s0}:events", {"task": "t0", "status": "PENDING_SUBMIT", "version": 1})
    scan = SecretScan(SECRET)
    scan_redis(sync_redis, scan)
    assert scan.found == [] and scan.checked["secret scan: Redis keys"] >= 2

    half = SECRET[: len(SECRET) // 2 + 3]  # an error message cut short
    r.hset(task, "error_message", f"AUTH failed for {SECRET}")
    r.hset("atd:{s0}:task:t2", mapping={SECRET: "x", "error_message": f"...{half}"})
    r.set(f"atd:cache:{SECRET}", "1")
    r.rpush("atd:list", "a", SECRET)
    r.sadd("atd:set", "b", SECRET)
    r.zadd("atd:zset", {SECRET: 1.0})
    r.xadd("atd:{s0}:events", {"task": "t1", "status": "FAILED", "message": SECRET})
    kwargs = sync_redis.connection_pool.connection_kwargs
    other: Any = Redis(host=kwargs["host"], port=kwargs["port"], db=3)
    try:
        other.set("db3-key", SECRET.encode() + b"\xff")
        scan = SecretScan(SECRET)
        scan_redis(sync_redis, scan)
    finally:
        other.flushdb()
        other.close()
    found = " | ".join(scan.found)
    assert len(scan.found) == 9, found
    for place in (
        f"hash {task!r} field 'error_message'",
        "hash 'atd:{s0}:task:t2' field '<secret>'",
        "hash 'atd:{s0}:task:t2' field 'error_message'",
        "the name of key 'atd:cache:<secret>'",
        "list 'atd:list'",
        "set 'atd:set'",
        "zset 'atd:zset'",
        "stream 'atd:{s0}:events' entry",
        "Redis db3: string 'db3-key'",
    ):
        assert place in found, place
    assert scan.checked["secret scan: stream entries"] == 2
    violations = scan.violations()
    assert {v.kind for v in violations} == {"secret_leak"}
    assert not any(scan.holds_secret(v.message) for v in violations), "places are masked"


def test_secret_scan_reads_files_and_text(tmp_path: Path) -> None:
    clean = tmp_path / "daemon-0-1.log"
    clean.write_text('{"level": "warning", "msg": "save refused: STALE_FENCE"}\n')
    leaky = tmp_path / "daemon-1-2.log"
    leaky.write_bytes(b'{"msg": "cannot connect: WRONGPASS ' + SECRET.encode() + b'"}\n\xff')
    scan = SecretScan(SECRET)
    files = [("daemon log a", clean), ("daemon log b", leaky), ("gone", tmp_path / "no")]
    scan_files(files, scan)
    assert scan.found == ["daemon log b"]
    assert scan.checked["secret scan: files"] == 2
    assert scan.holds_secret("report text\n" + SECRET[-20:])
    assert not scan.holds_secret("report text\nchaos-secret-")
    with pytest.raises(ValueError, match="16 characters"):
        SecretScan("short")


def test_judge_reports_leaks_and_a_secret_in_the_report_itself(tmp_path: Path) -> None:
    cfg = ChaosConfig(workdir=tmp_path, secret=SECRET)
    assert SECRET not in repr(cfg)
    outcome = RunOutcome(cfg, clean(), exit_codes=[0, 0, 0], secret_scan=SecretScan(SECRET))
    report = judge(outcome)
    assert report.ok, report.format()
    outcome.secret_scan = scan = SecretScan(SECRET)
    scan.look("daemon log daemon-2-9.log", f"password={SECRET}")
    outcome.problems.append(f"daemon 2 exited on its own (1):\nREDIS_PASSWORD={SECRET}")
    report = judge(outcome)
    assert report.kinds() == {"runner": 1, "secret_leak": 2}, report.format()
    messages = [v.message for v in report.violations if v.kind == "secret_leak"]
    assert messages == [
        "the secret is in daemon log daemon-2-9.log",
        "the secret is in this report",
    ]


# --- On Redis Cluster: every shard on every primary ------------------------------------------


async def drive_on(store: Store, shard: int, outcome: Status) -> str:
    """`drive` on one shard of several."""
    tid = new_task_id(shard)
    await store.run(store.ops.create(tid, "demo", encode_json({"n": 1}), timeout_ms=60_000))
    [c] = (await store.claim(shard, "submit", 1, 10_000, "w")).claimed
    r = await store.start(c.lease, False)
    lease = Lease(tid, c.lease.fence, r.version)
    handle = encode_json({"external_id": "job_1", "query": {}})
    fields: dict[str, str | bytes | int | float] = {"external_id": "job_1", "handle": handle}
    await store.save(lease, Status.SUBMITTED, fields=fields)
    [c] = (await store.claim(shard, "query", 1, 10_000, "w")).claimed
    await store.save(c.lease, outcome, fields={"result": encode_json({"output": {"n": 1}})})
    return tid


@pytest.mark.slow
def test_reads_every_shard_of_a_cluster_and_catches_tampering(tmp_path: Path) -> None:
    import anyio
    from redis.cluster import ClusterNode, RedisCluster

    from asynctaskd.embedded import find_binary
    from asynctaskd.store import open_redis
    from tests.cluster import LocalCluster

    binary = find_binary("redis-server") or find_binary("valkey-server")
    if binary is None:
        pytest.skip("no redis-server or valkey-server")
    shards = 8
    keys = Keys("atd", shards)
    with LocalCluster(binary, tmp_path / "cluster") as c:

        async def write() -> list[str]:
            client = open_redis(c.url)
            store = Store(client, keys)
            try:
                await store.prepare()
                return [await drive_on(store, s, Status.SUCCEEDED) for s in range(shards)]
            finally:
                await store.close()
                await client.aclose()

        ids = anyio.run(write)
        r: Any = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", m.port) for m in c.masters])
        try:
            history = read_history(r, "atd", shards)
            report = check(history, check_results=False)
            assert report.ok, report.format()
            assert set(history.tasks) == set(ids) and history.stream_complete
            assert history.task_shards == {tid: s for s, tid in enumerate(ids)}
            assert report.checked["shard counters"] > 0
            # A count moved from one shard to another: the sums agree, the shards do not.
            r.hincrby(keys.counts(5), "SUCCEEDED@demo", 1)
            r.hincrby(keys.counts(2), "SUCCEEDED@demo", -1)
            r.zadd(keys.leases(7), {ids[7]: 1})
            moved = r.hgetall(keys.task(6, ids[6]))  # a hash on a shard its id does not name
            r.delete(keys.task(6, ids[6]))
            r.hset(keys.task(3, ids[6]), mapping=moved)
            tampered = check(read_history(r, "atd", shards), check_results=False)
            drift = [v.message for v in tampered.violations if v.kind == "counter_drift"]
            assert any(m.startswith("shard 5:") for m in drift), drift
            assert any(m.startswith("shard 2:") for m in drift), drift
            assert not any(m.startswith("counts[") for m in drift)  # the sums still agree
            assert {"lease_left", "wrong_shard"} <= set(tampered.kinds())
            # The secret scan, node by node, finds a secret on whichever master holds it.
            r.set("atd:{s4}:note", SECRET)
            scan = SecretScan(SECRET)
            for i, m in enumerate(c.masters):
                with Redis(port=m.port) as node:
                    scan_redis(node, scan, label=f"Redis master {i}")
            owner = c.masters.index(c.primary_of_slot(r.keyslot("atd:{s4}:note")))
            assert scan.found == [f"Redis master {owner} db0: string 'atd:{{s4}}:note'"]
        finally:
            r.close()


def test_a_lookup_entry_is_legal_only_for_a_parked_task_with_a_find_record() -> None:
    h = clean()
    tid = first(h)
    h.indexes["due:find"] = {tid: float(T0)}
    report = check(h)
    assert kinds(h) == {"index_left"} and "due:find" in report.violations[0].message
    # the same entry, of a parked task whose start recorded find: waiting for a lookup
    parked = clean()
    tid = first(parked)
    task = parked.tasks[tid]
    task.update(status="SUBMIT_UNKNOWN", find=f"2:{T0}:5000")
    parked.indexes["due:find"] = {tid: float(T0)}
    report = check(parked)
    assert "index_left" not in report.kinds()
    assert report.figures["parked waiting for a lookup"] == 1
