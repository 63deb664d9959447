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

`--floor` also counts bench/poll_floor.py's floor of a poll on the same workload (the
fewest lines over the same libraries, nothing checked), each in a child of its own, and
`--parts fetch,codec` the floor again with each of the daemon's parts in it: what the
daemon pays over the floor, and what each part costs of that.

    python bench/daemon_cost.py [--tasks 600] [--polls 3] [--floor [--parts fetch,codec]]
Prints a table, then one JSON line {"bench": "daemon_cost", ...}. Needs valgrind;
~1 minute for 600 tasks, ~20 s more for the floor and for each part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.embedded import ServerProcess, find_binary
from bench import create_tasks, emit, machine, machine_line, run_child, say, table, workdir
from bench.poll_floor import PARTS, prepare_floor


async def prepare_worker(
    redis_url: str, vendor_url: str, tasks: int
) -> tuple[Any, Callable[[], Awaitable[dict[str, int]]]]:
    """The counted Worker, ready to run: `tasks` tasks created, the demo handler calling the
    fake vendor through the shared client, 100 calls in flight, a 1 ms poll interval, the
    garbage collector tuned as `asynctaskd run` tunes it. Returns it and what to await once
    it ran: it closes the clients and returns how many tasks ended in each status."""
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

    async def finish() -> dict[str, int]:
        await http.aclose()
        statuses: dict[str, int] = {}
        for tid in ids:
            task = await store.get(tid)
            key = task.status.value if task is not None else "missing"
            statuses[key] = statuses.get(key, 0) + 1
        await redis.aclose()
        return statuses

    return worker, finish


async def _worker(redis_url: str, vendor_url: str, tasks: int) -> dict[str, Any]:
    """Child side (under valgrind): create the tasks, count the worker's run."""
    worker, finish = await prepare_worker(redis_url, vendor_url, tasks)
    _callgrind("--zero")
    await worker.run_until_idle()
    _callgrind("--dump")
    return {"statuses": await finish()}


def _callgrind(flag: str) -> None:
    subprocess.run(
        ["callgrind_control", flag, str(os.getpid())],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def _floor(
    redis_url: str, vendor_url: str, tasks: int, parts: frozenset[str]
) -> dict[str, Any]:
    """Child side of `--floor`: bench/poll_floor.py's daemon of the fewest lines, counted."""
    floor = await prepare_floor(redis_url, vendor_url, tasks, parts)
    _callgrind("--zero")
    await floor.run(tasks)
    _callgrind("--dump")
    return {"statuses": {"SUCCEEDED": floor.done}, "claims": floor.claims}


def _child(redis_url: str, vendor_url: str, tasks: int, floor: str | None = None) -> int:
    """`floor`: None counts the Worker, else the floor with these parts (comma list)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        if floor is None:
            out = runner.run(_worker(redis_url, vendor_url, tasks))
        else:
            parts = frozenset(filter(None, floor.split(",")))
            out = runner.run(_floor(redis_url, vendor_url, tasks, parts))
    print(json.dumps(out), flush=True)  # noqa: T201 - read by the parent
    return 0


def _count(
    binary: str, tasks: int, polls: int, floor: str | None
) -> tuple[int, bool, dict[str, Any]]:
    """One counted child (the Worker, or the floor with the parts `floor` lists) on its own
    Redis and vendor: its instructions, whether every task SUCCEEDED after one submit and
    `polls` polls, and the machine line."""
    with (
        workdir("bench-daemon-cost-") as tmp,
        ServerProcess(binary) as server,
        FakeVendorProcess.start(Behaviour(polls_to_done=polls)) as vendor,
    ):
        m = machine(server.port)
        out = tmp / "callgrind.out"
        argv = [str(Path(__file__).resolve()), "--child", server.url, vendor.url, str(tasks)]
        child, proc = run_child(
            [*argv, *(["--floor", floor] if floor is not None else [])],
            timeout=900,
            prefix=["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p"],
        )
        if proc.returncode != 0 or child is None:
            raise RuntimeError(f"the counted child failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
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
    ok = (
        child["statuses"] == {"SUCCEEDED": tasks}
        and len(log) == tasks
        and all(entry["outcome"] == "created" for entry in log)
        and all(job["polls"] == polls for job in jobs)
    )
    return total, ok, m


def run(
    tasks: int = 600, polls: int = 3, floor: bool = False, parts: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Count the Worker; with `floor`, bench/poll_floor.py's workload too, bare and then
    with each of `parts` (the daemon's own HTTP client, its codec) swapped in."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind not found: install it (Debian: apt install valgrind)")
    binary = find_binary(os.environ.get("BENCH_REDIS_SERVER", "redis-server"))
    if binary is None:
        raise SystemExit("redis-server not found (set BENCH_REDIS_SERVER)")
    total, ok, m = _count(binary, tasks, polls, floor=None)
    calls = tasks * (1 + polls)
    rows = [
        ("per task", f"{total / tasks:,.0f}"),
        ("per vendor call", f"{total / calls:,.0f}"),
        ("all SUCCEEDED, each submitted once", str(ok)),
    ]
    result: dict[str, Any] = {
        "machine": m,
        "tasks": tasks,
        "polls": polls,
        "instructions_per_task": round(total / tasks),
        "instructions_per_call": round(total / calls),
    }
    if floor:
        floor_total, floor_ok, _ = _count(binary, tasks, polls, floor="")
        ok = ok and floor_ok
        rows += [
            ("floor per task (bench/poll_floor.py)", f"{floor_total / tasks:,.0f}"),
            ("floor per vendor call", f"{floor_total / calls:,.0f}"),
            ("daemon / floor", f"{total / floor_total:.2f}x"),
            ("floor: all SUCCEEDED, each submitted once", str(floor_ok)),
        ]
        result["floor_per_task"] = round(floor_total / tasks)
        result["floor_per_call"] = round(floor_total / calls)
        for part in parts:
            part_total, part_ok, _ = _count(binary, tasks, polls, floor=part)
            ok = ok and part_ok
            rows += [
                (f"floor with the daemon's {part}: per task", f"{part_total / tasks:,.0f}"),
                (f"  its {part} per task", f"{(part_total - floor_total) / tasks:,.0f}"),
                ("  all SUCCEEDED, each submitted once", str(part_ok)),
            ]
            result[f"floor_{part}_per_task"] = round(part_total / tasks)
    say(
        table(
            f"Daemon instructions ({tasks} tasks, a submit and {polls} polls each, callgrind)",
            ["figure", "value"],
            rows,
        )
    )
    say(f"  machine: {machine_line(m)}")
    result["ok"] = ok
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--child"]:
        floor = args[5] if args[4:5] == ["--floor"] else None
        return _child(args[1], args[2], int(args[3]), floor=floor)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=600)
    parser.add_argument("--polls", type=int, default=3)
    parser.add_argument(
        "--floor", action="store_true", help="count bench/poll_floor.py's workload too"
    )
    parser.add_argument(
        "--parts",
        default="",
        help="with --floor, count the floor again with each of these daemon parts in it "
        "(comma list: fetch, codec)",
    )
    parsed = parser.parse_args(args)
    parts = tuple(filter(None, parsed.parts.split(",")))
    if unknown := set(parts) - PARTS:
        parser.error(f"unknown parts {sorted(unknown)}: choose from {sorted(PARTS)}")
    result = run(parsed.tasks, parsed.polls, floor=parsed.floor or bool(parts), parts=parts)
    emit("daemon_cost", result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
