"""W2 on SAQ, written the idiomatic SAQ way: one job submits, then enqueues a scheduled
poll job (`scheduled=now + poll`) until the vendor says the job ended.

    python saq_w2.py worker  --redis URL --vendor URL --ready FILE [--concurrency N]
    python saq_w2.py enqueue --redis URL --tasks N     (prints {"t0": epoch} when it starts)
    python saq_w2.py enqueue-seq --redis URL --tasks N [--concurrency C] [--warmup W]
    python saq_w2.py w1 --redis URL --tasks N [--concurrency N]

`enqueue-seq` (bench/producer.py) awaits one `queue.enqueue` after the other (split over
C coroutines when C > 1), after W untimed ones, and prints its rate and CPU as JSON.

`w1` (bench/w1_peers.py) is W1 on SAQ: N no-op jobs enqueued up front (100 coroutines of
awaits, untimed), then one SAQ Worker in this process drains them. It prints
{"enqueued": N} and waits for a line on stdin, then times from the worker's start to the
N-th job's end (`after_process`, after the job's finish is written) and prints the JSON
line, then waits for a line again and stops the worker. The stop is this count, not SAQ's
burst mode: burst ends only after a dequeue has waited `dequeue_timeout` in vain, a tail
that is SAQ's way to notice an empty queue rather than its cost per job.

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
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from _seq import handshake, rate_line, sequential_loops, w1_line  # beside this script
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


async def noop(ctx: dict[str, Any]) -> None:
    """W1's job: nothing to do, so the rate is the queue's own cost per job."""


async def w1(args: argparse.Namespace) -> None:
    queue = Queue.from_url(args.redis)
    await queue.connect()

    async def put(start: int, count: int) -> None:
        for _ in range(count):
            await queue.enqueue("noop")

    await sequential_loops(put, 0, args.tasks, 100)
    ended: dict[str, tuple[float, float]] = {}
    runs: Counter[str] = Counter()  # jobs run, by the status they ended in
    all_done = asyncio.Event()

    async def after_process(ctx: dict[str, Any]) -> None:
        runs[ctx["job"].status.value] += 1
        if ctx["job"].status == "complete":
            ended[ctx["job"].key] = (time.perf_counter(), time.process_time())
        if len(ended) >= args.tasks:
            all_done.set()

    # concurrency: jobs this worker runs at once, each its own dequeue loop (a blocking
    # BLMOVE on a connection of its own). 100, as W2 uses: on 20,000 jobs 20 and 100 gave
    # the same rate within noise (~2,200/s), 300 and 1000 less (~1,800 and ~1,400/s).
    w = Worker(queue, functions=[noop], concurrency=args.concurrency, after_process=after_process)
    await handshake({"enqueued": args.tasks})
    t0, c0 = time.perf_counter(), time.process_time()
    running = asyncio.create_task(w.start())
    await all_done.wait()
    t1, c1 = max(ended.values())
    line = w1_line(args.tasks, len(ended), t1 - t0, c1 - c0, concurrency=args.concurrency)
    # More runs than jobs (seen: 0 to 2 in 20,000): SAQ's sweep, run as the worker starts,
    # retries a job it finds in the active list that its dequeuer has not yet marked
    # active. Reported, not counted against SAQ: every job did complete.
    line["job_runs"] = dict(runs)
    await handshake(line)
    await w.stop()
    running.cancel()
    await queue.disconnect()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["worker", "enqueue", "enqueue-seq", "w1"])
    parser.add_argument("--redis", required=True)
    parser.add_argument("--vendor", default="")
    parser.add_argument("--ready", default="/dev/null")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args()
    import uvloop

    modes = {"worker": worker, "enqueue": enqueue, "enqueue-seq": enqueue_seq, "w1": w1}
    uvloop.run(modes[args.mode](args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
