"""`python -m bench` runs every benchmark quickly (< 3 minutes); `--full` the long versions.

W1 bench/lifecycle.py (child process; with the bench venv against arq and SAQ too,
bench/w1_peers.py), W2 bench/w2_poll.py (asynctaskd vs arq and SAQ from
the bench-only venv, bench/peers/setup.sh), W3 bench/w3_due_lag.py, W4 bench/w4_wakeup.py,
W5 bench/w5_memory.py, W6 bench/w6_web.py (HTTP submits vs the Python client), W7
bench/w7_sse.py (5,000 SSE watchers on one web process), admission on/off
bench/admission.py, producer bench/producer.py (submits/s against SAQ and arq). The Redis
ceiling (redis-benchmark EVALSHA of a claim-shaped script) is measured first, on a fresh
redis-server, and handed to every bench. Each bench prints its table and its JSON line;
all JSON lines also go to bench/results/<time>.jsonl.

                quick (default)                   --full
    W1          5,000 tasks, 1 run, arq + SAQ     20,000 tasks, 3 runs, arq, arq-50ms, SAQ
    W2          1,000 tasks, 1 run, arq + SAQ     2,000 tasks, 3 runs, arq, arq-50ms, SAQ
    W3          10,000 tasks, 15 s window         10,000 tasks, 60 s window
    W4          200 submits, 1 run                200 submits, 3 runs
    W5          100,000 stored                    1,000,000 stored
    W6          5,000 POSTs, 32 clients           20,000 POSTs, 32 clients
    W7          1,000 watchers, 100 changes       5,000 watchers, 1,000 changes
    adm         5,000 tasks, 20,000 paused        20,000 tasks, 100,000 paused
    prod        3,000 calls, 3 rounds             10,000 calls, 5 rounds
    cost        with --only cost                  instructions under callgrind: Redis per
                                                  script operation (2,000 tasks), the daemon
                                                  per task (600); needs valgrind, ~2 minutes

    python -m bench [--full] [--only w2,w5] [--profile DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from bench import (
    ROOT,
    emit,
    loadavg,
    machine,
    machine_line,
    redis_ceiling,
    redis_server,
    run_child,
    say,
    spread,
    table,
)

# and "cost": run by --full, or asked for
ALL = ("w1", "w2", "w3", "w4", "w5", "w6", "w7", "adm", "prod")


def run_w1(full: bool, ceiling: dict[str, Any]) -> dict[str, Any]:
    """bench/lifecycle.py's runs, and with the bench venv arq's and SAQ's W1 in the same
    rounds (bench/w1_peers.py): the asynctaskd runs serve both tables."""
    from bench import w1_peers

    tasks, runs = (20_000, 3) if full else (5_000, 1)
    compared = w1_peers.run(tasks, runs)
    results = compared["results"].pop(w1_peers.OURS)
    keys = (
        "tasks_per_s",
        "redis_commands_per_task",
        "round_trips_per_task",
        "cpu_ms_per_task",
        "redis_cpu_ms_per_task",
        "peak_rss_mb",
    )
    out: dict[str, Any] = {
        "tasks": tasks,
        "runs": runs,
        "summary": {k: spread([r[k] for r in results]) for k in keys},
        "results": results,
        "ok": all(r["all_succeeded_once"] for r in results),
    }
    if ceiling.get("evalsha_per_s"):
        out["lifecycles_vs_evalsha_ceiling"] = (
            out["summary"]["tasks_per_s"]["median"] / ceiling["evalsha_per_s"]
        )
    rows = [[k, v["median"], v["min"], v["max"]] for k, v in out["summary"].items()]
    say(
        table(
            f"W1 lifecycle: {tasks:,} tasks, instant in-process vendor, {runs} run(s)",
            ["figure", "median", "min", "max"],
            rows,
        )
    )
    if "lifecycles_vs_evalsha_ceiling" in out:
        say(
            f"  lifecycles/s vs EVALSHA ceiling: {out['lifecycles_vs_evalsha_ceiling']:.3f} "
            "(target >= 5,000 tasks/s)"
        )
    say(f"  all SUCCEEDED, each submitted once: {out['ok']}")
    out["peers"] = compared
    if "vs_best_peer" in compared:
        out["vs_best_peer"] = compared["vs_best_peer"]
    if compared["results"]:  # the peers' (asynctaskd's are above); none: skipped, said so
        w1_peers.report(compared)
    out["ok"] = out["ok"] and compared["ok"]
    emit("w1_lifecycle", out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the long versions (~10 minutes)")
    parser.add_argument(
        "--only", default=",".join(ALL), help="comma list of w1..w7, adm, prod, cost"
    )
    parser.add_argument("--profile", type=Path, help="directory for py-spy profiles (W2, W3)")
    args = parser.parse_args(argv)
    only = [x.strip().lower() for x in args.only.split(",") if x.strip()]
    full = args.full
    results_dir = ROOT / "bench" / "results"
    results_dir.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_path = results_dir / f"{stamp}{'-full' if full else ''}.jsonl"
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    with redis_server() as server:
        m = machine(server.port)
        say(f"machine: {machine_line(m)}")
        ceiling = redis_ceiling(server.port, requests=100_000 if full else 50_000)
    say(
        f"Redis ceiling (redis-benchmark, claim-shaped EVALSHA, 50 clients): "
        f"{ceiling['evalsha_per_s'] or float('nan'):,.0f}/s, pipelined -P 16: "
        f"{ceiling['evalsha_pipelined_per_s'] or float('nan'):,.0f}/s"
    )
    collected: dict[str, Any] = {"machine": m, "ceiling": ceiling, "full": full}
    ok = True

    section = [time.monotonic()]

    def record(name: str, result: dict[str, Any]) -> None:
        nonlocal ok
        result["elapsed_s"] = round(time.monotonic() - section[0], 1)
        section[0] = time.monotonic()
        say(f"  ({name}: {result['elapsed_s']:.0f} s, load {loadavg()[0]:.2f})")
        collected[name] = result
        ok = ok and bool(result.get("ok", True))
        with log_path.open("a") as f:
            f.write(json.dumps({"bench": name, **result}, default=str) + "\n")

    if "w1" in only:
        say("\n== W1 lifecycle throughput")
        record("w1_lifecycle", run_w1(full, ceiling))
    if "w2" in only:
        from bench import w2_poll

        say("\n== W2 poll-shaped, asynctaskd vs arq and SAQ")
        prof = args.profile / "w2-daemon.txt" if args.profile else None
        peers = list(w2_poll.PEERS) if full else ["arq", "saq"]
        out = w2_poll.run(
            2000 if full else 1000,
            3 if full else 1,
            peers,
            prof,
            ceiling,
            account_tasks=500 if full else 100,
        )
        w2_poll.report(out)
        emit("w2_poll", out)
        record("w2_poll", out)
    if "w3" in only:
        from bench import w3_due_lag

        say("\n== W3 due lag")
        prof = args.profile / "w3-daemon.txt" if args.profile else None
        r = w3_due_lag.run(10_000, 60.0 if full else 15.0, profile=prof, ceiling=ceiling)
        w3_due_lag.report(r)
        emit("w3_due_lag", r)
        record("w3_due_lag", r)
    if "w4" in only:
        from bench import w4_wakeup

        say("\n== W4 wake-up latency")
        out = w4_wakeup.run(200, 0.05, 3 if full else 1)
        w4_wakeup.report(out)
        emit("w4_wakeup", out)
        record("w4_wakeup", out)
    if "w5" in only:
        from bench import w5_memory

        say("\n== W5 stored tasks")
        r = w5_memory.run(1_000_000 if full else 100_000, 300 if full else 150, ceiling)
        w5_memory.report(r)
        emit("w5_memory", r)
        record("w5_memory", r)
    if "w6" in only:
        from bench import w6_web

        say("\n== W6 HTTP API submits vs the Python client")
        r = w6_web.run(20_000 if full else 5_000, 32)
        w6_web.report(r)
        emit("w6_web", r)
        record("w6_web", r)
    if "w7" in only:
        from bench import w7_sse

        say("\n== W7 SSE watchers on one web process")
        r = w7_sse.run(5_000 if full else 1_000, 1_000 if full else 100)
        w7_sse.report(r)
        emit("w7_sse", r)
        record("w7_sse", r)

    if "adm" in only:
        say("\n== Admission: claim throughput with limits on and off")
        args_adm = ["--tasks", "20000", "--backlog", "100000"] if full else [
            "--tasks", "5000", "--backlog", "20000"]  # fmt: skip
        adm, proc = run_child([str(ROOT / "bench" / "admission.py"), *args_adm], timeout=600)
        say(proc.stdout.rsplit("\n", 2)[0] if proc.returncode == 0 else proc.stdout + proc.stderr)
        record("admission", adm or {"ok": False})

    if "prod" in only:
        from bench import producer

        say("\n== Producer: submits/s against SAQ and arq")
        r = producer.run(10_000 if full else 3_000, 5 if full else 3)
        producer.report(r)
        emit("producer", r)
        record("producer", r)

    if "cost" in only or (full and args.only == ",".join(ALL)):
        # Instruction counts under callgrind (needs valgrind): the same code gives the same
        # figures on any load, where the timed benches above move by tens of percent.
        if shutil.which("valgrind") is None:
            say("\n== Instruction counts: skipped (no valgrind)")
        else:
            from bench import daemon_cost, script_cost

            say("\n== Instruction counts (callgrind): Redis per script operation, daemon per task")
            scripts = script_cost.run()
            emit("script_cost", scripts)
            record("script_cost", scripts)
            daemon = daemon_cost.run(floor=True)
            emit("daemon_cost", daemon)
            record("daemon_cost", daemon)

    elapsed = time.monotonic() - started
    say(
        f"\nall benches done in {elapsed:.0f} s; load average now "
        f"{' '.join(f'{x:.2f}' for x in loadavg())}; all checks passed: {ok}"
    )
    say(f"JSON lines: {log_path.relative_to(ROOT)}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
