"""`asynctaskd migrate`: a namespace copied from one real server to another, and run on.

Private servers only (ServerProcess, the embedded server of a tmp data dir, a LocalCluster);
real daemons (`asynctaskd run`) on a fake vendor.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis as SyncRedis

from asynctaskd import Client, Status
from asynctaskd.cli import EXIT_REFUSED
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.embedded import EmbeddedServer, ServerProcess, find_binary, require_valkey_binary
from asynctaskd.keys import PROTOCOL_VERSION, Keys
from asynctaskd.store import SyncStore
from tests.configs import demo_handler, write_daemon_config
from tests.conftest import wait_until_sync


def cli(*args: str, check: int | None = 0) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "asynctaskd", "migrate", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check is not None:
        assert proc.returncode == check, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def private(name: str, tmp_path: Path) -> ServerProcess:
    binary = find_binary(name)
    if binary is None:
        pytest.skip(f"{name} is not installed")
    return ServerProcess(binary, data_dir=tmp_path / name).start()


@pytest.fixture
def source(tmp_path: Path) -> Iterator[ServerProcess]:
    server = private("valkey-server", tmp_path)
    yield server
    server.stop()


@pytest.fixture
def target(tmp_path: Path) -> Iterator[ServerProcess]:
    server = private("redis-server", tmp_path)
    yield server
    server.stop()


def some_tasks(url: str, shards: int = 2, n: int = 6) -> list[str]:
    """`n` tasks on `url`, taken in as a daemon's claim would: PENDING_SUBMIT, some delayed,
    one with a dedup key; and one request no daemon has taken in yet."""
    keys = Keys("atd", shards)
    with Client.from_url(url, shards=shards) as producer:
        ids = [
            producer.submit(
                "demo", {"n": i}, tracking_timeout=600, delay=3600 if i % 2 else None,
                dedup_key="once" if i == 0 else None, strict=False,
            ).id
            for i in range(n)
        ]  # fmt: skip
        with SyncRedis.from_url(url) as r:
            store = SyncStore(r, keys)
            for shard in range(shards):
                store.run(store.ops.claim(shard, "submit", 0, 10_000, "take-in", 0))
        ids.append(producer.submit("demo", {}, tracking_timeout=600, strict=False).id)
    return ids


def heartbeat(url: str, age: float = 0.0) -> None:
    """A daemon's heartbeat record in `atd:daemons`, as `Store.publish_daemon` writes it."""
    beat = {"id": "d1", "pid": 1, "heartbeat_at": time.time() - age, "started_at": time.time()}
    with SyncRedis.from_url(url) as r:
        r.hset("atd:daemons", "d1", json.dumps(beat))


def namespace_keys(url: str) -> list[bytes]:
    with SyncRedis.from_url(url) as r:
        return sorted(r.scan_iter(match="atd:*"))


def test_copies_every_key_with_its_ttl_and_checks_the_copy(
    source: ServerProcess, target: ServerProcess
) -> None:
    ids = some_tasks(source.url)
    with SyncRedis.from_url(source.url) as r:
        r.set("atd:{adm}:bucket:x", "1", px=600_000)  # a key with a TTL
        r.set("atd:deployment", json.dumps({"protocol": 1, "shards": 2}))
        r.set("other:key", "not ours")
    heartbeat(source.url, age=120)  # a daemon that died long ago does not count
    done = cli("--from", source.url, "--to", target.url, "--shards", "2", "--json")
    report = json.loads(done.stdout)
    assert report["verified"] and report["shards"] == 2
    # valkey 8 writes a DUMP format redis-server 7.0 cannot read: copied key by key then
    assert report["method"] in ("dump", "logical")
    assert report["keys"] == len(namespace_keys(source.url)) > len(ids)
    assert report["tasks"] == {"PENDING_SUBMIT": 6}
    assert namespace_keys(target.url) == namespace_keys(source.url)
    with SyncRedis.from_url(target.url) as r:
        assert 500_000 < r.pttl("atd:{adm}:bucket:x") <= 600_000
        assert r.pttl("atd:deployment") == -1
        assert r.get("other:key") is None  # another namespace stays behind
    with Client.from_url(target.url, shards=2) as reader:
        for task_id in ids[:-1]:
            assert reader.get(task_id).status is Status.PENDING_SUBMIT  # type: ignore[union-attr]


def test_refuses_while_a_daemon_is_alive_on_the_source_unless_forced(
    source: ServerProcess, target: ServerProcess
) -> None:
    some_tasks(source.url, shards=1, n=2)
    heartbeat(source.url)
    refused = cli("--from", source.url, "--to", target.url, check=EXIT_REFUSED)
    assert "1 daemon(s) of namespace 'atd' are alive on the source (d1)" in refused.stderr
    assert "--force" in refused.stderr
    assert namespace_keys(target.url) == []
    forced = cli("--from", source.url, "--to", target.url, "--force")
    assert "warning: --force" in forced.stderr
    assert namespace_keys(target.url) == namespace_keys(source.url)


def test_refuses_a_target_that_holds_keys_of_the_namespace(
    source: ServerProcess, target: ServerProcess
) -> None:
    some_tasks(source.url, shards=1, n=2)
    with SyncRedis.from_url(target.url) as r:
        r.set("atd:{s0}:counts", "left over")
    refused = cli("--from", source.url, "--to", target.url, check=EXIT_REFUSED)
    assert "the target already holds keys of namespace 'atd' (first: atd:{s0}:counts)" in (
        refused.stderr
    )
    assert "migrate never overwrites" in refused.stderr
    assert namespace_keys(target.url) == [b"atd:{s0}:counts"]
    # another namespace on the same target is no obstacle
    cli("--from", source.url, "--to", target.url, "--namespace", "else")


def test_refuses_a_target_with_another_shard_count(
    source: ServerProcess, target: ServerProcess, tmp_path: Path
) -> None:
    # no deployment record: shards read off the keys, so every shard must hold a task (ids
    # pick a shard at random: 40 leave shard 2 empty once in ~10 million runs)
    some_tasks(source.url, shards=3, n=40)
    config = write_daemon_config(tmp_path / "t.toml", target.url, "http://127.0.0.1:1")
    refused = cli("--from", source.url, "--config", str(config), check=EXIT_REFUSED)
    assert "has 3 shard(s), the target is configured with 1" in refused.stderr
    assert "would never be claimed" in refused.stderr
    assert "Set [redis] shards = 3" in refused.stderr
    assert namespace_keys(target.url) == []


def test_dry_run_says_what_it_would_copy_and_writes_nothing(
    source: ServerProcess, target: ServerProcess
) -> None:
    some_tasks(source.url, shards=1, n=3)
    dry = cli("--from", source.url, "--to", target.url, "--dry-run")
    assert "would copy" in dry.stdout and "tasks: PENDING_SUBMIT 3" in dry.stdout
    assert namespace_keys(target.url) == []
    heartbeat(source.url)
    dry = cli("--from", source.url, "--to", target.url, "--dry-run", check=EXIT_REFUSED)
    assert "would be refused: 1 daemon(s)" in dry.stderr


def test_a_target_server_too_old_for_the_dump_is_named() -> None:
    from asynctaskd.migrate import _restore_problem

    text = _restore_problem(b"atd:x", Exception("DUMP payload version or checksum are wrong"), 3)
    assert "RDB version is older than the source's" in text and "partial copy" in text


# ---- a whole move: an embedded deployment to a redis-server, daemons on both ----


@pytest.fixture(scope="module")
def vendor() -> Iterator[FakeVendorProcess]:
    with FakeVendorProcess.start(Behaviour(polls_to_done=1)) as v:
        yield v


@pytest.fixture(scope="module")
def slow_vendor() -> Iterator[FakeVendorProcess]:
    with FakeVendorProcess.start(Behaviour(polls_to_done=1_000_000)) as v:
        yield v


_STARTED = {Status.SUBMITTED, Status.RUNNING}


@contextlib.contextmanager
def daemon(config: Path, url: str, log: Path, shards: int = 2) -> Iterator[None]:
    with log.open("ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "asynctaskd", "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:

        def registered() -> bool:
            try:
                with Client.from_url(url, shards=shards) as client:
                    return bool(client.stats().daemons)
            except Exception:  # not up yet
                return False

        wait_until_sync(registered, "the daemon", 30)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()


@pytest.mark.slow
def test_an_embedded_deployment_moves_to_a_redis_server_and_runs_on(
    tmp_path: Path, target: ServerProcess, vendor: FakeVendorProcess, slow_vendor: FakeVendorProcess
) -> None:
    binary = require_valkey_binary("this test")
    data_dir = tmp_path / "data"
    source = f"embedded://{data_dir}"
    handlers = [demo_handler(vendor.url), demo_handler(slow_vendor.url, key="slow")]
    sections = {
        "worker": {"lease": "1s", "shutdown_grace": "1s"},
        "log": {"format": "json", "level": "warning"},
        "handlers": handlers,
    }
    old = write_daemon_config(
        tmp_path / "old.toml", "embedded", vendor.url,
        redis={"data_dir": str(data_dir), "shards": 2}, **sections,
    )  # fmt: skip
    new = write_daemon_config(
        tmp_path / "new.toml", target.url, vendor.url, redis={"shards": 2}, **sections
    )
    with daemon(old, source, tmp_path / "old.log"), Client.from_url(source, shards=2) as c:
        done = [c.submit("demo", {"n": i}, tracking_timeout=600).id for i in range(4)]
        slow = [c.submit("slow", {}, tracking_timeout=600).id for i in range(2)]
        later = [c.submit("demo", {}, tracking_timeout=600, delay=3600).id for i in range(3)]
        gone = c.submit("demo", {}, tracking_timeout=600, delay=3600).id
        c.cancel(gone)

        def settled() -> bool:
            return (
                all(c.get(i).status is Status.SUCCEEDED for i in done)  # type: ignore[union-attr]
                and all(c.get(i).status in _STARTED for i in slow)  # type: ignore[union-attr]
                and c.get(gone).status is Status.CANCELED  # type: ignore[union-attr]
            )

        wait_until_sync(settled, "the tasks to reach their statuses", 30)
        refused = cli("--from", source, "--to", target.url, check=EXIT_REFUSED)
        assert "alive on the source" in refused.stderr
    # The daemon took its server along; a producer's request arrives while none runs.
    server = EmbeddedServer(binary, data_dir / "valkey").start()
    try:
        with Client.from_url(source, shards=2) as c:
            waiting = c.submit("demo", {}, tracking_timeout=600, strict=False).id
    finally:
        server.stop()
    moved = cli("--from", source, "--config", str(new))  # starts the embedded server itself
    assert "started the embedded server" in moved.stderr
    assert "verified" in moved.stdout, moved.stdout
    assert "SUCCEEDED 4" in moved.stdout
    assert "PENDING_SUBMIT 3" in moved.stdout and "CANCELED 1" in moved.stdout
    with daemon(new, target.url, tmp_path / "new.log"), Client.from_url(target.url, shards=2) as c:
        assert c.wait(waiting, timeout=30).status is Status.SUCCEEDED
        assert {c.get(i).status for i in done} == {Status.SUCCEEDED}  # type: ignore[union-attr]
        assert {c.get(i).status for i in later} == {Status.PENDING_SUBMIT}  # type: ignore[union-attr]
        assert {c.get(i).status for i in slow} <= _STARTED  # type: ignore[union-attr]


@pytest.mark.slow
def test_a_cluster_target_gets_each_key_on_its_slot_and_a_daemon_carries_on_there(
    source: ServerProcess, tmp_path: Path, vendor: FakeVendorProcess
) -> None:
    from tests.cluster import LocalCluster

    binary = find_binary("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    ids = some_tasks(source.url, shards=3, n=9)
    # Daemons ran on the source: their deployment record names the shard count (without it
    # the count is read off the keys, and 10 tasks leave a shard empty once in ~60 runs).
    record = {"protocol": PROTOCOL_VERSION, "shards": 3}
    with SyncRedis.from_url(source.url) as r:
        r.set(Keys("atd", 3).deployment(), json.dumps(record))
    with LocalCluster(binary, tmp_path / "cluster", masters=3, aof=False) as cluster:
        done = cli("--from", source.url, "--to", cluster.url, "--shards", "3")
        assert "verified" in done.stdout and "PENDING_SUBMIT 9" in done.stdout
        per_node = []
        for node in cluster.masters:
            with SyncRedis(port=node.port) as r:
                per_node.append(r.dbsize())
        assert sum(per_node) == len(namespace_keys(source.url))
        assert sum(1 for n in per_node if n) >= 2  # spread over the masters, by slot
        with Client.from_url(cluster.url, shards=3) as reader:
            for task_id in ids[:-1]:
                assert reader.get(task_id).status is Status.PENDING_SUBMIT  # type: ignore[union-attr]
        # the daemons continue there: the tasks due now (every other one, and the request
        # no daemon had taken in) complete; the delayed ones wait for their time
        config = write_daemon_config(
            tmp_path / "cluster.toml", cluster.url, vendor.url, redis={"shards": 3},
            worker={"lease": "2s", "shutdown_grace": "1s"}, handlers=[demo_handler(vendor.url)],
        )  # fmt: skip
        due = [*ids[:-1:2], ids[-1]]
        log = tmp_path / "cluster.log"
        with (
            daemon(config, cluster.url, log, shards=3),
            Client.from_url(cluster.url, shards=3) as c,
        ):
            for task_id in due:
                assert c.wait(task_id, timeout=30).status is Status.SUCCEEDED
            delayed = {c.get(i).status for i in ids[1:-1:2]}  # type: ignore[union-attr]
            assert delayed == {Status.PENDING_SUBMIT}
