"""W6: POST /api/v1/tasks throughput of one `asynctaskd web` process, beside the Python
client's `submit()` rate in the same run.

One private redis-server; `python -m asynctaskd web` as a child process on loopback (no
daemon: creates wait in the shards' intake lists, as they do for the Python client). The
harness, in this process, first calls `AsyncClient.submit` from `--concurrency`
coroutines until `--tasks` were created, then POSTs the same bodies to the web process
from `--concurrency` httpx clients (an httpx.AsyncClient each, one connection each),
then from one aiohttp session with as many connections; each request with a producer
token, after a warm-up. Reported: the rates, HTTP / Python ratios (goal >= 0.60), and
the CPU the web process and the harness spent per request: on a 2-core host the harness
shares the cores with the web process and Redis, and httpx spends more CPU per request
than the server (so the aiohttp figure is the closer one to the server's own rate, and
1 / web CPU per POST its single-core ceiling). Checks: every POST answered 201.

    python bench/w6_web.py [--tasks 5000] [--concurrency 32]
Prints a table, then one JSON line {"bench": "w6_web", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import httpx
import msgspec

from asynctaskd.client import AsyncClient
from asynctaskd.web.tokens import mint, tokens_key
from bench import (
    ROOT,
    arun,
    child_env,
    emit,
    free_port,
    loadavg,
    machine,
    machine_line,
    proc_cpu,
    redis_server,
    say,
    table,
    workdir,
)

BODY = {"handler": "demo", "params": {"n": 1}, "tracking_timeout": 600, "strict": False}


def raise_nofile(wanted: int) -> int:
    """Raise this process's open-file limit (children inherit it) toward `wanted`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class WebProcess:
    """`python -m asynctaskd web --config FILE` as a child process; `token(role, tenant)`
    stores a token for it."""

    def __init__(self, process: subprocess.Popen[bytes], base: str, redis_url: str) -> None:
        self.process, self.base, self.redis_url = process, base, redis_url

    @property
    def pid(self) -> int:
        return self.process.pid

    def token(self, role: Any = "producer", tenant: str | None = "bench") -> str:
        from redis import Redis

        token, record = mint(role, tenant)
        with Redis.from_url(self.redis_url) as r:
            r.hset(tokens_key("atd"), record.id, msgspec.json.encode(record))
        return token


@contextmanager
def web_process(redis_url: str, tmp: Path, redis_connections: int = 256) -> Iterator[WebProcess]:
    port = free_port()
    config = tmp / "web.toml"
    config.write_text(
        f'[redis]\nurl = "{redis_url}"\nnamespace = "atd"\n'
        f'[web]\nlisten = "127.0.0.1:{port}"\nredis_connections = {redis_connections}\n'
        '[log]\nlevel = "warning"\nformat = "json"\n'
    )
    log = tmp / "web.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "asynctaskd", "web", "--config", str(config)],
            stdout=subprocess.DEVNULL, stderr=err, env=child_env(), cwd=str(ROOT),
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:  # until its listener answers
            if proc.poll() is not None:
                raise RuntimeError(f"asynctaskd web exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"asynctaskd web not ready: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield WebProcess(proc, base, redis_url)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _drive(n: int, concurrency: int, one: Any) -> float:
    """Seconds for `n` calls of `one()` from `concurrency` coroutines."""
    left = n

    async def loop() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return time.perf_counter() - started


async def _python_rate(url: str, n: int, concurrency: int) -> float:
    async with AsyncClient.from_url(url) as client:

        async def one() -> None:
            await client.submit(BODY["handler"], BODY["params"], tracking_timeout=600,
                                strict=False)  # fmt: skip

        await _drive(200, concurrency, one)  # warm-up: connections, scripts
        await client.redis.flushdb()
        return n / await _drive(n, concurrency, one)


class Phase(msgspec.Struct):
    per_s: float
    web_cpu_ms: float  # per request
    harness_cpu_ms: float
    non_201: int


async def _timed(web: WebProcess, n: int, drive: Any) -> Phase:
    cpu0, own0 = proc_cpu(web.pid), time.process_time()
    seconds, bad = await drive(n)
    web_cpu, own = proc_cpu(web.pid) - cpu0, time.process_time() - own0
    return Phase(round(n / seconds, 1), round(web_cpu / n * 1000, 3), round(own / n * 1000, 3),
                 bad)  # fmt: skip


async def _httpx_rate(web: WebProcess, n: int, concurrency: int) -> Phase:
    auth = {"Authorization": f"Bearer {web.token()}"}
    clients = [httpx.AsyncClient(base_url=web.base, timeout=30) for _ in range(concurrency)]
    bad = 0

    async def drive(count: int) -> tuple[float, int]:
        nonlocal bad
        bad, left = 0, count

        async def loop(http: httpx.AsyncClient) -> None:
            nonlocal bad, left
            while left > 0:
                left -= 1
                r = await http.post("/api/v1/tasks", json=BODY, headers=auth)
                bad += r.status_code != 201

        started = time.perf_counter()
        await asyncio.gather(*(loop(c) for c in clients))
        return time.perf_counter() - started, bad

    try:
        await drive(200)  # warm-up: connections
        return await _timed(web, n, drive)
    finally:
        for c in clients:
            await c.aclose()


async def _aiohttp_rate(web: WebProcess, n: int, concurrency: int) -> Phase:
    auth = {"Authorization": f"Bearer {web.token()}"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(web.base, connector=connector) as http:
        bad = 0

        async def one() -> None:
            nonlocal bad
            async with http.post("/api/v1/tasks", json=BODY, headers=auth) as r:
                await r.read()
                bad += r.status != 201

        async def drive(count: int) -> tuple[float, int]:
            nonlocal bad
            bad = 0
            return await _drive(count, concurrency, one), bad

        await drive(200)
        return await _timed(web, n, drive)


def run(tasks: int = 5000, concurrency: int = 32) -> dict[str, Any]:
    raise_nofile(4096)
    with redis_server() as server, workdir("bench-w6-") as tmp:
        m = machine(server.port)
        python_rate = arun(_python_rate(server.url, tasks, concurrency))
        from redis import Redis

        with Redis.from_url(server.url) as r:
            r.flushdb()
        with web_process(server.url, tmp) as web:
            via_httpx = arun(_httpx_rate(web, tasks, concurrency))
            via_aiohttp = arun(_aiohttp_rate(web, tasks, concurrency))
    ratio = via_httpx.per_s / python_rate
    best = max(via_httpx.per_s, via_aiohttp.per_s) / python_rate
    return {
        "machine": m,
        "tasks": tasks,
        "concurrency": concurrency,
        "python_submit_per_s": round(python_rate, 1),
        "httpx": msgspec.to_builtins(via_httpx),
        "aiohttp": msgspec.to_builtins(via_aiohttp),
        "ratio_httpx": round(ratio, 3),
        "ratio_aiohttp": round(via_aiohttp.per_s / python_rate, 3),
        "web_ceiling_per_s": round(1000 / via_aiohttp.web_cpu_ms, 1)
        if via_aiohttp.web_cpu_ms
        else None,
        "goal_ratio": 0.60,
        "goal_met": best >= 0.60,
        "loadavg_1m": loadavg()[0],
        "ok": via_httpx.non_201 == 0 and via_aiohttp.non_201 == 0,
    }


def report(r: dict[str, Any]) -> None:
    say(f"machine: {machine_line(r['machine'])}")
    say(
        table(
            f"W6 web submits: {r['tasks']:,} tasks, {r['concurrency']} concurrent, loopback",
            ["figure", "value"],
            [
                ["Python AsyncClient.submit()/s", r["python_submit_per_s"]],
                ["POST/s, httpx clients", r["httpx"]["per_s"]],
                ["POST/s, one aiohttp session", r["aiohttp"]["per_s"]],
                ["ratio httpx / Python (goal >= 0.60)", r["ratio_httpx"]],
                ["ratio aiohttp / Python", r["ratio_aiohttp"]],
                [
                    "web CPU ms per POST (httpx, aiohttp)",
                    f"{r['httpx']['web_cpu_ms']:.3f}, {r['aiohttp']['web_cpu_ms']:.3f}",
                ],
                [
                    "harness CPU ms per POST (httpx, aiohttp)",
                    f"{r['httpx']['harness_cpu_ms']:.3f}, {r['aiohttp']['harness_cpu_ms']:.3f}",
                ],
                ["web single-core ceiling, POST/s", r["web_ceiling_per_s"]],
                ["answers other than 201", r["httpx"]["non_201"] + r["aiohttp"]["non_201"]],
            ],
        )
    )
    say(f"  goal met: {r['goal_met']}; load {r['loadavg_1m']:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    r = run(args.tasks, args.concurrency)
    report(r)
    emit("w6_web", r)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
