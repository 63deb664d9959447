"""The embedded server as a deployment: one per data dir, gone with its daemon, reachable.

Real daemons (`asynctaskd run` with `redis.url = "embedded"`), real kills, a real fake
vendor; producers reach the server through `embedded://<data_dir>`, as a web app on the
same host would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from asynctaskd import Client, Status, embedded
from asynctaskd.connection import local_url
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.embedded import (
    EmbeddedServer,
    PortTaken,
    ServerProcess,
    find_binary,
    require_valkey_binary,
)
from asynctaskd.errors import ConfigError
from tests.configs import demo_handler, write_daemon_config
from tests.conftest import wait_until_sync

pytestmark = pytest.mark.slow


def servers_of(data_dir: Path) -> list[int]:
    """Pids of the servers working in `data_dir` (a server changes into its --dir, and
    rewrites its command line, so the working directory is what tells)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (
                    Path(os.readlink(entry / "cwd")) == data_dir / "valkey"
                    and b"valkey" in (entry / "cmdline").read_bytes()
                ):
                    found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def vendor() -> Iterator[FakeVendorProcess]:
    with FakeVendorProcess.start(Behaviour(polls_to_done=1)) as v:
        yield v


def start_daemon(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "asynctaskd", "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


@contextlib.contextmanager
def serving(config: Path, data_dir: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A daemon on the embedded server of `data_dir`, registered there; SIGTERM at the end."""
    daemon = start_daemon(config, log)
    try:
        wait_until_sync(lambda: reachable(f"embedded://{data_dir}"), "the daemon", 30)
        yield daemon
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)


def embedded_config(tmp_path: Path, vendor_url: str) -> tuple[Path, Path]:
    data_dir = tmp_path / "data"
    config = write_daemon_config(
        tmp_path / "daemon.toml",
        "embedded",
        vendor_url,
        redis={"data_dir": str(data_dir)},
        worker={"lease": "1s", "shutdown_grace": "2s"},
        log={"format": "json", "level": "warning"},
        handlers=[demo_handler(vendor_url, idempotent=True)],
    )
    return config, data_dir


def reachable(url: str) -> bool:
    """The server answers through its socket, and a daemon has registered there."""
    try:
        with Client.from_url(url) as client:
            return bool(client.stats().daemons)
    except Exception:  # not up yet
        return False


def test_a_killed_daemon_takes_its_server_along_and_the_next_one_finishes_the_work(
    tmp_path: Path, vendor: FakeVendorProcess
) -> None:
    config, data_dir = embedded_config(tmp_path, vendor.url)
    url = f"embedded://{data_dir}"
    log = tmp_path / "daemon.log"
    daemon = start_daemon(config, log)
    try:
        wait_until_sync(lambda: reachable(url), "the embedded server's socket", timeout=30)
        assert len(servers_of(data_dir)) == 1
        with Client.from_url(url) as producer:  # a producer on the same host
            ids = [producer.submit("demo", {"n": i}, tracking_timeout=120).id for i in range(50)]
            first = servers_of(data_dir)
            daemon.send_signal(signal.SIGKILL)
            daemon.wait(timeout=10)
            # the kernel takes the server down with the daemon: nothing left on the data
            wait_until_sync(lambda: servers_of(data_dir) == [], "the orphaned server to go", 10)
            daemon = start_daemon(config, log)
            wait_until_sync(lambda: reachable(url), "the server of the new daemon", timeout=30)
            assert len(servers_of(data_dir)) == 1 and servers_of(data_dir) != first

            def settled() -> bool:
                return all((t := producer.get(i)) is not None and t.status.is_settled for i in ids)

            wait_until_sync(settled, "every task to settle", timeout=60)
            statuses = {producer.get(i).status for i in ids}  # type: ignore[union-attr]
        assert statuses == {Status.SUCCEEDED}, statuses  # nothing lost with the kill
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
    assert daemon.returncode == 0, log.read_text()
    assert servers_of(data_dir) == []


def test_a_second_daemon_on_the_same_data_dir_is_refused(
    tmp_path: Path, vendor: FakeVendorProcess
) -> None:
    config, data_dir = embedded_config(tmp_path, vendor.url)
    with serving(config, data_dir, tmp_path / "first.log") as first:
        second = subprocess.run(
            [sys.executable, "-m", "asynctaskd", "run", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2, second.stderr
        assert f"in use by another asynctaskd daemon (pid {first.pid})" in second.stderr
        assert len(servers_of(data_dir)) == 1


def test_a_server_left_by_an_older_crash_is_stopped_before_a_new_one_starts(
    tmp_path: Path,
) -> None:
    binary = require_valkey_binary("this test")
    valkey_dir = tmp_path / "data" / "valkey"
    # A server of the data dir that outlived its daemon (no parent-death signal then).
    left = ServerProcess(binary, data_dir=valkey_dir, aof=True).start()
    assert left.process is not None
    (valkey_dir / "server.pid").write_text(f"{left.process.pid}\n")
    server = EmbeddedServer(binary, valkey_dir).start()
    try:
        assert left.process.wait(timeout=10) is not None  # stopped, not orphaned
        assert servers_of(tmp_path / "data") == [server.server.process.pid]  # type: ignore[union-attr]
        mode = (valkey_dir / "valkey.sock").stat().st_mode & 0o777
        assert mode == 0o770  # the daemon's user and group may connect, nobody else
    finally:
        server.stop()
        left.stop()
    assert servers_of(tmp_path / "data") == []


def test_embedded_urls_name_the_data_dir() -> None:
    assert local_url("embedded:///srv/atd") == "unix:///srv/atd/valkey/valkey.sock"
    assert local_url("embedded:///srv/atd?db=3") == "unix:///srv/atd/valkey/valkey.sock?db=3"
    assert local_url("redis://h:6379/0") == "redis://h:6379/0"
    with pytest.raises(ConfigError, match="absolute path"):
        local_url("embedded://srv/atd")


def test_the_cli_reads_the_daemons_config_to_find_its_server(
    tmp_path: Path, vendor: FakeVendorProcess
) -> None:
    config, data_dir = embedded_config(tmp_path, vendor.url)
    with serving(config, data_dir, tmp_path / "daemon.log"):
        argv = [sys.executable, "-m", "asynctaskd"]
        made = subprocess.run(
            [*argv, "submit", "demo", "{}", "--config", str(config)],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        waited = subprocess.run(
            [*argv, "wait", made.stdout.strip(), "--timeout", "30s", "--config", str(config)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert waited.returncode == 0, waited.stderr
    assert servers_of(data_dir) == []  # the daemon's exit took its server along


# --- a port taken between free_port() and the server's bind ------------------------------


@contextlib.contextmanager
def _listening() -> Iterator[int]:
    """A loopback port some other process holds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_a_chosen_port_taken_before_the_bind_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    binary = find_binary("redis-server")
    assert binary is not None
    real = embedded.free_port
    with _listening() as taken:
        handed = iter([taken])
        monkeypatch.setattr(embedded, "free_port", lambda: next(handed, 0) or real())
        server = ServerProcess(binary)
        assert server.port == taken
        server.start()
        try:
            assert server.port != taken
            with Redis(port=server.port) as r:
                assert r.ping()
        finally:
            server.stop()


def test_a_given_port_that_is_taken_is_not_replaced() -> None:
    binary = find_binary("redis-server")
    assert binary is not None
    with _listening() as taken:
        server = ServerProcess(binary, port=taken)
        with pytest.raises(PortTaken, match="Address already in use"):
            server.start()
        assert server.process is None and server.port == taken
