"""HTTP client throughput: httpx's default transport, the shared client, `ctx.fetch`.

The cells: ``httpx-default`` (httpx's own pool), ``shared-client`` (what handlers get as
`ctx.http`: a stock httpx client over our `PoolTransport`, whose in-memory requests go
through `Http1Pool`), ``fetch`` (`ctx.fetch`: the same pool without httpx's request and
response objects) and plain ``aiohttp`` for reference.

Run with ``python bench/http_client.py`` (``--help`` for the knobs). The fake vendor
(`asynctaskd.devtools.fakevendor`, on `asynctaskd.devtools.fakehttp` and uvloop) serves in its own
process; each cell (one client at one concurrency) runs in a fresh child process that
GETs one job's status 4,000 times with 1, 100 or 1,000 requests in flight. All four
clients get the same connection limit (1,000) and run on the same event loop (uvloop
when installed).

A cell first warms its pool: every worker makes one request and waits for the others, so
the timed part measures a long-lived client, not the connect storm (1,000 simultaneous
connects can overflow a listen backlog and stall a second on SYN retransmits). A cell
stops at its request count or its time budget, whichever comes first (caps shrink if the
whole run would pass ``--deadline``, 55 s); a capped cell is marked ``*`` and reports the
rate over the requests it finished. A capped child exits without closing its client,
because httpx's pool takes tens of seconds to cancel a thousand waiting requests; that
keeps a run under a minute.

Prints a table on stdout, then one JSON line ``{"bench": "http_client", ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any

import aiohttp
import httpx

from asynctaskd.devtools.fakevendor import FakeVendorProcess
from asynctaskd.transport import fetcher_for, make_http_client

CLIENTS = ("httpx-default", "shared-client", "fetch", "aiohttp")
Get = Callable[[], Awaitable[None]]


@contextlib.asynccontextmanager
async def _client(name: str, url: str, max_connections: int) -> AsyncIterator[Get]:
    """Yield one GET of `url` through a fresh client called `name`; close it afterwards."""
    if name == "aiohttp":
        connector = aiohttp.TCPConnector(limit=max_connections)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def aiohttp_get() -> None:
                async with session.get(url) as response:
                    response.raise_for_status()
                    await response.read()

            yield aiohttp_get
        return
    if name == "shared-client":
        async with make_http_client(max_connections=max_connections) as shared:

            async def shared_get() -> None:
                response = await shared.get(url)
                response.raise_for_status()

            yield shared_get
        return
    if name == "fetch":
        async with make_http_client(max_connections=max_connections) as shared:
            fetch = fetcher_for(shared)

            async def fetch_get() -> None:
                reply = await fetch("GET", url)
                if reply.status >= 400:
                    raise httpx.HTTPError(f"status {reply.status}")

            yield fetch_get
        return
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )
    async with httpx.AsyncClient(limits=limits, timeout=30.0) as client:

        async def httpx_get() -> None:
            response = await client.get(url)
            response.raise_for_status()

        yield httpx_get


def _finish(result: dict[str, Any], *, abandon: bool) -> None:
    print(json.dumps(result), flush=True)  # noqa: T201 - the child's one line for the parent
    if abandon:
        # Skip the client's shutdown: cancelling a thousand requests queued in httpx's pool
        # takes tens of seconds and would blow the run's time bound.
        os._exit(0)


async def _cell(
    name: str, url: str, concurrency: int, requests: int, warmup_s: float, budget_s: float
) -> None:
    """Measure one cell and print it as JSON; runs in its own child process."""
    async with _client(name, url, 1000) as get:
        warm = asyncio.Barrier(concurrency + 1)
        issued = done = errors = 0

        async def worker() -> None:
            nonlocal issued, done, errors
            await get()  # opens (or reuses) this worker's connection
            await warm.wait()
            while issued < requests:
                issued += 1
                try:
                    await get()
                except (httpx.HTTPError, aiohttp.ClientError, OSError):
                    errors += 1
                else:
                    done += 1

        tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        warm_started = time.perf_counter()
        try:
            async with asyncio.timeout(warmup_s):
                await warm.wait()
        except TimeoutError:
            warmed = warm.n_waiting
            _finish(
                {"rate": warmed / warmup_s, "capped": True, "errors": 0, "note": "warm-up"},
                abandon=True,
            )
        started = time.perf_counter()
        try:
            async with asyncio.timeout(budget_s):
                await asyncio.gather(*tasks)
        except TimeoutError:
            seconds = time.perf_counter() - started
            _finish({"rate": done / seconds, "capped": True, "errors": errors}, abandon=True)
        seconds = time.perf_counter() - started
        result = {
            "rate": done / seconds,
            "capped": False,
            "errors": errors,
            "warmup_s": round(started - warm_started, 3),
        }
    _finish(result, abandon=False)


def _run(coro: Coroutine[Any, Any, None], loop_name: str) -> None:
    if loop_name == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(coro)
        return
    asyncio.run(coro)


def _create_job(base_url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(
        f"{base_url}/v1/jobs",
        data=json.dumps({"input": {}}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with opener.open(request, timeout=5.0) as response:
        job_id: str = json.loads(response.read())["id"]
    return job_id


def _spawn_cell(
    args: argparse.Namespace, name: str, url: str, concurrency: int, share_s: float
) -> dict[str, Any]:
    # Shrink this cell's caps when the run's remaining time, shared among the cells
    # left, is smaller than they are (one second kept for the child's start-up).
    scale = min(1.0, max(0.1, (share_s - 1.0) / (args.warmup + args.budget)))
    warmup_s, budget_s = args.warmup * scale, args.budget * scale
    argv = [sys.executable, os.path.abspath(__file__), "--loop", args.loop]
    argv += ["--requests", str(args.requests), "--budget", str(budget_s)]
    argv += ["--warmup", str(warmup_s), "--cell", name, str(concurrency), url]
    hard_limit_s = warmup_s + budget_s + 10.0
    try:
        child = subprocess.run(argv, capture_output=True, text=True, timeout=hard_limit_s)
    except subprocess.TimeoutExpired:
        return {"rate": 0.0, "capped": True, "errors": 0, "note": "killed"}
    lines = child.stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        raise RuntimeError(f"cell {name}@{concurrency} failed:\n{child.stderr}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _report(args: argparse.Namespace, levels: Sequence[int], results: dict[str, Any]) -> None:
    header = f"{'client':<26}" + "".join(f"{'c=' + str(level):>14}" for level in levels)
    lines = [header, "-" * len(header)]
    for name in CLIENTS:
        cells = "".join(
            f"{results[name][level]['rate']:>13,.0f}"
            + ("*" if results[name][level]["capped"] else " ")
            for level in levels
        )
        lines.append(f"{name:<26}{cells}")
    lines.append("requests/s; * = stopped by the time budget, rate over finished requests")
    print("\n".join(lines))  # noqa: T201 - the report


def main(argv: Sequence[str] | None = None) -> int:
    """Run every cell against one fake vendor and print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000, help="GETs per cell")
    parser.add_argument("--levels", default="1,100,1000", help="concurrency levels: 1,100,1000")
    parser.add_argument("--budget", type=float, default=3.0, help="timed seconds per cell, max")
    parser.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per cell, max")
    parser.add_argument("--deadline", type=float, default=55.0, help="seconds for the whole run")
    try:
        import uvloop  # noqa: F401 - probing only
    except ImportError:
        default_loop = "asyncio"
    else:
        default_loop = "uvloop"
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default=default_loop)
    parser.add_argument(
        "--cell", nargs=3, metavar=("CLIENT", "CONCURRENCY", "URL"), help="internal"
    )
    args = parser.parse_args(argv)

    if args.cell:
        name, concurrency, url = args.cell
        _run(_cell(name, url, int(concurrency), args.requests, args.warmup, args.budget), args.loop)
        return 0

    levels = [int(level) for level in args.levels.split(",")]
    started = time.perf_counter()
    results: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in CLIENTS}
    with FakeVendorProcess.start() as vendor:
        url = f"{vendor.url}/v1/jobs/{_create_job(vendor.url)}"
        print(  # noqa: T201 - progress for a human watching
            f"fake vendor at {vendor.url} (own process); clients on {args.loop}, one child "
            f"process per cell; {args.requests} GETs per cell, at most {args.budget:g} s",
            file=sys.stderr,
            flush=True,
        )
        for concurrency in levels:
            for name in CLIENTS:
                cells_left = len(levels) * len(CLIENTS) - sum(map(len, results.values()))
                remaining_s = args.deadline - (time.perf_counter() - started)
                cell = _spawn_cell(args, name, url, concurrency, remaining_s / cells_left)
                results[name][concurrency] = cell
                print(  # noqa: T201
                    f"  {name:<24} c={concurrency:<5} {cell['rate']:9,.0f} req/s"
                    f"{' (capped: ' + cell.get('note', 'time') + ')' if cell['capped'] else ''}",
                    file=sys.stderr,
                    flush=True,
                )
    _report(args, levels, results)
    summary = {
        "bench": "http_client",
        "requests": args.requests,
        "loop": args.loop,
        "python": platform.python_version(),
        "httpx": httpx.__version__,
        "aiohttp": aiohttp.__version__,
        "cpus": os.cpu_count(),
        "seconds": round(time.perf_counter() - started, 1),
        "req_per_s": {
            name: {str(level): round(results[name][level]["rate"]) for level in levels}
            for name in CLIENTS
        },
        "capped": [
            f"{name}@{level}"
            for name in CLIENTS
            for level in levels
            if results[name][level]["capped"]
        ],
        "errors": sum(cell["errors"] for cells in results.values() for cell in cells.values()),
    }
    print(json.dumps(summary, separators=(",", ":")))  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
