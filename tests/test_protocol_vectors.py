"""The protocol's language-neutral test vectors, checked against the Python implementation."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from redis.exceptions import ResponseError

from asynctaskd import AsyncClient
from asynctaskd.errors import ConfigError
from asynctaskd.keys import PROTOCOL_VERSION, Keys, shard_for_dedup
from asynctaskd.model import shard_of
from asynctaskd.scripts import export_files
from tests.configs import write_daemon_config

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "protocol" / "scripts"
VECTORS = json.loads((Path(__file__).parent / "vectors" / "dedup_shard.json").read_text())


@pytest.mark.parametrize("v", VECTORS["vectors"], ids=lambda v: f"{v['tenant']}/{v['shards']}")
def test_the_dedup_shard_function_matches_the_vectors(v: dict[str, Any]) -> None:
    assert shard_for_dedup(v["tenant"], v["dedup_key"], v["shards"]) == v["shard"]
    assert v["crc32"] % v["shards"] == v["shard"]


@pytest.mark.anyio
async def test_the_client_puts_deduplicated_tasks_where_the_vectors_say(redis_client: Any) -> None:
    for v in VECTORS["vectors"]:
        client = AsyncClient(redis_client, shards=v["shards"])
        task = await client.submit(
            "h", {}, tracking_timeout=60, strict=False,
            tenant=v["tenant"] or None, dedup_key=v["dedup_key"],
        )  # fmt: skip
        assert shard_of(task.id) == v["shard"], v


@pytest.mark.anyio
async def test_a_producer_with_another_shard_count_writes_nothing(redis_client: Any) -> None:
    keys = Keys("atd", 4)
    await redis_client.set(keys.deployment(), json.dumps({"protocol": 1, "shards": 4}))
    before = await redis_client.dbsize()
    wrong = AsyncClient(redis_client, shards=1)
    with pytest.raises(ConfigError, match=r"has 4 shard\(s\).*configured with 1"):
        await wrong.submit("h", {}, tracking_timeout=60, strict=False)
    assert await redis_client.dbsize() == before
    right = AsyncClient(redis_client, shards=4)
    await right.submit("h", {}, tracking_timeout=60, strict=False)
    await redis_client.set(keys.deployment(), json.dumps({"protocol": 2, "shards": 4}))
    newer = AsyncClient(redis_client, shards=4)
    with pytest.raises(
        ConfigError, match=f"speaks protocol 2, this asynctaskd speaks {PROTOCOL_VERSION}"
    ):
        await newer.submit("h", {}, tracking_timeout=60, strict=False)


@pytest.mark.slow
def test_a_daemon_with_another_shard_count_refuses_to_start(
    redis_url: str, sync_redis: Any, tmp_path: Path
) -> None:
    sync_redis.set(Keys().deployment(), json.dumps({"protocol": 1, "shards": 4}))
    config = write_daemon_config(
        tmp_path / "daemon.toml", redis_url, "http://127.0.0.1:9", redis={"shards": 2}
    )
    run = subprocess.run(
        [sys.executable, "-m", "asynctaskd", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "namespace 'atd' has 4 shard(s)" in run.stderr and "configured with 2" in run.stderr
    assert sync_redis.hlen(Keys().daemons()) == 0  # it never registered as a daemon


@pytest.mark.slow
def test_exported_scripts_load_under_the_sha_the_manifest_names(
    sync_redis: Any, tmp_path: Path
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asynctaskd", "scripts", "export", str(tmp_path / "lua")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "manifest.json and SHA1SUMS" in out.stdout
    manifest = json.loads((tmp_path / "lua" / "manifest.json").read_text())
    assert manifest["protocol"] == PROTOCOL_VERSION and manifest["scripts"]
    for name, entry in manifest["scripts"].items():
        source = (tmp_path / "lua" / f"{name}.lua").read_text()
        assert sync_redis.script_load(source) == entry["sha1"], name  # what EVALSHA names
    # a producer in another language, with only these files: create a task by EVALSHA
    create = manifest["scripts"]["create"]
    assert create["keys"] == ["prefix", "task", "dedup"]
    keys = Keys()
    tid = "01J0000000000000000000000A"
    args = [tid, "h", "", "", "", 0, 0, 0, 60_000, "{}", "", ""]
    prefix = keys.tag(0) + ":"  # KEYS[1] of every script: the shard prefix
    reply = sync_redis.evalsha(create["sha1"], 3, prefix, keys.task(0, tid),
                               keys.no_dedup(0), *args)  # fmt: skip
    assert reply[0] == 1


def test_the_shipped_scripts_are_what_this_code_assembles() -> None:
    """protocol/scripts/ is what producers in other languages load: it must be the exact
    text the daemons run, or their EVALSHA names scripts that no daemon loads."""
    expected = export_files(PROTOCOL_VERSION)
    shipped = {p.name: p.read_bytes() for p in SHIPPED.iterdir()}
    fix = "run `asynctaskd scripts export protocol/scripts` and commit the result"
    assert set(shipped) == set(expected), f"{set(shipped) ^ set(expected)}: {fix}"
    stale = sorted(name for name, data in expected.items() if shipped[name] != data)
    assert not stale, f"{stale} differ from lua/: {fix}"
    manifest = json.loads(shipped["manifest.json"])
    for line in shipped["SHA1SUMS"].decode().splitlines():  # what `sha1sum -c` checks
        sha, name = line.split("  ")
        assert hashlib.sha1(shipped[name]).hexdigest() == sha
        assert manifest["scripts"][name.removesuffix(".lua")]["sha1"] == sha


# The producer vectors (tests/vectors/producer.json: its "about" says how to read them),
# run here from the shipped script files, as a producer in another language would.

PRODUCER = json.loads((Path(__file__).parent / "vectors" / "producer.json").read_text())
_TIME = re.compile(r"^@(\w+)(?:\+(\d+))?$")


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return [_text(v) for v in value]
    if isinstance(value, dict):
        return {_text(k): _text(v) for k, v in value.items()}
    return value


def _match(expected: Any, got: Any, times: dict[str, int], window: tuple[int, int]) -> None:
    """`got` as `expected` says, binding each `@name` to a server time in `window`."""
    if isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), (expected, got)
        for e, g in zip(expected, got, strict=True):
            _match(e, g, times, window)
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), (expected, got)
        for k, e in expected.items():
            _match(e, got[k], times, window)
    elif isinstance(expected, str) and (m := _TIME.match(expected)):
        value = int(got) - int(m[2] or 0)
        if m[1] not in times:
            assert window[0] <= value <= window[1], (expected, got, window)
            times[m[1]] = value
        assert value == times[m[1]], (expected, got, times)
        assert isinstance(got, int) or got == str(int(got)), got  # decimal text as written
    else:
        assert got == expected, (expected, got)


def _state(redis: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted(_text(redis.keys("*"))):
        kind = _text(redis.type(key))
        if kind == "list":
            out[key] = {"type": kind, "value": _text(redis.lrange(key, 0, -1))}
        elif kind == "hash":
            out[key] = {"type": kind, "value": _text(redis.hgetall(key))}
        elif kind == "string" and re.search(r"\}:new:[^:]+$", key):  # a create request
            items = _text(msgspec.msgpack.decode(redis.get(key)))
            out[key] = {
                "type": kind,
                "msgpack_pairs": dict(zip(items[::2], items[1::2], strict=True)),
            }
        else:
            out[key] = {"type": kind, "value": _text(redis.get(key))}
    return out


def _server_ms(redis: Any) -> int:
    seconds, micros = redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


@pytest.mark.parametrize("case", PRODUCER["cases"], ids=lambda c: c["name"])
def test_the_producer_vectors_hold_for_the_shipped_scripts(
    sync_redis: Any, case: dict[str, Any]
) -> None:
    manifest = json.loads((SHIPPED / "manifest.json").read_text())["scripts"]
    for name in {step["script"] for step in case["steps"]}:
        assert (
            sync_redis.script_load((SHIPPED / f"{name}.lua").read_text()) == manifest[name]["sha1"]
        )
    for command in case.get("given", []):
        sync_redis.execute_command(*command)
    times: dict[str, int] = {}
    for step in case["steps"]:
        before = _server_ms(sync_redis)
        try:
            reply, error = (
                sync_redis.evalsha(
                    manifest[step["script"]]["sha1"],
                    len(step["keys"]),
                    *step["keys"],
                    *step["argv"],
                ),
                None,
            )
        except ResponseError as exc:
            reply, error = None, str(exc)
        window = (before, _server_ms(sync_redis))
        if "error" in step:
            assert error is not None and step["error"] in error, (step, reply)
        else:
            assert error is None, error
            _match(step["reply"], _text(reply), times, window)
        if "state" in step:
            _match(step["state"], _state(sync_redis), times, window)
