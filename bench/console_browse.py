"""The console's task browser at N stored tasks (1,000,000 by default): how long a page
and a find take, through the real web app (aiohttp, a session cookie, httpx in front).

The tasks are written straight into one private redis-server as the scripts would leave
them (the task hash and its status index entry), with `redis-cli --pipe` for speed: 90%
SUCCEEDED, 5% FAILED, 3% RUNNING, 2% SUBMIT_UNKNOWN; 11 handlers, 47 tenants (primes, so
that no filter lines up with a status); each entered its status at a time spread over the
last 24 hours; every task has an external id and a metadata field `order`. Then, each
query REPEAT times (p50 and p99 of the HTTP round trip):

- browse: the first page (50) of all tasks; of SUCCEEDED; 20 pages deep with the cursor;
  a handler filter (1 task in 11); a tenant filter (1 in 47: the page may come back short
  with a cursor, as the budget of 20 x limit hashes per request is spent); a one-hour time
  range in the middle of the day;
- find: by task id; by external id (of the newest SUCCEEDED task: behind the live and
  parked ones, 5% of N, in the walk; and one that is not there: one call reads up to
  FIND_SCAN tasks or for FIND_BUDGET_S, and "rows/read" says how many it looked at); by
  metadata field (the newest SUCCEEDED task's, and not there);
- a tenant's overview (the viewers' page): a walk of the status indexes reading each
  entry's tenant, up to WALK entries or WALK_BUDGET_S; "rows/read" is how many it read,
  and the JSON line says from how long ago each incomplete count is whole;
- the finds and the tenant's overview again as a Redis user allowed only the `atd:` keys
  (the operator's of docs/security.md), whom Redis refuses SORT's GET patterns: the
  HMGET fallback.

    python bench/console_browse.py [--tasks 1000000] [--repeat 30]
Prints a table, then one JSON line {"bench": "console_browse", ...}.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import msgspec
from aiohttp import web

from asynctaskd.client import AsyncClient
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.model import Status
from asynctaskd.store import open_redis
from asynctaskd.web import WebSettings, make_app
from asynctaskd.web.tokens import mint, tokens_key
from bench import arun, emit, machine, machine_line, percentile, redis_server, say, table

MIX = ((Status.SUCCEEDED, 90), (Status.FAILED, 5), (Status.RUNNING, 3),
       (Status.SUBMIT_UNKNOWN, 2))  # fmt: skip
DAY_MS = 86_400_000


def _resp(*args: str | bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def fill(port: int, n: int, now_ms: int) -> tuple[str, str]:
    """Write n tasks; returns (the newest SUCCEEDED task's id, its external id)."""
    cli = shutil.which("redis-cli")
    if cli is None:
        raise SystemExit("redis-cli not found (it comes with redis-server)")
    keys = Keys()
    statuses = [s for s, share in MIX for _ in range(share)]
    proc = subprocess.Popen([cli, "-p", str(port), "--pipe"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL)  # fmt: skip
    assert proc.stdin is not None
    newest = ("", "")
    chunk: list[bytes] = []
    for i in range(n):
        at = now_ms - DAY_MS + (i * DAY_MS) // n  # oldest first; ids sort with time
        task_id = new_task_id(now_ms=at)
        status = statuses[i % 100]
        ext = f"job_{i:08d}"
        chunk.append(_resp(
            "HSET", keys.task(0, task_id), "id", task_id, "handler", f"h{i % 11}",
            "status", status.value, "tenant", f"t{i % 47}", "account", f"a{i % 7}",
            "created_ms", str(at), "updated_ms", str(at), "deadline_ms", str(at + DAY_MS),
            "version", "6", "params", '{"doc":"x.pdf"}', "metadata", f'{{"order":{i}}}',
            "external_id", ext, "handle", f'{{"external_id":"{ext}","query":{{}}}}',
            *(("finished_ms", str(at)) if status.is_terminal else ()),
        ))  # fmt: skip
        chunk.append(_resp("ZADD", keys.index(0, status), str(at), task_id))
        if status is Status.SUCCEEDED:
            newest = (task_id, ext)
        if len(chunk) >= 20_000:
            proc.stdin.write(b"".join(chunk))
            chunk.clear()
    proc.stdin.write(b"".join(chunk))
    proc.stdin.close()
    if proc.wait() != 0:
        raise SystemExit("redis-cli --pipe failed")
    return newest


async def measure(
    port: int, repeat: int, newest: tuple[str, str], now_ms: int, keys_only: bool
) -> Any:
    """The queries through a web app on its own Redis connection; with `keys_only`, as a
    Redis user allowed only the `atd:` keys (as the operator's of docs/security.md), to
    whom Redis refuses SORT's GET patterns: only the finds, on their HMGET fallback."""
    redis = open_redis(f"redis://127.0.0.1:{port}/0")
    web_redis = redis
    if keys_only:
        await redis.execute_command("ACL", "SETUSER", "bench-keys", "on", ">pw", "+@all", "~atd:*")
        web_redis = open_redis(f"redis://bench-keys:pw@127.0.0.1:{port}/0")
    runner = web.AppRunner(make_app(AsyncClient(web_redis, "atd"), WebSettings()), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    token, record = mint("operator", None)
    await redis.hset(tokens_key("atd"), record.id, msgspec.json.encode(record))
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    rows: list[list[Any]] = []
    result: dict[str, Any] = {}
    suffix = " [HMGET]" if keys_only else ""
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            r = await http.post("/console/api/login", json={"token": token})
            assert r.status_code == 200, r.text

            async def timed(name: str, path: str, params: dict[str, str], times: int) -> None:
                name += suffix
                took: list[float] = []
                body: dict[str, Any] = {}
                for _ in range(times):
                    start = time.perf_counter()
                    r = await http.get(path, params=params)
                    took.append((time.perf_counter() - start) * 1000)
                    assert r.status_code == 200, r.text
                    body = r.json()
                shown = body["scanned"] if "scanned" in body else len(body["tasks"])
                if path.endswith("tenant"):
                    whole = {k: v for k, v in body["whole_since"].items() if v is not None}
                    result[name + ": counts whole since (h ago)"] = {
                        k: round((now_ms / 1000 - v) / 3600, 2) for k, v in whole.items()
                    }
                p50, p99 = percentile(took, 50), percentile(took, 99)
                rows.append([name, shown, p50, p99])
                result[name] = {"p50_ms": round(p50, 2), "p99_ms": round(p99, 2), "rows": shown}

            find = "/console/api/find"
            await timed("tenant overview (1 in 47)", "/console/api/tenant", {"tenant": "t7"},
                        repeat)  # fmt: skip
            if keys_only:
                await finds(timed, find, newest, repeat)
                return rows, result
            tasks = "/console/api/tasks"
            await timed("first page, all", tasks, {"limit": "50"}, repeat)
            await timed("first page, SUCCEEDED", tasks, {"status": "SUCCEEDED", "limit": "50"},
                        repeat)  # fmt: skip
            # 20 pages deep: the time of each page on the way
            params = {"status": "SUCCEEDED", "limit": "50"}
            took: list[float] = []
            for _ in range(20):
                start = time.perf_counter()
                r = await http.get(tasks, params=params)
                took.append((time.perf_counter() - start) * 1000)
                params["cursor"] = r.json()["cursor"]
            rows.append(["pages 1-20, SUCCEEDED", 50, percentile(took, 50), percentile(took, 99)])
            result["pages"] = {"p50_ms": round(percentile(took, 50), 2),
                               "p99_ms": round(percentile(took, 99), 2)}  # fmt: skip
            await timed(
                "handler filter (1 in 11)",
                tasks,
                {"status": "SUCCEEDED", "handler": "h3", "limit": "50"},
                repeat,
            )
            await timed("tenant filter (1 in 47)", tasks,
                        {"tenant": "t7", "limit": "50"}, repeat)  # fmt: skip
            mid = (now_ms - DAY_MS // 2) / 1000
            await timed(
                "one-hour time range",
                tasks,
                {"since": str(mid), "until": str(mid + 3600), "limit": "50"},
                repeat,
            )
            await finds(timed, find, newest, repeat)
    finally:
        await runner.cleanup()
        await redis.aclose()
        if web_redis is not redis:
            await web_redis.aclose()
    return rows, result


async def finds(timed: Any, find: str, newest: tuple[str, str], repeat: int) -> None:
    await timed("find by id", find, {"by": "id", "q": newest[0]}, repeat)
    await timed("find external id (recent)", find, {"by": "external_id", "q": newest[1]}, repeat)
    few = max(3, repeat // 10)
    await timed("find external id (absent: one call)", find,
                {"by": "external_id", "q": "job_nope"}, few)  # fmt: skip
    order = str(int(newest[1][4:]))
    await timed("find metadata (recent)", find, {"by": "metadata", "q": f"order={order}"}, repeat)
    await timed("find metadata (absent: one call)", find,
                {"by": "metadata", "q": "order=-1"}, few)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    with redis_server().start() as server:
        say(machine_line(machine(server.port)))
        now_ms = int(time.time() * 1000)
        started = time.perf_counter()
        newest = fill(server.port, args.tasks, now_ms)
        say(f"wrote {args.tasks:,} tasks in {time.perf_counter() - started:.1f} s")
        rows, result = arun(measure(server.port, args.repeat, newest, now_ms, False))
        fallback_rows, fallback = arun(measure(server.port, args.repeat, newest, now_ms, True))
    rows += fallback_rows
    result.update(fallback)
    say(table(f"console task browser at {args.tasks:,} stored tasks (HTTP round trip, ms)",
              ["query", "rows/read", "p50", "p99"], rows))  # fmt: skip
    emit("console_browse", {"tasks": args.tasks, "repeat": args.repeat, **result})


if __name__ == "__main__":
    main()
