"""W7: 5,000 concurrent SSE watchers on one `asynctaskd web` process: memory per watcher
and the delay from a status change to its event at the client.

One private redis-server, `python -m asynctaskd web` as a child process, `--watchers`
tasks created waiting (PENDING_SUBMIT). The harness opens one event stream per task from
aiohttp client sessions (500 connections each) and waits until every stream has shown
its first event (the current state); the web process's RSS before and after, divided by
the watchers, is the memory per watcher. Then it claims `--changes` of the tasks (the
daemon's claim script moves each to SUBMITTING) in batches of `--batch` every `--spacing`
seconds, taking `time.time()` just before each claim call: the delay of a task is when
its SUBMITTING event arrived at its client minus that time. Goal: p99 < 250 ms. Checks:
every changed task's watcher got its event.

The open-file limit is raised for the harness and its children.

The web process reads each shard's events stream once, for every open stream
(asynctaskd/web/feed.py): "Redis connected clients while open" shows that the
connections do not grow with the watchers. No daemon runs: the harness takes the
creates in before the streams open, as a running daemon would have within milliseconds
(left to the first timed claim, the take-in's 5,000 events would be the shard stream's
first entries, and every stream would re-read its task once, docs/api.md).

    python bench/w7_sse.py [--watchers 5000] [--changes 200] [--batch 1] [--spacing 0.1]
Prints a table, then one JSON line {"bench": "w7_sse", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import msgspec

from asynctaskd.codec import encode_json
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.store import Store, open_redis
from bench import (
    arun,
    emit,
    loadavg,
    machine,
    machine_line,
    percentile,
    proc_rss_mb,
    redis_server,
    say,
    table,
    workdir,
)
from bench.w6_web import WebProcess, raise_nofile, web_process

PER_SESSION = 500
WAVE = 250


async def _create(url: str, n: int) -> list[str]:
    redis = open_redis(url)
    store = Store(redis, Keys())
    await store.prepare()
    ids = [new_task_id() for _ in range(n)]
    calls = [store.ops.create(t, "demo", encode_json({}), timeout_ms=3_600_000) for t in ids]
    for s in range(0, n, 1000):
        for r in await store.run_many(calls[s : s + 1000]):
            if isinstance(r, Exception):
                raise r
    # Take the requests in (a claim of none), as a running daemon would within milliseconds.
    while (await store.claim(0, "submit", 0, 1000, "w7-intake", 0)).taken:
        pass
    await redis.aclose()
    return ids


async def _watch(
    http: aiohttp.ClientSession, task_id: str, auth: dict[str, str],
    connected: asyncio.Event, counter: list[int], total: int, arrived: dict[str, float],
) -> None:  # fmt: skip
    async with http.get(f"/api/v1/tasks/{task_id}/events", headers=auth) as r:
        if r.status != 200:
            raise RuntimeError(f"events of {task_id}: HTTP {r.status} {await r.text()}")
        first = True
        async for raw in r.content:
            line = raw.rstrip(b"\n")
            if not line.startswith(b"data: "):
                continue
            status = msgspec.json.decode(line[6:])["status"]
            if first:
                first = False
                counter[0] += 1
                if counter[0] >= total:
                    connected.set()
                continue
            if status != "PENDING_SUBMIT":
                arrived[task_id] = time.time()
                return


async def _run(
    web: WebProcess, ids: list[str], changes: int, batch: int, spacing: float
) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {web.token('operator', None)}"}
    n = len(ids)
    sessions = [
        aiohttp.ClientSession(
            web.base,
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=120),
        )
        for _ in range((n + PER_SESSION - 1) // PER_SESSION)
    ]
    counter = [0]
    arrived: dict[str, float] = {}
    changed: dict[str, float] = {}
    redis = open_redis(web.redis_url)
    store = Store(redis, Keys())
    await store.prepare()
    try:
        async with sessions[0].get("/readyz") as r:  # warm the process before measuring
            await r.read()
        rss0 = proc_rss_mb(web.pid)["rss_mb"]
        opened = time.perf_counter()
        watchers: list[asyncio.Task[None]] = []
        deadline = time.monotonic() + 600
        # In waves of WAVE, each open before the next starts: a thundering herd of
        # thousands of connects at once measures the listen backlog, not the streams.
        for wave in range(0, n, WAVE):
            ready = asyncio.Event()
            goal = min(n, wave + WAVE)
            watchers += [
                asyncio.create_task(
                    _watch(sessions[i // PER_SESSION], ids[i], auth, ready, counter, goal,
                           arrived)
                )
                for i in range(wave, goal)
            ]  # fmt: skip
            waiting = asyncio.ensure_future(ready.wait())
            while not ready.is_set():
                done, _ = await asyncio.wait(
                    [waiting, *watchers], return_when=asyncio.FIRST_COMPLETED,
                    timeout=deadline - time.monotonic(),
                )  # fmt: skip
                ended = [w for w in done if w is not waiting]
                if ended:
                    ended[0].result()  # raises what ended it
                    raise RuntimeError("an event stream ended before its task changed")
                if not done:
                    raise RuntimeError(f"only {counter[0]} of {n} streams opened in 600 s")
        open_s = time.perf_counter() - opened
        rss1 = proc_rss_mb(web.pid)["rss_mb"]
        clients = int((await redis.info("clients"))["connected_clients"])
        # The changes: claims of `batch` tasks, `spacing` apart.
        claimed = 0
        while claimed < changes:
            t0 = time.time()
            got = await store.claim(0, "submit", min(batch, changes - claimed), 600_000, "w7")
            for c in got.claimed:
                changed[c.lease.task_id] = t0
            claimed += len(got.claimed)
            if not got.claimed:
                raise RuntimeError(f"claimed {claimed} of {changes}: no more waiting tasks")
            await asyncio.sleep(spacing)
        by_id = dict(zip(ids, watchers, strict=True))
        await asyncio.wait([by_id[t] for t in changed], timeout=60)
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
    finally:
        for s in sessions:
            await s.close()
        await redis.aclose()
    delays = [(arrived[t] - changed[t]) * 1000 for t in ids if t in arrived and t in changed]
    return {
        "watchers": n,
        "open_all_s": round(open_s, 2),
        "rss_before_mb": round(rss0, 1),
        "rss_after_mb": round(rss1, 1),
        "kb_per_watcher": round((rss1 - rss0) * 1024 / n, 1),
        "redis_clients": clients,
        "changes": len(changed),
        "delivered": len(delays),
        "p50_ms": round(percentile(delays, 50), 1) if delays else None,
        "p99_ms": round(percentile(delays, 99), 1) if delays else None,
        "max_ms": round(max(delays), 1) if delays else None,
    }


def run(
    watchers: int = 5000, changes: int = 200, batch: int = 1, spacing: float = 0.1
) -> dict[str, Any]:
    nofile = raise_nofile(3 * watchers + 1000)  # harness sockets; Redis and the web inherit
    with redis_server() as server, workdir("bench-w7-") as tmp:
        m = machine(server.port)
        ids = arun(_create(server.url, watchers))
        with web_process(server.url, tmp) as web:
            r = arun(_run(web, ids, min(changes, watchers), batch, spacing))
    ok = r["delivered"] == r["changes"]
    return {
        "machine": m,
        "batch": batch,
        "spacing_s": spacing,
        "nofile": nofile,
        **r,
        "goal_p99_ms": 250,
        "goal_met": bool(ok and r["p99_ms"] is not None and r["p99_ms"] < 250),
        "loadavg_1m": loadavg()[0],
        "ok": ok,
    }


def report(r: dict[str, Any]) -> None:
    say(f"machine: {machine_line(r['machine'])}")
    say(
        table(
            f"W7 SSE: {r['watchers']:,} watchers on one web process, {r['changes']} changes "
            f"in batches of {r['batch']} every {r['spacing_s']} s",
            ["figure", "value"],
            [
                ["seconds to open every stream", r["open_all_s"]],
                ["web RSS before / after, MB", f"{r['rss_before_mb']} / {r['rss_after_mb']}"],
                ["KB per watcher (RSS delta / watchers)", r["kb_per_watcher"]],
                ["Redis connected clients while open", r["redis_clients"]],
                ["changes / delivered", f"{r['changes']} / {r['delivered']}"],
                ["delay p50 ms", r["p50_ms"]],
                ["delay p99 ms (goal < 250)", r["p99_ms"]],
                ["delay max ms", r["max_ms"]],
            ],
        )
    )
    say(f"  goal met: {r['goal_met']}; load {r['loadavg_1m']:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--watchers", type=int, default=5000)
    parser.add_argument("--changes", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--spacing", type=float, default=0.1)
    args = parser.parse_args()
    r = run(args.watchers, args.changes, args.batch, args.spacing)
    report(r)
    emit("w7_sse", r)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
