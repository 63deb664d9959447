"""`asynctaskd dev`: embedded Valkey + fake vendor + a daemon, and a live demo view."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import anyio

from asynctaskd.config import Config, parse_config
from asynctaskd.daemon import Daemon, install_uvloop
from asynctaskd.embedded import ServerProcess, require_valkey_binary
from asynctaskd.errors import ConfigError
from asynctaskd.model import Status

from .fakevendor import Behaviour, FakeVendorProcess

__all__ = ["run_dev"]

_ORDER = [
    Status.PENDING_SUBMIT,
    Status.SUBMITTING,
    Status.SUBMITTED,
    Status.RUNNING,
    Status.SUCCEEDED,
    Status.FAILED,
    Status.CANCELED,
    Status.TRACKING_TIMED_OUT,
    Status.SUBMIT_UNKNOWN,
]


def dev_config(url: str, vendor_url: str) -> Config:
    text = f"""
[redis]
url = {json.dumps(url)}
[worker]
lease = "5s"
shutdown_grace = "5s"
[retry]
poll_interval = "400ms"
first_error_delay = "200ms"
max_error_delay = "2s"
[metrics]
listen = "127.0.0.1:0"
[log]
level = "warning"
format = "text"
[[handlers]]
key = "demo"
type = "python"
factory = "asynctaskd.devtools.demo:make_handler"
options = {{ base_url = {json.dumps(vendor_url)}, key = "demo", idempotent = true }}
"""
    return parse_config(text, "<dev>")


def _line(counts: Counter[Status], total: int, elapsed: float) -> str:
    parts = [f"{s.value.lower()} {counts[s]}" for s in _ORDER if counts[s]]
    done = sum(counts[s] for s in _ORDER if s.is_settled)
    width = 30
    filled = int(width * done / total) if total else width
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {elapsed:5.1f}s  " + ", ".join(
        parts
    )


async def _demo(config: Config, n: int, keep_running: bool) -> int:
    from asynctaskd.client import AsyncClient
    from asynctaskd.logs import setup_logging

    setup_logging("warning", "text")
    daemon = Daemon(config)
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.serve)
        assert daemon.worker is not None
        client = AsyncClient.from_url(config.redis.url)
        try:
            ids = []
            t0 = time.monotonic()
            for i in range(n):
                task = await client.submit(
                    "demo",
                    {"document": f"page-{i}.pdf"},
                    tracking_timeout=120,
                    tenant=f"tenant-{i % 3}",
                    priority=i % 3,
                    strict=False,
                )
                ids.append(task.id)
            counts: Counter[Status] = Counter()
            tty = sys.stdout.isatty() and n > 0
            last_print = 0.0
            while True:
                stats = await client.stats()
                counts = Counter({s: stats.by_status.get(s, 0) for s in _ORDER})
                settled = sum(counts[s] for s in _ORDER if s.is_settled)
                now = time.monotonic()
                if tty:
                    sys.stdout.write("\r" + _line(counts, n, now - t0) + "\x1b[K")
                    sys.stdout.flush()
                elif n and (now - last_print >= 1.0 or settled >= n):
                    print(_line(counts, n, now - t0))  # noqa: T201 - CLI output
                    last_print = now
                if settled >= n:
                    break
                await anyio.sleep(0.2)
            elapsed = time.monotonic() - t0
            if tty:
                print()  # noqa: T201 - CLI output
            if n:
                print(f"\n{n} demo tasks settled in {elapsed:.1f}s:")  # noqa: T201 - CLI output
                for s in _ORDER:
                    if counts[s]:
                        print(f"  {s.value:<20} {counts[s]:>5}")  # noqa: T201 - CLI output
            if keep_running:
                if ids:
                    print(f"\ntry: asynctaskd get {ids[0]} --url {config.redis.url}")  # noqa: T201
                print(f"     asynctaskd stats --url {config.redis.url}")  # noqa: T201
                print("the daemon keeps running; Ctrl-C to stop")  # noqa: T201 - CLI output
                await anyio.sleep_forever()
        finally:
            await client.aclose()
            daemon.worker.stop()
    return 0


def run_dev(args: argparse.Namespace) -> int:
    try:
        binary = require_valkey_binary("asynctaskd dev")
    except ConfigError as exc:
        print(f"asynctaskd: {exc}", file=sys.stderr)  # noqa: T201 - CLI output
        return 2
    data_dir = Path(args.data_dir).resolve() / "dev-valkey"
    # dev is a sandbox: every run starts from an empty server, so the view counts only
    # this run's tasks.
    shutil.rmtree(data_dir, ignore_errors=True)
    behaviour = Behaviour(
        polls_to_done=max(1, args.polls),
        query_latency=0.02,
        latency_jitter=0.05,
        error_rate=0.03,
        throttle_rate=0.02,
        fail_fraction=0.03,
        retry_after=1,
    )
    with (
        ServerProcess(binary, data_dir=data_dir, aof=True) as server,
        FakeVendorProcess.start(behaviour) as vendor,
    ):
        print(f"embedded valkey  {server.url}  (data in {data_dir})")  # noqa: T201
        print(f"fake vendor      {vendor.url}")  # noqa: T201 - CLI output
        config = dev_config(server.url, vendor.url)
        factory = install_uvloop()
        options = {"loop_factory": factory} if factory else {}
        try:
            return anyio.run(
                _demo,
                config,
                args.demo,
                args.keep_running or args.demo == 0,
                backend="asyncio",
                backend_options=options,
            )
        except KeyboardInterrupt:
            return 0
