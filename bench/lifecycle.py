"""W1: lifecycle throughput of one daemon process against an instant in-process vendor.

N tasks go create -> submit -> one query -> SUCCEEDED. Prints tasks/s, Redis commands
per task (INFO commandstats delta), daemon CPU seconds, peak RSS, and the Redis ceiling
measured in the same run (EVALSHA of a claim-shaped script, pipelined and not), then a
JSON line. Every run checks that all tasks SUCCEEDED and each was submitted once.

    python bench/lifecycle.py [--tasks 20000] [--inflight 1000] [--batch 100]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import httpx

from asynctaskd.config import parse_config
from asynctaskd.daemon import tune_gc
from asynctaskd.embedded import ServerProcess, find_binary
from asynctaskd.handlers import HandlerContext, HandlerEntry, Submitted, Succeeded
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.store import Store, open_redis
from asynctaskd.worker import Worker

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import create_tasks


class Instant:
    key = "instant"
    idempotent_submit = False

    def __init__(self) -> None:
        self.submits: Counter[str] = Counter()

    async def submit(self, params: Any, ctx: HandlerContext) -> Submitted:
        self.submits[ctx.task_id] += 1
        return Submitted("x-" + ctx.task_id)

    async def query(self, handle: dict[str, Any], ctx: HandlerContext) -> Succeeded:
        return Succeeded({"ok": True})


def w1_worker(
    store: Store,
    http: httpx.AsyncClient,
    inflight: int = 1000,
    batch: int = 100,
    lease: str = "30s",
) -> tuple[Worker, Instant]:
    """W1's worker and its instant handler: `inflight` calls, claims of `batch`, and a 1 ms
    poll interval (the one query is due at once)."""
    config = parse_config(
        f'[worker]\nmax_inflight = {inflight}\nbatch_size = {batch}\nlease = "{lease}"\n'
        '[retry]\npoll_interval = "1ms"\n'
    )
    handler = Instant()
    entry = {"instant": HandlerEntry(key="instant", handler=handler, provider="instant")}
    return Worker(store, entry, config, http=http), handler


def redis_cpu(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def commandstats(client: Any) -> int:
    info = client.info("commandstats")
    return sum(int(v["calls"]) for v in info.values())


async def redis_ceiling(url: str, seconds: float = 2.0) -> dict[str, float]:
    """EVALSHA/s of a claim-shaped script (ZRANGEBYSCORE + HGET + ZADD), 50 concurrent."""
    r = open_redis(url, max_connections=50)
    script = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 1)
if #ids > 0 then redis.call('HGET', KEYS[2], 'status') end
redis.call('ZADD', KEYS[1], ARGV[1], 'x')
return #ids
"""
    sha = await r.script_load(script)
    count = 0
    stop = time.perf_counter() + seconds

    async def one() -> None:
        nonlocal count
        while time.perf_counter() < stop:
            await r.evalsha(sha, 2, "bench:z", "bench:h", 1)
            count += 1

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(50):
            tg.start_soon(one)
    plain = count / (time.perf_counter() - t0)
    count = 0
    t0 = time.perf_counter()
    stop = t0 + seconds
    while time.perf_counter() < stop:
        async with r.pipeline(transaction=False) as pipe:
            for _ in range(100):
                pipe.evalsha(sha, 2, "bench:z", "bench:h", 1)
            await pipe.execute()
        count += 100
    piped = count / (time.perf_counter() - t0)
    await r.delete("bench:z", "bench:h")
    await r.aclose()
    return {"evalsha_per_s": plain, "evalsha_pipelined_per_s": piped}


async def run(url: str, n: int, inflight: int, batch: int) -> dict[str, Any]:
    from redis import Redis

    sync = Redis.from_url(url)
    sync.flushdb()
    redis = open_redis(url)
    store = Store(redis, Keys())
    await store.prepare()
    ids = [new_task_id() for _ in range(n)]
    await create_tasks(store, ids, "instant")
    tune_gc()  # as the daemon process does once it is set up
    before = commandstats(sync)
    rcpu0 = redis_cpu(sync)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    async with httpx.AsyncClient() as http:
        worker, handler = w1_worker(store, http, inflight, batch)
        await worker.run_until_idle()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    commands = commandstats(sync) - before
    rcpu = redis_cpu(sync) - rcpu0
    done = Counter()
    pipe = sync.pipeline(transaction=False)
    for tid in ids:
        pipe.hget(Keys().task(0, tid), "status")
    for status in pipe.execute():
        done[status.decode()] += 1
    ok = done == Counter({"SUCCEEDED": n}) and max(handler.submits.values()) == 1
    await redis.aclose()
    sync.close()
    return {
        "tasks": n,
        "inflight": inflight,
        "batch": batch,
        "wall_s": wall,
        "tasks_per_s": n / wall,
        "redis_commands_per_task": commands / n,
        "round_trips_per_task": sum(store.round_trips.values()) / n,
        "cpu_s": cpu,
        "cpu_ms_per_task": cpu * 1000 / n,
        "redis_cpu_ms_per_task": rcpu * 1000 / n,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "all_succeeded_once": ok,
        "statuses": dict(done),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--inflight", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=100, help="tasks per claim (batch_size)")
    parser.add_argument("--server", default="redis-server")
    parser.add_argument("--no-ceiling", action="store_true", help="skip the Redis ceiling")
    args = parser.parse_args()
    binary = find_binary(args.server)
    if binary is None:
        print(f"{args.server} not found", file=sys.stderr)  # noqa: T201
        return 2
    with ServerProcess(binary) as server:
        try:
            import uvloop

            options: dict[str, Any] = {"loop_factory": uvloop.new_event_loop}
        except ImportError:
            options = {}
        result = anyio.run(
            run, server.url, args.tasks, args.inflight, args.batch, backend_options=options
        )
        if args.no_ceiling:
            ceiling = {"evalsha_per_s": float("nan"), "evalsha_pipelined_per_s": float("nan")}
        else:
            ceiling = anyio.run(redis_ceiling, server.url, backend_options=options)
    result.update(ceiling)
    result["lifecycles_vs_evalsha_ceiling"] = result["tasks_per_s"] / ceiling["evalsha_per_s"]
    print(  # noqa: T201
        f"W1 lifecycle ({args.server}): {result['tasks']} tasks, {result['inflight']} in flight, "
        f"claims of {result['batch']}"
    )
    for k in (
        "tasks_per_s",
        "redis_commands_per_task",
        "round_trips_per_task",
        "cpu_ms_per_task",
        "redis_cpu_ms_per_task",
        "peak_rss_mb",
        "evalsha_per_s",
        "evalsha_pipelined_per_s",
        "lifecycles_vs_evalsha_ceiling",
    ):
        print(f"  {k:<32} {result[k]:>12.3f}")  # noqa: T201
    print(f"  all succeeded, each submitted once: {result['all_succeeded_once']}")  # noqa: T201
    print(json.dumps({"bench": "w1_lifecycle", **result}))  # noqa: T201
    return 0 if result["all_succeeded_once"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
