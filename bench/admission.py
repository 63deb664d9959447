"""Admission cost: submit-phase claim throughput with admission off and on, in one run.

Seeds N due tasks spread over T tenants, then claims them all in batches (as a worker
does) and reports claims per second for:

    off      no limits
    caps     a default per-tenant in-flight cap (high enough never to bind) and a provider cap
    rate     a provider submit rate (high enough never to bind): take, claim with the
             grant, refund the rest, as the worker does
    both     caps and rate

for T = 1, 100 and 10,000 tenants, each mode on a fresh server, and the ratio to "off".
Also: with one tenant paused and 100,000 of its tasks set aside, the time from another
tenant's submit to its claim (the no-head-of-line-blocking figure). Every run checks that
each task was claimed exactly once.

    python bench/admission.py [--tasks 20000] [--batch 100] [--tenants 1,100,10000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import anyio

from asynctaskd import AsyncClient
from asynctaskd.embedded import ServerProcess, find_binary
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.store import Store, open_redis

MODES = ("off", "caps", "rate", "both")


async def _seed(store: Store, n: int, tenants: int) -> list[str]:
    ids = [new_task_id() for _ in range(n)]
    calls = [
        store.ops.create(tid, "h", b"{}", timeout_ms=3_600_000, tenant=f"t{i % tenants}")
        for i, tid in enumerate(ids)
    ]
    for s in range(0, n, 2000):
        await store.run_many(calls[s : s + 2000])
    return ids


async def claim_run(url: str, mode: str, n: int, tenants: int, batch: int) -> dict[str, Any]:
    redis = open_redis(url)
    await redis.flushall()
    store = Store(redis, Keys())
    await store.prepare()
    client = AsyncClient(redis)
    if mode in ("caps", "both"):
        await client.set_limit(tenant="*", max_in_flight=10 * n)
        await client.set_limit(provider="h", max_in_flight=10 * n)
    if mode in ("rate", "both"):
        await client.set_limit(provider="h", submit_rate=1e6, submit_burst=10 * n)
    ids = await _seed(store, n, tenants)
    seen: set[str] = set()
    waiting: dict[str, int] = {}
    calls = 0
    t0 = time.perf_counter()
    while len(seen) < n:
        grants: dict[str, int] = {}
        if waiting:
            want = {lane: min(w, batch) for lane, w in waiting.items()}
            got = await store.run(store.ops.take("take", want))
            grants = {lane: g for lane, (g, _) in got.items() if g}
        result = await store.claim(0, "submit", batch, 600_000, "bench", grants=grants)
        calls += 1
        unused = {
            lane: g - result.lanes.get(lane, (0, 0))[0]
            for lane, g in grants.items()
            if g > result.lanes.get(lane, (0, 0))[0]
        }
        if unused:
            await store.run(store.ops.take("refund", unused))
        waiting = {lane: w for lane, (_, w) in result.lanes.items() if w}
        for c in result.claimed:
            assert c.lease.task_id not in seen, "claimed twice"
            seen.add(c.lease.task_id)
        if not result.claimed and not waiting and not result.ready_left:
            break
    wall = time.perf_counter() - t0
    assert seen == set(ids), f"{len(seen)} of {n} claimed"
    await redis.aclose()
    return {"mode": mode, "tenants": tenants, "tasks": n, "claims_per_s": n / wall,
            "claim_calls": calls}  # fmt: skip


async def hol_run(url: str, backlog: int, samples: int) -> dict[str, Any]:
    """Submit -> claim of another tenant's task while a paused tenant has `backlog` tasks."""
    redis = open_redis(url)
    await redis.flushall()
    store = Store(redis, Keys())
    await store.prepare()
    client = AsyncClient(redis)
    await _seed(store, backlog, 1)  # tenant t0, all due
    await client.pause(tenant="t0")
    while (await store.claim(0, "submit", 100, 600_000, "bench")).ready_left:
        pass  # the claims set the paused backlog aside, 1,000 per call
    lat = []
    for _ in range(samples):
        t0 = time.perf_counter()
        task = await client.submit("h", {}, tracking_timeout=60, tenant="other", strict=False)
        got = await store.claim(0, "submit", 1, 600_000, "bench")
        lat.append(time.perf_counter() - t0)
        assert [c.lease.task_id for c in got.claimed] == [task.id]
    await redis.aclose()
    return {"backlog": backlog, "submit_to_claim_ms_p50": statistics.median(lat) * 1000,
            "submit_to_claim_ms_max": max(lat) * 1000}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--tenants", default="1,100,10000")
    parser.add_argument("--backlog", type=int, default=100_000)
    args = parser.parse_args(argv)
    binary = find_binary("redis-server")
    if binary is None:
        print("redis-server not found", file=sys.stderr)  # noqa: T201
        return 2
    rows = []
    with ServerProcess(binary) as server:
        for tenants in (int(t) for t in args.tenants.split(",")):
            base = None
            for mode in MODES:
                r = anyio.run(claim_run, server.url, mode, args.tasks, tenants, args.batch)
                base = base or r["claims_per_s"]
                r["vs_off"] = r["claims_per_s"] / base
                rows.append(r)
                print(f"tenants={tenants:<6} {mode:<5} {r['claims_per_s']:>9.0f} claims/s"  # noqa: T201
                      f"  x{r['vs_off']:.2f} of off  ({r['claim_calls']} claim calls)")  # fmt: skip
        hol = anyio.run(hol_run, server.url, args.backlog, 50)
    print(f"paused tenant with {hol['backlog']} tasks aside: another tenant's submit -> "  # noqa: T201
          f"claim p50 {hol['submit_to_claim_ms_p50']:.2f} ms, max "
          f"{hol['submit_to_claim_ms_max']:.2f} ms")  # fmt: skip
    print(json.dumps({"bench": "admission", "claims": rows, "head_of_line": hol}))  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
