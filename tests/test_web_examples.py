"""examples/web: the Node producer run with `node` against a real `asynctaskd web`
process, with a worker (the daemon's loop, in this process) doing the task."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest
from redis import Redis as SyncRedis

from asynctaskd.store import Store
from asynctaskd.web.tokens import mint, tokens_key
from tests.test_web import Steps, _worker
from tests.test_web_cli import config, web_process  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

ROOT = Path(__file__).resolve().parent.parent
PRODUCER = ROOT / "examples" / "web" / "producer.mjs"


def _node() -> str:
    node = shutil.which("node")
    if node is None:  # CI installs it (.ci/run); CI_MAY_SKIP does not allow this skip
        pytest.skip("node is not installed")
    return node


async def test_the_node_producer_follows_its_task_to_succeeded(
    web_process: tuple[subprocess.Popen[str], str],  # noqa: F811
    sync_redis: SyncRedis,
    store: Store,
) -> None:
    node = _node()
    _, base = web_process
    token, record = mint("producer", "t1", "examples test")
    sync_redis.hset(tokens_key("atd"), record.id, msgspec.json.encode(record))
    handler = Steps([0.5])
    handler.go.set()
    env = {**os.environ, "ATD_URL": base, "ATD_TOKEN": token}
    argv = [node, str(PRODUCER), "demo", '{"pages": 3}', "--no-strict"]
    lines: list[str] = []
    with anyio.fail_after(60):
        async with (
            await anyio.open_process(argv, env=env, stderr=subprocess.STDOUT) as proc,
            httpx.AsyncClient() as http,
        ):
            assert proc.stdout is not None
            buffer = b""
            started = False
            async for chunk in proc.stdout:
                buffer += chunk
                *done, buffer = buffer.split(b"\n")
                lines += [line.decode() for line in done]
                if not started and any(line.startswith("PENDING_SUBMIT") for line in lines):
                    # Subscribed and shown the current state: now let a worker run it.
                    started = True
                    await _worker(store, handler, http).run_until_idle()
            lines += [buffer.decode()] if buffer else []
            code = await proc.wait()
    output = "\n".join(lines)
    assert code == 0, output
    statuses = [line.split()[0] for line in lines[1:] if line and line.split()[0].isupper()]
    assert lines[0].startswith("task ") and "tenant t1" in lines[0], output
    assert statuses[0] == "PENDING_SUBMIT" and statuses[-1] == "SUCCEEDED", output
    assert statuses.index("SUBMITTING") < statuses.index("RUNNING"), output
    assert "RUNNING v" in output and "50%" in output
    assert lines[-1] == 'result: {"ok":true}', output


async def test_the_node_producer_reports_an_api_refusal(
    web_process: tuple[subprocess.Popen[str], str],  # noqa: F811
) -> None:
    node = _node()
    _, base = web_process
    env = {**os.environ, "ATD_URL": base, "ATD_TOKEN": "atd_0000000000000000_" + "x" * 43}
    result = await anyio.run_process(
        [node, str(PRODUCER), "demo"], env=env, check=False, stderr=subprocess.STDOUT
    )
    assert result.returncode == 2
    assert b"HTTP 401 unauthorized" in result.stdout
