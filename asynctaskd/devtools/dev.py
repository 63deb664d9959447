"""`asynctaskd dev`: embedded Valkey + fake vendor + a daemon, and a live demo view."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

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


def _cli() -> str:
    """How to run the CLI so that a copied command works: `asynctaskd` when it is on PATH,
    else the script beside this interpreter (a venv not activated), else `python -m`."""
    if shutil.which("asynctaskd"):
        return "asynctaskd"
    beside = Path(sys.executable).parent / "asynctaskd"
    if beside.exists():
        return str(beside)
    return f"{sys.executable} -m asynctaskd"


def _say(text: str = "") -> None:
    print(text, flush=True)  # noqa: T201 - CLI output


async def _demo(config: Config, n: int, keep_running: bool, vendor_url: str) -> int:
    from asynctaskd.client import AsyncClient
    from asynctaskd.logs import setup_logging

    setup_logging("warning", "text")
    daemon = Daemon(config)
    url = config.redis.url
    shown = False
    async with anyio.create_task_group() as tg:

        async def serve(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            # The daemon drains on Ctrl-C or SIGTERM (its own signal handling); when it has,
            # the demo's view has nothing left to show.
            await daemon.serve(task_status=task_status)
            if not shown:
                _say("\nstopped")
            tg.cancel_scope.cancel()

        await tg.start(serve)
        assert daemon.worker is not None
        client = AsyncClient.from_url(url)
        try:
            ids = await _show(client, n, keep_running)
            shown = not keep_running
            if keep_running:
                cli = _cli()
                _say("\nthe daemon keeps running; Ctrl-C stops it, the vendor and the server")
                _say(f"  metrics       http://127.0.0.1:{daemon.health_port}/metrics"
                     " (and /healthz, /readyz)")  # fmt: skip
                _say(f"  valkey        {url}")
                _say(f"  fake vendor   {vendor_url}")
                _say("try:")
                if ids:
                    _say(f"  {cli} get {ids[0]} --url {url}")
                _say(f"  {cli} list --status failed --url {url}")
                _say(f"  {cli} stats --url {url}")
                await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await client.aclose()
            daemon.worker.stop()
    return 0


async def _show(client: Any, n: int, keep_running: bool) -> list[str]:
    """Submit `n` demo tasks and show them settle; returns their ids."""
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
    while n:
        stats = await client.stats()
        counts = Counter({s: stats.by_status.get(s, 0) for s in _ORDER})
        settled = sum(counts[s] for s in _ORDER if s.is_settled)
        now = time.monotonic()
        if tty:
            sys.stdout.write("\r" + _line(counts, n, now - t0) + "\x1b[K")
            sys.stdout.flush()
        elif now - last_print >= 1.0 or settled >= n:
            _say(_line(counts, n, now - t0))
            last_print = now
        if settled >= n:
            break
        await anyio.sleep(0.2)
    if not n:
        return ids
    if tty:
        _say()
    _say(f"\n{n} demo tasks settled in {time.monotonic() - t0:.1f}s:")
    for s in _ORDER:
        if counts[s]:
            _say(f"  {s.value:<20} {counts[s]:>5}")
    if counts[Status.FAILED]:
        _say(
            "\nThe FAILED ones are the fake vendor's doing: it fails about 3% of jobs on "
            "purpose,\nand answers some calls with errors and 429s, which the daemon retries."
        )
        if not keep_running:
            _say(f"To look at them: {_cli()} dev --demo {n} --keep-running, then its commands.")
    return ids


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
    # Until the daemon's own signal handling runs (and after it), Ctrl-C and SIGTERM end
    # the run through KeyboardInterrupt: the `with` below then stops the vendor and the
    # server, which live in sessions of their own so that the terminal's Ctrl-C reaches
    # only this process.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with (
            ServerProcess(binary, data_dir=data_dir, aof=True) as server,
            FakeVendorProcess.start(behaviour) as vendor,
        ):
            _say(f"embedded valkey  {server.url}  (data in {data_dir})")
            _say(f"fake vendor      {vendor.url}")
            config = dev_config(server.url, vendor.url)
            factory = install_uvloop()
            options = {"loop_factory": factory} if factory else {}
            return anyio.run(
                _demo,
                config,
                args.demo,
                args.keep_running or args.demo == 0,
                vendor.url,
                backend="asyncio",
                backend_options=options,
            )
    except KeyboardInterrupt:
        _say("\nstopped")
        return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
