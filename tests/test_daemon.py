"""`python -m asynctaskd run` as a real subprocess: readiness, sd_notify, drain, signals."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis as SyncRedis

from asynctaskd.codec import encode_json
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.embedded import free_port
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.store import SyncStore
from tests.configs import write_daemon_config
from tests.conftest import statuses, wait_until_sync

pytestmark = pytest.mark.slow


def write_config(tmp: Path, url: str, vendor_url: str, *, metrics_port: int, **worker: Any) -> Path:
    return write_daemon_config(
        tmp / "config.toml",
        url,
        vendor_url,
        worker={"lease": "2s", "shutdown_grace": "10s", **worker},
        metrics={"listen": f"127.0.0.1:{metrics_port}"},
        log={"format": "json"},
    )


class Notify:
    """A NOTIFY_SOCKET datagram socket, as systemd provides one."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="notify-")
        self.path = os.path.join(self.dir, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.messages: list[str] = []

    def drain(self) -> list[str]:
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                return self.messages

    def saw(self, prefix: str) -> bool:
        return any(m.startswith(prefix) for m in self.drain())

    def close(self) -> None:
        self.sock.close()


def start_daemon(config: Path, notify: Notify | None = None) -> subprocess.Popen[bytes]:
    """Start `asynctaskd run`; its stderr goes to a file next to the config (never a pipe
    nobody reads: a full pipe would block the daemon's logging)."""
    env = dict(os.environ)
    if notify is not None:
        env["NOTIFY_SOCKET"] = notify.path
        env["WATCHDOG_USEC"] = "1000000"
        env.pop("WATCHDOG_PID", None)
    return subprocess.Popen(
        [sys.executable, "-m", "asynctaskd", "run", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=(config.parent / f"daemon-{time.monotonic_ns()}.log").open("wb"),
        env=env,
    )


@pytest.fixture
def vendor() -> Iterator[FakeVendorProcess]:
    with FakeVendorProcess.start(Behaviour(polls_to_done=2)) as v:
        yield v


def create(store: SyncStore, n: int) -> list[str]:
    ids = []
    for i in range(n):
        tid = new_task_id()
        store.run(store.ops.create(tid, "demo", encode_json({"i": i}), timeout_ms=120_000))
        ids.append(tid)
    return ids


def test_daemon_runs_tasks_notifies_systemd_and_drains_on_sigterm(
    tmp_path: Path, redis_url: str, sync_redis: SyncRedis, vendor: FakeVendorProcess
) -> None:
    port = free_port()
    config = write_config(tmp_path, redis_url, vendor.url, metrics_port=port)
    notify = Notify()
    proc = start_daemon(config, notify)
    try:
        wait_until_sync(lambda: notify.saw("READY=1"), "READY=1", timeout=15)
        wait_until_sync(lambda: notify.saw("WATCHDOG=1"), "WATCHDOG=1", timeout=5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            assert r.status == 200
        store = SyncStore(sync_redis, Keys())
        ids = create(store, 100)
        wait_until_sync(
            lambda: statuses(store, ids) == {Status.SUCCEEDED: 100}, "all tasks done", timeout=30
        )

        def counted() -> bool:  # the counter moves once the save's reply is back
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                body = r.read().decode()
            return 'asynctaskd_transitions_total{handler="demo",status="SUCCEEDED"} 100.0' in body

        wait_until_sync(counted, "the metric to count 100 successes", timeout=5)
        # daemons publish their handler keys for strict submits
        assert sync_redis.hget(Keys().handlers(), "demo") is not None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert notify.saw("STOPPING=1")
        order = [m.split("=")[0] for m in notify.messages if m.split("\n")[0] != "WATCHDOG=1"]
        assert order.index("READY") < order.index("STOPPING")
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()


def test_sigterm_with_calls_in_flight_lets_a_peer_finish(
    tmp_path: Path, redis_url: str, sync_redis: SyncRedis, vendor: FakeVendorProcess
) -> None:
    # Slow queries: 200 calls are in flight when the first daemon is told to stop.
    vendor.configure(query_latency=1.0, polls_to_done=2)
    config = write_config(tmp_path, redis_url, vendor.url, metrics_port=0, shutdown_grace="200ms")
    store = SyncStore(sync_redis, Keys())
    ids = create(store, 200)
    first = start_daemon(config)
    try:

        def inflight() -> bool:
            # every task is past its submit and inside a (slow) query call
            counts = store.counts()
            polling = counts.get("SUBMITTED", 0) + counts.get("RUNNING", 0)
            return polling == 200 and sync_redis.zcard(Keys().leases(0)) == 200

        wait_until_sync(inflight, "200 calls in flight", timeout=20)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=20) == 0
        # the drained daemon gave its leases back: nothing waits for a lease to expire
        assert sync_redis.zcard(Keys().leases(0)) == 0
        second = start_daemon(config)
        try:
            wait_until_sync(
                lambda: statuses(store, ids).get(Status.SUCCEEDED) == 200,
                "the second daemon to finish everything",
                timeout=60,
            )
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=20) == 0
        finally:
            if second.poll() is None:
                second.kill()
    finally:
        if first.poll() is None:
            first.kill()
    created = [e for e in vendor.submit_log() if e["outcome"] == "created"]
    assert len(created) == 200 and len({e["ref"] for e in created}) == 200


def test_bad_config_exits_2_with_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[worker]\nlease = "soon"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "asynctaskd", "run", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "bad.toml:2" in proc.stderr and "worker.lease" in proc.stderr


def test_sighup_reloads_handlers(
    tmp_path: Path, redis_url: str, sync_redis: SyncRedis, vendor: FakeVendorProcess
) -> None:
    config = write_config(tmp_path, redis_url, vendor.url, metrics_port=0)
    proc = start_daemon(config)
    try:
        wait_until_sync(
            lambda: sync_redis.hget(Keys().handlers(), "demo"), "handlers published", timeout=15
        )
        text = config.read_text()
        config.write_text(text + text[text.index("[[handlers]]") :].replace('"demo"', '"demo2"'))
        proc.send_signal(signal.SIGHUP)
        wait_until_sync(
            lambda: sync_redis.hget(Keys().handlers(), "demo2"), "demo2 published", timeout=15
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_tune_gc_freezes_what_is_loaded_and_collects_the_young_generation_less_often() -> None:
    # In a process of its own: the tuning is process-wide, and the daemon applies it only
    # when it owns the process (`asynctaskd run`), never to a process that embeds it.
    code = (
        "import gc\n"
        "from asynctaskd.daemon import tune_gc\n"
        "before = gc.get_freeze_count()\n"
        "tune_gc()\n"
        "print(before, gc.get_freeze_count() > 1000, gc.get_threshold())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split(maxsplit=2) == ["0", "True", "(10000, 50, 100)\n"]
