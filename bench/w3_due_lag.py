"""W3: 10,000 tasks in flight, polled every 1 s by one daemon: due lag and daemon CPU.

One redis-server, the fake vendor in its own process (instant answers, polls_to_done so
large that no job ends in the window), one daemon as `python -m asynctaskd run --config`
(retry.poll_interval = 1s, max_inflight 2000, batch_size 100 (the default), metrics on a
free port).
The 10,000 tasks are created in pipelined batches, all due at once; the daemon submits
them all, then polls each every second. Once every task is submitted and has been polled
(warm-up), a window of `--window` seconds (60 FULL, 15 quick) is measured:

* due lag p50/p99 from the daemon's own `asynctaskd_due_lag_seconds{phase="query"}`
  histogram, scraped from /metrics at both ends of the window and subtracted (so only
  claims in the window count), interpolated inside buckets as Prometheus'
  histogram_quantile does (bucket edges: 1, 5, 10, 25, 50, 100, 250 ms, ...);
* due lag max from a sampler: every 50 ms the harness reads the oldest due-but-unclaimed
  query task (heads of due:query and ready:query) and its age; the max over samples is a
  lower bound of the true max, the p99 over samples the backlog most of the time;
* polls/s in the window (claimed_total{phase="query"} delta) against the 10,000/s needed;
* daemon CPU (/proc) and Redis CPU over the window.

Checks: every task submitted exactly once (vendor /_log), none ended or failed, and every
job's poll count grew during the window.

    python bench/w3_due_lag.py [--tasks 10000] [--window 15] [--profile out.txt]
Prints a table, then one JSON line {"bench": "w3_due_lag", ...}.
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asynctaskd.codec import encode_json
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.store import Store, open_redis
from bench import (
    Daemon,
    Profiler,
    arun,
    daemon_config,
    emit,
    machine,
    machine_line,
    metrics_port,
    percentile,
    proc_cpu,
    profile_summary,
    redis_ceiling,
    redis_cpu,
    redis_server,
    say,
    table,
    workdir,
)

PRIO_SPAN = 2**42
_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\}\s+(\S+)$")


def scrape(port: int) -> dict[str, Any]:
    """The query-phase due-lag histogram (cumulative bucket counts) and claimed total."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    buckets: dict[float, float] = {}
    out: dict[str, Any] = {"count": 0.0, "sum": 0.0, "claimed": 0.0}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m[1], m[2], float(m[3])
        if 'phase="query"' not in labels:
            continue
        if name == "asynctaskd_due_lag_seconds_bucket":
            le = re.search(r'le="([^"]+)"', labels)
            assert le is not None
            buckets[float(le[1])] = value
        elif name == "asynctaskd_due_lag_seconds_count":
            out["count"] = value
        elif name == "asynctaskd_due_lag_seconds_sum":
            out["sum"] = value
        elif name == "asynctaskd_claimed_total":
            out["claimed"] = value
    out["buckets"] = dict(sorted(buckets.items()))
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus-style: linear inside the bucket holding rank q*count; inf bucket -> its
    lower edge (the largest finite bound)."""
    edges = sorted(buckets)
    total = buckets[edges[-1]] if edges else 0
    if total <= 0:
        return float("nan")
    rank = q * total
    prev_edge, prev_count = 0.0, 0.0
    for edge in edges:
        count = buckets[edge]
        if count >= rank:
            if edge == float("inf"):
                return prev_edge
            width = count - prev_count
            return prev_edge + (edge - prev_edge) * ((rank - prev_count) / width if width else 1)
        prev_edge, prev_count = edge, count
    return prev_edge


def bucket_of(q: float, buckets: dict[float, float]) -> str:
    """The bucket (lo, hi] in seconds that holds quantile q: the histogram's resolution."""
    edges = sorted(buckets)
    total = buckets[edges[-1]] if edges else 0
    lo = 0.0
    for edge in edges:
        if total and buckets[edge] >= q * total:
            return f"({lo:g}, {edge:g}]"
        lo = edge
    return "n/a"


class Sampler(threading.Thread):
    """Age of the oldest due-but-unclaimed query task, every `interval` seconds."""

    def __init__(self, url: str, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        from redis import Redis

        self.redis = Redis.from_url(url)
        self.keys = Keys()
        self.interval = interval
        self.samples: list[float] = []
        self.ready_depth: list[int] = []
        self._halt = threading.Event()

    def run(self) -> None:
        due, ready = self.keys.scheduled(0, "query"), self.keys.ready(0, "query")
        while not self._halt.is_set():
            pipe = self.redis.pipeline(transaction=False)
            pipe.time()
            pipe.zrange(due, 0, 0, withscores=True)
            pipe.zrange(ready, 0, 0, withscores=True)
            pipe.zcard(ready)
            (sec, usec), head_due, head_ready, depth = pipe.execute()
            now_ms = sec * 1000 + usec / 1000
            oldest = now_ms
            if head_due and head_due[0][1] <= now_ms:
                oldest = min(oldest, head_due[0][1])
            if head_ready:
                oldest = min(oldest, head_ready[0][1] % PRIO_SPAN)
            self.samples.append(max(0.0, (now_ms - oldest) / 1000))
            self.ready_depth.append(int(depth))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        self.redis.close()


async def create_tasks(url: str, n: int) -> list[str]:
    redis = open_redis(url)
    store = Store(redis, Keys())
    await store.prepare()
    ids = [new_task_id() for _ in range(n)]
    calls = [
        store.ops.create(tid, "demo", encode_json({"i": i}), timeout_ms=3_600_000)
        for i, tid in enumerate(ids)
    ]
    for s in range(0, n, 1000):
        for r in await store.run_many(calls[s : s + 1000]):
            if isinstance(r, Exception):
                raise r
    await redis.aclose()
    return ids


def redis_breakdown(before: dict[str, Any], after: dict[str, Any], polls: float) -> dict[str, Any]:
    """Per poll, from INFO commandstats: script calls and their server time, the commands
    run inside Lua and theirs; the difference is Lua interpreter and reply building."""

    def delta(name: str, field: str) -> float:
        return float(after.get(name, {}).get(field, 0)) - float(before.get(name, {}).get(field, 0))

    names = (set(before) | set(after)) - {"cmdstat_info"}
    scripts = ("cmdstat_evalsha", "cmdstat_eval")
    top = {n.removeprefix("cmdstat_"): (delta(n, "calls"), delta(n, "usec")) for n in names}
    script_calls = sum(delta(n, "calls") for n in scripts)
    script_us = sum(delta(n, "usec") for n in scripts)
    # Inside scripts or not cannot be told apart here; the daemon's only other commands
    # in a window are BLPOP (wake-ups), the heartbeat and the reaper's reads: small.
    other = {k: v for k, v in top.items() if f"cmdstat_{k}" not in scripts and v[0] > 0}
    other_us = sum(us for _, us in other.values())
    return {
        "script_calls": script_calls / polls,
        "script_us": script_us / polls,
        "other_commands": sum(c for c, _ in other.values()) / polls,
        "other_us": other_us / polls,
        "lua_and_reply_us": (script_us - other_us) / polls,
        "by_time": {
            k: {"calls": round(c / polls, 2), "us": round(us / polls, 1)}
            for k, (c, us) in sorted(other.items(), key=lambda kv: -kv[1][1])[:10]
        },
    }


def run(
    tasks: int = 10_000,
    window: float = 15.0,
    warmup_timeout: float = 120.0,
    profile: Path | None = None,
    ceiling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from redis import Redis

    with (
        redis_server() as server,
        workdir("bench-w3-") as tmp,
        FakeVendorProcess.start(Behaviour(polls_to_done=1_000_000)) as vendor,
    ):
        m = machine(server.port)
        if ceiling is None:
            ceiling = redis_ceiling(server.port)
        sync = Redis.from_url(server.url)
        sync.flushdb()
        port = metrics_port()
        config = daemon_config(
            tmp / "w3.toml",
            server.url,
            vendor.url,
            poll_interval="1s",
            max_inflight=2000,
            metrics_port=port,
        )
        tracking = [Keys().index(0, s) for s in (Status.SUBMITTED, Status.RUNNING)]
        with Daemon(config, server.url) as daemon:
            t_start = time.monotonic()
            ids = arun(create_tasks(server.url, tasks))
            # Warm-up: every task submitted, then one more poll interval plus a margin.
            deadline = time.monotonic() + warmup_timeout
            while True:
                c = [int(sync.zcard(k)) for k in tracking]
                tracked = sum(c)
                if tracked >= tasks:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"warm-up: only {tracked} of {tasks} submitted: {c}")
                time.sleep(0.1)
            submit_s = time.monotonic() - t_start
            time.sleep(2.0)
            jobs0 = {j["id"]: j["polls"] for j in vendor.jobs()}
            profiler = Profiler(daemon.pid, profile) if profile else None
            h0 = scrape(port)
            st0 = sync.info("commandstats")
            cpu0, rcpu0, vcpu0 = proc_cpu(daemon.pid), redis_cpu(sync), proc_cpu(vendor.process.pid)
            sampler = Sampler(server.url)
            t0 = time.monotonic()
            sampler.start()
            time.sleep(window)
            sampler.stop()
            wall = time.monotonic() - t0
            h1 = scrape(port)
            st1 = sync.info("commandstats")
            cpu1, rcpu1, vcpu1 = proc_cpu(daemon.pid), redis_cpu(sync), proc_cpu(vendor.process.pid)
            if profiler:
                profiler.stop()
            load = machine()["loadavg"]
            jobs1 = vendor.jobs()
            log = vendor.submit_log()
            final = {s.value: int(sync.zcard(Keys().index(0, s))) for s in Status}
        sync.close()
    buckets = {le: h1["buckets"].get(le, 0) - h0["buckets"].get(le, 0) for le in h1["buckets"]}
    claims = h1["count"] - h0["count"]
    polls = h1["claimed"] - h0["claimed"]
    cpu = cpu1 - cpu0
    per_ref = Counter(e["ref"] for e in log)
    grew = [j["polls"] - jobs0.get(j["id"], 0) for j in jobs1]
    submitted_once = (
        Counter(e["outcome"] for e in log) == Counter({"created": tasks})
        and set(per_ref) == set(ids)
        and max(per_ref.values()) == 1
    )
    statuses = {k: v for k, v in final.items() if "@" not in k and v}
    none_ended = set(statuses) <= {"SUBMITTED", "RUNNING", "SUBMITTING"}
    result: dict[str, Any] = {
        "machine": m,
        "loadavg_after": load,
        "ceiling": ceiling,
        "tasks": tasks,
        "window_s": wall,
        "submit_phase_s": submit_s,
        "due_lag_source": "p50/p99: daemon histogram asynctaskd_due_lag_seconds{phase=query} "
        "delta over the window (bucket-interpolated); max: 50 ms sampler of the oldest "
        "due-but-unclaimed query task",
        "due_lag_p50_s": histogram_quantile(0.50, buckets),
        "due_lag_p99_s": histogram_quantile(0.99, buckets),
        "due_lag_p50_bucket": bucket_of(0.50, buckets),
        "due_lag_p99_bucket": bucket_of(0.99, buckets),
        "due_lag_mean_s": (h1["sum"] - h0["sum"]) / claims if claims else float("nan"),
        "due_lag_max_sampled_s": max(sampler.samples, default=float("nan")),
        "oldest_unclaimed_p50_s": percentile(sampler.samples, 50),
        "oldest_unclaimed_p99_s": percentile(sampler.samples, 99),
        "ready_depth_max": max(sampler.ready_depth, default=0),
        "samples": len(sampler.samples),
        "histogram_window": buckets,
        "polls_per_s": polls / wall,
        "polls_needed_per_s": tasks / 1.0,
        "daemon_cpu_util": cpu / wall,
        "daemon_cpu_ms_per_poll": cpu * 1000 / polls if polls else float("nan"),
        "redis_cpu_util": (rcpu1 - rcpu0) / wall,
        "redis_cpu_ms_per_poll": (rcpu1 - rcpu0) * 1000 / polls if polls else float("nan"),
        "vendor_cpu_util": (vcpu1 - vcpu0) / wall,
        "polls_per_job_in_window": {"min": min(grew, default=0), "max": max(grew, default=0)},
        "statuses_after": statuses,
        "submitted_once": submitted_once,
        # Correctness only: a job not polled in the window is a figure (backlog), not a bug.
        "ok": submitted_once and none_ended,
    }
    if polls:
        result["redis_per_poll"] = redis_breakdown(st0, st1, polls)
    if ceiling.get("evalsha_per_s") and polls:
        result["redis_bound_polls_per_s"] = 1000 / result["redis_cpu_ms_per_poll"]
        result["poll_cost_in_ceiling_evalsha"] = (
            result["redis_cpu_ms_per_poll"] / 1000 * ceiling["evalsha_per_s"]
        )
    if profile:
        result["profile"] = profile_summary(profile)
    return result


def report(r: dict[str, Any]) -> None:
    ms = 1000
    rows = [
        [
            "due lag p50 (histogram)",
            r["due_lag_p50_s"] * ms,
            "ms",
            f"bucket {r['due_lag_p50_bucket']} s",
        ],
        [
            "due lag p99 (histogram)",
            r["due_lag_p99_s"] * ms,
            "ms",
            f"target < 100 ms; bucket {r['due_lag_p99_bucket']} s",
        ],
        ["due lag mean (histogram)", r["due_lag_mean_s"] * ms, "ms", ""],
        ["due lag max (sampled)", r["due_lag_max_sampled_s"] * ms, "ms", ""],
        ["oldest unclaimed p99 (sampled)", r["oldest_unclaimed_p99_s"] * ms, "ms", ""],
        ["polls/s achieved", r["polls_per_s"], "/s", f"{r['polls_needed_per_s']:,.0f} needed"],
        ["daemon CPU", r["daemon_cpu_util"] * 100, "% of a core", ""],
        ["daemon CPU per poll", r["daemon_cpu_ms_per_poll"], "ms", ""],
        ["Redis CPU", r["redis_cpu_util"] * 100, "% of a core", ""],
        ["vendor CPU", r["vendor_cpu_util"] * 100, "% of a core", ""],
    ]
    if "redis_bound_polls_per_s" in r:
        rows.append(
            [
                "Redis-bound polls/s",
                r["redis_bound_polls_per_s"],
                "/s",
                f"{r['poll_cost_in_ceiling_evalsha']:.1f} ceiling EVALSHA per poll",
            ]
        )
    say(
        table(
            f"W3 due lag: {r['tasks']:,} tasks polled every 1 s, window {r['window_s']:.0f} s "
            f"(submit phase took {r['submit_phase_s']:.1f} s)",
            ["figure", "value", "unit", "target / note"],
            rows,
        )
    )
    if "redis_per_poll" in r:
        b = r["redis_per_poll"]
        top = ", ".join(
            f"{k} {v['calls']:.1f}x {v['us']:.1f} us" for k, v in list(b["by_time"].items())[:6]
        )
        say(
            f"  Redis per poll: {b['script_calls']:.2f} script calls, {b['script_us']:.0f} us = "
            f"{b['other_commands']:.1f} commands in {b['other_us']:.0f} us + "
            f"{b['lua_and_reply_us']:.0f} us Lua and reply; by time: {top}"
        )
    if r.get("profile"):
        say(f"  daemon profile ({r['profile']['samples']} samples), top self time:")
        for fn, pct in r["profile"]["self"][:12]:
            say(f"    {pct:5.1f}%  {fn}")
    say(
        f"  checks: submitted once {r['submitted_once']}, statuses {r['statuses_after']}, "
        f"polls per job in window {r['polls_per_job_in_window']}: ok={r['ok']}"
    )
    say(f"  machine: {machine_line(r['machine'])}; load after {r['loadavg_after']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--window", type=float, default=15.0, help="seconds (FULL: 60)")
    parser.add_argument("--profile", type=Path, help="py-spy raw output for the daemon")
    args = parser.parse_args(argv)
    r = run(args.tasks, args.window, profile=args.profile)
    report(r)
    emit("w3_due_lag", r)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
