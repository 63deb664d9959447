"""The chaos runner: real Redis, fake vendor, N daemons, producers, and faults on a schedule.

It starts a Redis-protocol server with AOF and `appendfsync always` (redis-server or
valkey-server), the fake vendor with error injection, and N `asynctaskd run` processes;
producer threads submit thousands of tasks through `asynctaskd.Client` (several tenants,
priorities, dedup keys, short deadlines, delayed tasks, an idempotent handler beside the
non-idempotent one) and cancel some of them, while the fault schedule SIGKILLs and restarts
daemons, SIGSTOPs one for longer than its lease, kills -9 and restarts Redis on the same
port and directory, pauses Redis (`CLIENT PAUSE ... ALL`), and makes the vendor slow
(beyond the lease), throw 5xx/429 storms and answer ambiguously. Then it waits until every
task is settled (or past its deadline plus the slack), stops the daemons with SIGTERM (exit
0 expected) and reads the history for `tests.chaos.checker`.

The daemons log in to Redis as an ACL user whose password (`ChaosConfig.secret`) they get
from the environment, as in production; after the run every key and value in the server,
its append-only files, every daemon log and the checker's report are searched for it.

Cluster mode (`ChaosConfig(..., cluster=True)`, `--cluster`): instead of one server, a
local Redis Cluster of `masters` masters (tests/cluster.py: AOF, `appendfsync always`, no
replicas, the same ACL file on every node); daemons and producers use its
`redis+cluster://` URL with `shards` shards (8: every master serves some). Redis faults
hit one master chosen at random: `kill -9` and a restart on the same port and directory
(the node rejoins with its nodes.conf; the run waits for `cluster_state:ok` on every node
again), or `CLIENT PAUSE ... ALL` on it. The checker reads every shard on every primary,
the final kill -9 takes down every master at once, and the secret scan reads every key of
every node and every node's data directory.

From pytest: `run_chaos(ChaosConfig.ci(tmp_path))` (or `ChaosConfig.cluster_ci`), then
`judge(outcome)`. By hand, from the repository root:

    .venv/bin/python -m tests.chaos.runner --duration 600            # about 11 minutes
    .venv/bin/python -m tests.chaos.runner --duration 60 --server valkey-server
    .venv/bin/python -m tests.chaos.runner --duration 60 --cluster   # 3 masters, 8 shards

`--duration` is the length of the load-and-faults window in seconds; the settle phase
(at most the tracking timeout plus the slack) and start/stop come on top.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import random
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from redis import Redis
from redis.crc import key_slot

from asynctaskd import Client
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.embedded import ServerProcess, find_binary
from asynctaskd.errors import AsyncTaskdError, StoreUnavailable, TaskNotFound
from tests.chaos.checker import (
    History,
    Report,
    SecretScan,
    Submission,
    Violation,
    check,
    read_history,
    scan_files,
    scan_redis,
)
from tests.chaos.harness import (
    Daemons,
    chaos_daemon_config,
    connection_users,
    keyed_client,
    pause_redis,
    write_acl_file,
)
from tests.cluster import LocalCluster

NAMESPACE = "atd"
LIVE = ("PENDING_SUBMIT", "SUBMITTING", "SUBMITTED", "RUNNING")
HANDLER = "demo"
IDEMPOTENT_HANDLER = "demo-idem"
# Daemon crashes already pinned by an xfail(strict=True) regression test, as
# {log substring: test}: a run counts them (and restarts the daemon, as systemd would)
# instead of failing on them. Remove an entry with its fix. (Empty: the uvloop
# "handler is closed" crash was fixed in 8720864.)
KNOWN_CRASHES: dict[str, str] = {}


@dataclass(frozen=True)
class ChaosConfig:
    """Size and mix of one run. `ci()` is the CI-sized run; `scaled()` grows with time."""

    workdir: Path
    server: str = "redis-server"
    duration: float = 60.0  # seconds of load with faults
    tasks: int = 3000
    daemons: int = 3
    producers: int = 3
    # Faults, spread over the load window.
    kills: int = 10
    sigstops: int = 1
    redis_restarts: int = 2
    redis_pauses: int = 2
    latency_spikes: int = 2
    storms: int = 2
    ambiguous_bursts: int = 1
    tenant_pauses: int = 1  # pause tenant `paused_tenant` for `tenant_pause_for` seconds
    paused_tenant: str = "t3"
    tenant_pause_for: float = 12.0
    redis_down_for: float = 0.7  # seconds between kill -9 and restart
    # The vendor's steady misbehaviour.
    error_rate: float = 0.10
    throttle_rate: float = 0.02
    ambiguous_rate: float = 0.05
    ambiguous_delay: float = 2.5  # beyond the lease: the holder must keep renewing
    submit_latency: float = 0.01
    query_latency: float = 0.005
    latency_jitter: float = 0.03
    polls_to_done: int = 3
    fail_fraction: float = 0.05
    never_finish_fraction: float = 0.005
    # Daemons.
    lease: float = 1.0
    max_inflight: int = 300
    # Tasks.
    timeout: float = 30.0  # tracking timeout of ordinary tasks
    short_deadline_fraction: float = 0.10  # these get 0.5-4 s
    delay_fraction: float = 0.05  # due 0.5-5 s after submit
    cancel_fraction: float = 0.05
    dedup_fraction: float = 0.05
    idempotent_fraction: float = 0.15
    tenants: int = 4
    slack: float = 15.0  # a task may settle this long after its deadline
    seed: int = 1
    # The daemons' Redis ACL user and password (REDIS_USERNAME, REDIS_PASSWORD): the
    # password is the secret looked for everywhere after the run. Never printed.
    redis_user: str = "chaos-daemon"
    secret: str = field(default_factory=lambda: f"chaos-secret-{secrets.token_hex(12)}", repr=False)
    # Redis Cluster instead of one server: `masters` masters, tasks over `shards` shards.
    cluster: bool = False
    masters: int = 3
    shards: int = 1

    @classmethod
    def ci(cls, workdir: Path, server: str = "redis-server", seed: int = 1) -> ChaosConfig:
        """The acceptance run: 3 daemons, 3,000 tasks, 10 kills, 1 SIGSTOP, 2 restarts."""
        return cls(workdir=workdir, server=server, seed=seed)

    @classmethod
    def cluster_ci(cls, workdir: Path, server: str = "redis-server", seed: int = 1) -> ChaosConfig:
        """The CI-sized cluster run: 3 masters, 8 shards, 1,200 tasks in 30 s, 3 daemons,
        4 kills, 1 SIGSTOP, 1 master kill -9 + restart, 1 CLIENT PAUSE on a master, and
        one each of the tenant pause, latency spike, storm and ambiguous burst; the same
        vendor misbehaviour as `ci()`. About 50 s on 2 cores."""
        return cls(
            workdir=workdir,
            server=server,
            seed=seed,
            cluster=True,
            masters=3,
            shards=8,
            duration=30.0,
            tasks=1200,
            kills=4,
            sigstops=1,
            redis_restarts=1,
            redis_pauses=1,
            latency_spikes=1,
            storms=1,
            ambiguous_bursts=1,
            tenant_pauses=1,
            timeout=15.0,  # the never-finishing tasks time out 15 s after the last create
        )

    @classmethod
    def scaled(
        cls, duration: float, workdir: Path, server: str = "redis-server", seed: int = 1
    ) -> ChaosConfig:
        """The same mix for a longer window: 50 tasks/s and faults in proportion."""
        k = duration / 60.0
        return cls(
            workdir=workdir,
            server=server,
            duration=duration,
            tasks=max(100, round(50 * duration)),
            kills=max(1, round(10 * k)),
            sigstops=max(1, round(k)),
            redis_restarts=max(1, round(2 * k)),
            redis_pauses=max(1, round(2 * k)),
            latency_spikes=max(1, round(2 * k)),
            storms=max(1, round(2 * k)),
            ambiguous_bursts=max(1, round(k)),
            tenant_pauses=max(1, round(k)),
            seed=seed,
        )


@dataclass
class RunOutcome:
    """What a run leaves for the checker and for the figures."""

    config: ChaosConfig
    history: History
    exit_codes: list[int]
    faults: Counter[str] = field(default_factory=Counter)
    producers: Counter[str] = field(default_factory=Counter)
    log_lines: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # runner-level violations
    timings: dict[str, float] = field(default_factory=dict)
    secret_scan: SecretScan | None = None
    layout: dict[str, list[int]] = field(default_factory=dict)  # cluster: master -> shards

    def figures(self) -> dict[str, Any]:
        t = self.timings
        cfg = self.config
        server = cfg.server
        if cfg.cluster:
            server += f" (cluster: {cfg.masters} masters, {cfg.shards} shards)"
        out: dict[str, Any] = {
            "server": server,
            "tasks submitted (acknowledged)": self.producers["acknowledged"],
            "load window s": round(t.get("load", 0.0), 1),
            "settle s": round(t.get("settle", 0.0), 1),
            "total s": round(t.get("total", 0.0), 1),
            "secret scan s": round(t.get("secret scan", 0.0), 1),
        }
        if cfg.cluster:
            out["shards by master"] = self.layout
            out["master restart to cluster_state:ok s (max)"] = round(t.get("recovery", 0.0), 1)
        return {
            **out,
            "faults": dict(sorted(self.faults.items())),
            "producers": dict(sorted(self.producers.items())),
            "daemon log lines": dict(self.log_lines.most_common(12)),
            "daemon exit codes": self.exit_codes,
        }


class _Vendor:
    """The fake vendor's knobs: a base behaviour plus the overrides of active faults."""

    def __init__(self, proc: FakeVendorProcess, base: dict[str, Any]) -> None:
        self.proc = proc
        self.base = base
        self.active: dict[int, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self._next = 0

    def push(self, changes: dict[str, Any]) -> int:
        with self.lock:
            self._next += 1
            self.active[self._next] = changes
            self._apply()
            return self._next

    def pop(self, token: int) -> None:
        with self.lock:
            self.active.pop(token, None)
            self._apply()

    def _apply(self) -> None:
        merged = dict(self.base)
        for changes in self.active.values():
            merged.update(changes)
        self.proc.configure(**merged)


class _Target:
    """The Redis under test: one server, or (`cfg.cluster`) a local cluster of masters.

    `url` is what daemons and producers use; `client()` a plain redis-py client routed by
    key (a `RedisCluster` on a cluster); `nodes` every server process (the masters).
    """

    def __init__(self, cfg: ChaosConfig, binary: Path, acl: Path) -> None:
        args = ("--aclfile", str(acl.resolve()))
        self.cfg = cfg
        self.shards = cfg.shards
        self.cluster: LocalCluster | None = None
        if cfg.cluster:
            self.cluster = LocalCluster(
                binary, cfg.workdir / "cluster", masters=cfg.masters, aof=True, extra_args=args
            )
            self.nodes = list(self.cluster.masters)
        else:
            server = ServerProcess(
                binary, data_dir=cfg.workdir / "redis", aof=True, extra_args=args
            )
            self.nodes = [server]
        self.recoveries: list[float] = []  # cluster: seconds from restart to cluster_state:ok

    @property
    def url(self) -> str:
        return self.cluster.url if self.cluster is not None else self.nodes[0].url

    def start(self) -> None:
        if self.cluster is not None:
            try:
                self.cluster.start()
            except BaseException:
                self.cluster.stop()
                raise
        else:
            self.nodes[0].start()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def client(self, socket_timeout: float | None = None) -> Any:
        return keyed_client(self.url, socket_timeout=socket_timeout)

    def masters_of_shards(self) -> dict[int, list[int]]:
        """Cluster: node index -> the shards whose slot it serves (all nodes, even empty)."""
        out: dict[int, list[int]] = {i: [] for i in range(len(self.nodes))}
        if self.cluster is None:
            out[0] = list(range(self.shards))
            return out
        for shard in range(self.shards):
            owner = self.cluster.primary_of_slot(key_slot(f"{NAMESPACE}:{{s{shard}}}".encode()))
            out[self.nodes.index(owner)].append(shard)
        return out

    def kill_restart(self, node: ServerProcess, down_for: float) -> None:
        """kill -9 one server and start it again on the same port and directory."""
        node.kill()
        time.sleep(down_for)
        node.start()
        if self.cluster is not None:
            # The node rejoins with its nodes.conf; a restarted master also waits a moment
            # before it calls its slots served again. Wait for cluster_state:ok everywhere.
            started = time.monotonic()
            deadline = started + 60
            while not self.cluster.healthy():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node {node.port} did not rejoin the cluster in 60 s")
                time.sleep(0.05)
            self.recoveries.append(time.monotonic() - started)

    def restart_all(self) -> None:
        """kill -9 every server at once, then start them all again."""
        for node in self.nodes:
            node.kill()
        for node in self.nodes:
            node.start()
        if self.cluster is not None:
            deadline = time.monotonic() + 60
            while not self.cluster.healthy():
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not come back in 60 s")
                time.sleep(0.05)


class _Chaos:
    """One run's moving parts."""

    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.faults: Counter[str] = Counter()
        self.producers: Counter[str] = Counter()
        self.problems: list[str] = []
        self.submissions: list[Submission] = []
        self.max_deadline = 0.0  # epoch seconds
        self.lock = threading.Lock()
        self.stop_load = threading.Event()
        self.cancels: list[tuple[float, str, str | None]] = []  # heap: (at, id, tenant)
        self.stopped: set[int] = set()  # daemons under SIGSTOP
        self.pause_windows: list[tuple[str, int, int]] = []  # (dimension, from ms, to ms)
        self.tenant_paused: tuple[Client, int] | None = None  # (its client, from ms)
        self.tenant_pause_gen = 0  # the latest tenant_pause fault's number
        self.expected_down: set[int] = set()
        self.server: _Target | None = None
        self.daemons: Daemons | None = None
        self.vendor: _Vendor | None = None

    # --- producers ---------------------------------------------------------------------

    def produce(self, index: int, count: int, first: int, started: float) -> None:
        cfg = self.cfg
        assert self.server is not None
        rng = random.Random(cfg.seed * 1000 + index)
        window = cfg.duration * 0.92
        client = Client.from_url(self.server.url, NAMESPACE, shards=cfg.shards)
        try:
            for k in range(count):
                if self.stop_load.is_set():
                    return
                delay = started + window * k / count - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                n = first + k
                kwargs = self._options(rng, n)
                task = self._submit(client, n, kwargs)
                if task is None:
                    continue
                tenant = kwargs.get("tenant")
                deduped = isinstance(task.params, dict) and task.params.get("n") != n
                with self.lock:
                    self.producers["acknowledged"] += 1
                    self.producers["dedup hits"] += deduped
                    self.submissions.append(
                        Submission(task.id, tenant, kwargs.get("dedup_key"), deduped)
                    )
                    self.max_deadline = max(self.max_deadline, task.deadline_at)
                    if not deduped and rng.random() < cfg.cancel_fraction:
                        at = time.monotonic() + rng.choice([0.0, 0.05, 0.3, 1.0, 3.0])
                        heapq.heappush(self.cancels, (at, task.id, tenant))
        finally:
            client.close()

    def _options(self, rng: random.Random, n: int) -> dict[str, Any]:
        cfg = self.cfg
        kwargs: dict[str, Any] = {
            "tracking_timeout": cfg.timeout,
            "priority": rng.randint(-3, 3),
            "metadata": {"producer_seq": n},
        }
        if rng.random() < 0.8:
            kwargs["tenant"] = f"t{rng.randrange(cfg.tenants)}"
        if rng.random() < cfg.short_deadline_fraction:
            kwargs["tracking_timeout"] = round(rng.uniform(0.5, 4.0), 3)
        elif rng.random() < cfg.delay_fraction:
            kwargs["delay"] = round(rng.uniform(0.5, 5.0), 3)
        if rng.random() < cfg.dedup_fraction:
            kwargs["dedup_key"] = f"order-{rng.randrange(40)}"
        return kwargs

    def _submit(self, client: Client, n: int, kwargs: dict[str, Any]) -> Any:
        handler = IDEMPOTENT_HANDLER if n % 100 < self.cfg.idempotent_fraction * 100 else HANDLER
        params = {"n": n, "blob": f"{n:x}" * (1 + n % 7)}
        for attempt in range(200):
            try:
                return client.submit(handler, params, **kwargs)
            except StoreUnavailable:
                # The create may or may not have run: the task may exist with an id we
                # never learnt. The checker reads every task in Redis, not only ours.
                with self.lock:
                    self.producers["submit errors (Redis away)"] += 1
                time.sleep(0.1 + 0.05 * attempt)
            except AsyncTaskdError as exc:
                with self.lock:
                    self.producers[f"submit refused: {type(exc).__name__}"] += 1
                    self.problems.append(f"submit of task #{n} refused: {exc}")
                return None
        with self.lock:
            self.producers["submits given up"] += 1
        return None

    def cancel_loop(self) -> None:
        assert self.server is not None
        client = Client.from_url(self.server.url, NAMESPACE, shards=self.cfg.shards)
        try:
            while True:
                with self.lock:
                    ready = bool(self.cancels) and self.cancels[0][0] <= time.monotonic()
                    item = heapq.heappop(self.cancels) if ready else None
                    empty = not self.cancels
                if item is None:
                    if empty and self.stop_load.is_set():
                        return
                    time.sleep(0.01)
                    continue
                _, task_id, tenant = item
                self._probe_tenants(client, task_id)
                for attempt in range(100):
                    try:
                        canceled = client.cancel(task_id, tenant=tenant)
                        with self.lock:
                            self.producers["cancels accepted" if canceled else "cancels late"] += 1
                        break
                    except StoreUnavailable:
                        time.sleep(0.1 + 0.05 * attempt)
                    except TaskNotFound as exc:
                        with self.lock:
                            self.problems.append(f"cancel of {task_id} (own tenant): {exc}")
                        break
        finally:
            client.close()

    def _probe_tenants(self, client: Client, task_id: str) -> None:
        """Another tenant can neither read nor cancel the task."""
        with contextlib.suppress(StoreUnavailable):
            seen = client.get(task_id, tenant="intruder")
            try:
                client.cancel(task_id, tenant="intruder")
                leaked = True
            except TaskNotFound:
                leaked = False
            with self.lock:
                self.producers["cross-tenant probes"] += 1
                if seen is not None or leaked:
                    self.problems.append(f"tenant isolation: {task_id} visible to another tenant")

    # --- faults ------------------------------------------------------------------------

    def schedule(self, start: float) -> list[tuple[float, str]]:
        cfg = self.cfg
        kinds = (
            ["kill"] * cfg.kills
            + ["sigstop"] * cfg.sigstops
            + ["redis_restart"] * cfg.redis_restarts
            + ["redis_pause"] * cfg.redis_pauses
            + ["latency_spike"] * cfg.latency_spikes
            + ["storm"] * cfg.storms
            + ["ambiguous_burst"] * cfg.ambiguous_bursts
            + ["tenant_pause"] * cfg.tenant_pauses
        )
        self.rng.shuffle(kinds)
        lo, hi = 3.0, max(4.0, cfg.duration - 3.0)
        step = (hi - lo) / max(1, len(kinds))
        out = []
        for i, kind in enumerate(kinds):
            at = lo + step * (i + self.rng.uniform(0.1, 0.9))
            out.append((start + at, kind))
        return out

    def inject(self, kind: str, later: list[tuple[float, int, Callable[[], None]]]) -> None:
        cfg = self.cfg
        assert self.daemons is not None and self.server is not None and self.vendor is not None
        now = time.monotonic()
        if kind == "kill":
            i = self._pick_daemon()
            self.expected_down.add(i)
            self.daemons.kill(i)
            self.daemons.start(i)
            self.expected_down.discard(i)
        elif kind == "sigstop":
            # Slow the vendor first so the victim holds leases of calls in flight, then
            # freeze the daemon holding the most for 3.5 leases: the stale-worker case.
            token = self.vendor.push(
                {"submit_latency": cfg.lease * 1.5, "query_latency": cfg.lease * 1.5}
            )
            vendor = self.vendor
            time.sleep(cfg.lease * 0.6)
            i, held = self._busiest_daemon()
            proc = self.daemons.procs[i]
            assert proc is not None
            proc.send_signal(signal.SIGSTOP)
            self.stopped.add(i)
            self.faults["leases held by SIGSTOPped daemons"] += held

            def sigcont(i: int = i, proc: Any = proc) -> None:
                proc.send_signal(signal.SIGCONT)
                self.stopped.discard(i)

            now = time.monotonic()
            later.append((now + cfg.lease * 1.0, len(later), lambda: vendor.pop(token)))
            later.append((now + cfg.lease * 3.5, len(later), sigcont))
        elif kind == "tenant_pause":
            dim = f"tenant:{cfg.paused_tenant}"
            # The server's clock (on a cluster every node runs on this host's clock).
            time_url = self.server.nodes[0].url
            self.tenant_pause_gen += 1
            gen = self.tenant_pause_gen
            if self.tenant_paused is None:
                client = Client.from_url(self.server.url, NAMESPACE, shards=cfg.shards)
                _retry(lambda: client.pause(tenant=cfg.paused_tenant, note="chaos"))
                start_ms = _server_ms(time_url)  # no claim of the tenant after this
                self.tenant_paused = (client, start_ms)
            else:
                # Still paused by an earlier fault: hold it longer (one window), or that
                # fault's resume would lift this one's pause inside its window.
                self.faults["tenant pauses extended"] += 1

            def unpause(gen: int = gen) -> None:
                if gen != self.tenant_pause_gen or self.tenant_paused is None:
                    return  # a later tenant_pause holds the tenant longer
                client, start_ms = self.tenant_paused
                self.tenant_paused = None
                end_ms = _server_ms(time_url)  # claims may start again after this
                moved = _retry(lambda: client.resume(tenant=cfg.paused_tenant))
                client.close()
                self.pause_windows.append((dim, start_ms, end_ms))
                self.faults["tasks held by tenant pauses"] += moved

            later.append((now + cfg.tenant_pause_for, len(later), unpause))
        elif kind == "redis_restart":
            node = self._pick_node(kind)
            self.server.kill_restart(node, cfg.redis_down_for)
        elif kind == "redis_pause":
            pause_redis(self._pick_node(kind).url, round(cfg.lease * 2500))
        else:
            changes = {
                "latency_spike": {
                    "submit_latency": cfg.lease * 1.5,
                    "query_latency": cfg.lease * 1.5,
                },
                "storm": {"error_rate": 0.5, "throttle_rate": 0.3},
                "ambiguous_burst": {"ambiguous_rate": 0.3},
            }[kind]
            token = self.vendor.push(changes)
            vendor = self.vendor
            later.append((now + 3.0, len(later), lambda: vendor.pop(token)))
        self.faults[kind] += 1

    def _busiest_daemon(self) -> tuple[int, int]:
        """The running daemon that holds the most leases right now, and how many."""
        assert self.daemons is not None and self.server is not None
        owners: Counter[str] = Counter()
        client: Any = self.server.client(socket_timeout=5)
        try:
            for shard in range(self.cfg.shards):
                tag = f"{NAMESPACE}:{{s{shard}}}:"
                for member in client.zrange(tag + "leases", 0, -1):
                    owner = client.hget(tag + "task:" + member.decode(), "owner")
                    if owner is not None:
                        owners[owner.decode()] += 1
        finally:
            client.close()
        host = socket.gethostname()
        best = (self._pick_daemon(), 0)
        for i, proc in enumerate(self.daemons.procs):
            if proc is not None and i not in self.stopped:
                held = owners[f"{host}-{proc.pid}"]
                if held > best[1]:
                    best = (i, held)
        return best

    def _pick_node(self, kind: str) -> ServerProcess:
        """The server a Redis fault hits: the only one, or a random master of a cluster."""
        assert self.server is not None
        if len(self.server.nodes) == 1:
            return self.server.nodes[0]
        i = self.rng.randrange(len(self.server.nodes))
        self.faults[f"{kind} on master {i}"] += 1
        return self.server.nodes[i]

    def _pick_daemon(self) -> int:
        assert self.daemons is not None
        free = [i for i in range(len(self.daemons.procs)) if i not in self.stopped]
        return self.rng.choice(free)

    def check_daemons(self) -> None:
        """A daemon that exited without being killed is a finding; restart it."""
        assert self.daemons is not None
        for i, proc in enumerate(self.daemons.procs):
            if i in self.expected_down or proc is None or proc.poll() is None:
                continue
            tail = _log_tail(self.daemons, i)
            young = time.monotonic() - self.daemons.started_at[i] < 15
            known = next((k for k in KNOWN_CRASHES if k in tail), None)
            if proc.returncode == 1 and young and "StoreUnavailable" in tail:
                # Start-up while Redis was away: it exits 1 for systemd to restart it
                # (Restart=on-failure). Not a guarantee; counted, and restarted likewise.
                self.faults["daemon start-ups that failed: Redis away"] += 1
            elif known is not None:
                self.faults[f"daemon crashes, known bug ({KNOWN_CRASHES[known]})"] += 1
            else:
                self.problems.append(f"daemon {i} exited on its own ({proc.returncode}):\n{tail}")
                self.faults["unexpected daemon exits"] += 1
            self.daemons.start(i)


def _retry(fn: Callable[[], Any], tries: int = 200) -> Any:
    """Call through Redis restarts and pauses."""
    for attempt in range(tries):
        try:
            return fn()
        except StoreUnavailable:
            time.sleep(0.1 + 0.02 * attempt)
    return fn()


def _server_ms(url: str) -> int:
    def read() -> int:
        client = Redis.from_url(url, socket_timeout=10)
        try:
            sec, usec = client.time()
            return int(sec) * 1000 + int(usec) // 1000
        finally:
            client.close()

    for attempt in range(200):
        try:
            return read()
        except Exception:  # Redis restarting: try again
            time.sleep(0.1 + 0.02 * attempt)
    return read()


def _log_tail(daemons: Daemons, i: int, chars: int = 3000) -> str:
    logs = sorted(daemons.log_dir.glob(f"daemon-{i}-*.log"), key=lambda p: p.stat().st_mtime)
    return logs[-1].read_text(errors="replace")[-chars:] if logs else "<no log>"


def _unsettled(target: _Target) -> int:
    """Live tasks, summed over every shard's status indexes."""
    client: Any = target.client(socket_timeout=5)
    try:
        return sum(
            int(client.zcard(f"{NAMESPACE}:{{s{shard}}}:idx:{s}"))
            for shard in range(target.shards)
            for s in LIVE
        )
    finally:
        client.close()


def _log_stats(daemons: Daemons) -> Counter[str]:
    """Daemon log lines by level and message head (JSON lines; tracebacks counted apart)."""
    out: Counter[str] = Counter()
    for path in daemons.log_dir.glob("daemon-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                if line.startswith("Traceback"):
                    out["non-JSON traceback"] += 1
                continue
            if not isinstance(rec, dict):
                continue
            msg = str(rec.get("msg", ""))
            head = msg.split(":")[0][:60] if not msg.startswith("save refused") else msg[:40]
            out[f"{rec.get('level', '?')}: {head}"] += 1
    return out


def run_chaos(cfg: ChaosConfig, *, log: Callable[[str], None] | None = None) -> RunOutcome:
    """Run one chaos session end to end; raises only if the setup itself fails."""
    say = log or (lambda _msg: None)
    binary = find_binary(cfg.server)
    if binary is None:
        raise RuntimeError(f"{cfg.server} is not installed")
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    chaos = _Chaos(cfg)
    timings: dict[str, float] = {}
    t_begin = time.monotonic()
    acl = write_acl_file(cfg.workdir / "users.acl", cfg.redis_user, cfg.secret)
    server = _Target(cfg, binary, acl)
    server.start()
    layout: dict[str, list[int]] = {}
    chaos.server = server
    scan = SecretScan(cfg.secret)
    try:
        base: dict[str, Any] = {
            "submit_latency": cfg.submit_latency,
            "query_latency": cfg.query_latency,
            "latency_jitter": cfg.latency_jitter,
            "error_rate": cfg.error_rate,
            "throttle_rate": cfg.throttle_rate,
            "ambiguous_rate": cfg.ambiguous_rate,
            "ambiguous_delay": cfg.ambiguous_delay,
            "retry_after": 1,
            "polls_to_done": cfg.polls_to_done,
            "fail_fraction": cfg.fail_fraction,
            "never_finish_fraction": cfg.never_finish_fraction,
        }
        # Keep the whole events stream: the checker reads every transition.
        side = server.client()
        for shard in range(cfg.shards):
            side.hset(f"{NAMESPACE}:{{s{shard}}}:settings", "events_maxlen", 50_000_000)
        side.close()
        if cfg.cluster:
            layout = {f"master {i}": s for i, s in server.masters_of_shards().items()}
            idle = [name for name, shards in layout.items() if not shards]
            if idle:  # the faults on those masters would test nothing
                chaos.problems.append(f"{idle} serve no shard: {layout}")
        with FakeVendorProcess.start(Behaviour(**base, seed=cfg.seed)) as vendor_proc:
            chaos.vendor = _Vendor(vendor_proc, base)
            config = chaos_daemon_config(
                cfg.workdir,
                server.url,
                vendor_proc.url,
                lease=f"{cfg.lease}s",
                max_inflight=cfg.max_inflight,
                shards=cfg.shards,
            )
            credentials = {"REDIS_USERNAME": cfg.redis_user, "REDIS_PASSWORD": cfg.secret}
            daemons = Daemons(config, cfg.daemons, env=credentials)
            chaos.daemons = daemons
            exit_codes: list[int] = []
            try:
                daemons.start_all()
                _wait_for_handlers(server, time.monotonic() + 30)
                chaos.problems.extend(_check_logins(server, cfg.redis_user, scan))
                say(f"{cfg.server} {server.url}, vendor {vendor_proc.url}, {cfg.daemons} daemons")
                _load_and_faults(chaos, timings, say)
                _settle(chaos, timings, say)
                exit_codes = daemons.stop_all()
            finally:
                if not exit_codes:  # something above failed: do not leave processes behind
                    for proc in daemons.procs:
                        if proc is not None and proc.poll() is None:
                            proc.send_signal(signal.SIGCONT)
                    exit_codes = daemons.stop_all()
            vendor_log = vendor_proc.submit_log()
        history = _read(server)
        # Durability: everything acknowledged survives one more kill -9 (AOF, fsync always);
        # on a cluster, of every master at once.
        server.restart_all()
        again = _read(server)
        chaos.problems.extend(_differences(history, again))
        chaos.faults["redis_restart (final, compared)"] += 1
        t_scan = time.monotonic()
        for i, node in enumerate(server.nodes):
            side = Redis.from_url(node.url, socket_timeout=30)
            try:
                scan_redis(side, scan, label=f"Redis master {i}" if cfg.cluster else "Redis")
            finally:
                side.close()
        timings["secret scan"] = time.monotonic() - t_scan
    finally:
        server.stop()
    # After the stop: the append-only files and the server's log are complete.
    files = [(f"daemon log {p.name}", p) for p in sorted(daemons.log_dir.glob("daemon-*.log"))]
    for node in server.nodes:
        root = node.data_dir.parent if cfg.cluster else node.data_dir  # m0/..., m1/...
        files += [
            (f"Redis file {p.relative_to(root)}", p)
            for p in sorted(node.data_dir.rglob("*"))
            if p.is_file()
        ]
    t_scan = time.monotonic()
    scan_files(files, scan)
    timings["secret scan"] = timings.get("secret scan", 0.0) + time.monotonic() - t_scan
    history.vendor_log = vendor_log
    history.submissions = list(chaos.submissions)
    history.idempotent_handlers = frozenset({IDEMPOTENT_HANDLER})
    history.pause_windows = list(chaos.pause_windows)
    timings["total"] = time.monotonic() - t_begin
    if server.recoveries:
        timings["recovery"] = max(server.recoveries)
    if any(code != 0 for code in exit_codes):
        chaos.problems.append(f"daemons did not all exit 0 on SIGTERM: {exit_codes}")
    return RunOutcome(
        config=cfg,
        history=history,
        exit_codes=exit_codes,
        faults=chaos.faults,
        producers=chaos.producers,
        log_lines=_log_stats(daemons),
        problems=chaos.problems,
        timings=timings,
        secret_scan=scan,
        layout=layout,
    )


def _load_and_faults(chaos: _Chaos, timings: dict[str, float], say: Callable[[str], None]) -> None:
    """Producers and the canceller in threads; the fault schedule on this thread."""
    cfg = chaos.cfg
    t_load = time.monotonic()
    n = cfg.producers
    per = [cfg.tasks // n + (i < cfg.tasks % n) for i in range(n)]
    producers = [
        threading.Thread(target=chaos.produce, args=(i, per[i], sum(per[:i]), t_load), daemon=True)
        for i in range(cfg.producers)
    ]
    canceller = threading.Thread(target=chaos.cancel_loop, daemon=True)
    for t in [*producers, canceller]:
        t.start()
    plan = chaos.schedule(t_load)
    later: list[tuple[float, int, Callable[[], None]]] = []
    while plan or later or any(t.is_alive() for t in producers):
        now = time.monotonic()
        while later and min(later)[0] <= now:
            item = min(later)
            later.remove(item)
            item[2]()
        if plan and plan[0][0] <= now:
            _, kind = plan.pop(0)
            chaos.check_daemons()  # a crash is seen before a kill restarts that daemon
            chaos.inject(kind, later)
            say(f"  t+{time.monotonic() - t_load:5.1f}s {kind}")
            continue
        chaos.check_daemons()
        if now > t_load + cfg.duration * 3 + 120:
            chaos.problems.append("load phase overran: producers stuck")
            break
        time.sleep(0.05)
    chaos.stop_load.set()
    for t in [*producers, canceller]:
        t.join(timeout=60)
    timings["load"] = time.monotonic() - t_load
    say(f"load done in {timings['load']:.1f}s: {chaos.producers['acknowledged']} tasks")


def _settle(chaos: _Chaos, timings: dict[str, float], say: Callable[[str], None]) -> None:
    """Wait until nothing is live, or the last deadline plus the slack has passed."""
    assert chaos.server is not None
    t_settle = time.monotonic()
    give_up = t_settle + max(0.0, chaos.max_deadline - time.time()) + chaos.cfg.slack + 5
    left = -1
    while time.monotonic() < give_up:
        chaos.check_daemons()
        try:
            left = _unsettled(chaos.server)
        except Exception as exc:  # keep waiting; the checker will tell what is wrong
            say(f"  settle poll failed: {exc}")
        if left == 0:
            break
        time.sleep(0.25)
    timings["settle"] = time.monotonic() - t_settle
    say(f"settle phase {timings['settle']:.1f}s, live tasks left: {left}")


def _read(target: _Target) -> History:
    """The history, read by the checker: every shard, on every primary of a cluster."""
    client = target.client(socket_timeout=30)
    try:
        return read_history(client, NAMESPACE, target.shards)
    finally:
        client.close()


def _differences(before: History, after: History) -> list[str]:
    """What a kill -9 and restart lost or changed (nothing, with appendfsync always)."""
    out = []
    if before.tasks != after.tasks:
        changed = [t for t in before.tasks if before.tasks[t] != after.tasks.get(t)]
        out.append(f"kill -9 changed {len(changed)} task hashes, e.g. {changed[:3]}")
    if before.counts != after.counts:
        out.append(f"kill -9 changed the counters: {before.counts} -> {after.counts}")
    elif len(before.shard_counts) > 1 and before.shard_counts != after.shard_counts:
        out.append("kill -9 moved counts between shards")
    n_before = sum(len(e) for e in before.events.values())
    n_after = sum(len(e) for e in after.events.values())
    if n_before != n_after:
        out.append(f"kill -9 changed the events stream: {n_before} -> {n_after} entries")
    return out


def _check_logins(target: _Target, user: str, scan: SecretScan) -> list[str]:
    """The daemons use the password: each connection is `user`'s (else the scan is moot).

    Right after start-up only daemons are connected; a client the runner just closed may
    still be listed for a moment, so wait for the default user's connections to go. On a
    cluster, every master must have the daemons' connections, and only theirs.
    """
    deadline = time.monotonic() + 3
    while True:
        per_node = [connection_users(node.url) for node in target.nodes]
        done = all(set(users) <= {user} and users[user] for users in per_node)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    total = sum(users[user] for users in per_node)
    scan.checked["secret scan: daemon connections logged in with it"] = total
    out = []
    for i, users in enumerate(per_node):
        node = f" on master {i}" if target.cluster is not None else ""
        if not users[user]:
            out.append(
                f"no connection logged in as {user!r}{node}: the daemons did not use the password"
            )
        others = {u: n for u, n in users.items() if u != user}
        if others:
            out.append(
                f"connections of other users while only daemons were connected{node}: {others}"
            )
    return out


def _wait_for_handlers(target: _Target, deadline: float) -> None:
    client: Any = target.client()
    try:
        while time.monotonic() < deadline:
            live = client.hgetall(f"{NAMESPACE}:handlers")
            now_ms = time.time() * 1000
            names = {k.decode() for k, v in live.items() if int(v) > now_ms}
            if {HANDLER, IDEMPOTENT_HANDLER} <= names:
                return
            time.sleep(0.05)
    finally:
        client.close()
    raise RuntimeError("daemons did not register their handlers within 30 s")


def judge(outcome: RunOutcome) -> Report:
    """Run the checker and fold in what only the runner saw (exits, tenant leaks)."""
    report = check(outcome.history, slack_s=outcome.config.slack)
    for problem in outcome.problems:
        report.violations.append(Violation("runner", None, problem))
    report.figures = {**outcome.figures(), **report.figures}
    scan = outcome.secret_scan
    if scan is not None:
        report.checked.update(scan.checked)
        report.violations.extend(scan.violations())
        # Last, the report as it will be printed: every other part is in it by now.
        if scan.holds_secret(report.format()):
            report.violations.append(Violation("secret_leak", None, "the secret is in this report"))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.runner", description=__doc__)
    parser.add_argument("--duration", type=float, default=60.0, help="load+faults window, s")
    parser.add_argument("--tasks", type=int, help="default: 50 per second of --duration")
    parser.add_argument("--daemons", type=int, default=3)
    parser.add_argument("--server", default="redis-server", help="redis-server or valkey-server")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    parser.add_argument("--workdir", type=Path, help="default: a fresh temporary directory")
    parser.add_argument("--keep", action="store_true", help="keep the workdir on success")
    parser.add_argument(
        "--cluster", action="store_true", help="a local Redis Cluster instead of one server"
    )
    parser.add_argument("--masters", type=int, default=3, help="with --cluster")
    parser.add_argument("--shards", type=int, default=8, help="with --cluster")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="asynctaskd-chaos-"))
    cfg = ChaosConfig.scaled(args.duration, workdir, args.server, args.seed)  # 60 s = ci()
    cfg = replace(cfg, daemons=args.daemons, tasks=args.tasks or cfg.tasks)
    if args.cluster:
        cfg = replace(cfg, cluster=True, masters=args.masters, shards=args.shards)
    print(f"chaos run: {cfg}", flush=True)  # noqa: T201 - a command-line tool
    outcome = run_chaos(cfg, log=lambda m: print(m, flush=True))  # noqa: T201
    report = judge(outcome)
    print(report.format(), flush=True)  # noqa: T201
    if report.ok and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"workdir kept: {workdir}")  # noqa: T201
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
