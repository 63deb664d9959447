"""examples/node: a producer written from docs/protocol.md and protocol/scripts/ alone,
run with `node` next to the Python client, against a real daemon on 4 shards."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis as SyncRedis

from asynctaskd.client import Client
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.keys import Keys, shard_for_dedup
from asynctaskd.model import Status, shard_of
from tests.acl import create_user_sync, user_url
from tests.configs import write_daemon_config
from tests.conftest import wait_until_sync

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "node"
SCRIPTS = ROOT / "protocol" / "scripts"
SHARDS = 4
PRODUCER = "asynctaskd-producer"


@pytest.fixture(scope="session")
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example with its locked dependencies installed (`npm ci`), once per lock file:
    the install is kept in the user's cache, keyed by the lock file's hash."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:  # .ci/run installs both; CI_MAY_SKIP does not allow this
        pytest.skip("node or npm is not installed")
    manifests = [EXAMPLE / "package.json", EXAMPLE / "package-lock.json"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in manifests)).hexdigest()[:16]
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    installed = cache_home / "asynctaskd-tests" / f"node-{digest}"
    if not (installed / "node_modules").is_dir():
        staging = installed.parent / f"staging-{uuid.uuid4().hex}"
        staging.mkdir(parents=True)
        for path in manifests:
            shutil.copy(path, staging)
        npm_ci = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"],
            cwd=staging, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if npm_ci.returncode:
            shutil.rmtree(staging, ignore_errors=True)
            pytest.fail(f"npm ci of examples/node failed:\n{npm_ci.stderr[-2000:]}")
        try:
            staging.rename(installed)  # atomic: another test process may have won the race
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    run_dir = tmp_path_factory.mktemp("node-producer")
    (run_dir / "node_modules").symlink_to(installed / "node_modules")
    for source in EXAMPLE.glob("*.mjs"):
        shutil.copy(source, run_dir)
    return run_dir


def node(
    node_dir: Path, redis_url: str, *args: str, shards: int = SHARDS, check: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "ATD_REDIS_URL": redis_url,
        "ATD_SHARDS": str(shards),
        "ATD_SCRIPTS": str(SCRIPTS),
    }
    run = subprocess.run(
        ["node", str(node_dir / "producer.mjs"), *args],
        env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    if check:
        assert run.returncode == 0, run.stderr
    return run


def lines(run: subprocess.CompletedProcess[str]) -> list[Any]:
    return [json.loads(line) for line in run.stdout.splitlines()]


def load_shipped_scripts(redis: SyncRedis) -> None:
    """What a daemon or an operator does (a producer may not load scripts)."""
    manifest = json.loads((SCRIPTS / "manifest.json").read_text())
    for name, entry in manifest["scripts"].items():
        assert redis.script_load((SCRIPTS / f"{name}.lua").read_text()) == entry["sha1"]


def test_a_node_producer_with_another_shard_count_writes_nothing(
    node_dir: Path, redis_url: str, sync_redis: SyncRedis
) -> None:
    load_shipped_scripts(sync_redis)
    sync_redis.set(Keys().deployment(), json.dumps({"protocol": 1, "shards": SHARDS}))
    before = sync_redis.dbsize()
    wrong = node(node_dir, redis_url, "submit", "demo", "{}", "--dedup-key", "k", shards=2,
                 check=False)  # fmt: skip
    assert wrong.returncode == 2, wrong.stderr
    assert "has 4 shard(s)" in wrong.stderr and "configured with 2" in wrong.stderr
    assert wrong.stdout == "" and sync_redis.dbsize() == before
    sync_redis.set(Keys().deployment(), json.dumps({"protocol": 2, "shards": SHARDS}))
    newer = node(node_dir, redis_url, "submit", "demo", "{}", check=False)
    assert newer.returncode == 2 and "speaks protocol 2" in newer.stderr
    assert sync_redis.dbsize() == before
    # refused input writes nothing either, and says which argument
    bad = node(node_dir, redis_url, "submit", "demo", "{}", "--tenant", "a b", check=False)
    assert bad.returncode == 2 and "tenant must be 1-64" in bad.stderr
    long_key = "k" * 201
    bad = node(node_dir, redis_url, "submit", "demo", "{}", "--dedup-key", long_key, check=False)
    assert bad.returncode == 2 and "1-200 characters" in bad.stderr
    assert sync_redis.dbsize() == before
    # the right count writes (a request: no daemon runs here), and reads it back
    sync_redis.set(Keys().deployment(), json.dumps({"protocol": 1, "shards": SHARDS}))
    (made,) = lines(node(node_dir, redis_url, "submit", "demo", '{"a": 1}', "--tenant", "t1",
                         "--dedup-key", "ключ"))  # fmt: skip
    assert made["created"] and shard_of(made["id"]) == shard_for_dedup("t1", "ключ", SHARDS)
    (read,) = lines(node(node_dir, redis_url, "get", made["id"], "--tenant", "t1"))
    assert read["status"] == "PENDING_SUBMIT" and read["version"] == 1
    assert read["params"] == {"a": 1} and read["tenant"] == "t1"
    with Client(sync_redis, shards=SHARDS) as client:  # the Python client reads it alike
        task = client.get(made["id"], tenant="t1")
        assert task is not None and task.params == {"a": 1}
    # a tenant's submit quota (2 per period) is counted, and a live duplicate is not
    sync_redis.hset(Keys().admission() + "rates", "quota:tenant:t9", "0.001 2")
    quota = ("submit", "demo", "{}", "--tenant", "t9")
    (first,) = lines(node(node_dir, redis_url, *quota, "--dedup-key", "q"))
    (again,) = lines(node(node_dir, redis_url, *quota, "--dedup-key", "q"))
    assert again == {"id": first["id"], "created": False}
    lines(node(node_dir, redis_url, *quota))
    before = sync_redis.dbsize()
    over = node(node_dir, redis_url, *quota, check=False)
    assert over.returncode == 2 and "tenant t9 is over its submit quota" in over.stderr
    assert sync_redis.dbsize() == before


@pytest.fixture
def daemon(tmp_path: Path, redis_url: str, sync_redis: SyncRedis) -> Iterator[None]:
    """`asynctaskd run` on 4 shards with the demo handler on a fake vendor."""
    with FakeVendorProcess.start(Behaviour(polls_to_done=2)) as vendor:
        config = write_daemon_config(
            tmp_path / "daemon.toml", redis_url, vendor.url, redis={"shards": SHARDS}
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "asynctaskd", "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "daemon.log").open("wb"),
        )
        try:
            wait_until_sync(
                lambda: sync_redis.hget(Keys().handlers(), "demo"), "the daemon", timeout=30
            )
            yield
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, (tmp_path / "daemon.log").read_text()


@pytest.fixture
def producer_url(redis_url: str, sync_redis: SyncRedis) -> Iterator[str]:
    """The server as the producers' ACL user of docs/security.md: Node may do only what a
    producer may."""
    create_user_sync(sync_redis, PRODUCER, "producer-password")
    try:
        yield user_url(redis_url, PRODUCER, "producer-password")
    finally:
        sync_redis.execute_command("ACL", "DELUSER", PRODUCER)  # a server of the session


def test_node_and_python_producers_share_tasks_and_dedup_keys_on_4_shards(
    node_dir: Path, producer_url: str, sync_redis: SyncRedis, daemon: None
) -> None:
    redis_url = producer_url
    record = json.loads(sync_redis.get(Keys().deployment()) or "null")
    assert record == {"protocol": 1, "shards": SHARDS}  # written by the daemon
    client = Client(sync_redis, shards=SHARDS)

    # The same tenant and dedup key from both producers is one task, whoever comes first.
    keys = [f"order-{i}" for i in range(8)]
    assert len({shard_for_dedup("t1", k, SHARDS) for k in keys}) > 1  # more than one shard
    pairs = []
    for i, key in enumerate(keys):
        args = ("submit", "demo", json.dumps({"key": key}), "--tenant", "t1",
                "--dedup-key", key, "--delay-ms", "3600000")  # fmt: skip
        submit: dict[str, Any] = {
            "tracking_timeout": 3600,
            "tenant": "t1",
            "dedup_key": key,
            "delay": 3600,
        }
        if i % 2:
            (from_node,) = lines(node(node_dir, redis_url, *args))
            from_python = client.submit("demo", {"key": key}, **submit)
            assert from_node["created"]
        else:
            from_python = client.submit("demo", {"key": key}, **submit)
            (from_node,) = lines(node(node_dir, redis_url, *args))
            assert not from_node["created"]
        assert from_node["id"] == from_python.id, key
        assert shard_of(from_python.id) == shard_for_dedup("t1", key, SHARDS)
        pairs.append(from_python.id)
    tasks = sum(
        len(sync_redis.keys(f"atd:{{s{s}}}:task:*")) + len(sync_redis.keys(f"atd:{{s{s}}}:new:*"))
        for s in range(SHARDS)
    )
    assert tasks == len(keys)  # one task per key, not two

    # Node-created tasks settle through the Python daemon; Node follows them all at once.
    made = lines(node(node_dir, redis_url, "submit", "demo", '{"pages": 2}', "--tenant", "t1",
                      "--count", "30"))  # fmt: skip
    node_ids = [m["id"] for m in made]
    assert len({shard_of(i) for i in node_ids}) == SHARDS
    python_ids = [
        client.submit("demo", {"n": n}, tracking_timeout=600, tenant="t1").id for n in range(30)
    ]
    changes = lines(node(node_dir, redis_url, "follow", *node_ids, *python_ids))
    seen: dict[str, list[tuple[str, int]]] = {}
    for change in changes:
        seen.setdefault(change["id"], []).append((change["status"], change["version"]))
    assert set(seen) == {*node_ids, *python_ids}
    for task_id, steps in seen.items():
        versions = [v for _, v in steps]
        assert versions == sorted(set(versions)), (task_id, steps)  # each change once, in order
        assert steps[-1][0] == "SUCCEEDED", (task_id, steps)
    for task_id in node_ids:  # Python reads what Node made
        task = client.get(task_id, tenant="t1")
        assert task is not None and task.status is Status.SUCCEEDED and task.params == {"pages": 2}
    for task_id in python_ids:  # and Node reads what Python made
        (read,) = lines(node(node_dir, redis_url, "get", task_id, "--tenant", "t1"))
        task = client.get(task_id, tenant="t1")
        assert task is not None
        assert (read["status"], read["params"], read["result"], read["version"]) == (
            "SUCCEEDED", task.params, task.result, task.version,
        )  # fmt: skip
        (other,) = lines(node(node_dir, redis_url, "get", task_id, "--tenant", "t2"))
        assert other is None  # another tenant's task is not there

    # Node cancels a live task; the daemon carries the cancel out; the follow ends with it.
    victim = pairs[0]
    (asked,) = lines(node(node_dir, redis_url, "cancel", victim, "--tenant", "t2"))
    assert asked == {"id": victim, "outcome": "not_found"}
    (asked,) = lines(node(node_dir, redis_url, "cancel", victim, "--tenant", "t1"))
    assert asked["outcome"] == "requested"
    followed = lines(node(node_dir, redis_url, "follow", victim))
    assert followed[-1]["status"] == "CANCELED"
    (again,) = lines(node(node_dir, redis_url, "cancel", victim))
    assert again == {"id": victim, "outcome": "terminal", "status": "CANCELED"}
    task = client.get(victim, tenant="t1")
    assert task is not None and task.status is Status.CANCELED
    # its dedup key is free again: a new submit with it is a new task
    key = keys[0]
    (fresh,) = lines(node(node_dir, redis_url, "submit", "demo", "{}", "--tenant", "t1",
                          "--dedup-key", key, "--delay-ms", "3600000"))  # fmt: skip
    assert fresh["created"] and fresh["id"] != victim
    client.close()


def test_the_producer_vectors_hold_through_node(
    node_dir: Path, redis_url: str, sync_redis: SyncRedis, tmp_path: Path
) -> None:
    vectors = ROOT / "tests" / "vectors" / "producer.json"
    argv = ["node", str(node_dir / "conformance.mjs")]
    env = {**os.environ, "ATD_REDIS_URL": redis_url, "ATD_SCRIPTS": str(SCRIPTS)}
    refused = subprocess.run([*argv, str(vectors)], env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and "--flush" in refused.stderr  # it empties the database
    run = subprocess.run([*argv, str(vectors), "--flush"], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    cases = json.loads(vectors.read_text())["cases"]
    assert lines(run) == [{"name": c["name"], "ok": True} for c in cases]
    # and a vector that does not hold is reported as such
    cases[0]["steps"][0]["reply"][1] = 2
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"cases": cases[:1]}))
    run = subprocess.run([*argv, str(wrong), "--flush"], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode == 1
    ((result),) = lines(run)
    assert not result["ok"] and "step 0 reply[1]: expected 2, got 1" in result["why"]
