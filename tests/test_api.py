"""The public API is pinned, and modules only import in the documented direction."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import asynctaskd

PACKAGE = Path(asynctaskd.__file__).parent


def test_all_is_sorted_and_importable() -> None:
    assert asynctaskd.__all__ == sorted(asynctaskd.__all__)
    for name in asynctaskd.__all__:
        assert getattr(asynctaskd, name) is not None, name


def test_spec_names_are_importable_from_the_root() -> None:
    from asynctaskd import (  # noqa: F401 - the import is the test
        AsyncClient,
        Client,
        Failed,
        Handler,
        PermanentError,
        RetryableError,
        Running,
        Status,
        Submitted,
        Succeeded,
    )


def _imports(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_import_direction() -> None:
    # The store never knows about workers, handlers or the client; the client never
    # imports the worker side; handlers never talk to Redis.
    forbidden = {
        "model": {"store", "worker", "client", "handlers", "daemon"},
        "keys": {"store", "worker", "client", "daemon"},
        "codec": {"store", "worker", "client", "daemon"},
        "scripts": {"store", "worker", "client", "daemon"},
        "store": {"worker", "client", "handlers", "daemon", "reaper", "cli", "durability"},
        "durability": {"worker", "client", "handlers", "daemon", "reaper", "cli"},
        "client": {"worker", "handlers", "daemon", "reaper", "metrics", "http_handler", "cli"},
        "handlers": {"store", "worker", "daemon", "client"},
        "http_handler": {"store", "worker", "daemon", "client"},
        "worker": {"daemon", "cli", "client"},
        "plans": {"client", "admission", "worker", "daemon", "cli"},
        "cursors": {"store", "plans", "client", "worker", "daemon", "cli"},
        "admission": {"worker", "daemon", "cli", "handlers", "http_handler"},
        "connection": {"store", "client", "worker", "daemon", "cli", "handlers"},
        "transport": {"store", "client", "worker", "daemon", "handlers", "connection"},
        "http1": {"store", "client", "worker", "daemon", "handlers", "transport", "connection"},
        "downloads": {"store", "client", "worker", "daemon", "handlers", "http_handler"},
    }
    for name, banned in forbidden.items():
        path = PACKAGE / f"{name}.py"
        if not path.exists():
            continue
        bad = _imports(path) & banned
        assert not bad, f"asynctaskd.{name} imports {bad}"


def test_client_import_stays_light() -> None:
    code = (
        "import asynctaskd.client, sys; "
        "bad = [m for m in ('httpx', 'prometheus_client', 'asynctaskd.worker', 'aiohttp') "
        "if m in sys.modules]; print(bad); assert not bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
