"""Lifecycle throughput on one Redis node versus a local 3-master Redis Cluster.

Seeds N tasks over S shards, then D daemon processes (each a Worker with an instant
in-process vendor, as in W1) run them all: create -> submit -> one query -> SUCCEEDED.
Reports lifecycles/s for each target and the ratio cluster / single node. Every run
checks that all tasks SUCCEEDED and each was submitted once (per daemon, counted by the
parent from the daemons' reports).

On a 2-core machine the three masters, the daemons and this process share two cores, so
the ratio says what the cluster's overhead is (routing, one pipeline per node, per-shard
claims), not how throughput grows with real hardware per node.

    python bench/cluster.py [--tasks 20000] [--daemons 2] [--shards 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from asynctaskd.config import parse_config
from asynctaskd.connection import open_async
from asynctaskd.embedded import ServerProcess, find_binary
from asynctaskd.handlers import HandlerEntry
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.store import Store
from asynctaskd.worker import Worker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import create_tasks
from bench.lifecycle import Instant


async def seed(url: str, n: int, shards: int) -> list[str]:
    redis = open_async(url)
    store = Store(redis, Keys("atd", shards))
    await store.prepare()
    ids = [new_task_id(i % shards) for i in range(n)]
    await create_tasks(store, ids, "instant")
    await store.close()
    await redis.aclose()
    return ids


async def daemon(url: str, shards: int) -> dict[str, Any]:
    """One daemon: run until nothing is left, report the submits it made."""
    redis = open_async(url)
    store = Store(redis, Keys("atd", shards))
    await store.prepare()
    config = parse_config(
        f"[redis]\nshards = {shards}\n[worker]\nmax_inflight = 1000\nbatch_size = 500\n"
        'lease = "30s"\n[retry]\npoll_interval = "1ms"\n'
    )
    handler = Instant()
    entry = {"instant": HandlerEntry(key="instant", handler=handler, provider="instant")}
    cpu0 = time.process_time()
    async with httpx.AsyncClient() as http:
        worker = Worker(store, entry, config, http=http)
        await worker.run_until_idle()
    await store.close()
    await redis.aclose()
    return {"submits": dict(handler.submits), "cpu_s": time.process_time() - cpu0}


async def count_succeeded(url: str, ids: list[str], shards: int) -> int:
    redis = open_async(url)
    store = Store(redis, Keys("atd", shards))
    n = (await store.counts()).get("SUCCEEDED", 0)
    await redis.aclose()
    return n


def run_target(url: str, n: int, daemons: int, shards: int) -> dict[str, Any]:
    ids = anyio.run(seed, url, n, shards)
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--daemon", url, "--shards", str(shards)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(daemons)
    ]
    reports = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    wall = time.perf_counter() - t0
    submits: dict[str, int] = {}
    for r in reports:
        for tid, k in r["submits"].items():
            submits[tid] = submits.get(tid, 0) + k
    succeeded = anyio.run(count_succeeded, url, ids, shards)
    ok = succeeded == n and set(submits) == set(ids) and max(submits.values()) == 1
    return {"tasks": n, "daemons": daemons, "shards": shards, "wall_s": wall,
            "tasks_per_s": n / wall, "daemon_cpu_s": sum(r["cpu_s"] for r in reports),
            "all_succeeded_once": ok}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--daemons", type=int, default=2)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--daemon", help=argparse.SUPPRESS)  # child mode: the URL
    args = parser.parse_args(argv)
    if args.daemon:
        print(json.dumps(anyio.run(daemon, args.daemon, args.shards)))  # noqa: T201
        return 0
    from tests.cluster import LocalCluster

    binary = find_binary("redis-server")
    if binary is None:
        print("redis-server not found", file=sys.stderr)  # noqa: T201
        return 2
    results = {}
    with ServerProcess(binary) as node:
        results["single_node"] = run_target(node.url, args.tasks, args.daemons, args.shards)
    with tempfile.TemporaryDirectory() as d, LocalCluster(binary, Path(d), aof=False) as c:
        results["cluster_3_masters"] = run_target(c.url, args.tasks, args.daemons, args.shards)
    for name, r in results.items():
        line = (
            f"{name:<18} {r['tasks_per_s']:>8.0f} lifecycles/s  ({r['daemons']} daemons, "
            f"{r['shards']} shards, {r['wall_s']:.1f} s, ok={r['all_succeeded_once']})"
        )
        print(line)  # noqa: T201
    ratio = results["cluster_3_masters"]["tasks_per_s"] / results["single_node"]["tasks_per_s"]
    print(f"cluster / single node: {ratio:.2f}")  # noqa: T201
    print(json.dumps({"bench": "cluster", **results, "ratio": ratio}))  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
