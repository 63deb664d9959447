"""What both peers' drivers share: the loops of awaits and the JSON line of `enqueue-seq`,
and the handshake and JSON line of `w1`.

The drivers run as scripts from the bench-only venv, so this sits beside them (their
directory is on the path) rather than in the bench package.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any


async def sequential_loops(run: Any, first: int, n: int, concurrency: int) -> None:
    """n calls numbered from `first`: one loop of awaits, or `concurrency` such loops."""
    share = -(-n // concurrency)
    starts = range(first, first + n, share)
    await asyncio.gather(*(run(s, min(share, first + n - s)) for s in starts))


def rate_line(args: argparse.Namespace, wall: float, cpu: float) -> dict[str, Any]:
    return {
        "jobs": args.tasks,
        "warmup": args.warmup,
        "concurrency": args.concurrency,
        "wall_s": wall,
        "per_s": args.tasks / wall,
        "cpu_ms_per_job": cpu * 1000 / args.tasks,
    }


async def handshake(line: dict[str, Any]) -> None:
    """Print one JSON line, then wait for the harness's answer on stdin: it reads Redis's
    INFO between the two, so its deltas cover the timed part only."""
    print(json.dumps(line), flush=True)  # noqa: T201
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


def w1_line(jobs: int, done: int, wall: float, cpu: float, **extra: Any) -> dict[str, Any]:
    return {
        "jobs": jobs,
        "done": done,
        "wall_s": wall,
        "per_s": jobs / wall,
        "cpu_ms_per_job": cpu * 1000 / jobs,
        "ok": done == jobs,
        **extra,
    }
