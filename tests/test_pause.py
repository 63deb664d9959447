"""Pause and resume through the clients, the CLI and a running worker."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import anyio
import httpx
import pytest

from asynctaskd import AsyncClient, Client, InvalidTask, Status
from asynctaskd.handlers import HandlerContext, HandlerEntry, Submitted, Succeeded
from asynctaskd.store import Store
from asynctaskd.worker import Worker
from tests.test_worker import make_config

pytestmark = pytest.mark.anyio


async def test_async_client_pause_resume(redis_url: str, store: Store) -> None:
    async with AsyncClient.from_url(redis_url) as client:
        assert await client.pause(tenant="t1", note="over budget")
        assert not await client.pause(tenant="t1")
        assert (await client.paused())["tenant:t1"]["note"] == "over budget"
        held = [await client.submit("h", {}, tracking_timeout=60, tenant="t1", strict=False)
                for _ in range(3)]  # fmt: skip
        other = await client.submit("h", {}, tracking_timeout=60, tenant="t2", strict=False)
        batch = await store.claim(0, "submit", 10, 10_000, "w")
        assert [c.lease.task_id for c in batch.claimed] == [other.id]
        assert await client.resume(tenant="t1") == 3
        assert await client.paused() == {}
        again = await store.claim(0, "submit", 10, 10_000, "w")
        assert [c.lease.task_id for c in again.claimed] == [t.id for t in held]


def test_sync_client_validates_the_dimension(redis_url: str, sync_redis: Any) -> None:
    with Client.from_url(redis_url) as client:
        with pytest.raises(InvalidTask, match="exactly one"):
            client.pause(tenant="a", account="b")
        with pytest.raises(InvalidTask, match="exactly one"):
            client.pause()
        with pytest.raises(InvalidTask, match="cannot pause"):
            client.pause(tenant="no spaces allowed")
        assert sync_redis.dbsize() == 0
        assert client.pause(handler="ocr")
        assert list(client.paused()) == ["handler:ocr"]


class Instant:
    key = "h"
    idempotent_submit = False

    def __init__(self) -> None:
        self.submitted: list[str] = []

    async def submit(self, params: Any, ctx: HandlerContext) -> Submitted:
        self.submitted.append(ctx.tenant)
        return Submitted("x")

    async def query(self, handle: dict[str, Any], ctx: HandlerContext) -> Succeeded:
        return Succeeded(1)


async def test_a_paused_tenant_does_not_delay_another(redis_url: str, store: Store) -> None:
    handler = Instant()
    async with AsyncClient.from_url(redis_url) as client:
        await client.pause(tenant="slow")
        for _ in range(200):
            await client.submit("h", {}, tracking_timeout=60, tenant="slow", strict=False)
        fast = await client.submit("h", {}, tracking_timeout=60, tenant="fast", strict=False)
        async with httpx.AsyncClient() as http:
            worker = Worker(store, {"h": HandlerEntry(key="h", handler=handler, provider="h")},
                            make_config(), http=http)  # fmt: skip
            with anyio.fail_after(20):
                await worker.run_until_idle()
        assert handler.submitted == ["fast"]
        task = await client.get(fast.id)
        assert task is not None and task.status is Status.SUCCEEDED
        # paused work is held, not lost: it finishes after resume
        assert await client.resume(tenant="slow") == 200
        async with httpx.AsyncClient() as http:
            worker = Worker(store, {"h": HandlerEntry(key="h", handler=handler, provider="h")},
                            make_config(), http=http)  # fmt: skip
            with anyio.fail_after(30):
                await worker.run_until_idle()
        assert handler.submitted.count("slow") == 200
        stats = await client.stats()
        assert stats.by_status[Status.SUCCEEDED] == 201


@pytest.mark.slow
def test_cli_pause_resume_and_stats(redis_url: str, sync_redis: Any) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "asynctaskd", *args, "--url", redis_url],
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    assert cli("pause", "--provider", "acme", "--note", "incident 42").returncode == 0
    stats = json.loads(cli("stats", "--json").stdout)
    assert stats["paused"]["provider:acme"]["note"] == "incident 42"
    assert "provider:acme" in cli("stats").stdout
    out = cli("resume", "--provider", "acme", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["result"] == 0
    assert cli("pause").returncode == 2  # a dimension is required
