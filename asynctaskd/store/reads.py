"""Reads: a task's snapshot, counts, parked tasks and pauses, server time and settings,
wake-ups; and plain reads for asynctaskd.client (`Read`, `read_many`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import anyio
import msgspec
import redis.exceptions as rex

from asynctaskd.keys import Keys
from asynctaskd.model import Status, Task, shard_of

from .failures import _mapped, _reading_task
from .replies import _s, _task_reply, task_or_request
from .runner import SyncStore, _Runner


class _Reads(_Runner):
    """`Store`'s reads (no script: plain commands)."""

    async def get(self, task_id: str) -> Task | None:
        """The task's snapshot (from its create request until a daemon takes that in), or
        None. Raises CorruptTask if it cannot be read."""
        _, task_key = self.ops._task(task_id)
        request_key = self.keys.request(shard_of(task_id), task_id)
        self._count("get")
        with _mapped("get"), _reading_task(task_id):
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.get(request_key)
                pipe.hgetall(task_key)
                request, raw = await pipe.execute()
        return _task_reply(task_or_request(raw, request, task_id), task_id)

    async def counts(self) -> dict[str, int]:
        """Exact per-status (and `STATUS@handler`) counts summed over every shard."""
        with _mapped("counts"):
            return counted(self.keys.shards, await read_many(self, count_reads(self.keys)))

    async def server_time(self) -> float:
        with _mapped("time"):
            sec, usec = await self.redis.time()
        return float(sec) + usec / 1e6

    async def parked(self) -> dict[str, int]:
        """Parked tasks (SUBMIT_UNKNOWN) over all shards: those a lookup will settle
        ("lookup": scheduled in due:find, or being looked up) and those left to an
        operator ("operator")."""
        reads: list[Read] = []
        for shard in range(self.keys.shards):
            reads.append(("zcard", (self.keys.index(shard, Status.SUBMIT_UNKNOWN),), {}))
            reads.append(("zcard", (self.keys.lookups(shard),), {}))
        replies = await read_many(self, reads)
        parked = sum(int(r or 0) for r in replies[0::2])
        lookup = sum(int(r or 0) for r in replies[1::2])
        return {"lookup": min(lookup, parked), "operator": max(0, parked - lookup)}

    async def paused(self) -> dict[str, dict[str, Any]]:
        """Paused dimensions (as written on shard 0) with when and why."""
        with _mapped("paused"):
            raw = await self.redis.hgetall(self.keys.paused(0))
        return {_s(k): msgspec.json.decode(v) for k, v in raw.items()}

    # Durability, wake-ups and the daemon registry.

    async def server_setting(self, name: str) -> str | None:
        """A server setting by CONFIG GET (on a cluster, shard 0's node), or None when the
        server will not say (an ACL without CONFIG, a managed service that renamed it)."""
        node: Any = self.redis
        if self.cluster:
            _, node = self._node_client(self.keys.tag(0))
        try:
            raw: dict[Any, Any] = dict(await node.config_get(name))
        except (rex.ResponseError, rex.RedisError):
            return None
        value = raw.get(name, raw.get(name.encode()))
        if value is None:
            return None
        return _s(value) if isinstance(value, bytes) else str(value)

    async def read_persistence(self) -> Persistence:
        """How the server keeps writes: AOF, its fsync policy, replicas, version.

        On a cluster every primary should be configured alike, so shard 0's is asked.
        CONFIG GET may be refused (an ACL without it, a managed service that renamed it):
        `appendfsync` is then empty and `refused` says why; nothing is raised for that.
        """
        with _mapped("durability check"):
            node: Any = self.redis
            if self.cluster:
                _, node = self._node_client(self.keys.tag(0))
            info = await node.info("persistence")
            repl = await node.info("replication")
            server = await node.info("server")
            appendfsync, refused = "", ""
            try:
                raw: dict[Any, Any] = dict(await node.config_get("appendfsync"))
                value = raw.get("appendfsync", raw.get(b"appendfsync", b""))
                appendfsync = _s(value) if isinstance(value, bytes) else str(value)
                if not appendfsync:
                    refused = "CONFIG GET appendfsync returned nothing"
            except rex.ResponseError as exc:  # NOPERM, or no CONFIG command at all
                refused = f"CONFIG GET appendfsync refused: {exc}"
        return Persistence(
            version=str(server.get("redis_version", "0.0")),
            aof=int(info.get("aof_enabled", 0)) == 1,
            appendfsync=appendfsync,
            replicas=int(repl.get("connected_slaves", 0)),
            refused=refused,
        )

    async def wait_wake(self, timeout: float) -> bool:
        """Block until a create/release/reap pushes a wake marker, or timeout (seconds)."""
        keys = [self.keys.wake(s) for s in range(self.keys.shards)]
        timeout = max(0.01, timeout)
        if self.cluster and len(keys) > 1:
            return await self._wait_wake_each(keys, timeout)
        with _mapped("wake"):
            reply = await self.redis.blpop(keys, timeout=timeout)
        return reply is not None

    async def _wait_wake_each(self, keys: list[str], timeout: float) -> bool:
        """Cluster: the wake keys are in different slots, so one BLPOP per shard, at once;
        the first marker ends them all."""
        woken = False
        with _mapped("wake"):
            async with anyio.create_task_group() as tg:

                async def one(key: str) -> None:
                    nonlocal woken
                    if await self.redis.blpop([key], timeout=timeout) is not None:
                        woken = True
                        tg.cancel_scope.cancel()

                for key in keys:
                    tg.start_soon(one, key)
        return woken


class Persistence(msgspec.Struct, frozen=True, kw_only=True):
    """What a server said about how it keeps writes (`Store.read_persistence`)."""

    version: str  # redis_version; Valkey reports 7.2.x for compatibility
    aof: bool  # appendonly on
    appendfsync: str  # "always", "everysec", "no"; "" when it could not be read
    replicas: int  # connected replicas
    refused: str = ""  # why appendfsync could not be read

    @property
    def has_waitaof(self) -> bool:
        """WAITAOF arrived in Redis 7.2."""
        try:
            major, minor = (int(p) for p in self.version.split(".")[:2])
        except ValueError:
            return False
        return (major, minor) >= (7, 2)


# ---------------------------------------------------------------------------------------
# Plain reads for asynctaskd.client (snapshots, indexes, the event stream, registries).
# Added for the client; the scripts above stay the only writers. Each read is a redis-py
# method name with its arguments, so both clients share one description of the work.

Read = tuple[str, tuple[Any, ...], dict[str, Any]]


def count_reads(keys: Keys) -> list[Read]:
    """The reads `counted` folds: per shard, its counts hash, then the size of each status's
    index (a status's total: the scripts count by status and handler only)."""
    reads: list[Read] = []
    for shard in range(keys.shards):
        reads.append(("hgetall", (keys.counts(shard),), {}))
        reads.extend(("zcard", (keys.index(shard, status),), {}) for status in Status)
    return reads


def counted(shards: int, replies: Sequence[Any]) -> dict[str, int]:
    """Counts by status (`STATUS`) and by status and handler (`STATUS@handler`), summed over
    the shards, from the replies to `count_reads`. A counts field without a handler is a
    total an older release kept: the index sizes say it now."""
    out: dict[str, int] = {}
    step = 1 + len(Status)
    for shard in range(shards):
        raw, *sizes = replies[shard * step : (shard + 1) * step]
        for k, v in raw.items():
            name = _s(k)
            if "@" in name:
                out[name] = out.get(name, 0) + int(v)
        for status, size in zip(Status, sizes, strict=True):
            if size:
                out[status.value] = out.get(status.value, 0) + int(size)
    return out


# Commands without a key cannot be pipelined on Redis Cluster (no slot to route them by).
_KEYLESS: Final = frozenset({"time"})


def _split(cluster: bool, reads: Sequence[Read]) -> tuple[list[int], list[int]]:
    """Indexes of the reads to pipeline and of those to send on their own."""
    if not cluster:
        return list(range(len(reads))), []
    alone = [i for i, r in enumerate(reads) if r[0] in _KEYLESS]
    return [i for i in range(len(reads)) if i not in alone], alone


async def read_many(store: _Runner, reads: Sequence[Read]) -> list[Any]:
    """Run read commands in one pipeline (one round trip); redis errors are mapped here."""
    store._count("read")
    piped, alone = _split(store.cluster, reads)
    out: list[Any] = [None] * len(reads)
    with _mapped("read"):
        if piped:
            async with store.redis.pipeline(transaction=False) as pipe:
                for i in piped:
                    name, args, kwargs = reads[i]
                    getattr(pipe, name)(*args, **kwargs)
                for i, reply in zip(piped, await pipe.execute(), strict=True):
                    out[i] = reply
        for i in alone:
            name, args, kwargs = reads[i]
            out[i] = await getattr(store.redis, name)(*args, **kwargs)
    return out


def read_many_sync(store: SyncStore, reads: Sequence[Read]) -> list[Any]:
    """Blocking `read_many`."""
    store._count("read")
    piped, alone = _split(type(store.redis).__name__ == "RedisCluster", reads)
    out: list[Any] = [None] * len(reads)
    with _mapped("read"):
        if piped:
            with store.redis.pipeline(transaction=False) as pipe:
                for i in piped:
                    name, args, kwargs = reads[i]
                    getattr(pipe, name)(*args, **kwargs)
                for i, reply in zip(piped, pipe.execute(), strict=True):
                    out[i] = reply
        for i in alone:
            name, args, kwargs = reads[i]
            out[i] = getattr(store.redis, name)(*args, **kwargs)
    return out
