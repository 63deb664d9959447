"""Redis CPU per script operation, counted in instructions: deterministic on a noisy host.

Wall and CPU times on a shared 2-core VM move by 30% between identical runs, too much to
see a change of a few percent in what the scripts cost Redis. This bench runs a private
redis-server under valgrind's callgrind, which counts the instructions the server
executes whatever else the machine does, and drives one task lifecycle per task through
the real scripts, with the calls of each step pipelined as the daemon sends them:

    create and claim (submit phase, 100 a call) in turn, as a daemon that keeps up takes
    new requests in, start, save SUBMITTED, then polls: claim
    (query phase, 100 a call) + save RUNNING, the first changing the status and the next
    keeping it, and a last claim + save SUCCEEDED; renew of 100 leases a call; and a
    submit claim of a backlog (all requests made before the first claim).

Then W1 as a daemon runs it (bench/lifecycle.py's workload: the tasks created up front,
then a Worker runs them, claims and saves batched as its timing makes them, polls due
1 ms later promoted from the due set): the create, and the rest of the lifecycle.

Each step's figure is the server's instructions over the step divided by its tasks, so a
claim's or renew's share of its batch is included (reading, parsing and answering the
pipeline too). Two reference rows show the floor: an EVALSHA of `return 1`, and one of
lua/_core.lua alone (what every script runs first: TIME and the helpers all use).
The same binary, inputs and scripts give the same counts to within a fraction of a
percent; a change to a script shows as a change of its rows.

Needs valgrind (callgrind_control comes with it) and runs ~2 minutes for 2,000 tasks.

    python bench/script_cost.py [--tasks 2000] [--server redis-server]
Prints a table, then one JSON line {"bench": "script_cost", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis.asyncio

from asynctaskd.embedded import ServerProcess, find_binary
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.scripts import load_scripts
from asynctaskd.store import Call, Claimed, Lease, Store
from bench import emit, machine, machine_line, say, table, workdir

CLAIM_BATCH = 100


class CallgrindServer(ServerProcess):
    """A redis-server under callgrind; `counted()` reads the instructions since the last."""

    def __init__(self, binary: Path, out: Path) -> None:
        super().__init__(binary)
        self.out = out

    def _argv(self) -> list[str]:
        return [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={self.out}.%p",
            *super()._argv(),
        ]

    def counted(self) -> int:
        """Instructions executed since the previous call (callgrind dumps and zeroes)."""
        assert self.process is not None
        before = set(self.out.parent.glob(f"{self.out.name}.*"))
        subprocess.run(
            ["callgrind_control", "--dump", str(self.process.pid)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        [dump] = set(self.out.parent.glob(f"{self.out.name}.*")) - before
        for line in dump.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
        raise RuntimeError(f"no totals in {dump}")


async def _lifecycle(server: CallgrindServer, tasks: int) -> list[tuple[str, int, int]]:
    """Drive `tasks` tasks through the scripts; (step, calls, instructions) per step."""
    client = redis.asyncio.Redis(port=server.port)
    store = Store(client, Keys())
    await store.prepare()
    ops = store.ops
    rows: list[tuple[str, int, int]] = []

    async def step(name: str, calls: list[Call[Any]]) -> list[Any]:
        server.counted()
        results: list[Any] = []
        for i in range(0, len(calls), 200):
            out, _, _ = await store.pipeline(calls[i : i + 200])
            results += out
        rows.append((name, len(calls), server.counted()))
        for r in results:
            if isinstance(r, Exception):
                raise r
        return results

    async def claim(name: str, phase: str, want: int = tasks) -> list[Claimed]:
        server.counted()
        got: list[Claimed] = []
        while len(got) < want:
            call = ops.claim(0, phase, CLAIM_BATCH, 60_000, "bench", 1000)  # type: ignore[arg-type]
            batch = await store.run(call)
            if not batch.claimed:
                raise RuntimeError(f"{name}: {len(got)} of {want} tasks claimed")
            got += batch.claimed
        rows.append((name, len(got), server.counted()))
        return got

    def creates(n: int) -> list[Call[Any]]:
        return [
            ops.create(new_task_id(), "demo", b'{"n":1}', timeout_ms=3_600_000) for _ in range(n)
        ]

    # A daemon keeping up: each submit claim takes in the requests made since the last one
    # (and claims them straight from the intake, lua/_intake.lua).
    got: list[Claimed] = []
    for _ in range(0, tasks, CLAIM_BATCH):
        await step("create", creates(CLAIM_BATCH))
        got += await claim("claim (submit phase)", "submit", CLAIM_BATCH)
    started = await step("start", [ops.start(c.lease, False) for c in got])
    leases = [
        Lease(c.lease.task_id, c.lease.fence, r.version) for c, r in zip(got, started, strict=True)
    ]
    handle: dict[str, str | bytes | int | float] = {
        "external_id": "job",
        "handle": '{"external_id":"job","query":{}}',
    }
    await step(
        "save SUBMITTED", [ops.save(lease, Status.SUBMITTED, fields=handle) for lease in leases]
    )
    for n, name in ((1, "save RUNNING (status changes)"), (2, "save RUNNING (same status)")):
        got = await claim("claim (query phase)", "query")
        if n == 2:
            renewed = [c.lease for c in got]
            batches = [renewed[i : i + CLAIM_BATCH] for i in range(0, tasks, CLAIM_BATCH)]
            await step("renew (100 leases a call)", [ops.renew(0, 60_000, b) for b in batches])
            rows[-1] = (rows[-1][0], tasks, rows[-1][2])  # per lease, not per call
        fields: dict[str, str | bytes | int | float] = {
            "poll_count": n,
            "progress": "0.5",
            "consecutive_errors": "",
        }
        await step(name, [ops.save(c.lease, Status.RUNNING, fields=fields) for c in got])
    got = await claim("claim (query phase)", "query")
    await step(
        "save SUCCEEDED",
        [ops.save(c.lease, Status.SUCCEEDED, fields={"result": '{"ok":1}'}) for c in got],
    )
    # A backlog: the requests of `tasks` creates wait before the first claim takes them in;
    # the tasks claimed go on to the lookups below
    await step("create", creates(tasks))
    got = await claim("claim (submit phase, backlog)", "submit")
    # parked tasks settled by asking the vendor (lua/lookup.lua, lua/reconcile.lua): a start
    # that records `find`, the park (a drain's release, 100 a call), the lookup's claim
    # (100 a call) and the reconcile of a job found
    started = await step("start (find)", [ops.start(c.lease, False, "t", 60_000) for c in got])
    leases = [
        Lease(c.lease.task_id, c.lease.fence, r.version) for c, r in zip(got, started, strict=True)
    ]
    batches = [leases[i : i + CLAIM_BATCH] for i in range(0, tasks, CLAIM_BATCH)]
    await step("release (parks, due for a lookup)", [ops.release(0, b) for b in batches])
    rows[-1] = (rows[-1][0], tasks, rows[-1][2])  # per task, not per call
    server.counted()
    looked: list[Claimed] = []
    while len(looked) < tasks:
        batch = await store.run(ops.lookup(0, CLAIM_BATCH, 60_000, "bench", ["demo"]))
        if not batch.claimed:
            raise RuntimeError(f"lookup: {len(looked)} of {tasks} tasks claimed")
        looked += batch.claimed
    rows.append(("lookup (100 a call)", len(looked), server.counted()))
    found = b'{"external_id":"job","query":{}}'
    await step(
        "reconcile (found)",
        [ops.reconcile(c.lease, "found", retry_ms=1000, max_lookups=20, give_up_ms=86_400_000,
                       external_id="job", handle_json=found) for c in looked],
    )  # fmt: skip
    # the floor: an EVALSHA that does nothing, and one that runs only what every script
    # runs first (the LEGAL constant and lua/_core.lua)
    scripts = load_scripts()
    core = scripts["quota"].source.split("-- script: ")[0]
    floor = (("EVALSHA of return 1", "return 1"), ("_core alone", core + "return 1"))
    for name, source in floor:
        sha = await client.script_load(source)
        server.counted()
        pipe = client.pipeline(transaction=False)
        for _ in range(tasks):
            pipe.evalsha(sha, 1, Keys().tag(0) + ":")
        await pipe.execute()
        rows.append((name, tasks, server.counted()))
    await client.aclose()
    return rows


async def _w1(server: CallgrindServer, tasks: int) -> list[tuple[str, int, int]]:
    """W1 as a daemon runs it: `tasks` tasks created up front, then a Worker (claims of 100,
    1,000 in flight, a 1 ms poll interval, bench/lifecycle.py's instant handler) runs them
    to SUCCEEDED. What the worker's own calls cost Redis per task, the create apart: its
    claims, starts and saves as it batches them, promotions of due polls included."""
    import httpx

    from bench import create_tasks
    from bench.lifecycle import w1_worker

    client = redis.asyncio.Redis(port=server.port)
    await client.flushdb()
    store = Store(client, Keys())
    await store.prepare()
    ids = [new_task_id() for _ in range(tasks)]
    server.counted()
    await create_tasks(store, ids, "instant")
    rows = [("W1 create (create_many, 1,000 a call)", tasks, server.counted())]
    async with httpx.AsyncClient() as http:
        worker, handler = w1_worker(store, http, lease="120s")  # a server under callgrind
        await worker.run_until_idle()
    rows.append(("W1 lifecycle after create (a Worker's calls)", tasks, server.counted()))
    if sorted(handler.submits) != sorted(ids) or max(handler.submits.values()) != 1:
        raise RuntimeError("W1: not every task was submitted exactly once")
    await client.aclose()
    return rows


def run(tasks: int = 2000, binary: str = "redis-server") -> dict[str, Any]:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind not found: install it (Debian: apt install valgrind)")
    found = find_binary(binary)
    if found is None:
        raise SystemExit(f"{binary} not found")
    with workdir("bench-cost-") as tmp:
        server = CallgrindServer(found, tmp / "callgrind.out")
        server.start(timeout=120)
        try:
            m = machine(server.port)
            rows = asyncio.run(_lifecycle(server, tasks))
            rows += asyncio.run(_w1(server, tasks))
        finally:
            server.stop()
    sums: dict[str, list[int]] = {}
    for name, calls, total in rows:  # a step run more than once (query claims): the mean
        sums.setdefault(name, [0, 0])
        sums[name][0] += calls
        sums[name][1] += total
    per_op = {name: round(total / calls) for name, (calls, total) in sums.items()}
    per_op["one lookup (claim share + reconcile)"] = (
        per_op["lookup (100 a call)"] + per_op["reconcile (found)"]
    )
    # one poll of a task in flight: its share of a query claim, then its save
    per_op["one poll (claim + save, same status)"] = (
        per_op["claim (query phase)"] + per_op["save RUNNING (same status)"]
    )
    per_op["W1 lifecycle, create included"] = (
        per_op["W1 create (create_many, 1,000 a call)"]
        + per_op["W1 lifecycle after create (a Worker's calls)"]
    )
    say(
        table(
            f"Redis instructions per operation ({found.name} under callgrind, {tasks} tasks)",
            ["operation", "instructions"],
            [(name, f"{n:,}") for name, n in per_op.items()],
        )
    )
    say(f"  machine: {machine_line(m)}")
    return {"machine": m, "tasks": tasks, "server": m.get("redis"), "instructions": per_op}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--server", default="redis-server", help="redis-server or valkey-server")
    args = parser.parse_args(argv)
    emit("script_cost", run(args.tasks, args.server))
    return 0


if __name__ == "__main__":
    sys.exit(main())
