"""W2: 2,000 tasks, each submits once to the fake vendor then polls every 200 ms until
done on the 5th poll (ideal ~1.0 s); asynctaskd versus arq and SAQ in the same run.

The fake vendor (`asynctaskd.devtools.fakevendor`, its own process, instant answers,
polls_to_done=5) and one redis-server are shared by every subject. Each subject gets a
flushed database, a reset vendor, and one worker process:

* asynctaskd: `python -m asynctaskd run --config <tmp>` with the demo handler,
  retry.poll_interval = 200ms, max_inflight = 4000, batch_size = 100 (the default), metrics off;
  the tasks come from `AsyncClient.submit` in this (harness) process.
* arq / SAQ (from the bench-only venv, bench/peers/setup.sh): bench/peers/{arq,saq}_w2.py,
  a job that submits and re-enqueues itself every 200 ms (arq `_defer_by`; SAQ
  `scheduled=`); the tasks come from an enqueuer process. arq runs twice: with its
  default poll_delay (0.5 s) and with poll_delay = 50 ms.

Wall time runs from the first submit/enqueue to the moment the harness sees all N done
(it polls one counter every 10 ms). Redis commands per task: INFO commandstats delta over
that window, minus the harness's own reads, divided by N (producer + worker). CPU per
task: the worker process's user+sys CPU (/proc) over the window. Every run checks that
all N tasks ended SUCCEEDED (done) and that the vendor's /_log shows exactly one created
submit per task and nothing else, and /_jobs that every job ended succeeded on poll 5.

    python bench/w2_poll.py [--tasks 2000] [--runs 1] [--peers arq,arq-50ms,saq]
                            [--profile out.txt]
Prints a table, then one JSON line {"bench": "w2_poll", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asynctaskd.client import AsyncClient
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.keys import Keys
from asynctaskd.model import Status
from bench import (
    ROOT,
    Daemon,
    Monitor,
    Profiler,
    arun,
    commands_delta,
    commandstats,
    daemon_config,
    emit,
    machine,
    machine_line,
    peer_python,
    proc_cpu,
    profile_summary,
    redis_ceiling,
    redis_cpu,
    redis_server,
    run_child,
    say,
    spread,
    table,
    workdir,
)

POLLS = 5
POLL_S = 0.2
IDEAL_S = POLLS * POLL_S
PEERS = {
    "arq": ("arq_w2.py", ["--max-jobs", "2000", "--poll-delay", "0.5"]),
    "arq-50ms": ("arq_w2.py", ["--max-jobs", "2000", "--poll-delay", "0.05"]),
    "saq": ("saq_w2.py", ["--concurrency", "100"]),
}


def check_vendor(vendor: FakeVendorProcess, refs: list[str]) -> dict[str, Any]:
    """Every task submitted once (exactly one 'created' per ref, nothing else), every job
    succeeded on its 5th poll."""
    log = vendor.submit_log()
    outcomes = Counter(e["outcome"] for e in log)
    per_ref = Counter(e["ref"] for e in log)
    jobs = vendor.jobs()
    submitted_once = (
        outcomes == Counter({"created": len(refs)})
        and set(per_ref) == set(refs)
        and max(per_ref.values(), default=0) == 1
    )
    jobs_ok = len(jobs) == len(refs) and all(
        j["status"] == "succeeded" and j["polls"] == POLLS for j in jobs
    )
    return {
        "submitted_once": submitted_once,
        "vendor_jobs_succeeded_on_poll_5": jobs_ok,
        "vendor_submits": len(log),
        "max_polls": max((j["polls"] for j in jobs), default=0),
    }


def snapshot(sync: Any, pid: int, vendor_pid: int) -> dict[str, Any]:
    return {
        "cmds": commandstats(sync),
        "redis_cpu": redis_cpu(sync),
        "cpu": proc_cpu(pid),
        "vendor_cpu": proc_cpu(vendor_pid),
    }


def figures(
    name: str, n: int, wall: float, before: dict[str, Any], after: dict[str, Any], harness: int
) -> dict[str, Any]:
    delta = commands_delta(before["cmds"], after["cmds"])
    total = sum(delta.values()) - harness
    cpu = after["cpu"] - before["cpu"]
    return {
        "subject": name,
        "tasks": n,
        "wall_s": wall,
        "vs_ideal": wall / IDEAL_S,
        "redis_commands_per_task": total / n,
        "worker_cpu_ms_per_task": cpu * 1000 / n,
        "worker_cpu_s": cpu,
        "worker_cpu_util": cpu / wall,
        "redis_cpu_ms_per_task": (after["redis_cpu"] - before["redis_cpu"]) * 1000 / n,
        "vendor_cpu_ms_per_task": (after["vendor_cpu"] - before["vendor_cpu"]) * 1000 / n,
        "top_commands": dict(list(delta.items())[:8]),
    }


def accounting(counted: dict[str, Any], n: int, harness_cmd: str, reads: int) -> dict[str, Any]:
    """Per-task top-level commands (what clients send; a pipeline of k counts k) and
    commands run inside Lua scripts, from a MONITOR pass; the harness's reads removed."""
    top = dict(counted["top_level"])
    top[harness_cmd] = top.get(harness_cmd, 0) - reads
    top = {k: v for k, v in top.items() if v > 0}
    return {
        "top_level_commands_per_task": sum(top.values()) / n,
        "in_lua_commands_per_task": counted["in_lua"] / n,
        "top_level_by_command_per_task": {k: round(v / n, 3) for k, v in top.items()},
        "in_lua_by_command_per_task": {
            k: round(v / n, 3) for k, v in counted.get("in_lua_by_command", {}).items()
        },
    }


# --- asynctaskd ----------------------------------------------------------------------------


async def _submit_and_wait(url: str, n: int, timeout: float) -> tuple[list[str], float, float, int]:
    from redis.asyncio import Redis

    watcher = Redis.from_url(url)
    succeeded = Keys().index(0, Status.SUCCEEDED)
    async with AsyncClient.from_url(url) as client:
        t0 = time.time()
        tasks = await asyncio.gather(
            *(client.submit("demo", {"i": i}, tracking_timeout=600) for i in range(n))
        )
        t_enq = time.time()
        reads = 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = await watcher.zcard(succeeded)
            reads += 1
            if done is not None and int(done) >= n:
                break
            await asyncio.sleep(0.01)
        t1 = time.time()
    await watcher.aclose()
    return [t.id for t in tasks], t1 - t0, t_enq - t0, reads


def run_asynctaskd(
    url: str,
    vendor: FakeVendorProcess,
    n: int,
    tmp: Path,
    profile: Path | None = None,
    monitor_port: int | None = None,
) -> dict[str, Any]:
    from redis import Redis

    sync = Redis.from_url(url)
    sync.flushdb()
    vendor.reset()
    config = daemon_config(
        tmp / "w2.toml", url, vendor.url, poll_interval="200ms", max_inflight=4000
    )
    with Daemon(config, url) as daemon:
        time.sleep(0.5)  # settle into the idle wait
        profiler = Profiler(daemon.pid, profile) if profile else None
        before = snapshot(sync, daemon.pid, vendor.process.pid)
        monitor = Monitor(monitor_port) if monitor_port else None
        ids, wall, enqueue_s, reads = arun(_submit_and_wait(url, n, timeout=120))
        counted = monitor.stop() if monitor else None
        after = snapshot(sync, daemon.pid, vendor.process.pid)
        if profiler:
            profiler.stop()
    result = figures("asynctaskd", n, wall, before, after, harness=reads)
    if counted:
        result.update(accounting(counted, n, "hget", reads))
    result["enqueue_s"] = enqueue_s
    pipe = sync.pipeline(transaction=False)
    for tid in ids:
        pipe.hget(Keys().task(0, tid), "status")
    statuses = Counter(s.decode() if s else "missing" for s in pipe.execute())
    result["statuses"] = dict(statuses)
    result.update(check_vendor(vendor, ids))
    result["ok"] = (
        statuses == Counter({"SUCCEEDED": n})
        and result["submitted_once"]
        and result["vendor_jobs_succeeded_on_poll_5"]
    )
    sync.close()
    return result


# --- peers -----------------------------------------------------------------------------------


def run_peer(
    name: str,
    python: Path,
    url: str,
    vendor: FakeVendorProcess,
    n: int,
    tmp: Path,
    monitor_port: int | None = None,
) -> dict[str, Any]:
    from redis import Redis

    script, extra = PEERS[name]
    path = ROOT / "bench" / "peers" / script
    sync = Redis.from_url(url)
    sync.flushdb()
    vendor.reset()
    ready = tmp / f"{name}.ready"
    ready.unlink(missing_ok=True)
    log = (tmp / f"{name}.log").open("wb")
    worker = subprocess.Popen(
        [
            str(python),
            str(path),
            "worker",
            "--redis",
            url,
            "--vendor",
            vendor.url,
            "--ready",
            str(ready),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name} worker did not start: {(tmp / f'{name}.log').read_text()}"
                )
            time.sleep(0.02)
        time.sleep(0.5)
        before = snapshot(sync, worker.pid, vendor.process.pid)
        monitor = Monitor(monitor_port) if monitor_port else None
        enq = subprocess.Popen(
            [str(python), str(path), "enqueue", "--redis", url, "--tasks", str(n)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        assert enq.stdout is not None
        t0 = json.loads(enq.stdout.readline())["t0"]
        reads = 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = sync.get("bench:done")
            reads += 1
            if done is not None and int(done) >= n:
                break
            time.sleep(0.01)
        t1 = time.time()
        counted = monitor.stop() if monitor else None
        after = snapshot(sync, worker.pid, vendor.process.pid)
        t_enq = json.loads(enq.stdout.readline())["t1"]
        enq.wait(timeout=30)
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        log.close()
    result = figures(name, n, t1 - t0, before, after, harness=reads)
    if counted:
        result.update(accounting(counted, n, "get", reads))
    result["enqueue_s"] = t_enq - t0
    done = int(sync.get("bench:done") or 0)
    result["statuses"] = {"done": done}
    result.update(check_vendor(vendor, [f"t{i}" for i in range(n)]))
    result["ok"] = (
        done == n and result["submitted_once"] and result["vendor_jobs_succeeded_on_poll_5"]
    )
    sync.close()
    return result


# --- HTTP floor -------------------------------------------------------------------------------

FLOOR_CLIENTS = ("aiohttp", "shared-client", "fetch")


async def _floor_child(client: str, base: str, n: int, concurrency: int) -> dict[str, float]:
    """CPU per vendor GET (+ JSON decode) for one client in this process, after warm-up."""
    import aiohttp

    from asynctaskd.transport import fetcher_for, make_http_client

    async with aiohttp.ClientSession() as s, s.post(f"{base}/v1/jobs", json={"input": 1}) as r:
        url = f"{base}/v1/jobs/{(await r.json())['id']}"
    if client == "aiohttp":
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000))

        async def get() -> None:
            async with session.get(url) as response:
                response.raise_for_status()
                await response.json()

        close = session.close
    elif client == "fetch":
        http = make_http_client()
        fetch = fetcher_for(http)

        async def get() -> None:
            reply = await fetch("GET", url)
            assert reply.status == 200
            reply.json()

        close = http.aclose
    else:
        http = make_http_client()

        async def get() -> None:
            response = await http.get(url)
            response.raise_for_status()
            response.json()

        close = http.aclose
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await get()

    await asyncio.gather(*(get() for _ in range(concurrency)))  # warm the pool
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    await close()
    return {"cpu_ms_per_request": cpu * 1000 / n, "requests_per_s": n / wall}


def http_floor(vendor_url: str, n: int = 3000, concurrency: int = 50) -> dict[str, Any]:
    """What one vendor GET costs a Python process on this machine, per client: the part of
    a W2 task (1 POST + 5 GETs) that no queue design removes."""
    out: dict[str, Any] = {}
    for client in FLOOR_CLIENTS:
        args = [str(Path(__file__).resolve()), "--http-floor-child", client, vendor_url]
        floor, proc = run_child([*args, str(n), str(concurrency)], timeout=120)
        out[client] = floor or {"error": proc.stderr[-500:]}
    return out


# --- the run -----------------------------------------------------------------------------------


def run(
    tasks: int = 2000,
    runs: int = 1,
    peers: list[str] | None = None,
    profile: Path | None = None,
    ceiling: dict[str, Any] | None = None,
    account_tasks: int = 500,
    http_floor_requests: int = 3000,
) -> dict[str, Any]:
    peers = list(PEERS) if peers is None else peers
    python = peer_python()
    skipped = []
    if python is None and peers:
        skipped = peers
        say("  (no .bench-venv: run bench/peers/setup.sh for arq and SAQ; peers skipped)")
        peers = []
    results: dict[str, list[dict[str, Any]]] = {}
    with (
        redis_server() as server,
        workdir("bench-w2-") as tmp,
        FakeVendorProcess.start(Behaviour(polls_to_done=POLLS)) as vendor,
    ):
        m = machine(server.port)
        if ceiling is None:
            ceiling = redis_ceiling(server.port)
        for r in range(runs):
            # Alternate the order so drift (other load on the machine) does not favour one.
            order = ["asynctaskd", *peers]
            if r % 2:
                order.reverse()
            for name in order:
                if name == "asynctaskd":
                    res = run_asynctaskd(
                        server.url, vendor, tasks, tmp, profile if r == 0 else None
                    )
                else:
                    assert python is not None
                    res = run_peer(name, python, server.url, vendor, tasks, tmp)
                res["loadavg_1m"] = machine()["loadavg"][0]
                results.setdefault(name, []).append(res)
                say(
                    f"  run {r + 1} {name:<11} wall {res['wall_s']:.2f}s  "
                    f"cmds/task {res['redis_commands_per_task']:.1f}  "
                    f"cpu/task {res['worker_cpu_ms_per_task']:.2f}ms  ok={res['ok']}  "
                    f"load {res['loadavg_1m']:.2f}"
                )
        # Accounting pass (MONITOR on, not timed): top-level vs in-Lua commands per task.
        accounts: dict[str, dict[str, Any]] = {}
        for name in ["asynctaskd", *peers] if account_tasks else []:
            if name == "asynctaskd":
                res = run_asynctaskd(
                    server.url, vendor, account_tasks, tmp, monitor_port=server.port
                )
            else:
                assert python is not None
                res = run_peer(
                    name, python, server.url, vendor, account_tasks, tmp, monitor_port=server.port
                )
            accounts[name] = {
                k: res[k]
                for k in (
                    "tasks",
                    "ok",
                    "top_level_commands_per_task",
                    "in_lua_commands_per_task",
                    "top_level_by_command_per_task",
                    "in_lua_by_command_per_task",
                )
            }
            say(
                f"  accounting {name:<11} top-level cmds/task "
                f"{res['top_level_commands_per_task']:.1f}, in Lua "
                f"{res['in_lua_commands_per_task']:.1f}  ok={res['ok']}"
            )
        floor = http_floor(vendor.url, http_floor_requests) if http_floor_requests else {}
        for client, f in floor.items():
            if "cpu_ms_per_request" in f:
                say(
                    f"  HTTP floor {client:<19} {f['cpu_ms_per_request']:.3f} ms CPU per GET "
                    f"({f['requests_per_s']:,.0f}/s, 50 in flight)"
                )
    summary = summarize(results, ceiling, accounts)
    out: dict[str, Any] = {
        "machine": m,
        "tasks": tasks,
        "runs": runs,
        "ceiling": ceiling,
        "summary": summary,
        "peers_skipped": skipped,
        "results": results,
        "accounting": accounts,
        "http_floor": floor,
        "ok": all(x["ok"] for rs in results.values() for x in rs)
        and all(a["ok"] for a in accounts.values()),
    }
    if profile:
        out["profile"] = profile_summary(profile)
    return out


def summarize(
    results: dict[str, list[dict[str, Any]]],
    ceiling: dict[str, Any],
    accounts: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    keys = (
        "wall_s",
        "redis_commands_per_task",
        "worker_cpu_ms_per_task",
        "redis_cpu_ms_per_task",
        "vendor_cpu_ms_per_task",
    )
    accounts = accounts or {}
    summary: dict[str, Any] = {
        name: {k: spread([x[k] for x in rs]) for k in keys} for name, rs in results.items()
    }
    for name, a in accounts.items():
        if name in summary:
            summary[name]["top_level_commands_per_task"] = a["top_level_commands_per_task"]
    ours = summary.get("asynctaskd")
    if not ours:
        return summary
    med = {k: ours[k]["median"] for k in keys}
    peers = {n: s for n, s in summary.items() if n != "asynctaskd"}
    ratios: dict[str, Any] = {}
    for name, s in peers.items():
        r = {
            "wall_speedup": s["wall_s"]["median"] / med["wall_s"],
            "worker_cpu_ratio": s["worker_cpu_ms_per_task"]["median"]
            / med["worker_cpu_ms_per_task"],
            "redis_cpu_ratio": s["redis_cpu_ms_per_task"]["median"] / med["redis_cpu_ms_per_task"],
            "all_commands_ratio": s["redis_commands_per_task"]["median"]
            / med["redis_commands_per_task"],
        }
        if "top_level_commands_per_task" in s and "top_level_commands_per_task" in ours:
            r["top_level_commands_ratio"] = (
                s["top_level_commands_per_task"] / ours["top_level_commands_per_task"]
            )
        ratios[name] = r
    if peers:
        best = min(peers, key=lambda n: peers[n]["wall_s"]["median"])
        ratios["best_peer"] = best
        ratios["speedup_vs_best_peer"] = ratios[best]["wall_speedup"]
    summary["ratios"] = ratios
    # Capacity bounds from the per-task costs: Redis is one thread, the daemon one process.
    summary["redis_cpu_bound_tasks_per_s"] = 1000 / med["redis_cpu_ms_per_task"]
    summary["daemon_cpu_bound_tasks_per_s"] = 1000 / med["worker_cpu_ms_per_task"]
    if ceiling.get("evalsha_per_s"):
        # Redis time of one task, in claim-shaped EVALSHAs at the measured ceiling.
        summary["task_cost_in_ceiling_evalsha"] = (
            med["redis_cpu_ms_per_task"] / 1000 * ceiling["evalsha_per_s"]
        )
    return summary


def report(out: dict[str, Any]) -> None:
    s = out["summary"]
    rows = []
    for name, fig in s.items():
        if name in ("ratios",) or not isinstance(fig, dict) or "wall_s" not in fig:
            continue
        wall = fig["wall_s"]
        rows.append(
            [
                name,
                f"{wall['median']:.2f} ({wall['min']:.2f}-{wall['max']:.2f})",
                fig["redis_commands_per_task"]["median"],
                out["accounting"].get(name, {}).get("top_level_commands_per_task", float("nan")),
                fig["worker_cpu_ms_per_task"]["median"],
                fig["redis_cpu_ms_per_task"]["median"],
                fig["vendor_cpu_ms_per_task"]["median"],
            ]
        )
    say(
        table(
            f"W2 poll-shaped: {out['tasks']} tasks x {POLLS} polls every {POLL_S * 1000:.0f} ms "
            f"(ideal {IDEAL_S:.1f} s), median of {out['runs']} (min-max)",
            [
                "subject",
                "wall s",
                "cmds/task (incl. Lua)",
                "top-level cmds/task",
                "worker cpu ms/task",
                "redis cpu ms/task",
                "vendor cpu ms/task",
            ],
            rows,
        )
    )
    ratios = s.get("ratios") or {}
    for name, r in ratios.items():
        if isinstance(r, dict):
            top = r.get("top_level_commands_ratio")
            say(
                f"  {name:<9}/ asynctaskd: wall {r['wall_speedup']:.2f}x, worker CPU "
                f"{r['worker_cpu_ratio']:.2f}x, Redis CPU {r['redis_cpu_ratio']:.2f}x, "
                f"commands incl. Lua {r['all_commands_ratio']:.2f}x"
                + (f", top-level commands {top:.1f}x" if top else "")
            )
    if "speedup_vs_best_peer" in ratios:
        say(
            f"  asynctaskd vs best peer ({ratios['best_peer']}): "
            f"{ratios['speedup_vs_best_peer']:.2f}x faster (target >= 3x)"
        )
    if "daemon_cpu_bound_tasks_per_s" in s:
        extra = ""
        if "task_cost_in_ceiling_evalsha" in s:
            extra = (
                f"; one task costs Redis {s['task_cost_in_ceiling_evalsha']:.1f} "
                f"claim-shaped EVALSHAs of the {out['ceiling']['evalsha_per_s']:,.0f}/s "
                "ceiling"
            )
        say(
            f"  bounds: daemon CPU -> {s['daemon_cpu_bound_tasks_per_s']:,.0f} tasks/s per "
            f"core, Redis CPU -> {s['redis_cpu_bound_tasks_per_s']:,.0f} tasks/s{extra}"
        )
    if out.get("profile"):
        say(f"  daemon profile ({out['profile']['samples']} samples), top self time:")
        for fn, pct in out["profile"]["self"][:12]:
            say(f"    {pct:5.1f}%  {fn}")
    say(f"  all tasks SUCCEEDED, each submitted once: {out['ok']}")
    say(f"  machine: {machine_line(out['machine'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--peers", default=",".join(PEERS), help="comma list; '' for none")
    parser.add_argument("--profile", type=Path, help="py-spy raw output for the daemon (run 1)")
    parser.add_argument(
        "--account-tasks",
        type=int,
        default=500,
        help="tasks in the MONITOR accounting pass (0: skip it)",
    )
    parser.add_argument("--http-floor-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.http_floor_child:
        client, url, n, conc = args.http_floor_child
        print(json.dumps(arun(_floor_child(client, url, int(n), int(conc)))))  # noqa: T201
        return 0
    peers = [p for p in args.peers.split(",") if p]
    out = run(args.tasks, args.runs, peers, args.profile, account_tasks=args.account_tasks)
    report(out)
    emit("w2_poll", out)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
