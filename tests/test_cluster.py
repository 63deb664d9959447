"""Redis Cluster: daemons and clients on a local 3-master cluster, and a master failover.

The cluster is built from the same binaries (tests/cluster.py). Tasks spread over 8 shards,
so every master holds some; the daemons claim across all of them, the admission buckets
live in their own slot (take / claim / refund), and a master killed under load is
replaced by its replica without any task submitted twice.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import ClusterNode, RedisCluster

from asynctaskd import Client, Status, Task
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.embedded import find_binary
from asynctaskd.errors import StoreUnavailable
from asynctaskd.keys import Keys
from asynctaskd.model import shard_of
from asynctaskd.store import Sweep, SyncStore
from tests.cluster import LocalCluster
from tests.configs import write_daemon_config
from tests.conftest import statuses, wait_until_sync

pytestmark = pytest.mark.slow
SHARDS = 8


def binary_or_skip(name: str) -> Path:
    binary = find_binary(name)
    if binary is None:
        pytest.skip(f"{name} is not installed")
    return binary


@pytest.fixture(scope="module", params=["redis-server", "valkey-server"])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    with LocalCluster(binary_or_skip(request.param), tmp_path_factory.mktemp("cluster")) as c:
        yield c


def admin(c: LocalCluster) -> RedisCluster:
    return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", m.port) for m in c.masters])


def write_config(tmp: Path, url: str, vendor_url: str, **redis: Any) -> Path:
    return write_daemon_config(
        tmp / "daemon.toml",
        url,
        vendor_url,
        redis={"shards": SHARDS, "socket_timeout": "2s", **redis},
        worker={"lease": "2s", "shutdown_grace": "2s", "max_inflight": 200},
        log={"level": "warning"},
    )


def start(config: Path, n: int, log_dir: Path) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen(
            [sys.executable, "-m", "asynctaskd", "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=(log_dir / f"daemon-{i}.log").open("wb"),
        )
        for i in range(n)
    ]


def stop(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=20))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(-9)
    return codes


def settled(client: Client, ids: list[str]) -> bool:
    """Every task settled. Not yet, while the client's first read after a failover meets
    the dead master (StoreUnavailable, the client's "try again"; it then re-reads the
    cluster's slots), as the chaos runner treats it."""
    try:
        counts = client.stats().by_status
    except StoreUnavailable:
        return False
    return sum(n for s, n in counts.items() if s.is_settled) >= len(ids)


def settled_tasks(client: Client, ids: list[str]) -> list[Task] | None:
    """Every task, read in one pass in which all of them were settled; None until then.

    A parked task is settled, yet a submit still in flight when its lease was lost can
    land its handle later (SUBMIT_UNKNOWN -> SUBMITTED): counts taken from two separate
    reads need not agree, so the test's checks all use this one pass."""
    if not settled(client, ids):
        return None
    try:
        tasks = [client.get(tid) for tid in ids]
    except StoreUnavailable:
        return None
    found = [t for t in tasks if t is not None]
    assert len(found) == len(ids), f"{len(ids) - len(found)} tasks vanished"
    return found if all(t.status.is_settled for t in found) else None


def leftovers(c: LocalCluster) -> dict[str, int]:
    """Leases and in-flight slots still held anywhere: both must be empty at the end."""
    r = admin(c)
    try:
        keys = Keys("atd", SHARDS)
        out = {f"leases {s}": int(r.zcard(keys.leases(s))) for s in range(SHARDS)}
        for s in range(SHARDS):
            for k in r.scan_iter(
                match=f"{keys.tag(s)}:inflight:*", target_nodes=RedisCluster.ALL_NODES
            ):
                out[k.decode()] = int(r.scard(k))
        return {k: v for k, v in out.items() if v}
    finally:
        r.close()


def test_daemons_and_clients_run_tasks_across_the_cluster_with_admission(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    r = admin(cluster)
    r.flushall(target_nodes=RedisCluster.PRIMARIES)
    r.close()
    n, rate, burst = 400, 300.0, 20
    with FakeVendorProcess.start(Behaviour(polls_to_done=2)) as vendor:
        config = write_config(tmp_path, cluster.url, vendor.url)
        config.write_text(
            config.read_text()
            + f"""
[[limits]]
provider = "demo"
submit_rate = {rate}
submit_burst = {burst}
[[limits]]
tenant = "*"
max_in_flight = 40
"""
        )
        procs = start(config, 2, tmp_path)
        client = Client.from_url(cluster.url, shards=SHARDS)
        try:
            wait_until_sync(lambda: len(client.handlers()) == 1, "the daemons to register", 20)
            ids = [
                client.submit("demo", {"i": i}, tracking_timeout=120, tenant=f"t{i % 4}").id
                for i in range(n)
            ]
            assert {shard_of(tid) for tid in ids} == set(range(SHARDS))
            wait_until_sync(lambda: settled(client, ids), "every task to settle", 90)
            assert statuses(client, ids) == Counter({Status.SUCCEEDED: n})
            created = [e for e in vendor.submit_log() if e["outcome"] == "created"]
        finally:
            codes = stop(procs)
            client.close()
    logs = "".join(p.read_text() for p in tmp_path.glob("daemon-*.log"))
    assert codes == [0, 0], logs[-3000:]
    assert Counter(e["ref"] for e in created) == Counter(ids)  # each submitted once
    times = sorted(e["at"] for e in created)
    # The bound holds for R*(t + d) + B, d the time from taking a token to the vendor
    # seeing its submit (a claim round trip, a refund of unused tokens taken just before
    # the window, the HTTP path on two shared cores): allow d = 50 ms.
    jitter = math.ceil(rate * 0.05)
    for i, t0 in enumerate(times):  # the shared bucket held across daemons and shards
        within = sum(1 for t in times[i:] if t < t0 + 1.0)
        assert within <= rate + burst + jitter
    assert leftovers(cluster) == {}


@pytest.mark.parametrize("server", ["redis-server", "valkey-server"])
def test_a_master_failover_loses_no_task_and_submits_none_twice(
    tmp_path: Path, server: str
) -> None:
    """Kill the master of some shards under load: its replica takes over, the daemon
    reconnects, every task ends, no vendor job is created twice (the durability gate
    waits for the replica before each submit, so the started mark survives).

    Two replicas per master: the promoted one still has a replica for the gate's WAIT.
    With one, a task of those shards not yet submitted at the kill could never pass the
    gate again (it cycled PENDING_SUBMIT <-> SUBMITTING until its tracking timeout)."""
    binary = binary_or_skip(server)
    n = 300
    behaviour = Behaviour(submit_latency=0.02, polls_to_done=3, seed=5)
    with (
        LocalCluster(binary, tmp_path / "cluster", replicas=2) as c,
        FakeVendorProcess.start(behaviour) as vendor,
    ):
        config = write_config(tmp_path, c.url, vendor.url, durability="wait", wait_replicas=1)
        procs = start(config, 1, tmp_path)
        client = Client.from_url(c.url, shards=SHARDS)
        try:
            wait_until_sync(lambda: len(client.handlers()) == 1, "the daemon to register", 20)
            ids = [client.submit("demo", {"i": i}, tracking_timeout=120).id for i in range(n)]

            def some_done() -> bool:
                return client.stats().by_status[Status.SUCCEEDED] >= n // 4

            wait_until_sync(some_done, "a quarter of the tasks to finish", 60)
            victim = c.primary_of_slot(_slot(Keys("atd", SHARDS).tag(1) + ":x"))
            assert victim.process is not None
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait()
            wait_until_sync(c.healthy, "a replica to take over", 30)
            tasks = wait_until_sync(lambda: settled_tasks(client, ids), "every task to settle", 120)
            final = Counter(t.status for t in tasks)
            parked = [t for t in tasks if t.status is Status.SUBMIT_UNKNOWN]
            created = [e for e in vendor.submit_log() if e["outcome"] in ("created", "ambiguous")]
        finally:
            codes = stop(procs)
            client.close()
        logs = "".join(p.read_text() for p in tmp_path.glob("daemon-*.log"))
        assert codes == [0], logs[-3000:]
        per_task = Counter(e["ref"] for e in created)
        assert not {ref: k for ref, k in per_task.items() if k > 1}, "a vendor job created twice"
        assert set(final) <= {Status.SUCCEEDED, Status.SUBMIT_UNKNOWN}, final
        assert all(t.submit_attempts >= 1 for t in parked)  # parked only after a started submit
        assert final[Status.SUCCEEDED] + len(parked) == n
        assert leftovers(c) == {}


def _slot(key: str) -> int:
    from redis.crc import key_slot

    return int(key_slot(key.encode()))


def test_the_cli_reaches_every_shard_of_the_cluster(cluster: LocalCluster) -> None:
    def cli(*args: str) -> str:
        argv = [sys.executable, "-m", "asynctaskd", *args, "--url", cluster.url, "--shards", "8"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    r = admin(cluster)
    r.flushall(target_nodes=RedisCluster.PRIMARIES)
    r.close()
    ids = [cli("submit", "h", "{}", "--no-strict", "--json") for _ in range(12)]
    shards = {shard_of(json.loads(out)["id"]) for out in ids}
    assert len(shards) > 1  # random shards: twelve tasks land on several
    stats = json.loads(cli("stats", "--json"))
    assert stats["requests"] == 12  # no daemon has taken them in: counted as requests
    r = admin(cluster)
    sync = SyncStore(r, Keys(shards=SHARDS))  # a daemon's claim of nothing takes them in
    for shard in range(SHARDS):
        sync.run(sync.ops.claim(shard, "submit", 0, 10_000, "take-in", 0))
    r.close()
    stats = json.loads(cli("stats", "--json"))
    assert stats["by_status"]["PENDING_SUBMIT"] == 12 and stats["requests"] == 0
    assert cli("limits", "set", "--tenant", "*", "--max-in-flight", "3").strip()
    # every shard got the table, staged and swapped in on its own node
    r = admin(cluster)
    try:
        version = r.get("atd:{adm}:version")
        for shard in range(SHARDS):
            tag = f"atd:{{s{shard}}}:"
            assert r.get(tag + "admission_version") == version
            assert r.hget(tag + "admission", "cap:tenant:*") == b"1"  # 3 over 8 shards: 1 each
            assert not r.exists(tag + "admission_next", tag + "admission_sync")
    finally:
        r.close()


def test_a_moved_reply_in_a_node_pipeline_refreshes_the_map(cluster: LocalCluster) -> None:
    """A per-node pipeline sent to a node that no longer serves the slot gets MOVED: the
    call is "Redis unavailable" (retried), not a script error, and the store reloads the
    cluster's map. redis-py raises MovedError without "MOVED" in its text, which the
    check by text missed (found with the cluster chaos run)."""
    import anyio
    import redis.asyncio

    from asynctaskd.store import Store, open_redis

    async def main() -> None:
        keys = Keys("atd", SHARDS)
        client = open_redis(cluster.url)
        store = Store(client, keys)
        try:
            await store.prepare()
            call = store.ops.time_out(1, 10)
            right = _slot(keys.tag(1) + ":x")
            owner = cluster.primary_of_slot(right)
            wrong = next(m for m in cluster.masters if m.port != owner.port)
            stray = redis.asyncio.Redis(port=wrong.port)
            refreshed: list[bool] = []
            real_refresh = store._refresh_topology

            async def refresh() -> None:
                refreshed.append(True)
                await real_refresh()

            store._node_client = lambda key: ("stale", stray)  # type: ignore[method-assign]
            store._refresh_topology = refresh  # type: ignore[method-assign]
            (result,), _, _ = await store.pipeline([call])
            await stray.aclose()
            assert isinstance(result, StoreUnavailable), result
            assert refreshed == [True]
            del store._node_client  # the real one again: the right node answers
            (result,), _, _ = await store.pipeline([call])
            assert result == Sweep([])
        finally:
            await store.close()
            await client.aclose()

    anyio.run(main)
