"""Shared fixtures: private Redis-protocol servers (redis and valkey), stores, wait_until."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
from hypothesis import settings
from redis import Redis as SyncRedis

from asynctaskd.embedded import ServerProcess, find_binary
from asynctaskd.keys import Keys
from asynctaskd.model import Status
from asynctaskd.store import Store, SyncStore, open_redis

# Fixtures shared by the client and routing tests (both clients, one test body).
from tests.clients import api, make_api  # noqa: F401 - registered as fixtures here

SERVER_BINARIES = ("redis-server", "valkey-server")

# CI must judge the change, not the luck of the draw: there hypothesis explores the same
# examples every run (and keeps no database). By hand it explores new ones each time.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")
    parser.addoption("--run-chaos", action="store_true", help="run tests marked chaos")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # By marker, not keyword: `item.keywords` also holds the names of the item's package
    # and module, so every test under tests/chaos/ counted as "chaos" whatever its marks.
    for item in items:
        if item.get_closest_marker("slow") and not config.getoption("--run-slow"):
            item.add_marker(pytest.mark.skip(reason="slow: run with --run-slow (make test does)"))
        if item.get_closest_marker("chaos") and not config.getoption("--run-chaos"):
            item.add_marker(pytest.mark.skip(reason="chaos: run with --run-chaos (make test does)"))


# What CI may skip: tests this machine cannot run whatever is installed (the embedded
# valkey binary has no TLS; a kernel or network it does not have), and tests that run on one
# server on purpose. Under CI=true any other skip (a tool, a server or an option missing)
# fails the run: `.ci/run` installs what the suite needs.
CI_MAY_SKIP = (
    "is built without TLS support",
    "run once, on redis-server",
    "this kernel",
    "this host has no address but loopback",
    "this redis-server has WAITAOF",
    # The full-disk test mounts a small tmpfs: a container without CAP_SYS_ADMIN may not,
    # and no other way fills a disk without filling the host's.
    "this container may not mount a filesystem",
)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not os.environ.get("CI") or hasattr(session.config, "workerinput"):
        return  # by hand, or an xdist worker: the controller sees every report
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    unexpected = []
    for report in reporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        reason = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
        if not any(allowed in reason for allowed in CI_MAY_SKIP):
            unexpected.append(f"{report.nodeid}: {reason}")
    if unexpected:
        reporter.ensure_newline()
        reporter.write_line(
            "CI=true: these tests were skipped, and CI must run them (install what they "
            "need in .ci/run, or add the reason to CI_MAY_SKIP with why):",
            red=True,
        )
        for line in unexpected:
            reporter.write_line(f"  {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session", params=SERVER_BINARIES)
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """One private server per binary per session, on a free loopback port."""
    binary = find_binary(request.param)
    if binary is None:
        pytest.skip(f"{request.param} is not installed")
    proc = ServerProcess(binary).start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(params=["redis-server", "valkey-server"])
def aof_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServerProcess]:
    """A private server of its own with AOF and `appendfsync always`, for fault tests that
    kill or restart it (the session servers must not be touched that way)."""
    binary = find_binary(request.param)
    if binary is None:
        pytest.skip(f"{request.param} is not installed")
    server = ServerProcess(binary, data_dir=tmp_path / "redis", aof=True).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(server: ServerProcess) -> str:
    return server.url


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = open_redis(redis_url)
    await client.flushdb()  # our own private server: safe
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def sync_redis(redis_url: str) -> Iterator[SyncRedis]:
    client = SyncRedis.from_url(redis_url)
    client.flushdb()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def keys() -> Keys:
    return Keys("atd", 1)


@pytest.fixture
async def store(redis_client: redis.asyncio.Redis, keys: Keys) -> Store:
    s = Store(redis_client, keys)
    await s.prepare()
    return s


@pytest.fixture
def sync_store(sync_redis: SyncRedis, keys: Keys) -> SyncStore:
    return SyncStore(sync_redis, keys)


async def wait_until(
    predicate: Callable[[], Awaitable[Any]], what: str, timeout: float = 5.0
) -> Any:
    """Poll an async predicate every 10 ms until it returns a truthy value."""
    import anyio

    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await anyio.sleep(0.01)


def statuses(reader: Any, ids: Iterable[str]) -> Counter[Status]:
    """How many of `ids` are in each status, read with `reader.get` (a Client, a SyncStore);
    a task that is gone fails the test."""
    out: Counter[Status] = Counter()
    for task_id in ids:
        task = reader.get(task_id)
        assert task is not None, f"{task_id} vanished"
        out[task.status] += 1
    return out


async def statuses_async(reader: Any, ids: Iterable[str]) -> Counter[Status]:
    """`statuses` through an async reader (a Store, an AsyncClient)."""
    out: Counter[Status] = Counter()
    for task_id in ids:
        task = await reader.get(task_id)
        assert task is not None, f"{task_id} vanished"
        out[task.status] += 1
    return out


def wait_until_sync(predicate: Callable[[], Any], what: str, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)
