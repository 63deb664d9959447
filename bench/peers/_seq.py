"""What both peers' `enqueue-seq` drivers share: the loops of awaits and the JSON line.

The drivers run as scripts from the bench-only venv, so this sits beside them (their
directory is on the path) rather than in the bench package.
"""

from __future__ import annotations

import argparse
import asyncio
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
