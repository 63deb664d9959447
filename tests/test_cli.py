"""Every CLI command through a real subprocess against a private Redis, --json parsed back."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis as SyncRedis

from asynctaskd.cli import EXIT_FAILED, EXIT_NOT_FOUND, EXIT_REFUSED, EXIT_TIMED_OUT
from asynctaskd.keys import Keys
from asynctaskd.model import Status
from asynctaskd.store import Lease, SyncStore
from tests.conftest import wait_until_sync

pytestmark = pytest.mark.slow


def cli(
    *args: str, url: str | None = None, check: int | None = 0
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "asynctaskd", *args]
    if url is not None:
        argv += ["--url", url]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check is not None:
        assert proc.returncode == check, (
            f"{args}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def take_in(redis: SyncRedis) -> None:
    """What a daemon's claim does first: take producers' requests in."""
    store = SyncStore(redis, Keys())
    store.run(store.ops.claim(0, "submit", 0, 10_000, "take-in", 0))


@contextlib.contextmanager
def taking_in(redis: SyncRedis) -> Iterator[None]:
    """A thread that takes requests in, as a running daemon would, while the block runs."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(0.02):
            take_in(redis)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def js(*args: str, url: str) -> Any:
    return json.loads(cli(*args, "--json", url=url).stdout)


def test_submit_get_list_stats_cancel(redis_url: str, sync_redis: SyncRedis) -> None:
    proc = cli(
        "submit",
        "ocr",
        '{"url": "https://x"}',
        "--timeout",
        "10m",
        "--tenant",
        "t1",
        "--no-strict",
        url=redis_url,
    )
    task_id = proc.stdout.strip()
    task = js("get", task_id, url=redis_url)
    assert task["status"] == "PENDING_SUBMIT" and task["params"] == {"url": "https://x"}
    assert task["tenant"] == "t1"
    assert js("stats", url=redis_url)["requests"] == 1  # until a daemon takes it in
    take_in(sync_redis)
    page = js("list", "--status", "PENDING_SUBMIT", url=redis_url)
    assert [t["id"] for t in page["tasks"]] == [task_id]
    stats = js("stats", url=redis_url)
    assert stats["by_status"]["PENDING_SUBMIT"] == 1
    # no daemon runs: the request waits for one
    answer = json.loads(cli("cancel", task_id, "--json", "--wait", "0", url=redis_url).stdout)
    assert answer == {"task_id": task_id, "canceled": True, "outcome": "pending"}
    take_in(sync_redis)
    assert js("get", task_id, url=redis_url)["status"] == "CANCELED"
    # a second cancel has nothing to do: refused
    cli("cancel", task_id, url=redis_url, check=EXIT_REFUSED)


def test_cancel_says_a_worker_holding_the_task_was_told(
    redis_url: str, sync_redis: SyncRedis
) -> None:
    task_id = cli("submit", "ocr", "{}", "--no-strict", url=redis_url).stdout.strip()
    store = SyncStore(sync_redis, Keys())
    assert store.run(store.ops.claim(0, "submit", 1, 60_000, "w", 100)).claimed  # held
    with taking_in(sync_redis):  # a daemon carries the cancel out: the holder is told
        said = cli("cancel", task_id, url=redis_url).stdout.strip()
    assert said == "cancel requested: the worker holding the task cancels it at its next save"
    task = store.get(task_id)
    assert task is not None and task.status is Status.SUBMITTING and task.cancel_requested


def test_not_found_and_usage_errors(redis_url: str, sync_redis: SyncRedis, tmp_path: Path) -> None:
    missing = cli("get", "01JAAAAAAAAAAAAAAAAAAAAAAA", url=redis_url, check=EXIT_NOT_FOUND)
    assert "no task" in missing.stderr
    bad = cli("submit", "ocr", "{not json", "--no-strict", url=redis_url, check=2)
    assert "params are not valid JSON" in bad.stderr
    unknown = cli("submit", "nobody-serves-this", "{}", url=redis_url, check=2)
    assert "nobody-serves-this" in unknown.stderr
    assert "pass --no-strict" in unknown.stderr and "strict=False" not in unknown.stderr
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    nested = cli("submit", "ocr", f"@{deep}", "--no-strict", url=redis_url, check=2)
    assert "nest too deeply" in nested.stderr and "Traceback" not in nested.stderr
    cli("submit", url=redis_url, check=2)  # argparse usage error
    assert sync_redis.dbsize() == 0  # nothing half-written by the refused submits


def test_resolve_requeue_and_purge(redis_url: str, sync_redis: SyncRedis, tmp_path: Path) -> None:
    task_id = cli("submit", "ocr", "{}", "--no-strict", url=redis_url).stdout.strip()
    store = SyncStore(sync_redis, Keys())
    batch = store.run(store.ops.claim(0, "submit", 1, 10_000, "w", 100))
    lease = batch.claimed[0].lease
    started = store.run(store.ops.start(lease, False))
    parked = store.run(
        store.ops.save(Lease(task_id, lease.fence, started.version), Status.SUBMIT_UNKNOWN)
    )
    assert parked.ok
    unknown = js("list", "--status", "SUBMIT_UNKNOWN", url=redis_url)
    assert [t["id"] for t in unknown["tasks"]] == [task_id]
    resolved = js(
        "resolve", task_id, "--as", "FAILED", "--message", "checked: no job", url=redis_url
    )
    assert resolved["status"] == "FAILED"
    # resolving again is refused: it is no longer SUBMIT_UNKNOWN
    refused = cli("resolve", task_id, "--as", "CANCELED", url=redis_url, check=EXIT_REFUSED)
    assert refused.stderr.startswith("asynctaskd: refused:")
    assert js("requeue", task_id, url=redis_url)["status"] == "PENDING_SUBMIT"
    # a daemon carries the cancel out while the CLI waits for it
    with taking_in(sync_redis):
        assert cli("cancel", task_id, url=redis_url).stdout.strip() == "canceled"
    archive = tmp_path / "archive.jsonl"
    out = cli("purge", "--older-than", "1ms", "--archive", str(archive), url=redis_url).stdout
    assert "purged 1" in out
    lines = archive.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [task_id]
    cli("get", task_id, url=redis_url, check=EXIT_NOT_FOUND)


def test_check_config(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[redis]\nurl = "redis://:hunter2@127.0.0.1:1/0"\n')
    out = cli("check-config", "--config", str(good), "--json").stdout
    assert "hunter2" not in out and json.loads(out)["redis"]["url"].startswith("redis://")
    bad = tmp_path / "bad.toml"
    bad.write_text("[worker]\nbatch_size = 0\n")
    err = cli("check-config", "--config", str(bad), check=2).stderr
    assert "bad.toml:2" in err and "worker.batch_size" in err


def test_wait_returns_the_settled_task(redis_url: str, sync_redis: SyncRedis) -> None:
    task_id = cli("submit", "ocr", "{}", "--no-strict", url=redis_url).stdout.strip()
    cli("cancel", task_id, "--wait", "0", url=redis_url)
    take_in(sync_redis)
    done = cli("wait", task_id, "--timeout", "5s", "--json", url=redis_url, check=1)
    assert json.loads(done.stdout)["status"] == "CANCELED"


def test_reads_with_tenant_never_show_another_tenants_task(
    redis_url: str, sync_redis: SyncRedis
) -> None:
    theirs = cli("submit", "ocr", "{}", "--tenant", "t1", "--no-strict", url=redis_url)
    task_id = theirs.stdout.strip()
    missing = "01JAAAAAAAAAAAAAAAAAAAAAAA"
    for command in (("get",), ("wait", "--timeout", "5s"), ("watch",)):
        shown = cli(command[0], task_id, *command[1:], "--tenant", "t2", url=redis_url, check=3)
        absent = cli(command[0], missing, *command[1:], "--tenant", "t2", url=redis_url, check=3)
        # exactly what a missing id gets: nothing tells the task exists
        assert shown.stdout == absent.stdout == ""
        assert shown.stderr.replace(task_id, missing) == absent.stderr
    assert js("list", "--tenant", "t2", url=redis_url)["tasks"] == []
    assert js("get", task_id, "--tenant", "t1", url=redis_url)["id"] == task_id
    cli("cancel", task_id, "--wait", "0", url=redis_url)
    take_in(sync_redis)
    done = cli("wait", task_id, "--tenant", "t1", "--json", url=redis_url, check=1)
    assert json.loads(done.stdout)["status"] == "CANCELED"


def test_help_reads_naturally() -> None:
    out = cli("--help").stdout
    words = ("run", "dev", "submit", "resolve", "check-config", "examples:", "watch 01J",
             "--dedup-by-content", "alerts --runbook-base", "exit codes: 0 ok")  # fmt: skip
    for word in words:
        assert word in out


def test_dev_demo_runs_to_completion(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "asynctaskd", "dev", "--demo", "20", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "20 demo tasks settled" in proc.stdout
    assert "SUCCEEDED" in proc.stdout


def test_limits_set_show_clear_and_quota_refusal(redis_url: str, sync_redis: SyncRedis) -> None:
    assert cli("limits", url=redis_url).stdout.strip() == "no limits set"
    out = cli("limits", "set", "--provider", "openai", "--submit-rate", "50",
              "--max-in-flight", "500", "--note", "org cap", url=redis_url).stdout  # fmt: skip
    assert "provider:openai" in out and "submit_rate=50" in out and "max_in_flight=500" in out
    cli("limits", "set", "--tenant", "t1", "--quota", "1", "--quota-period", "1h", url=redis_url)
    shown = js("limits", url=redis_url)
    assert shown["provider:openai"]["source"] == "runtime"
    assert shown["tenant:t1"]["limit"]["quota_period"] == 3600
    cli("submit", "h", "{}", "--tenant", "t1", "--no-strict", url=redis_url)
    refused = cli(
        "submit", "h", "{}", "--tenant", "t1", "--no-strict", url=redis_url, check=EXIT_REFUSED
    )
    assert "tenant 't1' has used its submit quota" in refused.stderr
    bad = cli("limits", "set", "--tenant", "t1", "--submit-rate", "5", url=redis_url, check=2)
    assert "rates apply to a provider or account" in bad.stderr
    assert cli("limits", "clear", "tenant:t1", url=redis_url).stdout.strip() == "cleared tenant:t1"
    cli("limits", "clear", "tenant:t1", url=redis_url, check=EXIT_NOT_FOUND)
    cli("submit", "h", "{}", "--tenant", "t1", "--no-strict", url=redis_url)  # no quota now


def test_stats_shows_each_daemons_durability_gate(redis_url: str, sync_redis: SyncRedis) -> None:
    """`stats` reads the gate from the heartbeats; the detail only when marks are at risk."""
    now = time.time()
    at_risk = {
        "mode": "off", "gate": "", "fsync": "everysec", "marks": "at_risk", "held": False,
        "detail": "no gate (auto: ...); appendfsync everysec: a crash of the Redis host ...",
    }  # fmt: skip
    fsynced = {**at_risk, "mode": "waitaof", "gate": "WAITAOF 1 0", "marks": "fsynced",
               "detail": "gate WAITAOF 1 0 (auto: AOF on, with WAITAOF); ..."}  # fmt: skip
    beat = {"inflight": 0, "handlers": ["demo"], "heartbeat_at": now}
    sync_redis.hset(Keys().daemons(), mapping={
        "a-risky": json.dumps({**beat, "id": "a-risky", "durability": at_risk}),
        "b-safe": json.dumps({**beat, "id": "b-safe", "durability": fsynced}),
        "c-older": json.dumps({**beat, "id": "c-older"}),  # a version without the field
    })  # fmt: skip
    lines = cli("stats", url=redis_url).stdout.splitlines()
    start = lines.index("live daemons: 3")
    assert lines[start + 1 :] == [
        "  a-risky  inflight=0 handlers=demo gate=off marks=at_risk",
        "    durability: " + at_risk["detail"],
        "  b-safe  inflight=0 handlers=demo gate=waitaof marks=fsynced",
        "  c-older  inflight=0 handlers=demo gate=? marks=?",
    ]
    daemons = {d["id"]: d for d in js("stats", url=redis_url)["daemons"]}
    assert daemons["a-risky"]["durability"] == at_risk
    assert "durability" not in daemons["c-older"]


def test_wait_says_when_it_timed_out_and_watch_streams_until_the_task_settles(
    redis_url: str, sync_redis: SyncRedis
) -> None:
    task_id = cli("submit", "ocr", "{}", "--no-strict", url=redis_url).stdout.strip()
    take_in(sync_redis)
    late = cli("wait", task_id, "--timeout", "0.2s", "--json", url=redis_url, check=EXIT_TIMED_OUT)
    assert json.loads(late.stdout)["status"] == "PENDING_SUBMIT"
    assert "timed out after 0.2s" in late.stderr
    # watch follows the task while another party cancels it, then exits as wait would
    argv = [sys.executable, "-m", "asynctaskd", "watch", task_id, "--json", "--url", redis_url]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as w:
        assert w.stdout is not None
        first = json.loads(w.stdout.readline())  # the state it starts from
        assert (first["task_id"], first["status"]) == (task_id, "PENDING_SUBMIT")
        cli("cancel", task_id, "--wait", "0", url=redis_url)
        take_in(sync_redis)
        rest = [json.loads(line) for line in w.stdout]
        assert w.wait(timeout=30) == EXIT_FAILED, w.stderr.read() if w.stderr else ""
    assert [e["status"] for e in rest][-1] == "CANCELED"
    text = cli("watch", task_id, url=redis_url, check=EXIT_FAILED).stdout.splitlines()
    assert len(text) == 1 and "CANCELED" in text[0]


def test_list_and_stats_read_as_tables_and_json_invents_nothing(
    redis_url: str, sync_redis: SyncRedis
) -> None:
    task_id = cli("submit", "ocr", "{}", "--no-strict", url=redis_url).stdout.strip()
    take_in(sync_redis)
    lines = cli("list", "--status", "pending_submit", url=redis_url).stdout.splitlines()
    assert lines[0].split() == ["id", "status", "handler", "tenant", "error"]
    assert lines[1].split() == [task_id, "PENDING_SUBMIT", "ocr", "-"]
    listed = js("list", url=redis_url)["tasks"][0]
    shown = js("get", task_id, url=redis_url)
    assert not {"fence", "owner", "started_fence", "reclaims", "idempotent"} & set(listed)
    assert {"fence", "idempotent"} <= set(shown)
    assert {k: v for k, v in shown.items() if k in listed} == listed
    bad = cli("list", "--status", "done", url=redis_url, check=2)
    assert "'done' is not a status" in bad.stderr
    stats = cli("stats", url=redis_url).stdout.splitlines()
    header = next(line for line in stats if line.startswith("handler"))
    assert all(s.value in header.split() for s in Status)  # whole names, none cut short


def test_list_shows_no_error_for_a_task_that_succeeded_after_one(
    redis_url: str, sync_redis: SyncRedis
) -> None:
    task_id = cli("submit", "ocr", "{}", "--no-strict", url=redis_url).stdout.strip()
    store = SyncStore(sync_redis, Keys())
    lease = store.run(store.ops.claim(0, "submit", 1, 10_000, "w", 100)).claimed[0].lease
    started = store.run(store.ops.start(lease, False))
    fields = {"external_id": "j1", "error_code": "HTTP_503", "error_message": "busy"}
    lease = Lease(task_id, lease.fence, started.version)
    assert store.run(store.ops.save(lease, Status.SUBMITTED, fields=fields)).ok
    lease = store.run(store.ops.claim(0, "query", 1, 10_000, "w", 100)).claimed[0].lease
    assert store.run(store.ops.save(lease, Status.SUCCEEDED, fields={"result": "{}"})).ok
    assert js("get", task_id, url=redis_url)["error"]["code"] == "HTTP_503"  # kept, as was
    lines = cli("list", "--status", "succeeded", url=redis_url).stdout.splitlines()
    assert lines[1].split() == [task_id, "SUCCEEDED", "ocr", "-"]  # no stale error column


def test_an_empty_namespace_is_named_not_read_as_zeros(redis_url: str) -> None:
    for command in (("stats",), ("list",), ("get", "01JAAAAAAAAAAAAAAAAAAAAAAA")):
        proc = cli(*command, "--namespace", "nothing-here", url=redis_url, check=None)
        assert "namespace 'nothing-here'" in proc.stderr and "holds no tasks" in proc.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly(redis_url: str) -> None:
    cli("submit", "ocr", "{}", "--no-strict", url=redis_url)
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head` that has already exited
    proc = subprocess.run(
        [sys.executable, "-m", "asynctaskd", "stats", "--url", redis_url],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
    )
    os.close(write_end)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_top_piped_prints_json_lines_without_terminal_codes(redis_url: str) -> None:
    argv = [sys.executable, "-m", "asynctaskd", "top", "--json", "--interval", "0.2"]
    with subprocess.Popen(
        [*argv, "--url", redis_url], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ) as top:
        assert top.stdout is not None
        views = [top.stdout.readline() for _ in range(2)]
        top.terminate()
    assert all("\x1b" not in v and "by_status" in json.loads(v) for v in views)


def test_every_option_says_what_it_does() -> None:
    from asynctaskd.cli.parser import _parser

    def walk(parser: argparse.ArgumentParser, path: str) -> list[str]:
        missing = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    missing += walk(sub, f"{path} {name}")
            elif not isinstance(action, argparse._HelpAction) and not action.help:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
        return missing

    assert walk(_parser(), "asynctaskd") == []


def test_without_a_server_named_the_default_one_is_said_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from asynctaskd.cli.common import DEFAULT_URL, _connection

    monkeypatch.delenv("ASYNCTASKD_URL", raising=False)
    bare = argparse.Namespace(url=None, config=None, namespace=None, shards=None)
    assert _connection(bare) == (DEFAULT_URL, "atd", 1)
    assert f"no --url, --config or $ASYNCTASKD_URL: using {DEFAULT_URL}" in capsys.readouterr().err
    monkeypatch.setenv("ASYNCTASKD_URL", "redis://elsewhere:6380/2")
    assert _connection(bare)[0] == "redis://elsewhere:6380/2"
    assert capsys.readouterr().err == ""


def test_submit_by_content_twice_is_one_task(redis_url: str) -> None:
    argv = ("submit", "ocr", "--no-strict", "--dedup-by-content")
    first = cli(argv[0], argv[1], '{"a": 1, "b": 2}', *argv[2:], url=redis_url).stdout.strip()
    again = cli(argv[0], argv[1], '{"b": 2, "a": 1}', *argv[2:], url=redis_url).stdout.strip()
    other = cli(argv[0], argv[1], '{"a": 2, "b": 2}', *argv[2:], url=redis_url).stdout.strip()
    assert first == again != other
    both = cli(*argv[:2], "{}", "--dedup-key", "k", "--dedup-by-content", url=redis_url, check=2)
    assert "not allowed with" in both.stderr


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    found.append(int(entry.name))
    return found


@pytest.mark.parametrize(
    ("phase", "signum"),
    [
        ("starting", signal.SIGINT),
        ("during the demo", signal.SIGINT),
        ("during the demo", signal.SIGTERM),
        ("keep running", signal.SIGINT),
    ],
    ids=["starting-ctrl-c", "demo-ctrl-c", "demo-sigterm", "keep-running-ctrl-c"],
)
def test_dev_stops_cleanly_on_ctrl_c(tmp_path: Path, phase: str, signum: int) -> None:
    """Ctrl-C at a terminal signals the whole foreground process group: here the group is
    the dev process's own session, signalled as a terminal would. SIGTERM (a service
    manager, `kill`) reaches the dev process alone."""
    argv = [sys.executable, "-m", "asynctaskd", "dev", "--demo", "300", "--data-dir", str(tmp_path)]
    if phase == "keep running":
        argv.append("--keep-running")
    wait_for = " stats --url " if phase == "keep running" else "/300"
    # The fake vendor's files go under TMPDIR: every child's command line names tmp_path.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    with subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
        start_new_session=True,
    ) as dev:
        assert dev.stdout is not None and dev.stderr is not None
        seen = []
        if phase == "starting":  # the embedded server is being started, nothing printed yet
            wait_until_sync(lambda: (tmp_path / "dev-valkey").exists(), "the server starting")
        else:
            for line in dev.stdout:
                seen.append(line)
                if wait_for in line:
                    break
            printed = "".join(seen)
            assert wait_for in printed, printed + dev.stderr.read()
        if phase == "keep running":
            # every command it prints works as printed, venv activated or not
            assert "/metrics" in printed
            # ~3% of the 300 jobs fail on purpose (none: a chance of 1 in 10,000)
            assert re.search(r"FAILED\s+\d+", printed), printed
            assert "The FAILED ones are the fake vendor's doing" in printed
            for line in seen[seen.index("try:\n") + 1 :]:
                ran = subprocess.run(shlex.split(line), capture_output=True, text=True, timeout=60)
                assert ran.returncode == 0, (line, ran.stderr)
        if signum == signal.SIGINT:
            os.killpg(dev.pid, signum)
        else:
            os.kill(dev.pid, signum)
        out, err = dev.communicate(timeout=30)
    assert dev.returncode == 0, out + err
    assert err == "", err  # no traceback, no warning about releases that failed
    assert out.rstrip().endswith("stopped")
    assert _processes_mentioning(str(tmp_path)) == []  # the server and the vendor are gone
    for vendor_url in (
        x.split()[-1] for x in seen + out.splitlines() if x.startswith("fake vendor")
    ):
        with pytest.raises(httpx.ConnectError):
            httpx.get(vendor_url + "/healthz", timeout=5)
