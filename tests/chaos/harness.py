"""Real processes for fault tests: a Redis with AOF, the fake vendor, several daemons."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from redis import Redis
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisError

from asynctaskd.codec import encode_json
from asynctaskd.config import load_config
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.store import SyncStore
from tests.configs import FAST_RETRY, demo_handler, write_daemon_config


def daemon_config(
    tmp: Path,
    url: str,
    vendor_url: str,
    *,
    idempotent: bool = False,
    lease: str = "1s",
    shards: int = 1,
    max_inflight: int = 300,
    max_reclaims: int | None = None,
    extra_handlers: Sequence[Mapping[str, Any]] = (),
    handler: Mapping[str, Any] | None = None,
) -> Path:
    """A daemon config on the fake vendor: `handler` (default: the demo handler, key
    "demo", which `create_tasks` uses) and `extra_handlers`."""
    redis: dict[str, Any] = {"socket_timeout": "2s"} | ({"shards": shards} if shards != 1 else {})
    worker: dict[str, Any] = {"lease": lease, "shutdown_grace": "2s", "max_inflight": max_inflight}
    if max_reclaims is not None:
        worker["max_reclaims"] = max_reclaims
    return write_daemon_config(
        tmp / "daemon.toml",
        url,
        vendor_url,
        redis=redis,
        worker=worker,
        retry={**FAST_RETRY, "max_error_delay": "1s", "max_consecutive_errors": 50},
        log={"format": "json", "level": "warning"},
        handlers=[handler or demo_handler(vendor_url, idempotent=idempotent), *extra_handlers],
    )


class Daemons:
    """N `asynctaskd run` processes that can be killed and restarted.

    `env` is added to the environment each one starts with (credentials, as systemd's
    `Environment=` or `LoadCredential=` would give them: never in the config file).
    """

    def __init__(self, config: Path, n: int, env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.env = dict(env or {})
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self.started_at = [0.0] * n  # the runner tells young crashes from old ones
        self.kills = 0
        self.log_dir = config.parent

    def start(self, i: int) -> None:
        log = (self.log_dir / f"daemon-{i}-{time.monotonic_ns()}.log").open("wb")
        self.started_at[i] = time.monotonic()
        self.procs[i] = subprocess.Popen(
            [sys.executable, "-m", "asynctaskd", "run", "--config", str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, **self.env},
        )

    def wait_heartbeats(self, timeout: float) -> None:
        config = load_config(self.config)
        client = keyed_client(config.redis.url)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                live = {p.pid for p in self.procs if p is not None and p.poll() is None}
                try:
                    records = client.hvals(Keys(config.redis.namespace).daemons())
                except RedisError:
                    records = []
                beating = {json.loads(r).get("pid") for r in records}
                if live <= beating:
                    return
                time.sleep(0.05)
        finally:
            client.close()

    def start_all(self) -> None:
        for i in range(len(self.procs)):
            self.start(i)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            if sig == signal.SIGKILL:
                proc.wait(timeout=10)
                self.kills += 1

    def kill_random_and_restart(self, rng: random.Random) -> None:
        i = rng.randrange(len(self.procs))
        self.kill(i)
        self.start(i)

    def stop_all(self) -> list[int]:
        codes = []
        # A process still starting up may have no signal handler yet: wait until every
        # live one has sent a heartbeat (its handlers are up by then), within bounds.
        self.wait_heartbeats(timeout=15)
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            if proc is not None:
                try:
                    codes.append(proc.wait(timeout=20))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    codes.append(-9)
        return codes

    def logs(self) -> str:
        return "\n".join(
            p.read_text(errors="replace")[-3000:] for p in self.log_dir.glob("daemon-*.log")
        )


def create_tasks(url: str, n: int, *, timeout_ms: int = 300_000, **fields: Any) -> list[str]:
    """n `demo` tasks, created in pipelines; `fields` go to `Ops.create` (tenant, account)."""
    client = Redis.from_url(url)
    store = SyncStore(client, Keys())
    ids = [new_task_id() for _ in range(n)]
    client.script_load(store.scripts["create"].source)
    sha = store.scripts["create"].sha
    pipe = client.pipeline(transaction=False)
    for i, tid in enumerate(ids):
        call = store.ops.create(tid, "demo", encode_json({"i": i}), timeout_ms=timeout_ms, **fields)
        pipe.evalsha(sha, len(call.keys), *call.keys, *call.args)
        if len(pipe) >= 500:
            pipe.execute()
    pipe.execute()
    client.close()
    return ids


def snapshot(url: str, ids: list[str]) -> dict[str, Any]:
    client = Redis.from_url(url)
    store = SyncStore(client, Keys())
    tasks = {tid: store.get(tid) for tid in ids}
    client.close()
    return tasks


def counts(url: str) -> dict[str, int]:
    """Shard 0's tasks per status (its status indexes) and per status and handler (its
    counters)."""
    client = Redis.from_url(url)
    try:
        return SyncStore(client, Keys()).counts()
    finally:
        client.close()


def ever_parked(url: str) -> set[str]:
    """Tasks that were SUBMIT_UNKNOWN at some time (shard 0's events stream)."""
    client = Redis.from_url(url)
    try:
        entries = client.xrange(Keys().events(0))
    finally:
        client.close()
    return {f[b"task"].decode() for _, f in entries if f.get(b"status") == b"SUBMIT_UNKNOWN"}


def settled(url: str, ids: list[str]) -> bool:
    now = counts(url)
    done = sum(now.get(s.value, 0) for s in Status if s.is_settled)
    return done >= len(ids)


def check_history(
    url: str, ids: list[str], vendor_log: list[dict[str, Any]], *, idempotent: bool = False
) -> Counter[Status]:
    """The guarantees: no duplicate vendor job, nothing lost, parked only if started."""
    tasks = snapshot(url, ids)
    statuses: Counter[Status] = Counter()
    for tid, task in tasks.items():
        assert task is not None, f"task {tid} vanished"
        statuses[task.status] += 1
        assert task.status.is_settled, f"{tid} is {task.status}"
        if task.status is Status.SUBMIT_UNKNOWN:
            assert task.submit_attempts >= 1, f"{tid} parked without a started submit"
    jobs_per_task = Counter(
        e["ref"] for e in vendor_log if e["outcome"] in ("created", "ambiguous")
    )
    if not idempotent:
        dupes = {ref: n for ref, n in jobs_per_task.items() if n > 1}
        assert not dupes, f"vendor jobs created twice: {dupes}"
    for tid, task in tasks.items():
        if task is not None and task.status is Status.SUCCEEDED:
            assert jobs_per_task[tid] >= 1, f"{tid} succeeded without a vendor job"
            assert task.external_id is not None
    client = Redis.from_url(url)
    try:
        assert client.zcard(Keys().leases(0)) == 0, "leases left behind"
        per_handler = {k.decode(): int(v) for k, v in client.hgetall(Keys().counts(0)).items()}
    finally:
        client.close()
    totals = counts(url)
    for status in Status:
        assert totals.get(status.value, 0) == statuses[status], f"index {status} drifted"
        counted = sum(v for k, v in per_handler.items() if k.startswith(f"{status.value}@"))
        assert counted == statuses[status], f"counter {status} drifted"
    return statuses


# --- Added for the chaos runner (tests/chaos/runner.py) -----------------------------------


def chaos_daemon_config(
    tmp: Path,
    url: str,
    vendor_url: str,
    *,
    lease: str = "1s",
    idempotent_key: str | None = "demo-idem",
    max_inflight: int = 300,
    max_reclaims: int = 20,
    shards: int = 1,
) -> Path:
    """daemon_config plus a second, idempotent handler on the same fake vendor.

    `max_reclaims` is raised above the default because every Redis restart or pause
    expires the leases of the query calls in flight, and a task that never finishes is
    polled through all of them; the reclaim limit is a poison-task guard, not a chaos one.
    `shards` other than 1 is written as `[redis] shards` (a cluster run).
    """
    extra = (
        []
        if idempotent_key is None
        else [demo_handler(vendor_url, idempotent_key, idempotent=True)]
    )
    return daemon_config(
        tmp,
        url,
        vendor_url,
        lease=lease,
        shards=shards,
        max_inflight=max_inflight,
        max_reclaims=max_reclaims,
        extra_handlers=extra,
    )


def keyed_client(url: str, **kwargs: Any) -> Any:
    """A plain redis-py client for `url`: a `RedisCluster` for `redis+cluster://` seeds
    (commands routed by key, SCAN sent where it is told), else `Redis.from_url`."""
    if url.startswith("redis+cluster://"):
        seeds = [s.rsplit(":", 1) for s in url.removeprefix("redis+cluster://").split(",")]
        nodes = [ClusterNode(host, int(port)) for host, port in seeds]  # type: ignore[no-untyped-call]
        return RedisCluster(startup_nodes=nodes, **kwargs)
    return Redis.from_url(url, **kwargs)


def write_acl_file(path: Path, user: str, password: str) -> Path:
    """An ACL file (`--aclfile`) with `user` and its password, kept only as its SHA-256.

    The default user stays open, for the runner, the producers and the checker; `user`
    may do everything, since the point is the password. It survives a restart of the server.
    """
    digest = hashlib.sha256(password.encode()).hexdigest()
    path.write_text(f"user default on nopass ~* &* +@all\nuser {user} on #{digest} ~* &* +@all\n")
    return path


def connection_users(url: str) -> Counter[str]:
    """The ACL user of every client connection to the server but the one asking."""
    client: Any = Redis.from_url(url, socket_timeout=5)
    try:
        own = client.client_id()
        return Counter(str(c["user"]) for c in client.client_list() if int(c["id"]) != own)
    finally:
        client.close()


def pause_redis(url: str, ms: int) -> None:
    """`CLIENT PAUSE <ms> ALL` from a side connection: every client's commands wait."""
    client = Redis.from_url(url, socket_timeout=5)
    try:
        client.execute_command("CLIENT", "PAUSE", ms, "ALL")
    finally:
        client.close()
