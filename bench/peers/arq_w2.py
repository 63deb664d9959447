"""W2 on arq, written the idiomatic arq way: one job submits, then re-enqueues a poll job
with `_defer_by=poll` until the vendor says the job ended.

    python arq_w2.py worker  --redis URL --vendor URL --ready FILE [--max-jobs N] [--poll-delay S]
    python arq_w2.py enqueue --redis URL --tasks N     (prints {"t0": epoch} when it starts)
    python arq_w2.py enqueue-seq --redis URL --tasks N [--concurrency C] [--warmup W]
    python arq_w2.py w1 --redis URL --tasks N --max-jobs 1000 [--poll-delay S]

`enqueue-seq` (bench/producer.py) awaits one `enqueue_job` after the other (split over C
coroutines when C > 1), after W untimed ones, and prints its rate and CPU as JSON.

`w1` (bench/w1_peers.py) is W1 on arq: N no-op jobs enqueued up front (100 coroutines of
awaits, untimed), then one arq Worker in this process drains them with `burst=True`
(`max_jobs` 1000 as W1's max_inflight; the pool of the enqueues, so no connect is timed).
It prints {"enqueued": N} and waits for a line on stdin, then times from the worker's
start to the N-th job's end (`after_job_end`, results recorded) and prints the JSON line
(wall to the worker's own exit apart, as `exit_s`), then waits for a line again.

The final poll stores the vendor's result as the job result (arq keeps it) and INCRs
`bench:done`, the counter the harness watches (asynctaskd keeps an exact status counter
in its save script: one command each side).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from _seq import handshake, rate_line, sequential_loops, w1_line  # beside this script
from arq import Worker, create_pool
from arq.connections import RedisSettings

POLL = 0.2  # seconds between polls (W2)
VENDOR = ""


async def startup(ctx: dict[str, Any]) -> None:
    ctx["http"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000))
    Path(ctx["ready_file"]).write_text("ready")  # noqa: ASYNC240


async def shutdown(ctx: dict[str, Any]) -> None:
    await ctx["http"].close()


async def submit(ctx: dict[str, Any], task_id: str, params: Any) -> None:
    async with ctx["http"].post(
        f"{VENDOR}/v1/jobs", json={"input": params, "ref": task_id}
    ) as response:
        response.raise_for_status()
        job = await response.json()
    await ctx["redis"].enqueue_job("poll", task_id, job["id"], _defer_by=POLL)


async def poll(ctx: dict[str, Any], task_id: str, job_id: str) -> Any:
    async with ctx["http"].get(f"{VENDOR}/v1/jobs/{job_id}") as response:
        response.raise_for_status()
        job = await response.json()
    if job["status"] in ("succeeded", "failed", "canceled"):
        await ctx["redis"].incr("bench:done")
        return job
    await ctx["redis"].enqueue_job("poll", task_id, job_id, _defer_by=POLL)
    return None


def worker(args: argparse.Namespace) -> None:
    global VENDOR
    VENDOR = args.vendor.rstrip("/")
    import uvloop

    uvloop.install()
    asyncio.set_event_loop(asyncio.new_event_loop())
    w = Worker(
        functions=[submit, poll],
        redis_settings=RedisSettings.from_dsn(args.redis),
        on_startup=startup,
        on_shutdown=shutdown,
        max_jobs=args.max_jobs,
        poll_delay=args.poll_delay,
        ctx={"ready_file": args.ready},
    )
    w.run()


async def enqueue(args: argparse.Namespace) -> None:
    pool = await create_pool(RedisSettings.from_dsn(args.redis))
    await pool.ping()
    print(json.dumps({"t0": time.time()}), flush=True)  # noqa: T201
    ids = [f"t{i}" for i in range(args.tasks)]
    await asyncio.gather(*(pool.enqueue_job("submit", tid, {"i": i}) for i, tid in enumerate(ids)))
    print(json.dumps({"enqueued": len(ids), "t1": time.time()}), flush=True)  # noqa: T201
    await pool.aclose()


async def enqueue_seq(args: argparse.Namespace) -> None:
    pool = await create_pool(RedisSettings.from_dsn(args.redis))

    async def run(start: int, count: int) -> None:
        for i in range(start, start + count):
            await pool.enqueue_job("submit", f"t{i}", {"i": i})

    await run(0, args.warmup)
    c0, t0 = time.process_time(), time.perf_counter()
    await sequential_loops(run, args.warmup, args.tasks, args.concurrency)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps(rate_line(args, wall, cpu)), flush=True)  # noqa: T201
    await pool.aclose()


async def noop(ctx: dict[str, Any]) -> None:
    """W1's job: nothing to do, so the rate is the queue's own cost per job."""


async def w1(args: argparse.Namespace) -> None:
    pool = await create_pool(RedisSettings.from_dsn(args.redis))

    async def put(start: int, count: int) -> None:
        for _ in range(count):
            await pool.enqueue_job("noop")

    await sequential_loops(put, 0, args.tasks, 100)
    ended: list[tuple[float, float]] = []

    async def after_job_end(ctx: dict[str, Any]) -> None:
        ended.append((time.perf_counter(), time.process_time()))

    # max_jobs: W1's max_inflight. poll_delay: the harness runs arq's default 0.5 s and
    # 50 ms. On a backlog it matters less than its name says: one poll reads up to
    # queue_read_limit (5 x max_jobs) ids and starts them as slots free, so the delay only
    # spaces the reads after a poll that found little (the last ones, as jobs end).
    # arq's defaults otherwise (keep_result 3600 s: each job's result is stored, as
    # asynctaskd stores its task's result).
    w = Worker(
        functions=[noop],
        redis_pool=pool,
        burst=True,
        max_jobs=args.max_jobs,
        poll_delay=args.poll_delay,
        after_job_end=after_job_end,
    )
    await handshake({"enqueued": args.tasks})
    t0, c0 = time.perf_counter(), time.process_time()
    await w.async_run()
    exit_s = time.perf_counter() - t0
    t1, c1 = max(ended) if ended else (time.perf_counter(), time.process_time())
    line = w1_line(args.tasks, w.jobs_complete, t1 - t0, c1 - c0, exit_s=exit_s)
    line.update(poll_delay_s=args.poll_delay, max_jobs=args.max_jobs, failed=w.jobs_failed)
    line["ok"] = line["ok"] and not w.jobs_failed and len(ended) == args.tasks
    await handshake(line)
    await w.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["worker", "enqueue", "enqueue-seq", "w1"])
    parser.add_argument("--redis", required=True)
    parser.add_argument("--vendor", default="")
    parser.add_argument("--ready", default="/dev/null")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--max-jobs", type=int, default=2000)
    parser.add_argument("--poll-delay", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args()
    if args.mode == "worker":
        worker(args)
    else:
        import uvloop

        modes = {"enqueue-seq": enqueue_seq, "enqueue": enqueue, "w1": w1}
        uvloop.run(modes[args.mode](args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
