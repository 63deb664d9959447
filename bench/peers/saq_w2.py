"""W2 on SAQ, written the idiomatic SAQ way: one job submits, then enqueues a scheduled
poll job (`scheduled=now + poll`) until the vendor says the job ended.

    python saq_w2.py worker  --redis URL --vendor URL --ready FILE [--concurrency N]
    python saq_w2.py enqueue --redis URL --tasks N     (prints {"t0": epoch} when it starts)
    python saq_w2.py enqueue-seq --redis URL --tasks N [--concurrency C] [--warmup W]

`enqueue-seq` (bench/producer.py) awaits one `queue.enqueue` after the other (split over
C coroutines when C > 1), after W untimed ones, and prints its rate and CPU as JSON.

SAQ moves scheduled jobs to the queue from its `schedule` timer (default 1 s, whole
seconds only: the lock is a SETEX), which is SAQ's own granularity; the default is kept.
The final poll returns the vendor's answer as the job result and INCRs `bench:done`.
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
from _seq import rate_line, sequential_loops  # beside this script (bench/peers)
from saq import Queue, Worker

POLL = 0.2
VENDOR = ""


async def startup(ctx: dict[str, Any]) -> None:
    ctx["http"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000))
    Path(READY).write_text("ready")  # noqa: ASYNC240


async def shutdown(ctx: dict[str, Any]) -> None:
    await ctx["http"].close()


async def submit(ctx: dict[str, Any], *, task_id: str, params: Any) -> None:
    async with ctx["http"].post(
        f"{VENDOR}/v1/jobs", json={"input": params, "ref": task_id}
    ) as response:
        response.raise_for_status()
        job = await response.json()
    await ctx["worker"].queue.enqueue(
        "poll", task_id=task_id, job_id=job["id"], scheduled=time.time() + POLL
    )


async def poll(ctx: dict[str, Any], *, task_id: str, job_id: str) -> Any:
    async with ctx["http"].get(f"{VENDOR}/v1/jobs/{job_id}") as response:
        response.raise_for_status()
        job = await response.json()
    queue = ctx["worker"].queue
    if job["status"] in ("succeeded", "failed", "canceled"):
        await queue.redis.incr("bench:done")
        return job
    await queue.enqueue("poll", task_id=task_id, job_id=job_id, scheduled=time.time() + POLL)
    return None


READY = "/dev/null"


async def worker(args: argparse.Namespace) -> None:
    global VENDOR, READY
    VENDOR = args.vendor.rstrip("/")
    READY = args.ready
    queue = Queue.from_url(args.redis)
    w = Worker(
        queue,
        functions=[submit, poll],
        concurrency=args.concurrency,
        startup=startup,
        shutdown=shutdown,
    )
    await w.start()


async def enqueue(args: argparse.Namespace) -> None:
    queue = Queue.from_url(args.redis)
    await queue.connect()
    await queue.redis.ping()
    print(json.dumps({"t0": time.time()}), flush=True)  # noqa: T201
    await asyncio.gather(
        *(queue.enqueue("submit", task_id=f"t{i}", params={"i": i}) for i in range(args.tasks))
    )
    print(json.dumps({"enqueued": args.tasks, "t1": time.time()}), flush=True)  # noqa: T201
    await queue.disconnect()


async def enqueue_seq(args: argparse.Namespace) -> None:
    queue = Queue.from_url(args.redis)
    await queue.connect()

    async def run(start: int, count: int) -> None:
        for i in range(start, start + count):
            await queue.enqueue("submit", task_id=f"t{i}", params={"i": i})

    await run(0, args.warmup)
    c0, t0 = time.process_time(), time.perf_counter()
    await sequential_loops(run, args.warmup, args.tasks, args.concurrency)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps(rate_line(args, wall, cpu)), flush=True)  # noqa: T201
    await queue.disconnect()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["worker", "enqueue", "enqueue-seq"])
    parser.add_argument("--redis", required=True)
    parser.add_argument("--vendor", default="")
    parser.add_argument("--ready", default="/dev/null")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args()
    import uvloop

    if args.mode == "enqueue-seq":
        uvloop.run(enqueue_seq(args))
        return 0
    uvloop.run(worker(args) if args.mode == "worker" else enqueue(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
