"""Operations: metrics, health endpoints, dashboard, alert rules, systemd units, deploy docs.

Fast tests check the files and the in-process pieces; slow ones run promtool,
systemd-analyze and real daemon subprocesses (scraped during an end-to-end run).
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import logging
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import redis.asyncio
from prometheus_client import generate_latest
from redis import Redis as SyncRedis

from asynctaskd import AsyncClient, Submitted, Succeeded, __version__
from asynctaskd.cli import main as cli_main
from asynctaskd.cli.operator import RUNBOOK_PLACEHOLDER
from asynctaskd.config import Config, MetricsConfig, parse_config, parse_listen
from asynctaskd.daemon import Daemon
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.embedded import ServerProcess, find_binary, free_port
from asynctaskd.health import serve_health
from asynctaskd.keys import Keys
from asynctaskd.metrics import Metrics
from asynctaskd.model import Status
from asynctaskd.reaper import observe, read_backlog
from asynctaskd.store import Store, SyncStore
from asynctaskd.web.metrics import WebMetrics
from tests.acl import create_user_sync
from tests.configs import daemon_toml, write_daemon_config
from tests.conftest import wait_until_sync
from tests.test_daemon import create, start_daemon, statuses, write_config

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "grafana" / "asynctaskd.json"
ALERTS = ROOT / "prometheus" / "alerts.yml"
ALERT_TESTS = ROOT / "prometheus" / "alerts_test.yml"
DEPLOY = ROOT / "docs" / "deploy.md"
UNITS = ROOT / "systemd"

METRIC_NAME = re.compile(r"\basynctaskd_[a-z_]+\b")
HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")
GRAFANA_BUILTINS = {"__rate_interval", "__range", "__interval", "__all"}
# `scope` and `lane` name configured limits (providers, accounts; tenants summed as one);
# `mode`, `fsync` and `state` are the fixed states of the durability state sets.
BOUNDED_LABELS = {"handler", "op", "outcome", "status", "phase", "code", "kind", "script",
                  "version", "scope", "lane", "mode", "fsync", "state", "exception"}  # fmt: skip

# Proxies from the environment must never see requests to loopback.
_http = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str) -> tuple[int, str]:
    try:
        with _http.open(url, timeout=5) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, OSError):
        return 0, ""  # not listening (yet)


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return found


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panels() -> list[dict[str, Any]]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def _dashboard_exprs() -> list[str]:
    return [t["expr"] for p in _panels() for t in p["targets"]] + [
        v["definition"] for v in _dashboard()["templating"]["list"] if v["type"] == "query"
    ]


def _alerts() -> dict[str, str]:
    """Alert name -> its rule block (text), read without a YAML parser."""
    blocks = re.split(r"\n\s*- alert: ", ALERTS.read_text())[1:]
    return {block.split("\n", 1)[0].strip(): block for block in blocks}


def _exported_names(exposition: str) -> tuple[set[str], set[str]]:
    """(every declared or sampled name, histogram family names) in a text exposition."""
    names: set[str] = set()
    histograms: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                histograms.add(name)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names, histograms


def _unexported(used: set[str], exposition: str) -> set[str]:
    names, histograms = _exported_names(exposition)
    return {
        name
        for name in used
        if name not in names and HISTOGRAM_SUFFIX.sub("", name) not in histograms
    }


def _sample(exposition: str, name: str, **labels: str) -> float | None:
    """The value of one sample, matching the given labels (others may be present)."""
    for line in exposition.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


def _sum(exposition: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in exposition.splitlines():
        if line.startswith((name + "{", name + " ")):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


# --- metric names and docs ------------------------------------------------------------------


def test_metric_names_follow_prometheus_conventions() -> None:
    metrics = Metrics()
    standard = {"process", "python_gc", "python_info"}  # prometheus-client's own collectors
    seen = set()
    for family in metrics.registry.collect():
        prefix = next((p for p in standard if family.name.startswith(p)), None)
        if prefix:
            seen.add(prefix)
            continue
        assert family.name.startswith("asynctaskd_"), family.name
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
        if family.type == "gauge":
            assert not family.name.endswith("_total"), family.name
    text = generate_latest(metrics.registry).decode()
    for line in text.splitlines():
        if line.startswith("# TYPE ") and line.endswith(" counter"):
            assert line.split()[2].endswith("_total"), line
    for collector in metrics.__dict__.values():
        labelnames = getattr(collector, "_labelnames", ())
        assert set(labelnames) <= BOUNDED_LABELS, labelnames
    assert _sample(text, "asynctaskd_build_info", version=__version__) == 1.0
    assert seen == standard  # memory, CPU, open files and the GC are in view
    assert _sample(text, "process_resident_memory_bytes") > 0


def test_deploy_doc_lists_every_exported_metric() -> None:
    text = generate_latest(Metrics().registry).decode()
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    declared = {name for name in declared if not name.endswith("_created")}  # client's extra
    doc = DEPLOY.read_text()
    table = set(re.findall(r"^\| `(asynctaskd_[a-z_]+)`", doc, re.M))
    assert table == {name for name in declared if name.startswith("asynctaskd_")}
    # prometheus-client's own families, one row per prefix
    for prefix in ("process_", "python_gc_", "python_info"):
        assert any(name.startswith(prefix) for name in declared), prefix
        assert f"| `{prefix}" in doc, prefix


# --- dashboard -------------------------------------------------------------------------------


def test_dashboard_is_importable_with_a_datasource_variable() -> None:
    dash = _dashboard()
    assert 36 <= dash["schemaVersion"] <= 41
    assert dash["uid"]
    assert dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["handler"]["type"] == "query"
    assert variables["handler"]["definition"].startswith("label_values(")
    # every panel and query uses the variable, never a datasource uid of some install
    for panel in _panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert target["expr"].strip()
    for name, var in variables.items():
        if var["type"] == "query":
            assert var["datasource"]["uid"] == "${datasource}", name
    # every $variable used is defined (or a Grafana built-in)
    used = {m for e in _dashboard_exprs() for m in re.findall(r"\$\{?(\w+)", e)}
    assert used <= set(variables) | GRAFANA_BUILTINS
    # unique ids, panels inside the 24-column grid and not overlapping
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dash["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] < g["x"] + g["w"] <= 24, panel["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_dashboard_has_what_operators_asked_for() -> None:
    titles = {p["title"] for p in _panels()}
    wanted = {
        "Live daemons",  # worker count
        "Created (submitted)",
        "Completed",
        "Failed",
        "Avg execution time",
        "Queue depth",
        "SUBMIT_UNKNOWN",
        "Throughput: transitions per second by status",
        "Lifecycle funnel: tasks by status",
        "Handler call latency",
        "Handler call latency p50 / p99 by handler and op",
        "Due lag p50 / p99",
        "Backlog",
        "Oldest pending age",
        "In-flight calls by daemon",
        "Leases lost and reclaims",
        "Rejected writes",
        "Store errors",
        "Redis call latency p99 by script",
        "Event loop lag p99",
        "Durability gate latency",
        "Durability gate by daemon",
        "Daemons with started marks at risk",
    }
    assert wanted <= titles, wanted - titles
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in _panels()}
    assert "asynctaskd_handler_call_seconds_sum" in exprs["Avg execution time"]
    assert "asynctaskd_handler_call_seconds_count" in exprs["Avg execution time"]
    assert 'asynctaskd_tasks{job=~"$job", status="SUBMIT_UNKNOWN"}' in exprs["SUBMIT_UNKNOWN"]
    assert 'status="SUBMIT_UNKNOWN"' in _alerts()["AsyncTaskdSubmitUnknown"]


# --- alert rules -----------------------------------------------------------------------------


def test_every_alert_is_documented_and_unit_tested_both_ways() -> None:
    alerts = _alerts()
    assert {
        "AsyncTaskdStuckTasks",
        "AsyncTaskdSubmitUnknown",
        "AsyncTaskdLeaseLosses",
        "AsyncTaskdDueLagHigh",
        "AsyncTaskdNoClaimsWhileDue",
        "AsyncTaskdRedisUnreachable",
        "AsyncTaskdDurabilityGateOff",
        "AsyncTaskdFailureRateHigh",  # tasks failing, vendors erroring
        "AsyncTaskdVendorErrorsHigh",
    } <= set(alerts)
    headings = set(re.findall(r"^### (\w+)$", DEPLOY.read_text(), re.M))
    for name, block in alerts.items():
        for annotation in ("summary:", "description:", "runbook_url:", "severity:"):
            assert annotation in block, (name, annotation)
        assert f'runbook_url: "{RUNBOOK_PLACEHOLDER}#{name.lower()}"' in block
        assert name in headings, f"docs/deploy.md has no runbook section for {name}"
    # (alertname, fires?) for every alert_rule_test case
    cases = re.findall(r"alertname: (\w+)\n\s+exp_alerts:( \[\])?", ALERT_TESTS.read_text())
    for name in alerts:
        assert (name, "") in cases, f"{name}: no case where it fires"
        assert (name, " []") in cases, f"{name}: no case where it stays quiet"


RUNBOOK_BASE = "https://git.example.com/ops/asynctaskd/blob/v1/docs/deploy.md"


def _rendered_alerts(capsys: pytest.CaptureFixture[str], base: str = RUNBOOK_BASE) -> str:
    """What `asynctaskd alerts --runbook-base BASE` prints."""
    capsys.readouterr()
    assert cli_main(["alerts", "--runbook-base", base]) == 0
    return capsys.readouterr().out


def test_the_alerts_command_builds_every_runbook_link_from_one_base(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = _rendered_alerts(capsys)
    header, _, rules = out.partition("\n")
    assert header.startswith(f"# Generated by asynctaskd {__version__}")
    # the rules as shipped (the package's copy is prometheus/alerts.yml), nothing else changed
    assert rules == ALERTS.read_text().replace(RUNBOOK_PLACEHOLDER, RUNBOOK_BASE)
    links = re.findall(r'runbook_url: "([^"]*)"', rules)
    assert links == [f"{RUNBOOK_BASE}#{name.lower()}" for name in _alerts()]
    assert "${" not in rules


@pytest.mark.parametrize(
    "base",
    ["docs/deploy.md", "ftp://host/deploy.md", "https://host/deploy.md#runbook",
     'https://host/a"b', "https:///deploy.md", "https://host/deploy md"],
)  # fmt: skip
def test_the_alerts_command_refuses_a_base_that_is_no_full_url(
    capsys: pytest.CaptureFixture[str], base: str
) -> None:
    assert cli_main(["alerts", "--runbook-base", base]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--runbook-base must be the http(s) URL of docs/deploy.md" in err


@pytest.mark.slow
def test_promtool_checks_and_unit_tests_the_alert_rules_as_generated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    promtool = _promtool()
    (tmp_path / "alerts.yml").write_text(_rendered_alerts(capsys))
    tests = ALERT_TESTS.read_text().replace(RUNBOOK_PLACEHOLDER, RUNBOOK_BASE)
    (tmp_path / ALERT_TESTS.name).write_text(tests)
    check = subprocess.run([promtool, "check", "rules", "alerts.yml"], capture_output=True,
                           text=True, timeout=30, cwd=tmp_path)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([promtool, "test", "rules", ALERT_TESTS.name], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert unit.returncode == 0, unit.stdout + unit.stderr


@pytest.mark.slow
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each dashboard query as a recording rule (Grafana variables filled)."""
    promtool = _promtool()
    fill = {"$__rate_interval": "5m", "$__range": "1h", "$__interval": "1m"}
    rules = []
    for i, expr in enumerate(_dashboard_exprs()):
        for var, value in fill.items():
            expr = expr.replace(var, value)
        expr = re.sub(r"\$\{?\w+\}?", ".*", expr)  # $job, $instance, $handler: "All"
        if expr.startswith("label_values("):
            expr = expr[len("label_values(") : expr.rindex(",")]  # the metric selector
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    check = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                           text=True, timeout=30)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr


# --- health endpoints ------------------------------------------------------------------------


async def _request(port: int, raw: str) -> tuple[int, dict[str, str], bytes]:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(raw.encode())
        data = b""
        try:
            while True:
                data += await stream.receive()
        except anyio.EndOfStream:
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


@pytest.fixture
async def health() -> AsyncIterator[tuple[int, list[tuple[bool, str]]]]:
    """A health listener whose readiness answers come from the returned list (last wins)."""
    answers: list[tuple[bool, str]] = [(True, "ready")]

    async def ready() -> tuple[bool, str]:
        return answers[-1]

    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_health, "127.0.0.1", 0, Metrics(), ready)
        yield port, answers
        tg.cancel_scope.cancel()


async def test_metrics_endpoint_serves_the_prometheus_text_format(
    health: tuple[int, list[tuple[bool, str]]],
) -> None:
    port, _ = health
    status, headers, body = await _request(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200
    assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert int(headers["content-length"]) == len(body)
    assert b"# TYPE asynctaskd_transitions_total counter" in body
    # OpenMetrics when the scraper asks for it
    accept = "Accept: application/openmetrics-text; version=1.0.0\r\n"
    status, headers, body = await _request(
        port, f"GET /metrics HTTP/1.1\r\nHost: x\r\n{accept}\r\n"
    )
    assert status == 200
    assert headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert body.endswith(b"# EOF\n")


async def test_head_405_404_and_bad_requests(health: tuple[int, list[tuple[bool, str]]]) -> None:
    port, _ = health
    status, headers, body = await _request(port, "HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200
    assert body == b""
    assert int(headers["content-length"]) > 0
    status, headers, body = await _request(port, "HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, body, headers["content-length"]) == (200, b"", "3")
    for method in ("POST", "PUT", "DELETE"):
        status, headers, _ = await _request(port, f"{method} /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 405
        assert headers["allow"] == "GET, HEAD"
    status, _, _ = await _request(port, "GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 404
    status, _, _ = await _request(port, "GARBAGE\r\n\r\n")
    assert status == 400
    # HTTP/1.1 requires a Host header (every scraper and probe sends one); 1.0 does not
    status, _, _ = await _request(port, "GET /healthz HTTP/1.1\r\n\r\n")
    assert status == 400
    status, _, body = await _request(port, "GET /healthz HTTP/1.0\r\n\r\n")
    assert (status, body) == (200, b"ok\n")


async def test_a_request_the_server_cannot_read_is_no_error_of_the_daemon(
    health: tuple[int, list[tuple[bool, str]]], caplog: pytest.LogCaptureFixture
) -> None:
    port, _ = health
    for raw in ("GET /healthz HTTP/1.1\r\n\r\n", "GET /x HTTP/9.9\r\nHost: x\r\n\r\n"):
        status, _, _ = await _request(port, raw)
        assert status == 400
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def _outside_address() -> str | None:
    """An address of this host that is not loopback (None if it has none); no packet is
    sent: connecting a UDP socket only picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if ipaddress.ip_address(address).is_loopback else address


async def test_the_listener_binds_only_the_configured_address_loopback_by_default() -> None:
    host, _ = parse_listen(MetricsConfig().listen)
    assert ipaddress.ip_address(host).is_loopback
    outside = _outside_address()
    if outside is None:
        pytest.skip("this host has no address but loopback")
    with pytest.raises(ValueError, match="address to listen on"):
        await serve_health("", 0, Metrics(), lambda: (True, "ready"))
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_health, host, 0, Metrics(), lambda: (True, "ready"))
        status, _, _ = await _request(port, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200
        with pytest.raises(OSError, match="connection attempts failed"):
            await anyio.connect_tcp(outside, port)
        tg.cancel_scope.cancel()


# A handler whose submits wait for the test (tests.test_ops:make_gated in a config).
_GATE: dict[str, anyio.Event] = {}


class _Gated:
    key = "gated"
    idempotent_submit = True

    async def submit(self, params: Any, ctx: Any) -> Any:
        _GATE["started"].set()
        await _GATE["release"].wait()
        return Submitted("job")

    async def query(self, handle: dict[str, Any], ctx: Any) -> Any:
        return Succeeded(None)


def make_gated(options: dict[str, Any]) -> _Gated:
    return _Gated()


async def test_the_listener_answers_through_a_drain_and_closes_when_it_ends(
    redis_client: redis.asyncio.Redis, redis_url: str
) -> None:
    """Drain order (daemon.py): the health listener stops at step 5, after the calls in
    flight finished; until then /readyz says "draining" and /healthz stays 200."""
    _GATE.update(started=anyio.Event(), release=anyio.Event())
    gated = {"key": "gated", "type": "python", "factory": "tests.test_ops:make_gated"}
    toml = daemon_toml(
        redis_url, "http://127.0.0.1:9", metrics={"listen": "127.0.0.1:0"},
        worker={"shutdown_grace": "20s"}, handlers=[gated],
    )  # fmt: skip
    daemon = Daemon(parse_config(toml))
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(daemon.serve)
            assert daemon.worker is not None and daemon.health_port is not None
            port = daemon.health_port
            async with AsyncClient.from_url(redis_url) as client:
                await client.submit("gated", {}, tracking_timeout=60)
            await _GATE["started"].wait()
            daemon.worker.stop()  # step 1; the call in flight holds the drain at step 2
            status, _, body = await _request(port, "GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (status, body.split(b"\n")[0]) == (503, b"draining")
            status, _, _ = await _request(port, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status == 200
            _GATE["release"].set()
    with pytest.raises(OSError, match="connection attempts failed"):
        await anyio.connect_tcp("127.0.0.1", port)


async def test_ready_only_once_the_daemon_claims_and_its_handlers_are_published(
    redis_client: redis.asyncio.Redis, redis_url: str
) -> None:
    """A load balancer or `systemctl` that trusts /readyz must find the daemon taking work:
    its first claim round ran and its handlers are in Redis for producers to see."""
    toml = daemon_toml(redis_url, "http://127.0.0.1:9", metrics={"listen": "127.0.0.1:0"})
    daemon = Daemon(parse_config(toml))
    answers: list[tuple[bool, str]] = []
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(daemon.serve)
            while not answers or not answers[-1][0]:  # every answer, from the very start
                answers.append(daemon.ready())
                if not answers[-1][0]:
                    assert answers[-1][1] == "starting"
                    await anyio.lowlevel.checkpoint()
                    continue
                worker = daemon.worker
                assert worker is not None and worker.first_pass.is_set()
                assert await redis_client.hexists(Keys().daemons(), worker.id)
                assert await redis_client.hexists(Keys().handlers(), "demo")
            daemon.worker.stop()
    assert answers[0] == (False, "starting")


async def test_readyz_says_why_it_is_not_ready(health: tuple[int, list[tuple[bool, str]]]) -> None:
    port, answers = health
    status, _, body = await _request(port, "GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, body) == (200, b"ready\n")
    for reason in ("redis unreachable", "due work waited 75s without a claim", "draining"):
        answers.append((False, reason))
        status, _, body = await _request(port, "GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (status, body) == (503, reason.encode() + b"\n")
        status, _, _ = await _request(port, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200  # alive all the same


# --- cluster-wide gauges read by the reaper ---------------------------------------------------


async def test_backlog_gauges_read_every_priority_band_and_live_daemons(store: Store) -> None:
    keys = store.keys
    band = 1 << 42
    now_ms = int(await store.server_time() * 1000)
    r = store.redis
    empty = await read_backlog(store)
    assert empty.oldest_age == {"submit": 0.0, "query": 0.0}
    assert empty.ready == {"submit": 0, "query": 0}
    assert empty.live_daemons == 0
    # ready:submit is ordered by priority first: the oldest entry is in a lower band
    await r.zadd(keys.ready(0, "submit"), {
        "high-recent": (100 - 5) * band + now_ms - 1_000,
        "high-older": (100 - 5) * band + now_ms - 60_000,
        "low-oldest": (100 + 3) * band + now_ms - 120_000,
    })  # fmt: skip
    await r.zadd(keys.scheduled(0, "submit"), {"later": now_ms + 60_000})  # not due yet
    await r.zadd(keys.scheduled(0, "query"), {"overdue": now_ms - 30_000})  # not promoted
    await r.hset(keys.daemons(), mapping={
        "live": json.dumps({"id": "live", "heartbeat_at": now_ms / 1000 - 3}),
        "crashed": json.dumps({"id": "crashed", "heartbeat_at": now_ms / 1000 - 300}),
        "odd": "not json",
    })  # fmt: skip
    backlog = await read_backlog(store)
    assert 120 <= backlog.oldest_age["submit"] < 125
    assert 30 <= backlog.oldest_age["query"] < 35
    assert backlog.ready == {"submit": 3, "query": 1}
    assert backlog.live_daemons == 1

    metrics = Metrics()
    await observe(store, metrics)
    value = metrics.registry.get_sample_value
    age = value("asynctaskd_oldest_pending_age_seconds", {"phase": "submit"})
    assert age is not None
    assert age >= 120
    assert value("asynctaskd_ready_tasks", {"phase": "query"}) == 1
    assert value("asynctaskd_live_daemons") == 1
    assert value("asynctaskd_tasks", {"status": "SUBMIT_UNKNOWN"}) == 0


async def test_per_handler_gauges_have_every_status_even_without_its_counter(
    store: Store,
) -> None:
    # tasks claimed straight from the intake never count as PENDING_SUBMIT: no such field
    await store.redis.hset(store.keys.counts(0), mapping={"SUBMITTING@h": 2, "SUBMITTING": 2})
    metrics = Metrics()
    await observe(store, metrics)
    value = metrics.registry.get_sample_value
    assert value("asynctaskd_tasks_by_handler", {"status": "SUBMITTING", "handler": "h"}) == 2
    for status in Status:
        if status is not Status.SUBMITTING:
            labels = {"status": status.value, "handler": "h"}
            assert value("asynctaskd_tasks_by_handler", labels) == 0, status


# --- systemd units ---------------------------------------------------------------------------


def _unit(name: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


@pytest.mark.parametrize("name", ["asynctaskd.service", "asynctaskd@.service"])
def test_units_have_the_service_contract(name: str) -> None:
    unit = _unit(name)
    expect = {
        "Type": "notify",
        "NotifyAccess": "main",
        "WatchdogSec": "30",
        "ExecReload": "/bin/kill -HUP $MAINPID",
        "KillSignal": "SIGTERM",
        "Restart": "on-failure",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "MemoryDenyWriteExecute": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "LoadCredential": "redis-password:/etc/asynctaskd/redis-password",
    }
    for key, value in expect.items():
        assert unit.get(key) == [value], (key, unit.get(key))
    assert "@system-service" in unit["SystemCallFilter"]
    assert unit.get("DynamicUser") == ["yes"] or unit.get("User") == ["asynctaskd"]
    # systemd must not SIGKILL a drain that is still within its grace period
    grace = float(Config().worker.shutdown_grace)
    assert float(unit["TimeoutStopSec"][0]) >= grace + 10
    config = "/etc/asynctaskd/%i.toml" if "@" in name else "/etc/asynctaskd/config.toml"
    assert unit["ExecStart"] == [f"/opt/asynctaskd/venv/bin/asynctaskd run --config {config}"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "instance"),
    [("asynctaskd.service", "asynctaskd.service"), ("asynctaskd@.service", "asynctaskd@1.service")],
)
def test_systemd_analyze_verifies_the_units(tmp_path: Path, name: str, instance: str) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify insists that ExecStart exists: point it at this venv's entry point.
    entry = Path(sys.executable).parent / "asynctaskd"
    assert entry.exists(), entry
    text = (UNITS / name).read_text().replace("/opt/asynctaskd/venv/bin/asynctaskd", str(entry))
    (tmp_path / name).write_text(text)
    target = str(tmp_path / instance)
    proc = subprocess.run([analyze, "verify", target], capture_output=True, text=True, timeout=60)
    problems = [
        line for line in (proc.stdout + proc.stderr).splitlines()
        if "asynctaskd" in line or str(tmp_path) in line
    ]  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not problems, proc.stdout + proc.stderr
    security = subprocess.run([analyze, "security", "--offline=true", target],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", security.stdout)
    if security.returncode != 0 and found is None:
        return  # an older systemd without --offline: verify above is the check
    assert found is not None, security.stdout + security.stderr
    assert float(found[1]) <= 2.0, security.stdout


# --- end to end: a real daemon, scraped ------------------------------------------------------


@pytest.fixture
def vendor() -> Iterator[FakeVendorProcess]:
    with FakeVendorProcess.start(Behaviour(polls_to_done=2)) as v:
        yield v


def _create_acl_user(redis: SyncRedis, password: str) -> None:
    """The daemon's ACL user exactly as docs/security.md gives it."""
    create_user_sync(redis, "asynctaskd", password)


def _stop(proc: subprocess.Popen[bytes]) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
            return None
    return proc.returncode


@pytest.mark.slow
def test_scrape_during_a_run_matches_the_tasks_and_covers_dashboard_and_alerts(
    tmp_path: Path, redis_url: str, sync_redis: SyncRedis, vendor: FakeVendorProcess
) -> None:
    n = 40
    _create_acl_user(sync_redis, "ops-test-pw")
    acl_url = redis_url.replace("redis://", "redis://asynctaskd:ops-test-pw@")
    port = free_port()
    config = write_config(tmp_path, acl_url, vendor.url, metrics_port=port)
    proc = start_daemon(config)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_sync(lambda: _get(base + "/readyz")[0] == 200, "readyz 200", timeout=15)
        store = SyncStore(sync_redis, Keys())
        ids = create(store, n)

        def done() -> bool:
            return statuses(store, ids) == {Status.SUCCEEDED: n}

        # A scrape while the run is under way: the gauges move and nothing is over-counted.
        wait_until_sync(lambda: _sample(_get(base + "/metrics")[1], "asynctaskd_claimed_total",
                                        phase="submit"), "first claims", timeout=15)  # fmt: skip
        status, during = _get(base + "/metrics")
        assert status == 200
        succeeded = _sample(during, "asynctaskd_transitions_total", status="SUCCEEDED") or 0
        assert succeeded <= n
        wait_until_sync(done, "all tasks done", timeout=30)

        def settled() -> str | None:
            text = _get(base + "/metrics")[1]
            fresh = _sample(text, "asynctaskd_tasks", status="SUCCEEDED") == n
            return text if fresh and _sample(text, "asynctaskd_live_daemons") == 1 else None

        text = wait_until_sync(settled, "gauges to catch up", timeout=15)
        assert isinstance(text, str)
    finally:
        code = _stop(proc)
    assert code == 0

    # Counts match what was processed: every task submitted once, succeeded once.
    created = [e for e in vendor.submit_log() if e["outcome"] == "created"]
    assert len(created) == n
    assert _sample(text, "asynctaskd_transitions_total", handler="demo", status="SUCCEEDED") == n
    assert _sample(text, "asynctaskd_transitions_total", handler="demo", status="SUBMITTED") == n
    assert _sample(text, "asynctaskd_claimed_total", phase="submit") == n
    assert _sum(text, "asynctaskd_handler_call_seconds_count", op="submit") == n
    assert _sum(text, "asynctaskd_handler_call_seconds_count", op="query") >= n
    assert _sample(text, "asynctaskd_tasks_by_handler", status="SUCCEEDED", handler="demo") == n
    assert _sample(text, "asynctaskd_tasks", status="PENDING_SUBMIT") == 0
    assert _sample(text, "asynctaskd_inflight_calls") == 0
    assert _sample(text, "asynctaskd_ready_tasks", phase="submit") == 0
    assert _sample(text, "asynctaskd_oldest_pending_age_seconds", phase="submit") == 0
    assert _sample(text, "asynctaskd_build_info", version=__version__) == 1
    assert _sum(text, "asynctaskd_redis_call_seconds_count", script="claim") > 0
    assert _sum(text, "asynctaskd_event_loop_lag_seconds_count") > 0
    assert _sum(text, "asynctaskd_due_lag_seconds_count") >= n
    # The documented ACL is enough: no Redis call failed, nothing was refused.
    assert _sum(text, "asynctaskd_store_errors_total") == 0
    logs = "".join(p.read_text() for p in tmp_path.glob("daemon-*.log"))
    assert "NOPERM" not in logs

    # Every metric the dashboard and the alert rules use is one the daemon exports (the
    # web panels: one `asynctaskd web` exports).
    used = {m for e in _dashboard_exprs() for m in METRIC_NAME.findall(e)}
    used |= set(METRIC_NAME.findall(ALERTS.read_text()))
    assert used, "no metric found in the dashboard or the rules"
    text += generate_latest(WebMetrics().registry).decode()
    assert not _unexported(used, text), _unexported(used, text)


def _readyz(base: str) -> tuple[int, list[str]]:
    """/readyz: the status and the body's lines (the reason, then detail such as durability)."""
    status, body = _get(base + "/readyz")
    return status, body.splitlines()


def _config_with_redis(tmp_path: Path, url: str, vendor_url: str, port: int, **redis: str) -> Path:
    return write_daemon_config(
        tmp_path / "config.toml",
        url,
        vendor_url,
        redis=redis,
        worker={"lease": "2s", "shutdown_grace": "10s"},
        metrics={"listen": f"127.0.0.1:{port}"},
        log={"format": "json"},
    )


def _stats_cli(url: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "asynctaskd", "stats", "--url", url, *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_a_gate_that_is_off_shows_in_metrics_readyz_stats_and_the_log(
    tmp_path: Path, vendor: FakeVendorProcess
) -> None:
    """The finding: Redis 7.0 (no WAITAOF), AOF with appendfsync everysec, no replicas,
    durability = "auto". The gate is off; a crash of the Redis host can lose a started mark."""
    binary = find_binary("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    with ServerProcess(binary, aof=True, extra_args=("--appendfsync", "everysec")) as server:
        admin = SyncRedis.from_url(server.url)
        version = str(admin.info("server")["redis_version"])
        if tuple(int(part) for part in version.split(".")[:2]) >= (7, 2):
            pytest.skip("this redis-server has WAITAOF: the gate would be on")
        port = free_port()
        config = _config_with_redis(tmp_path, server.url, vendor.url, port,
                                    durability_check_interval="100ms")  # fmt: skip
        proc = start_daemon(config)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until_sync(lambda: _readyz(base)[0] == 200, "readyz 200", timeout=15)
            # Still ready (under "auto" the gate never decides readiness), and says why.
            ready, durability = _readyz(base)[1]
            assert ready == "ready"
            assert durability.startswith("durability: no gate (auto: the server (7.0"), durability
            assert "appendfsync everysec: a crash of the Redis host can lose" in durability
            text = _get(base + "/metrics")[1]
            assert _sample(text, "asynctaskd_durability_gate", mode="off") == 1
            assert _sample(text, "asynctaskd_durability_gate", mode="waitaof") == 0
            assert _sample(text, "asynctaskd_durability_aof", fsync="everysec") == 1
            assert _sample(text, "asynctaskd_durability_marks", state="at_risk") == 1
            assert _sample(text, "asynctaskd_durability_marks", state="fsynced") == 0

            # `asynctaskd stats` reads it from the daemon's heartbeat in Redis.
            (daemon,) = json.loads(_stats_cli(server.url, "--json"))["daemons"]
            assert daemon["durability"]["mode"] == "off"
            assert daemon["durability"]["marks"] == "at_risk"
            assert daemon["durability"]["fsync"] == "everysec"
            assert "durability: " + daemon["durability"]["detail"] == durability
            table = _stats_cli(server.url)
            assert "gate=off marks=at_risk" in table
            assert "    " + durability in table.splitlines()

            # The server's config changes: the next check reports it.
            admin.config_set("appendfsync", "always")
            wait_until_sync(
                lambda: _sample(_get(base + "/metrics")[1], "asynctaskd_durability_marks",
                                state="fsynced") == 1,
                "the re-check to see appendfsync always", timeout=10,
            )  # fmt: skip
            status, lines = _readyz(base)
            assert status == 200
            assert "appendfsync always: Redis fsyncs every write" in lines[1]
        finally:
            code = _stop(proc)
            admin.close()
    assert code == 0
    logged = [json.loads(line) for p in tmp_path.glob("daemon-*.log")
              for line in p.read_text().splitlines() if line.startswith("{")]  # fmt: skip
    said = [(e["level"], e["msg"]) for e in logged if e["msg"].startswith("durability: ")]
    assert [level for level, _ in said] == ["warning", "info"], said
    assert "appendfsync everysec" in said[0][1]
    assert "appendfsync always" in said[1][1]


@pytest.mark.slow
def test_auto_turns_the_gate_on_in_a_running_daemon_once_the_server_can_honour_it(
    tmp_path: Path, vendor: FakeVendorProcess
) -> None:
    """A server with WAITAOF but AOF off: no gate at start. AOF switched on at runtime: the
    next check turns the gate on, and the worker's submits wait for WAITAOF from then on."""
    binary = find_binary("valkey-server")
    if binary is None:
        pytest.skip("valkey-server is not installed")
    with ServerProcess(binary) as server, SyncRedis.from_url(server.url) as admin:
        port = free_port()
        config = _config_with_redis(tmp_path, server.url, vendor.url, port,
                                    durability_check_interval="100ms")  # fmt: skip
        proc = start_daemon(config)
        base = f"http://127.0.0.1:{port}"

        def metric(name: str, **labels: str) -> float | None:
            return _sample(_get(base + "/metrics")[1], name, **labels)

        try:
            wait_until_sync(lambda: _readyz(base)[0] == 200, "readyz 200", timeout=15)
            assert metric("asynctaskd_durability_gate", mode="off") == 1
            admin.config_set("appendonly", "yes")
            wait_until_sync(lambda: metric("asynctaskd_durability_gate", mode="waitaof") == 1,
                            "the gate to turn on", timeout=15)  # fmt: skip
            assert "gate WAITAOF 1 0 (auto: AOF on, with WAITAOF)" in _readyz(base)[1][1]
            store = SyncStore(admin, Keys())
            ids = create(store, 5)
            wait_until_sync(lambda: statuses(store, ids) == {Status.SUCCEEDED: 5},
                            "tasks done", timeout=30)  # fmt: skip
            gated = "asynctaskd_durability_gate_seconds_count"
            assert metric(gated, outcome="ok") == 5  # each submit waited for WAITAOF
        finally:
            code = _stop(proc)
    assert code == 0


@pytest.mark.slow
def test_readyz_turns_503_when_redis_goes_away(tmp_path: Path, vendor: FakeVendorProcess) -> None:
    binary = find_binary("redis-server") or find_binary("valkey-server")
    if binary is None:
        pytest.skip("no redis-server or valkey-server")
    server = ServerProcess(binary).start()
    port = free_port()
    # No periodic re-check during the test: only the reconnect makes the daemon look again.
    config = _config_with_redis(tmp_path, server.url, vendor.url, port,
                                durability_check_interval="1h")  # fmt: skip
    proc = start_daemon(config)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_sync(lambda: _readyz(base)[0] == 200, "readyz 200", timeout=15)
        assert "AOF off" in _readyz(base)[1][1]
        server.kill()
        wait_until_sync(lambda: (r := _readyz(base))[0] == 503 and r[1][0] == "redis unreachable",
                        "readyz 503 'redis unreachable'", timeout=20)  # fmt: skip
        assert _get(base + "/healthz") == (200, "ok\n")
        wait_until_sync(
            lambda: _sample(_get(base + "/metrics")[1], "asynctaskd_watchdog_ok") == 0,
            "watchdog_ok 0",
            timeout=5,
        )
        wait_until_sync(
            lambda: _sum(_get(base + "/metrics")[1], "asynctaskd_store_errors_total") > 0,
            "store errors counted",
            timeout=5,
        )
        # Back on the same port, now with AOF: the reconnect makes the daemon check again
        # (a failover may also put it on a server that keeps writes differently).
        server.aof, server.extra_args = True, ("--appendfsync", "no")
        server.start()
        wait_until_sync(
            lambda: _sample(_get(base + "/metrics")[1], "asynctaskd_durability_aof",
                            fsync="no") == 1,
            "the durability check after the reconnect", timeout=20,
        )  # fmt: skip
        assert _readyz(base)[0] == 200
    finally:
        _stop(proc)
        server.stop()


def _mdwe_supported() -> bool:
    """Whether this kernel has PR_SET_MDWE (Linux 6.3+): the MemoryDenyWriteExecute check."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(66, 0, 0, 0, 0) >= 0)  # PR_GET_MDWE


@pytest.mark.slow
def test_daemon_runs_with_memory_deny_write_execute(
    tmp_path: Path, vendor: FakeVendorProcess
) -> None:
    """The unit sets MemoryDenyWriteExecute=yes: the daemon (uvloop, aiohttp, hiredis,
    msgspec) must never need writable+executable memory. The kernel's PR_SET_MDWE is the
    same rule, inherited across exec: run the daemon under it and process tasks."""
    if not _mdwe_supported():
        pytest.skip("this kernel has no PR_SET_MDWE (Linux 6.3+)")
    binary = find_binary("redis-server") or find_binary("valkey-server")
    if binary is None:
        pytest.skip("no redis-server or valkey-server")
    with ServerProcess(binary) as server:
        port = free_port()
        config = write_config(tmp_path, server.url, vendor.url, metrics_port=port)
        launcher = (
            "import ctypes, os, sys\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "assert libc.prctl(65, 1, 0, 0, 0) == 0, ctypes.get_errno()  # PR_SET_MDWE\n"
            "os.execv(sys.executable, [sys.executable, '-m', 'asynctaskd', *sys.argv[1:]])\n"
        )
        log = (tmp_path / "mdwe.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-c", launcher, "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            wait_until_sync(lambda: _get(base + "/readyz")[0] == 200, "readyz 200", timeout=15)
            sync = SyncRedis.from_url(server.url)
            try:
                store = SyncStore(sync, Keys())
                ids = create(store, 10)
                wait_until_sync(lambda: statuses(store, ids) == {Status.SUCCEEDED: 10},
                                "tasks done under MDWE", timeout=30)  # fmt: skip
            finally:
                sync.close()
            assert _stop(proc) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()


def test_example_config_documents_per_instance_metrics_ports() -> None:
    text = (ROOT / "config.example.toml").read_text()
    assert 'listen = "127.0.0.1:9464"' in text
    assert "asynctaskd@.service" in text
    deploy = DEPLOY.read_text()
    for needed in ("appendonly yes", "appendfsync", "maxmemory-policy noeviction",
                   "docs/security.md", "systemctl restart", "docs/protocol.md",
                   "job_name: asynctaskd"):  # fmt: skip
        assert needed in deploy, needed
