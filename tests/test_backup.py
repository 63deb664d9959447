"""`asynctaskd backup` and `asynctaskd restore` on real embedded servers and a real daemon.

A backup taken while a daemon works and a producer submits must be one instant's data:
every task record and the per-status counts agree with each other after a restore, and
everything acknowledged before the backup began is there with its status.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis as SyncRedis

from asynctaskd import Client, Status
from asynctaskd.cli import EXIT_REFUSED
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.embedded import EmbeddedServer, ServerProcess, require_valkey_binary
from asynctaskd.errors import StoreUnavailable
from tests.configs import demo_handler, write_daemon_config
from tests.conftest import wait_until_sync
from tests.test_embedded import reachable, serving, start_daemon

pytestmark = pytest.mark.slow
STARTED = {Status.SUBMITTED, Status.RUNNING}


def cli(*args: str, check: int | None = 0) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "asynctaskd", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check is not None:
        assert proc.returncode == check, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def vendor() -> Iterator[FakeVendorProcess]:
    with FakeVendorProcess.start(Behaviour(polls_to_done=1)) as v:
        yield v


@pytest.fixture(scope="module")
def slow_vendor() -> Iterator[FakeVendorProcess]:
    with FakeVendorProcess.start(Behaviour(polls_to_done=10_000)) as v:
        yield v


def test_a_backup_taken_while_tasks_flow_restores_every_task_with_its_status(
    tmp_path: Path, vendor: FakeVendorProcess, slow_vendor: FakeVendorProcess
) -> None:
    binary = require_valkey_binary("this test")
    data_dir = tmp_path / "data"
    url = f"embedded://{data_dir}"
    config = write_daemon_config(
        tmp_path / "daemon.toml",
        "embedded",
        vendor.url,
        redis={"data_dir": str(data_dir)},
        worker={"lease": "1s", "shutdown_grace": "2s"},
        log={"format": "json", "level": "warning"},
        handlers=[demo_handler(vendor.url), demo_handler(slow_vendor.url, key="slow")],
    )
    with serving(config, data_dir, tmp_path / "daemon.log"), Client.from_url(url) as c:
        done = [c.submit("demo", {"n": i}, tracking_timeout=600).id for i in range(20)]
        slow = [c.submit("slow", {}, tracking_timeout=600).id for i in range(3)]
        later = [c.submit("demo", {}, tracking_timeout=600, delay=3600).id for i in range(5)]
        gone = c.submit("demo", {}, tracking_timeout=600, delay=3600).id
        c.cancel(gone)

        def settled() -> bool:
            return all(c.get(i).status is Status.SUCCEEDED for i in done) and all(  # type: ignore[union-attr]
                c.get(i).status in STARTED  # type: ignore[union-attr]
                for i in slow
            )

        wait_until_sync(settled, "the tasks to reach their statuses", 30)
        # A producer keeps submitting (and the daemon keeps working) during the backup.
        flowing: list[str] = []
        stop = threading.Event()

        def produce() -> None:
            with Client.from_url(url) as p:
                while not stop.is_set():
                    flowing.append(p.submit("demo", {}, tracking_timeout=600).id)

        producer = threading.Thread(target=produce)
        producer.start()
        try:
            wait_until_sync(lambda: len(flowing) >= 20, "the producer to get going", 10)
            made = cli("backup", "--config", str(config), "--to", str(tmp_path / "bk"), "--json")
            wait_until_sync(lambda: len(flowing) >= 40, "more submits after the backup", 10)
        finally:
            stop.set()
            producer.join(timeout=10)
        assert c.get(done[0]) is not None  # the daemon's server still serves
    manifest = json.loads(made.stdout)
    assert manifest["namespace"] == "atd" and manifest["server"]["name"] == "valkey"
    assert manifest["tasks"]["SUCCEEDED"] >= 20 and manifest["tasks"]["CANCELED"] == 1
    assert manifest["tasks"]["PENDING_SUBMIT"] >= 5  # and the flowing ones, wherever they were
    assert json.loads((tmp_path / "bk" / "manifest.json").read_text())["sha256"]
    assert not (data_dir / "valkey" / "dump.rdb").exists()  # no second copy on the data disk

    restored = tmp_path / "restored"
    cli("restore", "--from", str(tmp_path / "bk"), "--data-dir", str(restored))
    server = EmbeddedServer(binary, restored / "valkey").start()
    try:
        with Client.from_url(f"embedded://{restored}") as r:
            assert {r.get(i).status for i in done} == {Status.SUCCEEDED}  # type: ignore[union-attr]
            assert {r.get(i).status for i in slow} <= STARTED  # type: ignore[union-attr]
            assert {r.get(i).status for i in later} == {Status.PENDING_SUBMIT}  # type: ignore[union-attr]
            assert r.get(gone).status is Status.CANCELED  # type: ignore[union-attr]
            # One instant: the records and the counts agree, with each other and with the
            # manifest, whichever of the flowing submits made it in.
            present = [t for i in flowing if (t := r.get(i)) is not None]
            assert 20 <= len(present) < len(flowing)
            statuses = Counter(r.get(i).status.value for i in done + slow + later + [gone])  # type: ignore[union-attr]
            statuses.update(t.status.value for t in present)
            stats = r.stats()
            by_status = {s.value: n for s, n in stats.by_status.items() if n}
            assert by_status == manifest["tasks"]
            # A create request the daemon had not taken in yet reads as PENDING_SUBMIT, and
            # is a request (stats.requests), not yet a task in the counts.
            by_status["PENDING_SUBMIT"] = by_status.get("PENDING_SUBMIT", 0) + stats.requests
            assert by_status == dict(statuses)
    finally:
        server.stop()
    # The restored data dir is a deployment: the daemon's server loaded it, and writes go on.
    assert (restored / "valkey" / "appendonlydir" / "appendonly.aof.manifest").exists()


def test_restore_refuses_a_running_daemons_data_dir_and_one_with_data(tmp_path: Path) -> None:
    binary = require_valkey_binary("this test")
    source = tmp_path / "source"
    server = EmbeddedServer(binary, source / "valkey").start()
    try:
        with Client.from_url(f"embedded://{source}") as c:
            ids = [c.submit("demo", {}, tracking_timeout=60, strict=False).id for _ in range(3)]
        with SyncRedis(unix_socket_path=str(server.socket)) as raw:
            keys = sorted(raw.keys("*"))
    finally:
        server.stop()
    # No daemon runs: backup starts the data dir's server itself for the snapshot.
    made = cli("backup", "--from", f"embedded://{source}", "--to", str(tmp_path / "bk"))
    assert f"{len(keys)} key(s)" in made.stdout, made.stdout
    again = cli("backup", "--from", f"embedded://{source}", "--to", str(tmp_path / "bk"),
                check=EXIT_REFUSED)  # fmt: skip
    assert "not an empty directory" in again.stderr

    busy = tmp_path / "busy"
    server = EmbeddedServer(binary, busy / "valkey").start()  # as a running daemon holds it
    try:
        refused = cli("restore", "--from", str(tmp_path / "bk"), "--data-dir", str(busy),
                      "--force", check=EXIT_REFUSED)  # fmt: skip
        assert "in use by a running asynctaskd daemon" in refused.stderr
        assert f"pid {os.getpid()}" in refused.stderr
    finally:
        server.stop()
    assert not (busy / "valkey" / "before-restore").exists()

    # Not running now, but it holds data (an AOF): refused without --force.
    refused = cli("restore", "--from", str(tmp_path / "bk"), "--data-dir", str(busy),
                  check=EXIT_REFUSED)  # fmt: skip
    assert "already holds data" in refused.stderr
    forced = cli("restore", "--from", str(tmp_path / "bk"), "--data-dir", str(busy), "--force")
    assert "before-restore-" in forced.stdout
    aside = [p for p in (busy / "valkey").iterdir() if p.name.startswith("before-restore-")]
    assert len(aside) == 1 and (aside[0] / "appendonlydir").is_dir()  # moved, never deleted
    server = EmbeddedServer(binary, busy / "valkey").start()
    try:
        with Client.from_url(f"embedded://{busy}") as c:
            assert {c.get(i).status for i in ids} == {Status.PENDING_SUBMIT}  # type: ignore[union-attr]
        with SyncRedis(unix_socket_path=str(server.socket)) as raw:
            assert sorted(raw.keys("*")) == keys
    finally:
        server.stop()


def test_a_damaged_backup_is_not_restored(tmp_path: Path) -> None:
    binary = require_valkey_binary("this test")
    source = tmp_path / "source"
    EmbeddedServer(binary, source / "valkey").start().stop()
    cli("backup", "--from", f"embedded://{source}", "--to", str(tmp_path / "bk"))
    with (tmp_path / "bk" / "dump.rdb").open("r+b") as f:
        f.seek(10)
        f.write(b"\xff")
    failed = cli("restore", "--from", str(tmp_path / "bk"), "--data-dir",
                 str(tmp_path / "new"), check=1)  # fmt: skip
    assert "does not match the sha256" in failed.stderr
    assert not (tmp_path / "new" / "valkey" / "appendonlydir").exists()


@contextlib.contextmanager
def small_filesystem(where: Path, size: str = "16m") -> Iterator[Path]:
    """A tmpfs of `size` mounted at `where`, for as long as the test needs it."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"this container may not mount a filesystem: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(path: Path) -> None:
    """Write zeros to `path` until the filesystem has no space left."""
    block = b"\0" * 65536
    with path.open("wb", buffering=0) as f:
        while True:
            try:
                f.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return


def test_a_full_disk_stops_the_daemon_clearly_and_loses_nothing_acknowledged(
    tmp_path: Path, vendor: FakeVendorProcess
) -> None:
    with contextlib.ExitStack() as stack:
        disk = stack.enter_context(small_filesystem(tmp_path / "disk"))
        data_dir = disk / "data"
        url = f"embedded://{data_dir}"
        config = write_daemon_config(
            tmp_path / "daemon.toml", "embedded", vendor.url,
            redis={"data_dir": str(data_dir)},
            worker={"lease": "1s", "shutdown_grace": "2s"},
            log={"format": "json", "level": "warning"},
            # a call in flight when the server died is resubmitted, not SUBMIT_UNKNOWN
            handlers=[demo_handler(vendor.url, idempotent=True)],
        )  # fmt: skip
        log = tmp_path / "daemon.log"
        daemon = start_daemon(config, log)

        @stack.callback
        def _kill() -> None:  # whatever daemon is left if the test fails half-way
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait(timeout=10)

        wait_until_sync(lambda: reachable(url), "the daemon", 30)
        with Client.from_url(url) as c:
            acked = [c.submit("demo", {"n": i}, tracking_timeout=600).id for i in range(10)]
            fill(disk / "filler")
            refused: Exception | None = None
            for _ in range(200):  # the first write that needs the disk fails
                try:
                    acked.append(c.submit("demo", {"pad": "x" * 4000}, tracking_timeout=600).id)
                except StoreUnavailable as exc:
                    refused = exc
                    break
            assert refused is not None, "every submit was acknowledged on a full disk"
        # Valkey with appendfsync always exits when it cannot append; the daemon follows
        # at once, saying why, so that systemd restarts it (Restart=on-failure).
        assert daemon.wait(timeout=15) == 1, log.read_text()
        text = log.read_text()
        assert "the embedded valkey server exited" in text and "AOF" in text, text
        # A backup now fails, saying so (the snapshot cannot be written, or the server not
        # even started), and leaves nothing behind.
        failed = cli("backup", "--config", str(config), "--to", str(tmp_path / "bk"), check=1)
        assert "backup failed" in failed.stderr, failed.stderr
        assert not (tmp_path / "bk").exists()
        (disk / "filler").unlink()  # space is back
        daemon = start_daemon(config, log)
        try:
            wait_until_sync(lambda: reachable(url), "the restarted daemon", 30)
            with Client.from_url(url) as c:

                def settled() -> bool:
                    return all((t := c.get(i)) is not None and t.status.is_settled for i in acked)

                wait_until_sync(settled, "every acknowledged task to settle", 60)
                assert {c.get(i).status for i in acked} == {Status.SUCCEEDED}  # type: ignore[union-attr]
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=30)
        assert daemon.returncode == 0, log.read_text()


UNITS = Path(__file__).resolve().parent.parent / "systemd"


def test_the_backup_units_and_the_embedded_drop_in_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify insists that ExecStart exists: point it at this venv's entry point.
    entry = str(Path(sys.executable).parent / "asynctaskd")
    for name in ("asynctaskd.service", "asynctaskd-backup.service", "asynctaskd-backup.timer"):
        text = (UNITS / name).read_text().replace("/opt/asynctaskd/venv/bin/asynctaskd", entry)
        (tmp_path / name).write_text(text)
    # a drop-in next to its unit is read by verify: a mistake in it shows
    shutil.copytree(UNITS / "asynctaskd.service.d", tmp_path / "asynctaskd.service.d")
    names = ["asynctaskd.service", "asynctaskd-backup.service", "asynctaskd-backup.timer"]
    proc = subprocess.run([analyze, "verify", *(str(tmp_path / n) for n in names)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    problems = [line for line in (proc.stdout + proc.stderr).splitlines()
                if "asynctaskd" in line or str(tmp_path) in line]  # fmt: skip
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr
    drop_in = (UNITS / "asynctaskd.service.d" / "embedded.conf").read_text()
    assert "UMask=0027" in drop_in and "StateDirectoryMode=0750" in drop_in
    backup = (UNITS / "asynctaskd-backup.service").read_text()
    assert "User=asynctaskd" in backup and " backup --config " in backup


def test_restore_stops_a_server_left_by_a_dead_daemon_before_it_writes(tmp_path: Path) -> None:
    binary = require_valkey_binary("this test")
    source = tmp_path / "source"
    EmbeddedServer(binary, source / "valkey").start().stop()
    cli("backup", "--from", f"embedded://{source}", "--to", str(tmp_path / "bk"))
    # A server working in the data dir, its pid recorded, but no daemon holding the lock.
    data = tmp_path / "data"
    leftover = ServerProcess(binary, data_dir=data / "valkey", aof=True).start()
    try:
        (data / "valkey" / "server.pid").write_text(f"{leftover.process.pid}\n")  # type: ignore[union-attr]
        # Reaped as it exits: not a child of restore's, as a real leftover would not be.
        threading.Thread(target=leftover.process.wait, daemon=True).start()  # type: ignore[union-attr]
        cli("restore", "--from", str(tmp_path / "bk"), "--data-dir", str(data), "--force")
        assert leftover.process.poll() is not None  # type: ignore[union-attr]
    finally:
        leftover.stop()
