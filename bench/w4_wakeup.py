"""W4: submit() -> vendor submit call latency with an idle daemon (wake-up on new work).

One redis-server, the fake vendor in its own process, one idle daemon as `python -m
asynctaskd run --config` (metrics off, poll interval 10 min so nothing else runs). The
harness calls `AsyncClient.submit` 200 times, one at a time, ~50 ms apart, taking
`time.time()` just before each call; the fake vendor logs every submit it receives with
`at` (epoch seconds, same clock). Latency = vendor `at` - client timestamp, matched by
task id (the demo handler sends it as `ref`). Also reported: how long `submit()` itself
took (the create round trip), and a PING sent halfway between two submits: one Redis
round trip after the same idle time, what each hop of the wake-up chain (create, wake,
claim, start, vendor call) pays on this host before any work. Checks: every task
reached the vendor exactly once.

    python bench/w4_wakeup.py [--submits 200] [--spacing 0.05]
Prints a table, then one JSON line {"bench": "w4_wakeup", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asynctaskd.client import AsyncClient
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.store import open_redis
from bench import (
    Daemon,
    arun,
    daemon_config,
    emit,
    machine,
    machine_line,
    percentile,
    redis_server,
    say,
    spread,
    table,
    workdir,
)


async def _submits(
    url: str, n: int, spacing: float
) -> tuple[dict[str, float], list[float], list[float]]:
    sent: dict[str, float] = {}
    call_s: list[float] = []
    ping_s: list[float] = []
    async with AsyncClient.from_url(url) as client, open_redis(url) as r:
        await client.handlers()  # connect before timing
        await r.ping()
        for i in range(n):
            t = time.time()
            p0 = time.perf_counter()
            task = await client.submit("demo", {"i": i}, tracking_timeout=600)
            call_s.append(time.perf_counter() - p0)
            sent[task.id] = t
            await asyncio.sleep(spacing / 2)
            p0 = time.perf_counter()
            await r.ping()
            ping_s.append(time.perf_counter() - p0)
            await asyncio.sleep(spacing / 2)
    return sent, call_s, ping_s


def one_run(
    url: str, vendor: FakeVendorProcess, tmp: Path, n: int, spacing: float
) -> dict[str, Any]:
    from redis import Redis

    sync = Redis.from_url(url)
    sync.flushdb()
    sync.close()
    vendor.reset()
    config = daemon_config(tmp / "w4.toml", url, vendor.url, poll_interval="10m", max_inflight=1000)
    with Daemon(config, url):
        time.sleep(1.0)  # idle: the claim loop is parked in its wait
        sent, call_s, ping_s = arun(_submits(url, n, spacing))
        deadline = time.monotonic() + 10
        while len(vendor.submit_log()) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        log = vendor.submit_log()
    per_ref = Counter(e["ref"] for e in log)
    lat = [e["at"] - sent[e["ref"]] for e in log if e["ref"] in sent]
    ok = (
        Counter(e["outcome"] for e in log) == Counter({"created": n})
        and set(per_ref) == set(sent)
        and max(per_ref.values(), default=0) == 1
    )
    return {
        "submits": n,
        "p50_ms": percentile(lat, 50) * 1000,
        "p90_ms": percentile(lat, 90) * 1000,
        "p99_ms": percentile(lat, 99) * 1000,
        "max_ms": max(lat, default=float("nan")) * 1000,
        "min_ms": min(lat, default=float("nan")) * 1000,
        "client_submit_p50_ms": percentile(call_s, 50) * 1000,
        "client_submit_p99_ms": percentile(call_s, 99) * 1000,
        "idle_ping_p50_ms": percentile(ping_s, 50) * 1000,
        "submitted_once": ok,
        "ok": ok,
        "loadavg_1m": machine()["loadavg"][0],
    }


def run(submits: int = 200, spacing: float = 0.05, runs: int = 1) -> dict[str, Any]:
    results = []
    with (
        redis_server() as server,
        workdir("bench-w4-") as tmp,
        FakeVendorProcess.start(Behaviour(polls_to_done=1_000_000)) as vendor,
    ):
        m = machine(server.port)
        for i in range(runs):
            r = one_run(server.url, vendor, tmp, submits, spacing)
            say(
                f"  run {i + 1}: p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  "
                f"ok={r['ok']}  load {r['loadavg_1m']:.2f}"
            )
            results.append(r)
    keys = (
        "p50_ms",
        "p90_ms",
        "p99_ms",
        "max_ms",
        "client_submit_p50_ms",
        "client_submit_p99_ms",
        "idle_ping_p50_ms",
    )
    return {
        "machine": m,
        "submits": submits,
        "spacing_s": spacing,
        "runs": runs,
        "summary": {k: spread([r[k] for r in results]) for k in keys},
        "results": results,
        "ok": all(r["ok"] for r in results),
    }


def report(out: dict[str, Any]) -> None:
    s = out["summary"]
    notes = {"p50_ms": "target < 5 ms", "idle_ping_p50_ms": "one idle round trip"}
    rows = [
        [k.removesuffix("_ms"), v["median"], v["min"], v["max"], notes.get(k, "")]
        for k, v in s.items()
    ]
    say(
        table(
            f"W4 wake-up: submit() -> vendor submit call, {out['submits']} sequential submits "
            f"{out['spacing_s'] * 1000:.0f} ms apart, idle daemon; ms over {out['runs']} run(s)",
            ["figure (ms)", "median", "min", "max", "note"],
            rows,
        )
    )
    say(f"  every task reached the vendor exactly once: {out['ok']}")
    say(f"  machine: {machine_line(out['machine'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--submits", type=int, default=200)
    parser.add_argument("--spacing", type=float, default=0.05)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args(argv)
    out = run(args.submits, args.spacing, args.runs)
    report(out)
    emit("w4_wakeup", out)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
