"""W5: many stored tasks: Redis memory per task, and claim cost with 1,000 vs N stored.

Everything goes through `asynctaskd.store.Store` (the scripts the daemon runs), in
pipelined batches of 1,000, against one private redis-server (no AOF, no RDB). Creates and
cancels are producers' requests: submit claims of no task take them in, as a daemon does,
and "create /s" and "cancel /s" include that:

1. Shape: 10,000 small tasks (params `{"i": n}`, handler "demo") created, then driven
   the real way to SUCCEEDED (claim submit -> start -> save SUBMITTED with a handle ->
   claim query -> save SUCCEEDED with a small result): `used_memory` delta per task
   while PENDING_SUBMIT and once SUCCEEDED.
2. Baseline: 1,000 stored tasks, 90% terminal (cancel), 100 pending: a claim of 100 in
   the submit phase, then a release of those 100 (untimed), repeated; claim p50/p99.
3. Scale: N stored tasks (1,000,000 FULL, 100,000 quick), created the same way, 90%
   cancelled (CANCELED, terminal): `used_memory` delta / N, with and without the events
   stream (capped at 100,000 entries, so its share shrinks as N grows); then the same
   claim-of-100 loop as the baseline. Its backlog is 10% of N (100 against 100,000 at
   FULL), so the ratio to the baseline holds a bigger ready set as well as the stored
   tasks; hence
4. Same backlog: the N/10 pending tasks alone, no terminal ones, and the same claim loop:
   the ratio of (3) to this is what the terminal tasks themselves cost a claim.

Checks: the shape tasks all SUCCEEDED; the counts (`Store.counts`) say exactly 90% of N
CANCELED and 10% PENDING_SUBMIT; every claim got 100 tasks and every release succeeded.

    python bench/w5_memory.py [--tasks 100000] [--claims 300]
Prints a table, then one JSON line {"bench": "w5_memory", ...}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asynctaskd.codec import encode_json
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.store import Code, Lease, Store, open_redis
from bench import (
    arun,
    emit,
    machine,
    machine_line,
    percentile,
    redis_ceiling,
    redis_server,
    say,
    table,
)

BATCH = 1000


async def used_memory(store: Store) -> int:
    info = await store.redis.info("memory")
    return int(info["used_memory"])


async def events_memory(store: Store) -> int:
    return int(await store.redis.memory_usage(Keys().events(0), samples=0) or 0)


async def pipelined(store: Store, calls: list[Any]) -> list[Any]:
    out: list[Any] = []
    for s in range(0, len(calls), BATCH):
        for r in await store.run_many(calls[s : s + BATCH]):
            if isinstance(r, Exception):
                raise r
            out.append(r)
    return out


async def create(store: Store, n: int) -> list[str]:
    ids: list[str] = []
    for s in range(0, n, BATCH):
        chunk = [new_task_id() for _ in range(min(BATCH, n - s))]
        calls = [
            store.ops.create(tid, "demo", encode_json({"i": s + i}), timeout_ms=86_400_000)
            for i, tid in enumerate(chunk)
        ]
        await pipelined(store, calls)
        ids.extend(chunk)
    return ids


async def take_in(store: Store) -> int:
    """What a daemon does first: carry out the producers' requests (creates and cancels are
    requests a daemon takes in, docs/security.md), here by submit claims of no task."""
    taken = 0
    while True:
        batch = await store.claim(0, "submit", 0, 600_000, "bench", 0)
        if not batch.taken:
            return taken
        taken += batch.taken


async def cancel(store: Store, ids: list[str]) -> None:
    results = await pipelined(store, [store.ops.cancel(tid) for tid in ids])
    assert all(r.code is Code.ACCEPTED for r in results), "cancel refused"
    await take_in(store)


async def to_succeeded(store: Store, n: int) -> int:
    """Drive every pending task through the real lifecycle to SUCCEEDED; returns count."""
    done = 0
    while True:
        got = await store.claim(0, "submit", BATCH, 600_000, "bench")
        if not got.claimed:
            break
        starts = await pipelined(store, [store.ops.start(c.lease, False) for c in got.claimed])
        saves = []
        for c, r in zip(got.claimed, starts, strict=True):
            ext = "job_" + c.lease.task_id[-8:]
            saves.append(
                store.ops.save(
                    Lease(c.lease.task_id, c.lease.fence, r.version),
                    Status.SUBMITTED,
                    fields={
                        "external_id": ext,
                        "handle": encode_json({"external_id": ext, "query": {}}),
                        "error_code": "",
                        "error_message": "",
                    },
                )
            )
        await pipelined(store, saves)
    while True:
        got = await store.claim(0, "query", BATCH, 600_000, "bench")
        if not got.claimed:
            break
        saves = [
            store.ops.save(
                c.lease,
                Status.SUCCEEDED,
                fields={
                    "result": encode_json({"output": {"i": 1}, "ref": c.lease.task_id}),
                    "poll_count": 1,
                    "progress": "1.0",
                },
            )
            for c in got.claimed
        ]
        results = await pipelined(store, saves)
        done += sum(1 for r in results if r.ok)
    return done


async def claim_loop(store: Store, rounds: int, n: int = 100) -> dict[str, Any]:
    """Claim n (timed), release them (untimed), `rounds` times.

    Claims go through `Store.claim` (EVALSHA); releases are sent as EVAL of the same
    release script, so the server's own per-command figures for `evalsha` (INFO
    latencystats and commandstats, reset first) are those of the claims alone: the
    Redis-side cost, free of the client's decoding and of scheduling noise."""
    redis = store.redis
    release = store.scripts["release"].source
    await redis.config_resetstat()
    lat: list[float] = []
    ok = True
    for _ in range(rounds):
        t0 = time.perf_counter()
        got = await store.claim(0, "submit", n, 600_000, "bench")
        lat.append(time.perf_counter() - t0)
        ok = ok and len(got.claimed) == n
        call = store.ops.release(0, [c.lease for c in got.claimed])
        codes = call.decode(await redis.eval(release, len(call.keys), *call.keys, *call.args))
        ok = ok and all(c is Code.OK for c in codes)
    stats = await redis.info("commandstats")
    evalsha = stats.get("cmdstat_evalsha", {})
    server = _percentiles(
        (await redis.info("latencystats")).get("latency_percentiles_usec_evalsha", {})
    )
    return {
        "claim100_p50_ms": percentile(lat, 50) * 1000,
        "claim100_p99_ms": percentile(lat, 99) * 1000,
        "claim100_max_ms": max(lat) * 1000,
        "claim100_server_us_mean": float(evalsha.get("usec_per_call", "nan")),
        "claim100_server_p50_us": server.get("p50", float("nan")),
        "claim100_server_p99_us": server.get("p99", float("nan")),
        "claims_ok": ok and int(evalsha.get("calls", 0)) == rounds,
    }


async def claim_breakdown(store: Store, rounds: int = 50, n: int = 100) -> dict[str, Any]:
    """Claims only (no release), stats reset first: where Redis spends a claim of n.

    Per claim: the commands the script runs inside Lua and their server time (INFO
    commandstats usec); what is left of the EVALSHA's own time is the Lua interpreter
    and the reply building."""
    redis = store.redis
    await redis.config_resetstat()
    for _ in range(rounds):
        got = await store.claim(0, "submit", n, 600_000, "bench")
        assert len(got.claimed) == n
    stats = await redis.info("commandstats")
    evalsha = stats.pop("cmdstat_evalsha")
    stats.pop("cmdstat_info", None)
    inner = {
        k.removeprefix("cmdstat_"): (int(v["calls"]) / rounds, int(v["usec"]) / rounds)
        for k, v in stats.items()
    }
    inner_us = sum(us for _, us in inner.values())
    total_us = int(evalsha["usec"]) / rounds
    return {
        "claims": rounds,
        "evalsha_us_per_claim": total_us,
        "inner_commands_per_claim": sum(c for c, _ in inner.values()),
        "inner_us_per_claim": inner_us,
        "lua_and_reply_us_per_claim": total_us - inner_us,
        "inner_by_time": {
            k: {"calls": round(c, 1), "us": round(us, 1)}
            for k, (c, us) in sorted(inner.items(), key=lambda kv: -kv[1][1])
        },
    }


def _percentiles(value: Any) -> dict[str, float]:
    """redis-py gives INFO latencystats values as a dict or as 'p50=1.0,p99=2.0'."""
    if isinstance(value, dict):
        return {str(k): float(v) for k, v in value.items()}
    out = {}
    for part in str(value).split(","):
        k, _, v = part.partition("=")
        if v:
            out[k] = float(v)
    return out


async def counts(store: Store) -> dict[str, int]:
    return {k: v for k, v in (await store.counts()).items() if "@" not in k and v}


async def scenario(url: str, n: int, rounds: int) -> dict[str, Any]:
    redis = open_redis(url)
    store = Store(redis, Keys())
    out: dict[str, Any] = {}

    # 1. the shape of one small task, pending and succeeded
    await redis.flushdb()
    await store.prepare()
    shape_n = 10_000
    m0 = await used_memory(store)
    await create(store, shape_n)
    m1 = await used_memory(store)
    done = await to_succeeded(store, shape_n)
    m2 = await used_memory(store)
    ev = await events_memory(store)
    out["shape_tasks"] = shape_n
    out["bytes_per_pending_task"] = (m1 - m0) / shape_n
    out["bytes_per_succeeded_task"] = (m2 - m0) / shape_n
    out["bytes_per_succeeded_task_without_events"] = (m2 - m0 - ev) / shape_n
    out["shape_all_succeeded"] = done == shape_n and (await counts(store)) == {"SUCCEEDED": shape_n}

    # 2. baseline: 1,000 stored, 900 terminal, 100 pending
    async def stored(total: int) -> dict[str, Any]:
        await redis.flushdb()
        await store.prepare()
        base = await used_memory(store)
        t0 = time.perf_counter()
        ids = await create(store, total)
        await take_in(store)
        create_s = time.perf_counter() - t0
        terminal = ids[: total * 9 // 10]
        t0 = time.perf_counter()
        await cancel(store, terminal)
        cancel_s = time.perf_counter() - t0
        mem = await used_memory(store) - base
        ev = await events_memory(store)
        c = await counts(store)
        claims = await claim_loop(store, rounds)
        return {
            "stored": total,
            "create_per_s": total / create_s,
            "cancel_per_s": len(terminal) / cancel_s,
            "bytes_per_task": mem / total,
            "bytes_per_task_without_events": (mem - ev) / total,
            "events_stream_bytes": ev,
            "counts_ok": c == {"CANCELED": len(terminal), "PENDING_SUBMIT": total - len(terminal)},
            **claims,
        }

    out["small"] = await stored(1_000)
    out["large"] = await stored(n)
    pending = n - n * 9 // 10
    out["claim_breakdown"] = await claim_breakdown(store, rounds=max(1, min(50, pending // 100)))

    # 4. the same backlog without the terminal tasks
    await redis.flushdb()
    await store.prepare()
    await create(store, pending)
    await take_in(store)
    c = await counts(store)
    out["backlog_only"] = {
        "pending": pending,
        "counts_ok": c == {"PENDING_SUBMIT": pending},
        **await claim_loop(store, rounds),
    }
    await redis.flushdb()
    await redis.aclose()
    return out


def run(
    tasks: int = 100_000, rounds: int = 300, ceiling: dict[str, Any] | None = None
) -> dict[str, Any]:
    with redis_server() as server:
        m = machine(server.port)
        if ceiling is None:
            ceiling = redis_ceiling(server.port, requests=50_000)
        r = arun(scenario(server.url, tasks, rounds))
    small, large = r["small"], r["large"]
    r["machine"] = m
    r["loadavg_after"] = machine()["loadavg"]
    r["ceiling"] = ceiling
    r["claim_p50_ratio_large_vs_small"] = large["claim100_p50_ms"] / small["claim100_p50_ms"]
    r["claim_p99_ratio_large_vs_small"] = large["claim100_p99_ms"] / small["claim100_p99_ms"]
    r["claim_server_mean_ratio_large_vs_small"] = (
        large["claim100_server_us_mean"] / small["claim100_server_us_mean"]
    )
    alone = r["backlog_only"]
    r["claim_p50_ratio_large_vs_backlog_only"] = large["claim100_p50_ms"] / alone["claim100_p50_ms"]
    r["claim_server_mean_ratio_large_vs_backlog_only"] = (
        large["claim100_server_us_mean"] / alone["claim100_server_us_mean"]
    )
    if ceiling.get("evalsha_per_s"):
        # How many claim-shaped EVALSHAs (at the ceiling rate) one claim of 100 costs Redis.
        r["claim100_in_ceiling_evalsha"] = (
            large["claim100_server_us_mean"] / 1e6 * ceiling["evalsha_per_s"]
        )
    r["ok"] = r["shape_all_succeeded"] and all(
        x["counts_ok"] and x["claims_ok"] for x in (small, large, alone)
    )
    return r


def report(r: dict[str, Any]) -> None:
    s, big = r["small"], r["large"]
    rows = [
        ["bytes/task, small task PENDING_SUBMIT", r["bytes_per_pending_task"], "", "< 1024"],
        ["bytes/task, small task SUCCEEDED", r["bytes_per_succeeded_task"], "", "< 1024"],
        ["  same, without the events stream", r["bytes_per_succeeded_task_without_events"], "", ""],
        [
            f"bytes/task, {big['stored']:,} stored (90% CANCELED)",
            big["bytes_per_task"],
            "",
            "< 1024",
        ],
        ["  same, without the events stream", big["bytes_per_task_without_events"], "", ""],
        [
            "claim of 100: p50 ms",
            s["claim100_p50_ms"],
            big["claim100_p50_ms"],
            f"ratio {r['claim_p50_ratio_large_vs_small']:.2f}",
        ],
        [
            "claim of 100: p99 ms",
            s["claim100_p99_ms"],
            big["claim100_p99_ms"],
            f"ratio {r['claim_p99_ratio_large_vs_small']:.2f}",
        ],
        [
            "claim of 100, Redis side: mean us",
            s["claim100_server_us_mean"],
            big["claim100_server_us_mean"],
            f"ratio {r['claim_server_mean_ratio_large_vs_small']:.2f}",
        ],
        [
            "claim of 100, Redis side: p50 us",
            s["claim100_server_p50_us"],
            big["claim100_server_p50_us"],
            "INFO latencystats",
        ],
        [
            "claim of 100, Redis side: p99 us",
            s["claim100_server_p99_us"],
            big["claim100_server_p99_us"],
            "",
        ],
        [
            f"same, {r['backlog_only']['pending']:,} pending alone: Redis-side mean us",
            "",
            r["backlog_only"]["claim100_server_us_mean"],
            f"terminal tasks' share: x{r['claim_server_mean_ratio_large_vs_backlog_only']:.2f}",
        ],
        [
            "  p50 ms",
            "",
            r["backlog_only"]["claim100_p50_ms"],
            f"x{r['claim_p50_ratio_large_vs_backlog_only']:.2f}",
        ],
        ["create (pipelined) /s", s["create_per_s"], big["create_per_s"], ""],
        ["cancel (pipelined) /s", s["cancel_per_s"], big["cancel_per_s"], ""],
    ]
    say(
        table(
            f"W5 stored tasks: memory and claim cost, {s['stored']:,} vs {big['stored']:,} stored",
            [
                "figure",
                f"{s['stored']:,} stored / value",
                f"{big['stored']:,} stored",
                "target / note",
            ],
            rows,
        )
    )
    if "claim100_in_ceiling_evalsha" in r:
        say(
            f"  a claim of 100 costs Redis {r['claim100_in_ceiling_evalsha']:.1f} claim-shaped "
            f"EVALSHAs at the ceiling ({r['ceiling']['evalsha_per_s']:,.0f}/s)"
        )
    b = r["claim_breakdown"]
    top = ", ".join(
        f"{k} {v['calls']:.0f}x {v['us']:.0f} us" for k, v in list(b["inner_by_time"].items())[:6]
    )
    say(
        f"  Redis inside one claim of 100 ({big['stored']:,} stored): "
        f"{b['evalsha_us_per_claim']:.0f} us = {b['inner_commands_per_claim']:.0f} commands "
        f"in {b['inner_us_per_claim']:.0f} us + {b['lua_and_reply_us_per_claim']:.0f} us Lua "
        f"and reply; by time: {top}"
    )
    say(f"  checks (shape SUCCEEDED, exact counters, every claim got 100): {r['ok']}")
    say(f"  machine: {machine_line(r['machine'])}; load after {r['loadavg_after']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100_000, help="FULL: 1000000")
    parser.add_argument("--claims", type=int, default=300, help="timed claims of 100 each")
    args = parser.parse_args(argv)
    r = run(args.tasks, args.claims)
    report(r)
    emit("w5_memory", r)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
