"""`asynctaskd web` and `asynctaskd token` as real subprocesses, and the systemd unit."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis import Redis as SyncRedis

from asynctaskd.cli import EXIT_NOT_FOUND

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
EXIT_USAGE = 2


def cli(*args: str, check: int | None = 0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "asynctaskd", *args], capture_output=True, text=True, timeout=60
    )
    if check is not None:
        assert proc.returncode == check, (
            f"{args}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def config(tmp_path: Path, redis_url: str, sync_redis: SyncRedis) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        f'[redis]\nurl = "{redis_url}"\nnamespace = "atd"\n'
        f'[web]\nlisten = "127.0.0.1:{free_port()}"\ntoken_cache = "100ms"\n'
        '[log]\nformat = "text"\n'
    )
    return path


@pytest.fixture
def web_process(config: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    listen = config.read_text().split('listen = "')[1].split('"')[0]
    proc = subprocess.Popen(
        [sys.executable, "-m", "asynctaskd", "web", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://{listen}"
    try:
        deadline = time.monotonic() + 20
        while True:  # until the listener answers (or the process died)
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "asynctaskd web did not start"
            time.sleep(0.05)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_tokens_made_and_revoked_at_runtime(
    config: Path, web_process: tuple[subprocess.Popen[str], str], sync_redis: SyncRedis
) -> None:
    proc, base = web_process
    made = json.loads(
        cli("token", "create", "--config", str(config), "--role", "producer", "--tenant", "t1",
            "--note", "billing app", "--json").stdout
    )  # fmt: skip
    assert made["role"] == "producer" and made["tenant"] == "t1"
    secret = made["token"].split("_", 2)[2]  # atd_<id>_<secret>; the secret may hold "_"
    assert len(secret) == 43
    stored = sync_redis.hget("atd:web:tokens", made["id"])
    assert stored is not None and secret.encode() not in stored  # only its hash is kept
    auth = {"Authorization": f"Bearer {made['token']}"}
    body = {"handler": "demo", "params": {}, "tracking_timeout": 60, "strict": False}
    r = httpx.post(f"{base}/api/v1/tasks", json=body, headers=auth)
    assert r.status_code == 201 and r.json()["tenant"] == "t1"
    listed = json.loads(cli("token", "list", "--config", str(config), "--json").stdout)
    assert [t["id"] for t in listed] == [made["id"]] and "sha256" not in listed[0]
    assert listed[0]["note"] == "billing app"
    assert "billing app" in cli("token", "list", "--config", str(config)).stdout
    cli("token", "revoke", "--config", str(config), made["id"])
    deadline = time.monotonic() + 5
    while httpx.get(f"{base}/api/v1/tasks", headers=auth).status_code != 401:
        assert time.monotonic() < deadline, "the revoked token still works"
    cli("token", "revoke", "--config", str(config), made["id"], check=EXIT_NOT_FOUND)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0


@pytest.mark.parametrize(
    "args",
    [
        ["--role", "producer"],  # a producer must be bound to a tenant
        ["--role", "operator", "--tenant", "t1"],  # an operator sees every tenant
        ["--role", "viewer", "--tenant", "no spaces"],
        ["--role", "producer", "--tenant", "t1", "--burst", "5"],  # a burst needs a rate
        ["--role", "producer", "--tenant", "t1", "--rate", "0"],
        ["--role", "producer", "--tenant", "t1", "--rate", "5", "--burst", "0"],
    ],
)
def test_token_create_refuses_a_role_without_its_tenant_rule(
    config: Path, args: list[str], sync_redis: SyncRedis
) -> None:
    proc = cli("token", "create", "--config", str(config), *args, check=EXIT_USAGE)
    assert "invalid input" in proc.stderr
    assert sync_redis.hlen("atd:web:tokens") == 0


def test_a_token_with_a_rate_gets_429_over_it(
    config: Path, web_process: tuple[subprocess.Popen[str], str], sync_redis: SyncRedis
) -> None:
    _, base = web_process
    made = json.loads(
        cli("token", "create", "--config", str(config), "--role", "viewer", "--tenant", "t1",
            "--rate", "0.01", "--burst", "2", "--json").stdout
    )  # fmt: skip
    assert (made["rate"], made["burst"]) == (0.01, 2)
    listed = cli("token", "list", "--config", str(config)).stdout
    assert "0.01/2" in listed
    auth = {"Authorization": f"Bearer {made['token']}"}
    codes = [httpx.get(f"{base}/api/v1/tasks", headers=auth).status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    r = httpx.get(f"{base}/api/v1/tasks", headers=auth)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
    assert 1 <= int(r.headers["Retry-After"]) <= 100


def test_the_unit_runs_asynctaskd_web(tmp_path: Path) -> None:
    text = (ROOT / "systemd" / "asynctaskd-web.service").read_text()
    assert "ExecStart=/opt/asynctaskd/venv/bin/asynctaskd web --config " in text
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    entry = Path(sys.executable).parent / "asynctaskd"
    unit = tmp_path / "asynctaskd-web.service"
    unit.write_text(text.replace("/opt/asynctaskd/venv/bin/asynctaskd", str(entry)))
    proc = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    problems = [line for line in (proc.stdout + proc.stderr).splitlines()
                if "asynctaskd" in line or str(tmp_path) in line]  # fmt: skip
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr


def test_sigterm_ends_open_event_streams_and_exits(
    config: Path, web_process: tuple[subprocess.Popen[str], str]
) -> None:
    proc, base = web_process
    made = json.loads(
        cli("token", "create", "--config", str(config), "--role", "producer", "--tenant", "t1",
            "--json").stdout
    )  # fmt: skip
    auth = {"Authorization": f"Bearer {made['token']}"}
    body = {"handler": "demo", "params": {}, "tracking_timeout": 60, "strict": False}
    task_id = httpx.post(f"{base}/api/v1/tasks", json=body, headers=auth).json()["id"]
    url = f"{base}/api/v1/tasks/{task_id}/events"
    with httpx.stream("GET", url, headers=auth, timeout=30) as stream:
        lines = stream.iter_lines()
        while not next(lines).startswith("data:"):  # the stream is open and has shown a state
            pass
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - started < 10
        rest = list(lines)  # the server ended the stream: no error, nothing more
        assert all(not line.startswith("data:") for line in rest), rest
