"""W1 against the peers: asynctaskd's steady lifecycle rate and arq's and SAQ's, same run.

Each subject drains N jobs created up front (untimed) with one worker in one process,
against an instant in-process job, each run on a fresh private redis-server:

* `asynctaskd`: bench/lifecycle.py (a child process): N tasks created, then one in-process
  Worker runs them all until idle (max_inflight 1000, claims of 100, the instant handler:
  submit, one query, SUCCEEDED);
* `arq` / `arq-50ms` (arq 0.28) and `saq` (SAQ 0.26), from the bench-only venv
  (bench/peers/setup.sh, or BENCH_VENV): bench/peers/{arq,saq}_w2.py `w1`, N no-op jobs
  enqueued, then one worker (uvloop, hiredis) in that process: arq with `burst=True`,
  max_jobs 1000, its default poll_delay 0.5 s and 50 ms; SAQ with concurrency 100.

The subjects run in turn, the order shifted each round so drift (other load on the
machine) favours none. Reported per subject: jobs/s from the worker's start to the last
job done, the worker process's CPU per job over that time, and Redis CPU per job and
commands per job (INFO cpu and commandstats deltas over the same time; commands run
inside Lua scripts count, as bench/lifecycle.py counts them). The peers' child prints a
line when its jobs are enqueued and waits, so the harness reads INFO just around the
timed part. Then the median rates and the ratio asynctaskd / best peer (target >= 4x).
Checks: every asynctaskd task SUCCEEDED and was submitted once; every peer job completed.

    python bench/w1_peers.py [--tasks 20000] [--rounds 3] [--subjects asynctaskd,arq,...]
Prints a table, then one JSON line {"bench": "w1_peers", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import (
    ROOT,
    commands_delta,
    commandstats,
    emit,
    loadavg,
    peer_python,
    redis_cpu,
    redis_server,
    run_child,
    say,
    spread,
    table,
)

OURS = "asynctaskd"
PEERS = {
    "arq": ("arq_w2.py", ["--max-jobs", "1000", "--poll-delay", "0.5"]),
    "arq-50ms": ("arq_w2.py", ["--max-jobs", "1000", "--poll-delay", "0.05"]),
    "saq": ("saq_w2.py", ["--concurrency", "100"]),
}
KEYS = ("per_s", "cpu_ms_per_job", "redis_cpu_ms_per_job", "redis_commands_per_job")


def run_asynctaskd(n: int) -> dict[str, Any]:
    """bench/lifecycle.py as `python -m bench` W1 runs it; its figures under the shared
    names too (per_s, cpu_ms_per_job, ...), its own keys kept."""
    server = os.environ.get("BENCH_REDIS_SERVER", "redis-server")
    args = [str(ROOT / "bench" / "lifecycle.py"), "--tasks", str(n), "--no-ceiling"]
    r, proc = run_child([*args, "--server", server], timeout=300)
    if r is None:
        raise RuntimeError(f"bench/lifecycle.py printed no JSON line:\n{proc.stdout}{proc.stderr}")
    r.update(
        per_s=r["tasks_per_s"],
        cpu_ms_per_job=r["cpu_ms_per_task"],
        redis_cpu_ms_per_job=r["redis_cpu_ms_per_task"],
        redis_commands_per_job=r["redis_commands_per_task"],
        ok=r["all_succeeded_once"],
    )
    return r


def _line(child: subprocess.Popen[str], name: str) -> dict[str, Any]:
    assert child.stdout is not None
    text = child.stdout.readline()
    if not text.startswith("{"):
        child.kill()
        _, err = child.communicate(timeout=30)
        raise RuntimeError(f"{name} w1 stopped: {text}{err[-2000:]}")
    out: dict[str, Any] = json.loads(text)
    return out


def _answer(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.write("\n")
    child.stdin.flush()


def run_peer(name: str, python: Path, n: int) -> dict[str, Any]:
    """One peer's `w1` child on a fresh redis-server, INFO read around its timed part."""
    from redis import Redis

    script, extra = PEERS[name]
    path = ROOT / "bench" / "peers" / script
    argv = [str(python), str(path), "w1", "--tasks", str(n), *extra]
    with redis_server() as server:
        sync = Redis.from_url(server.url)
        sync.flushdb()
        child = subprocess.Popen(
            [*argv, "--redis", server.url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _line(child, name)  # {"enqueued": n}: the backlog is in place
            before, cpu0 = commandstats(sync), redis_cpu(sync)
            _answer(child)
            out = _line(child, name)
            cpu1, after = redis_cpu(sync), commandstats(sync)
            _answer(child)
            child.communicate(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        sync.close()
    delta = commands_delta(before, after)
    out["redis_commands_per_job"] = sum(delta.values()) / n
    out["redis_commands"] = {k: round(v / n, 3) for k, v in delta.items()}
    out["redis_cpu_ms_per_job"] = (cpu1 - cpu0) * 1000 / n
    return out


def run(tasks: int = 20_000, rounds: int = 3, subjects: list[str] | None = None) -> dict[str, Any]:
    """Every subject `rounds` times, in turn; a missing bench venv skips the peers."""
    wanted = [OURS, *PEERS] if subjects is None else subjects
    python = peer_python()
    skipped: list[str] = []
    if python is None and any(s != OURS for s in wanted):
        skipped = [s for s in wanted if s != OURS]
        wanted = [s for s in wanted if s == OURS]
        say("  (no .bench-venv: run bench/peers/setup.sh for arq and SAQ; peers skipped)")
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in wanted}
    for r in range(rounds):
        shift = r % len(wanted)
        for name in wanted[shift:] + wanted[:shift]:
            if name == OURS:
                res = run_asynctaskd(tasks)
            else:
                assert python is not None
                res = run_peer(name, python, tasks)
            res["round"] = r + 1
            res["loadavg_1m"] = loadavg()[0]
            results[name].append(res)
            say(
                f"  round {r + 1} {name:>10}: {res['per_s']:8,.0f} jobs/s  "
                f"{res['cpu_ms_per_job']:.3f} ms CPU/job  "
                f"{res['redis_commands_per_job']:.1f} cmds/job  "
                f"{res['redis_cpu_ms_per_job']:.3f} ms Redis CPU/job  ok={res['ok']}  "
                f"load {res['loadavg_1m']:.2f}"
            )
    summary = {name: {k: spread([x[k] for x in rs]) for k in KEYS} for name, rs in results.items()}
    out: dict[str, Any] = {
        "tasks": tasks,
        "rounds": rounds,
        "summary": summary,
        "peers_skipped": skipped,
        "results": results,
        "ok": all(x["ok"] for rs in results.values() for x in rs),
    }
    out.update(ratios(summary))
    if "best_peer" in out:
        out["vs_best_peer_per_round"] = [
            ours["per_s"] / max(rs[r]["per_s"] for n, rs in results.items() if n != OURS)
            for r, ours in enumerate(results[OURS])
        ]
    return out


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """asynctaskd's median rate over each peer's, and over the best peer's (target >= 4x)."""
    if OURS not in summary:
        return {}
    ours = summary[OURS]["per_s"]["median"]
    peers = {n: s["per_s"]["median"] for n, s in summary.items() if n != OURS}
    if not peers:
        return {}
    best = max(peers, key=lambda n: peers[n])
    return {
        "rate_ratios": {n: ours / rate for n, rate in peers.items()},
        "best_peer": best,
        "vs_best_peer": ours / peers[best],
    }


def report(out: dict[str, Any]) -> None:
    rows = []
    for name, fig in out["summary"].items():
        rate = fig["per_s"]
        rows.append(
            [
                name,
                f"{rate['median']:,.0f} ({rate['min']:,.0f}-{rate['max']:,.0f})",
                fig["cpu_ms_per_job"]["median"],
                fig["redis_cpu_ms_per_job"]["median"],
                fig["redis_commands_per_job"]["median"],
                out.get("rate_ratios", {}).get(name, ""),
            ]
        )
    say(
        table(
            f"W1 vs peers: {out['tasks']:,} jobs drained by one worker, instant job, "
            f"median of {out['rounds']} (min-max)",
            [
                "subject",
                "jobs/s",
                "worker cpu ms/job",
                "redis cpu ms/job",
                "cmds/job (incl. Lua)",
                "asynctaskd / this",
            ],
            rows,
        )
    )
    if "vs_best_peer" in out:
        say(
            f"  asynctaskd / best peer ({out['best_peer']}): {out['vs_best_peer']:.2f}x "
            "the steady rate (target >= 4x); per round, over that round's best peer: "
            + ", ".join(f"{x:.2f}x" for x in out["vs_best_peer_per_round"])
        )
    if out["peers_skipped"]:
        say(f"  peers skipped (no bench venv): {', '.join(out['peers_skipped'])}")
    say(f"  all jobs done (asynctaskd: SUCCEEDED, each submitted once): {out['ok']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--subjects", default=",".join([OURS, *PEERS]), help="comma list")
    args = parser.parse_args(argv)
    subjects = [s for s in args.subjects.split(",") if s]
    unknown = [s for s in subjects if s != OURS and s not in PEERS]
    if unknown:
        parser.error(f"unknown subjects: {', '.join(unknown)}")
    out = run(args.tasks, args.rounds, subjects)
    report(out)
    emit("w1_peers", out)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
