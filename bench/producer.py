"""Producer: how fast one process creates tasks, asynctaskd against SAQ and arq.

One private redis-server, no daemon and no worker: creates wait in Redis. Each subject
runs in a child process of its own, after a warm-up of untimed calls, in alternating
order, `--rounds` times:

* `asynctaskd`: one coroutine awaiting `AsyncClient.submit` after the other (the default
  `strict=True`: the handler is registered live, as a running daemon would have it);
  `asynctaskd-32`: the same calls from 32 coroutines, each awaiting its own in turn;
* `saq` / `saq-32`: `await queue.enqueue(...)` (SAQ 0.26), `arq` / `arq-32`:
  `await pool.enqueue_job(...)` (arq 0.28), from the bench-only venv
  (bench/peers/setup.sh, or BENCH_VENV), bench/peers/{saq,arq}_w2.py `enqueue-seq`;
* `ping`: one coroutine awaiting redis-py's `PING` after the other (hiredis, RESP2): the
  floor of any call that waits for one round trip on this host;
* `create-floor`: the create's EVALSHA of a submit, built by `Ops.create` as a submit
  builds it, written on a bare asyncio protocol with hiredis parsing the reply, one after
  the other: what one awaited create costs with no client and no redis-py connection;
* `store-create`: the same creates run by `Store.run` (the store's lone-call path: its
  lane, asynctaskd.connection.lane): create-floor to store-create is the store's cost,
  store-create to asynctaskd the client's (its plan, checks and caches);
* `--compare TREE` adds `asynctaskd@base`, the sequential submit of another source tree
  (PYTHONPATH=TREE), interleaved with this one on the same server.

Reported per subject: calls/s, the child's process CPU per call, Redis commands per call
(INFO commandstats delta over the child's whole run, warm-up included; commands run
inside Lua scripts count, and EVALSHA apart), Redis CPU per call; for asynctaskd its
round trips per submit (the client's own count). Check: each asynctaskd run left one
request per submit in the shard's intake list. Then the ratios of asynctaskd's
sequential rate to SAQ's and arq's, per round and their median (target >= 2x SAQ).

    python bench/producer.py [--tasks 3000] [--rounds 3] [--subjects ...] [--compare TREE]
Prints a table, then one JSON line {"bench": "producer", ...}.
"""

from __future__ import annotations

import sys

_CHILD = sys.argv[1:2] == ["child"]  # an asynctaskd subject: imports the tree it was given


def _child_main(argv: list[str]) -> int:
    """`producer.py child --redis URL --tasks N --warmup W --concurrency C`: submits as
    one subject does, then prints one JSON line of figures."""
    import argparse
    import asyncio
    import json
    import time

    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", required=True)
    parser.add_argument("--tasks", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--ping", action="store_true", help="redis-py PINGs, not submits")
    parser.add_argument("--floor", action="store_true", help="bare creates, not submits")
    parser.add_argument("--store", action="store_true", help="with --floor: through Store.run")
    args = parser.parse_args(argv)

    async def floor() -> dict[str, float]:
        """The create's EVALSHA, built as a submit builds it, written on a bare asyncio
        protocol and its reply parsed by hiredis: no client, no redis-py connection."""
        from urllib.parse import urlparse

        import hiredis

        from asynctaskd.keys import Keys, new_task_id
        from asynctaskd.scripts import load_scripts
        from asynctaskd.store import Ops
        from asynctaskd.wire import pack

        class Lane(asyncio.Protocol):
            def __init__(self) -> None:
                self.reader = hiredis.Reader()
                self.waiter: asyncio.Future[Any] | None = None

            def connection_made(self, transport: Any) -> None:
                self.transport = transport

            def data_received(self, data: bytes) -> None:
                self.reader.feed(data)
                reply = self.reader.gets()
                if reply is not False and self.waiter is not None:
                    self.waiter.set_result(reply)

            async def call(self, payload: bytes) -> Any:
                self.waiter = asyncio.get_running_loop().create_future()
                self.transport.write(payload)
                return await self.waiter

        url = urlparse(args.redis)
        loop = asyncio.get_running_loop()
        transport, lane = await loop.create_connection(Lane, url.hostname, url.port)
        ops, sha = Ops(Keys("atd", 1)), load_scripts()["create"].sha
        store = None
        if args.store:  # the same creates, through the store's lone-call path instead
            from asynctaskd.store import Store, open_redis

            store = Store(open_redis(args.redis), Keys("atd", 1))

        async def create(i: int) -> None:
            call = ops.create(new_task_id(0), "demo", b'{"i":%d}' % i, timeout_ms=600_000)
            if store is not None:
                await store.run(call)
                return
            reply = await lane.call(pack(("EVALSHA", sha, len(call.keys), *call.keys, *call.args)))
            call.decode(reply)

        for i in range(args.warmup):
            await create(i)
        c0, t0 = time.process_time(), time.perf_counter()
        for i in range(args.tasks):
            await create(i)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        transport.close()
        if store is not None:
            await store.close()
            await store.redis.aclose()
        return {
            "wall_s": wall,
            "per_s": args.tasks / wall,
            "cpu_ms_per_job": cpu * 1000 / args.tasks,
        }

    async def pings() -> dict[str, float]:
        import redis.asyncio

        async with redis.asyncio.Redis.from_url(args.redis, protocol=2) as r:
            for _ in range(args.warmup):
                await r.ping()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(args.tasks):
                await r.ping()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {
            "wall_s": wall,
            "per_s": args.tasks / wall,
            "cpu_ms_per_job": cpu * 1000 / args.tasks,
        }

    async def main() -> dict[str, float]:
        if args.ping:
            return await pings()
        if args.floor:
            return await floor()
        from asynctaskd.client import AsyncClient

        async with AsyncClient.from_url(args.redis) as client:

            async def run(start: int, count: int) -> None:
                for i in range(start, start + count):
                    await client.submit("demo", {"i": i}, tracking_timeout=600)

            await run(0, args.warmup)
            trips = client._store.round_trips  # the store's count of round trips by name
            before = sum(trips.values())
            share = -(-args.tasks // args.concurrency)
            starts = range(args.warmup, args.warmup + args.tasks, share)
            c0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(
                *(run(s, min(share, args.warmup + args.tasks - s)) for s in starts)
            )
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            return {
                "wall_s": wall,
                "per_s": args.tasks / wall,
                "cpu_ms_per_job": cpu * 1000 / args.tasks,
                "round_trips_per_job": (sum(trips.values()) - before) / args.tasks,
            }

    try:
        import uvloop
    except ImportError:
        out = asyncio.run(main())
    else:
        out = uvloop.run(main())
    print(json.dumps(out), flush=True)  # noqa: T201
    return 0


if _CHILD and __name__ == "__main__":
    raise SystemExit(_child_main(sys.argv[2:]))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import (  # noqa: E402
    ROOT,
    commands_delta,
    commandstats,
    emit,
    loadavg,
    machine,
    machine_line,
    peer_python,
    redis_cpu,
    redis_server,
    say,
    spread,
    table,
)

CONCURRENT = 32
# subject -> (runner, concurrency); runner "asynctaskd", "base" (--compare), or a peer file
SUBJECTS: dict[str, tuple[str, int]] = {
    "asynctaskd": ("asynctaskd", 1),
    "asynctaskd-32": ("asynctaskd", CONCURRENT),
    "saq": ("saq_w2.py", 1),
    "arq": ("arq_w2.py", 1),
    "saq-32": ("saq_w2.py", CONCURRENT),
    "arq-32": ("arq_w2.py", CONCURRENT),
    "ping": ("ping", 1),
    "create-floor": ("floor", 1),
    "store-create": ("store", 1),
}
BASE = "asynctaskd@base"


def prepare_asynctaskd(sync: Any) -> None:
    """What a running daemon leaves behind: the scripts loaded, the deployment record, the
    demo handler registered live (for an hour), so that the default strict submit works."""
    from asynctaskd.keys import PROTOCOL_VERSION, Keys
    from asynctaskd.scripts import load_scripts

    keys = Keys("atd", 1)
    for script in load_scripts().values():
        sync.script_load(script.source)
    sync.set(keys.deployment(), json.dumps({"protocol": PROTOCOL_VERSION, "shards": 1}))
    sync.hset(keys.handlers(), "demo", str(int(time.time() * 1000) + 3_600_000))


def run_subject(
    name: str, url: str, sync: Any, n: int, warmup: int, peers: Path | None, base: Path | None
) -> dict[str, Any]:
    runner, concurrency = ("base", 1) if name == BASE else SUBJECTS[name]
    sync.flushdb()
    env = dict(os.environ)
    counts = ["--tasks", str(n), "--warmup", str(warmup), "--concurrency", str(concurrency)]
    if runner in ("asynctaskd", "base", "ping", "floor", "store"):
        prepare_asynctaskd(sync)
        tree = base if runner == "base" else ROOT
        env["PYTHONPATH"] = str(tree)
        argv = [sys.executable, str(Path(__file__).resolve()), "child", "--redis", url, *counts]
        argv += {"ping": ["--ping"], "floor": ["--floor"], "store": ["--floor", "--store"]}.get(
            runner, []
        )
    else:
        assert peers is not None
        path = ROOT / "bench" / "peers" / runner
        argv = [str(peers), str(path), "enqueue-seq", "--redis", url, *counts]
    before, cpu0 = commandstats(sync), redis_cpu(sync)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    cpu1, after = redis_cpu(sync), commandstats(sync)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed:\n{proc.stdout}\n{proc.stderr}")
    out: dict[str, Any] = json.loads(lines[-1])
    calls = n + warmup
    delta = commands_delta(before, after)
    delta.pop("redis_cpu", None)
    out["redis_commands_per_job"] = sum(delta.values()) / calls
    out["evalsha_per_job"] = (delta.get("evalsha", 0) + delta.get("eval", 0)) / calls
    out["redis_commands"] = {k: round(v / calls, 3) for k, v in delta.items()}
    out["redis_cpu_ms_per_job"] = (cpu1 - cpu0) * 1000 / calls
    if runner in (
        "asynctaskd",
        "base",
        "floor",
        "store",
    ):  # the check: every create left its request
        from asynctaskd.keys import Keys

        out["ok"] = sync.llen(Keys("atd", 1).intake(0)) == calls
    out["loadavg_1m"] = loadavg()[0]
    return out


def run(
    tasks: int = 3000,
    rounds: int = 3,
    subjects: list[str] | None = None,
    compare: Path | None = None,
    warmup: int = 200,
) -> dict[str, Any]:
    from redis import Redis

    wanted = list(SUBJECTS) if subjects is None else subjects
    peers = peer_python()
    skipped = []
    if peers is None:
        skipped = [s for s in wanted if SUBJECTS[s][0].endswith(".py")]
        wanted = [s for s in wanted if s not in skipped]
        say("  (no .bench-venv: run bench/peers/setup.sh for arq and SAQ; peers skipped)")
    if compare is not None:
        wanted.insert(1, BASE)
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in wanted}
    with redis_server() as server:
        m = machine(server.port)
        sync = Redis.from_url(server.url)
        for r in range(rounds):
            shift = r % len(wanted)
            for name in wanted[shift:] + wanted[:shift]:
                res = run_subject(name, server.url, sync, tasks, warmup, peers, compare)
                res["round"] = r + 1
                say(
                    f"  round {r + 1} {name:>15}: {res['per_s']:9,.0f}/s  "
                    f"{res['cpu_ms_per_job']:.4f} ms CPU  "
                    f"{res['redis_commands_per_job']:.2f} cmds/call  load {res['loadavg_1m']:.2f}"
                )
                results[name].append(res)
        sync.close()
    keys = ("per_s", "cpu_ms_per_job", "redis_commands_per_job", "evalsha_per_job",
            "redis_cpu_ms_per_job", "round_trips_per_job")  # fmt: skip
    summary = {
        name: {k: spread([x[k] for x in rs]) for k in keys if all(k in x for x in rs)}
        for name, rs in results.items()
    }
    ratios: dict[str, Any] = {}
    for peer in ("saq", "arq", "saq-32", "arq-32", BASE, "ping", "create-floor", "store-create"):
        mine = "asynctaskd-32" if peer.endswith("-32") else "asynctaskd"
        if results.get(peer) and results.get(mine):
            per_round = [
                a["per_s"] / b["per_s"] for a, b in zip(results[mine], results[peer], strict=True)
            ]
            ratios[f"{mine}/{peer}"] = {
                "median": statistics.median(per_round),
                "per_round": per_round,
                "cpu_ratio": summary[peer]["cpu_ms_per_job"]["median"]
                / summary[mine]["cpu_ms_per_job"]["median"],
            }
    return {
        "machine": m,
        "tasks": tasks,
        "warmup": warmup,
        "rounds": rounds,
        "subjects": wanted,
        "peers_skipped": skipped,
        "compare": str(compare) if compare else None,
        "summary": summary,
        "ratios": ratios,
        "results": results,
        "ok": all(x.get("ok", True) for rs in results.values() for x in rs),
    }


HEADER = ("subject", "calls/s", "min-max", "CPU ms/call", "Redis cmds/call", "EVALSHA/call",
          "Redis CPU ms/call", "round trips/call")  # fmt: skip


def report(out: dict[str, Any]) -> None:
    rows = []
    for name, s in out["summary"].items():
        rows.append([
            name,
            s["per_s"]["median"],
            f"{s['per_s']['min']:,.0f}-{s['per_s']['max']:,.0f}",
            s["cpu_ms_per_job"]["median"],
            s["redis_commands_per_job"]["median"],
            s["evalsha_per_job"]["median"],
            s["redis_cpu_ms_per_job"]["median"],
            s.get("round_trips_per_job", {}).get("median", ""),
        ])  # fmt: skip
    say(
        table(
            f"Producer: {out['tasks']:,} calls per subject after {out['warmup']} untimed, "
            f"{out['rounds']} round(s), alternating order; medians",
            HEADER,
            rows,
        )
    )
    for key, r in out["ratios"].items():
        rounds = ", ".join(f"{x:.2f}" for x in r["per_round"])
        note = "  (target >= 2x)" if key == "asynctaskd/saq" else ""
        say(
            f"  {key}: {r['median']:.2f}x the rate (rounds: {rounds}), "
            f"{r['cpu_ratio']:.2f}x less CPU per call{note}"
        )
    say(f"  every asynctaskd submit left its request in Redis: {out['ok']}")
    say(f"  machine: {machine_line(out['machine'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--subjects", default=",".join(SUBJECTS), help="comma list")
    parser.add_argument("--compare", type=Path, help="another source tree, as asynctaskd@base")
    args = parser.parse_args(argv)
    subjects = [s for s in args.subjects.split(",") if s]
    unknown = set(subjects) - set(SUBJECTS)
    if unknown:
        parser.error(f"unknown subjects {sorted(unknown)}; known: {', '.join(SUBJECTS)}")
    out = run(args.tasks, args.rounds, subjects, args.compare, args.warmup)
    report(out)
    emit("producer", out)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
