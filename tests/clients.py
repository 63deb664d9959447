"""One test body for both clients: the Api adapter and its fixtures (`make_api`, `api`)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
import redis.asyncio

from asynctaskd.client import AsyncClient, Client, TaskEvent
from asynctaskd.errors import StoreUnavailable
from asynctaskd.plans import Reads


class Api:
    """Runs one test body against either client: every call is awaited here."""

    def __init__(self, client: AsyncClient | Client) -> None:
        self.client = client
        self.is_async = isinstance(client, AsyncClient)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.client, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            return await result if self.is_async else result

        return call

    async def in_background(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Await an async call, or run a blocking one in a worker thread."""
        method = functools.partial(getattr(self.client, name), *args, **kwargs)
        if self.is_async:
            return await method()
        return await anyio.to_thread.run_sync(method, abandon_on_cancel=True)

    async def collect(self, task_id: str, out: list[TaskEvent], tenant: str | None = None) -> None:
        """Append every event of watch() to `out` until it ends."""
        if isinstance(self.client, AsyncClient):
            async for event in self.client.watch(task_id, tenant):
                out.append(event)  # noqa: PERF401 - the test reads `out` while this runs
            return
        sync_client = self.client

        def run() -> None:
            for event in sync_client.watch(task_id, tenant):
                out.append(event)  # noqa: PERF402 - the test reads `out` while this runs

        await anyio.to_thread.run_sync(run, abandon_on_cancel=True)

    async def take_in(self) -> int:
        """Do what a daemon's claim does first: take in producers' requests (creates and
        cancels) on every shard. Returns how many it took in."""
        store = self.client._store
        taken = 0
        for shard in range(store.keys.shards):
            call = store.ops.claim(shard, "submit", 0, 1000, "take-in", 0)
            batch = await store.run(call) if self.is_async else store.run(call)  # type: ignore[misc]
            taken += batch.taken
        return taken

    async def close(self) -> None:
        if isinstance(self.client, AsyncClient):
            await self.client.aclose()
        else:
            self.client.close()

    def hook_reads(self, monkeypatch: pytest.MonkeyPatch, hook: Callable[[Reads], None]) -> None:
        """Call hook(reads) after each read batch the client runs (a sync hook for both)."""
        original = self.client._execute

        async def async_reads(reads: Reads) -> Any:
            replies = await original(reads)
            hook(reads)
            return replies

        def sync_reads(reads: Reads) -> Any:
            replies = original(reads)
            hook(reads)
            return replies

        monkeypatch.setattr(self.client, "_execute", async_reads if self.is_async else sync_reads)

    def fail_reads(self, monkeypatch: pytest.MonkeyPatch, fail: Callable[[Reads], bool]) -> None:
        """Raise StoreUnavailable instead of running a read batch when fail(reads) says so."""
        original = self.client._execute

        def check(reads: Reads) -> None:
            if fail(reads):
                raise StoreUnavailable("injected: Redis is unavailable")

        async def async_reads(reads: Reads) -> Any:
            check(reads)
            return await original(reads)

        def sync_reads(reads: Reads) -> Any:
            check(reads)
            return original(reads)

        monkeypatch.setattr(self.client, "_execute", async_reads if self.is_async else sync_reads)


@pytest.fixture(params=["async", "sync"])
async def make_api(
    request: pytest.FixtureRequest,
    redis_url: str,
    redis_client: redis.asyncio.Redis,
    sync_redis: Any,
) -> AsyncIterator[Callable[..., Api]]:
    made: list[Api] = []

    def make(**kwargs: Any) -> Api:
        cls = AsyncClient if request.param == "async" else Client
        made.append(Api(cls.from_url(redis_url, **kwargs)))
        return made[-1]

    yield make
    for api in made:
        await api.close()


@pytest.fixture
def api(make_api: Callable[..., Api]) -> Api:
    return make_api()
