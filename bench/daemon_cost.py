"""The daemon's CPU per task, counted in instructions: deterministic on a noisy host.

The companion of bench/script_cost.py for the daemon's side. A Worker runs in a child
process under valgrind's callgrind, with the demo handler calling the fake vendor over
HTTP through the shared client (`make_http_client`), against a private redis-server;
the vendor and Redis run outside valgrind. Each task is submitted once and polled until
done on poll `--polls`, with a 1 ms poll interval and at most 100 calls in flight.
Counting starts when the worker starts and stops when it is idle, so what is counted
is the daemon's own work per task: claims, saves, HTTP exchanges, scheduling, metrics.

Instructions are not time (a syscall's kernel work is not counted, and an instruction
may take a cycle or a hundred), but the same code and inputs give the same count to
within ~0.5% whatever else the machine does, so a change of 1% shows.

    python bench/daemon_cost.py [--tasks 600] [--polls 3]
Prints a table, then one JSON line {"bench": "daemon_cost", ...}. Needs valgrind;
~1 minute for 600 tasks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.embedded import ServerProcess, find_binary
from bench import create_tasks, emit, machine, machine_line, run_child, say, table, workdir


async def _worker(redis_url: str, vendor_url: str, tasks: int) -> dict[str, Any]:
    """Child side (under valgrind): create the tasks, count the worker's run."""
    from asynctaskd.config import parse_config
    from asynctaskd.daemon import tune_gc
    from asynctaskd.devtools.demo import DemoHandler
    from asynctaskd.handlers import HandlerEntry
    from asynctaskd.keys import Keys, new_task_id
    from asynctaskd.store import Store, open_redis
    from asynctaskd.transport import make_http_client
    from asynctaskd.worker import Worker

    redis = open_redis(redis_url)
    store = Store(redis, Keys())
    await store.prepare()
    ids = [new_task_id() for _ in range(tasks)]
    await create_tasks(store, ids, "demo", b'{"n":1}')
    config = parse_config(
        '[worker]\nmax_inflight = 100\nlease = "30s"\n[retry]\npoll_interval = "1ms"\n'
    )
    handler = DemoHandler("demo", vendor_url)
    entries = {"demo": HandlerEntry(key="demo", handler=handler, provider="demo")}
    tune_gc()  # as `asynctaskd run` does once it is set up
    http = make_http_client()
    worker = Worker(store, entries, config, http=http)
    _callgrind("--zero")
    await worker.run_until_idle()
    _callgrind("--dump")
    await http.aclose()
    statuses: dict[str, int] = {}
    for tid in ids:
        task = await store.get(tid)
        key = task.status.value if task is not None else "missing"
        statuses[key] = statuses.get(key, 0) + 1
    await redis.aclose()
    return {"statuses": statuses}


def _callgrind(flag: str) -> None:
    subprocess.run(
        ["callgrind_control", flag, str(os.getpid())],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _child(redis_url: str, vendor_url: str, tasks: int) -> int:
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        out = runner.run(_worker(redis_url, vendor_url, tasks))
    print(json.dumps(out), flush=True)  # noqa: T201 - read by the parent
    return 0


def run(tasks: int = 600, polls: int = 3) -> dict[str, Any]:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind not found: install it (Debian: apt install valgrind)")
    binary = find_binary(os.environ.get("BENCH_REDIS_SERVER", "redis-server"))
    if binary is None:
        raise SystemExit("redis-server not found (set BENCH_REDIS_SERVER)")
    with (
        workdir("bench-daemon-cost-") as tmp,
        ServerProcess(binary) as server,
        FakeVendorProcess.start(Behaviour(polls_to_done=polls)) as vendor,
    ):
        m = machine(server.port)
        out = tmp / "callgrind.out"
        child, proc = run_child(
            [str(Path(__file__).resolve()), "--child", server.url, vendor.url, str(tasks)],
            timeout=900,
            prefix=["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p"],
        )
        if proc.returncode != 0 or child is None:
            raise RuntimeError(f"the counted worker failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
        dumps = [p for p in tmp.glob("callgrind.out.*.*") if p.suffix[1:].isdigit()]
        if len(dumps) != 1:
            raise RuntimeError(f"expected one callgrind dump, found {dumps}")
        total = next(
            int(line.split()[1])
            for line in dumps[0].read_text().splitlines()
            if line.startswith(("summary:", "totals:"))
        )
        log = vendor.submit_log()
        jobs = vendor.jobs()
    calls = tasks * (1 + polls)
    ok = (
        child["statuses"] == {"SUCCEEDED": tasks}
        and len(log) == tasks
        and all(entry["outcome"] == "created" for entry in log)
        and all(job["polls"] == polls for job in jobs)
    )
    per_task = total / tasks
    say(
        table(
            f"Daemon instructions ({tasks} tasks, a submit and {polls} polls each, callgrind)",
            ["figure", "value"],
            [
                ("per task", f"{per_task:,.0f}"),
                ("per vendor call", f"{total / calls:,.0f}"),
                ("all SUCCEEDED, each submitted once", str(ok)),
            ],
        )
    )
    say(f"  machine: {machine_line(m)}")
    return {
        "machine": m,
        "tasks": tasks,
        "polls": polls,
        "instructions_per_task": round(per_task),
        "instructions_per_call": round(total / calls),
        "ok": ok,
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--child"]:
        return _child(args[1], args[2], int(args[3]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=600)
    parser.add_argument("--polls", type=int, default=3)
    parsed = parser.parse_args(args)
    result = run(parsed.tasks, parsed.polls)
    emit("daemon_cost", result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
