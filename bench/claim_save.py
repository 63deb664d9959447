"""Store micro-benchmark: claim+save pairs per second, beside redis-benchmark's EVALSHA.

Seeds N due tasks in the query phase, then claims them in batches and saves each one
RUNNING again (the steady state of a daemon polling), from one process; separately it
runs `redis-benchmark` against the same server with a claim-shaped EVALSHA, so the
ratio says how close the store gets to what Redis itself can do. Prints a table and a
JSON line.

    python bench/claim_save.py [--tasks 20000] [--batch 100]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from asynctaskd.codec import encode_json
from asynctaskd.embedded import ServerProcess, find_binary
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.store import Batcher, Lease, Store, open_redis

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import create_tasks

CLAIM_SHAPED = (
    "local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 1) "
    "if #ids > 0 then redis.call('HGET', KEYS[2], 'status') end "
    "redis.call('ZADD', KEYS[1], ARGV[1], 'x') return #ids"
)


def redis_benchmark(port: int, pipeline: int) -> float | None:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    from redis import Redis

    sha = Redis(port=port).script_load(CLAIM_SHAPED)
    out = subprocess.run(
        [exe, "-p", str(port), "-n", "200000", "-c", "50", "-P", str(pipeline), "-q",
         "EVALSHA", sha, "2", "bench:z", "bench:h", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    m = re.search(r"([\d.]+) requests per second", out.stdout)
    return float(m[1]) if m else None


async def run(url: str, n: int, batch: int) -> dict[str, Any]:
    redis = open_redis(url)
    store = Store(redis, Keys())
    await store.prepare()
    ids = [new_task_id() for _ in range(n)]
    await create_tasks(store, ids, "h", timeout_ms=3_600_000)
    # move every task to the query phase once (claim + start + save SUBMITTED)
    while True:
        got = await store.claim(0, "submit", 1000, 60_000, "seed")
        if not got.claimed:
            break
        starts = await store.run_many([store.ops.start(c.lease, False) for c in got.claimed])
        saves = [
            store.ops.save(Lease(c.lease.task_id, c.lease.fence, r.version), Status.SUBMITTED,
                           fields={"external_id": "x", "handle": encode_json({"external_id": "x"})})
            for c, r in zip(got.claimed, starts, strict=True)
        ]  # fmt: skip
        await store.run_many(saves)
    batcher = Batcher(store)
    pairs = 0
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)

        async def save(lease: Lease) -> None:
            nonlocal pairs
            result, _ = await batcher.call(store.ops.save(lease, Status.RUNNING, delay_ms=0))
            assert result.ok, result
            pairs += 1

        async with anyio.create_task_group() as saves:
            while pairs < n:
                got = await store.claim(0, "query", batch, 60_000, "bench")
                for c in got.claimed:
                    saves.start_soon(save, c.lease)
                if not got.claimed:
                    await anyio.sleep(0.001)
        tg.cancel_scope.cancel()
    wall = time.perf_counter() - t0
    await redis.aclose()
    return {"pairs": pairs, "wall_s": wall, "claim_save_pairs_per_s": pairs / wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args()
    binary = find_binary("redis-server")
    if binary is None:
        print("redis-server not found", file=sys.stderr)  # noqa: T201
        return 2
    with ServerProcess(binary) as server:
        result = anyio.run(run, server.url, args.tasks, args.batch)
        result["redis_benchmark_evalsha_per_s"] = redis_benchmark(server.port, 1)
        result["redis_benchmark_evalsha_pipelined_per_s"] = redis_benchmark(server.port, 16)
    ceiling = result["redis_benchmark_evalsha_per_s"]
    if ceiling:
        # one pair = two script calls
        result["script_calls_vs_evalsha_ceiling"] = 2 * result["claim_save_pairs_per_s"] / ceiling
    print(f"claim+save pairs: {result['pairs']} in {result['wall_s']:.2f}s")  # noqa: T201
    for k, v in result.items():
        if isinstance(v, float):
            print(f"  {k:<42} {v:>12.2f}")  # noqa: T201
    print(json.dumps({"bench": "claim_save", **result}))  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
