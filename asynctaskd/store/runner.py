"""The runners: a `Call` run on Redis, asyncio (`_Runner`, the core of `Store`) or blocking
(`SyncStore`, for producers in sync web apps). NOSCRIPT handling and loading the scripts,
the per-node clients of Redis Cluster, and the batch write on the wire (`wire`)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

import anyio
import redis.asyncio
import redis.asyncio.cluster as redis_cluster
import redis.exceptions as rex
from redis import Redis as SyncRedis

from asynctaskd.connection.lane import Lanes, lanes_for
from asynctaskd.errors import StoreUnavailable
from asynctaskd.keys import Keys, settings_problem
from asynctaskd.model import Task, shard_of
from asynctaskd.scripts import Script, load_scripts
from asynctaskd.wire import Held, closed_under_io, exchange, pack, refresh_slots

from .failures import _mapped, _reading_task
from .ops import Ops
from .replies import Call, _task_reply, task_or_request

_AsyncRedis = redis.asyncio.Redis  # a name no parameter called `redis` shadows

T = TypeVar("T")

# How long a user that may not load scripts (a producer) waits for a daemon to load them.
SCRIPT_WAIT_S: Final = 10.0
_NOT_LOADED: Final = (
    "the asynctaskd scripts of this version are not loaded in Redis ({name} is missing), "
    "and this Redis user may not load them: start a daemon of this version, or run "
    "`asynctaskd scripts load` as an operator"
)


class _Base:
    def __init__(self, keys: Keys, settings: Mapping[str, int] | None = None) -> None:
        self.keys = keys
        self.ops = Ops(keys)
        self.scripts: dict[str, Script] = load_scripts()
        # Checked here, where they are written from (prepare()): a value the scripts would
        # refuse must fail at start-up, not in every script call after.
        for name, value in (settings or {}).items():
            if (problem := settings_problem(name, value)) is not None:
                raise ValueError(problem)
        # Any: redis-py's hset wants a Mapping over its own invariant key union.
        self.settings: dict[Any, Any] = dict(settings or {})
        self.round_trips: dict[str, int] = {}
        # Called with (script or op name, seconds) after each round trip: metrics hook.
        self.on_call: Callable[[str, float], None] | None = None

    def _count(self, name: str) -> None:
        self.round_trips[name] = self.round_trips.get(name, 0) + 1

    def _timed(self, name: str, started: float) -> None:
        if self.on_call is not None:
            self.on_call(name, time.perf_counter() - started)


class _Runner(_Base):
    """Asyncio runs of calls: one at a time (`run`), or written at once (`_send_packed`)."""

    def __init__(
        self, redis: redis.asyncio.Redis, keys: Keys, settings: Mapping[str, int] | None = None
    ) -> None:
        super().__init__(keys, settings)
        self.redis = redis
        # Redis Cluster: scripts run on the node of their shard's slot. Pipelines with a
        # durability gate go to each node over a plain connection of our own, so the
        # gate (WAITAOF/WAIT) follows that node's writes on the same connection.
        self.cluster = isinstance(redis, redis_cluster.RedisCluster)
        self._nodes: dict[str, _AsyncRedis] = {}
        # Script calls go out on lanes (asynctaskd.connection.lane) where they can stand in
        # for the pool's connections: lone calls (`run`) and batches (`_send_packed`).
        # While every lane is in use, a lone call takes one connection kept out of the
        # pool, and a batch a pooled connection.
        self._held: Held | None = None
        self._lanes: Lanes | None = None
        if not self.cluster:
            self._held = Held(redis.connection_pool)
            self._lanes = lanes_for(redis.connection_pool)

    async def prepare(self) -> None:
        """Load every script into Redis and write the per-shard settings."""
        if self.cluster:
            with _mapped("loading scripts"):
                await self._load_all()
                for shard in range(self.keys.shards):
                    if self.settings:
                        await self.redis.hset(self.keys.settings(shard), mapping=self.settings)
            return
        with _mapped("loading scripts"):
            async with self.redis.pipeline(transaction=False) as pipe:
                for script in self.scripts.values():
                    pipe.script_load(script.source)
                for shard in range(self.keys.shards):
                    if self.settings:
                        pipe.hset(self.keys.settings(shard), mapping=self.settings)
                await pipe.execute()

    async def run(self, call: Call[T]) -> T:
        """Run one script call and decode its reply."""
        script = self.scripts[call.script]
        self._count(call.script)
        started = time.perf_counter()
        try:
            try:
                reply = await self._evalsha(call)
            except rex.NoScriptError:
                # The server lost its script cache (restart, failover): NOSCRIPT means it
                # did not run, so loading and running again is safe.
                await self._load(script)
                reply = await self._evalsha(call)
        except Exception as exc:
            # Mapped here rather than around the call: entering `_mapped` costs a lone
            # call (a sequential producer's submit) about a microsecond of its forty.
            with _mapped(call.script):
                raise exc
        self._timed(call.script, started)
        return call.decode(reply)

    async def _evalsha(self, call: Call[Any]) -> Any:
        if self.cluster:  # redis-py routes it to the node of its slot
            script = self.scripts[call.script]
            return await self.redis.evalsha(script.sha, len(call.keys), *call.keys, *call.args)
        sha = self.scripts[call.script].sha
        payload = pack(("EVALSHA", sha, len(call.keys), *call.keys, *call.args))
        lane = None if self._lanes is None else self._lanes.idle()
        if lane is not None:
            reply = await lane.call(payload)
        else:
            assert self._held is not None
            reply = (await self._held.exchange(payload, 1))[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def _load(self, script: Script) -> None:
        """After NOSCRIPT (a restart or failover emptied the script cache): load every
        script, so that producers, who may not load scripts (docs/security.md), find theirs
        again too. A user that may not load them waits, for up to SCRIPT_WAIT_S, for a
        daemon or an operator to do it."""
        try:
            await self._load_all()
        except rex.NoPermissionError:
            deadline = time.monotonic() + SCRIPT_WAIT_S
            while not await self._loaded(script):
                if time.monotonic() >= deadline:
                    raise StoreUnavailable(_NOT_LOADED.format(name=script.name)) from None
                await anyio.sleep(0.1)

    async def _load_all(self) -> None:
        sources = [script.source for script in self.scripts.values()]
        if self.cluster:  # every primary: a script may run on any shard's node
            cluster: Any = self.redis
            for source in sources:
                await cluster.execute_command(
                    "SCRIPT LOAD", source, target_nodes=cluster.get_primaries()
                )
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for source in sources:
                pipe.script_load(source)
            await pipe.execute()

    async def _loaded(self, script: Script) -> bool:
        if self.cluster:
            cluster: Any = self.redis
            replies = await cluster.execute_command(
                "SCRIPT EXISTS", script.sha, target_nodes=cluster.get_primaries()
            )
            flat = replies.values() if isinstance(replies, dict) else [replies]
            return all(bool(r[0] if isinstance(r, list) else r) for r in flat)
        return bool((await self.redis.script_exists(script.sha))[0])

    async def load_scripts(self) -> None:
        """Load every script (NotPermitted for a user that may not)."""
        with _mapped("loading scripts"):
            await self._load_all()

    async def scripts_loaded(self) -> bool:
        """Whether Redis holds every script of this version (a daemon's heartbeat checks
        one, the create, since producers cannot load it themselves)."""
        with _mapped("script exists"):
            return await self._loaded(self.scripts["create"])

    def _node_client(self, key: str) -> tuple[str, redis.asyncio.Redis]:
        """The primary that serves `key`'s slot, as a plain client of our own."""
        cluster: Any = self.redis
        node = cluster.get_node_from_key(key)
        client = self._nodes.get(node.name)
        if client is None:
            pool = redis.asyncio.BlockingConnectionPool(
                connection_class=node.connection_class, max_connections=16, timeout=None,
                **node.connection_kwargs,
            )  # fmt: skip
            client = self._nodes[node.name] = redis.asyncio.Redis(connection_pool=pool)
        return node.name, client

    async def _refresh_topology(self) -> None:
        """After MOVED or a node gone: ask the cluster who serves what now."""
        cluster: Any = self.redis
        with contextlib.suppress(Exception):  # the next call tries again
            await refresh_slots(cluster)

    async def close(self) -> None:
        """Close the lanes, give back the held connection, close the per-node clients of
        cluster mode (the main client is the caller's)."""
        if self._lanes is not None:
            self._lanes.close()
        if self._held is not None:
            await self._held.close()
        for client in self._nodes.values():
            with contextlib.suppress(Exception):
                await client.aclose()
        self._nodes.clear()

    async def _send_packed(
        self,
        calls: Sequence[Call[Any]],
        trailer: tuple[Any, ...] | None,
        trailer_wait: float,
        client: redis.asyncio.Redis | None = None,
    ) -> list[Any]:
        """One write of every EVALSHA (and the trailer) on an idle lane, or on one pooled
        connection of `client` (a cluster node's own client; by default ours), then one
        reply per command; an error reply is returned in its place, not raised.

        What redis-py's `Pipeline` does, without its per-command packing and bookkeeping
        (half the daemon's save cost; `wire` says how). No retry: a dropped connection
        fails the whole batch as unavailable, and the callers retry (a save is fenced and
        versioned).
        """
        scripts = self.scripts
        commands = [
            pack(("EVALSHA", scripts[c.script].sha, len(c.keys), *c.keys, *c.args)) for c in calls
        ]
        if trailer is not None:
            commands.append(pack(trailer))
        payload, count = b"".join(commands), len(commands)
        lane = None if client is not None or self._lanes is None else self._lanes.idle()
        if lane is not None:
            replies: list[Any] = await lane.call(payload, trailer_wait, count=count)
            return replies
        pool = (client or self.redis).connection_pool
        return await exchange(pool, payload, count, trailer_wait)

    async def _pipeline_by_node(
        self, calls: Sequence[Call[Any]], trailer: tuple[Any, ...] | None, trailer_wait: float
    ) -> tuple[list[Any], list[Any]]:
        """Cluster: one pipeline per primary, concurrently, each with its own trailer."""
        groups: dict[str, tuple[redis.asyncio.Redis, list[int]]] = {}
        for i, call in enumerate(calls):
            name, client = self._node_client(call.keys[0])
            groups.setdefault(name, (client, []))[1].append(i)
        replies: list[Any] = [None] * len(calls)
        trailers: list[Any] = [None] * len(calls)
        stale = False

        async def one(client: redis.asyncio.Redis, indexes: list[int]) -> None:
            nonlocal stale
            try:
                got = await self._send_packed(
                    [calls[i] for i in indexes], trailer, trailer_wait, client
                )
            except (rex.RedisError, OSError, RuntimeError) as exc:
                got = [exc] * (len(indexes) + (trailer is not None))
            except AttributeError as exc:  # a connection closed under the write
                if not closed_under_io(exc):
                    raise
                got = [exc] * (len(indexes) + (trailer is not None))
                stale = True
            end = got.pop() if trailer is not None else None
            for i, reply in zip(indexes, got, strict=True):
                replies[i], trailers[i] = reply, end
                # MOVED/ASK: redis-py raises MovedError/AskError, without the code in the text
                moved = isinstance(reply, rex.AskError)
                if moved or isinstance(reply, (rex.ConnectionError, rex.TimeoutError, OSError)):
                    stale = True

        async with anyio.create_task_group() as tg:
            for client, indexes in groups.values():
                tg.start_soon(one, client, indexes)
        if stale:
            await self._refresh_topology()
        return replies, trailers


class SyncStore(_Base):
    """Blocking access for producers (Django, Flask): the same Calls, run synchronously."""

    def __init__(
        self, redis: SyncRedis, keys: Keys, settings: Mapping[str, int] | None = None
    ) -> None:
        super().__init__(keys, settings)
        self.redis = redis

    def run(self, call: Call[T]) -> T:
        script = self.scripts[call.script]
        self._count(call.script)
        with _mapped(call.script):
            try:
                reply = self.redis.evalsha(script.sha, len(call.keys), *call.keys, *call.args)
            except rex.NoScriptError:
                self._load(script)
                reply = self.redis.evalsha(script.sha, len(call.keys), *call.keys, *call.args)
        return call.decode(reply)

    def load_scripts(self) -> None:
        """Load every script (NotPermitted for a user that may not)."""
        with _mapped("loading scripts"):
            self._load_all()

    def _load_all(self) -> None:
        if type(self.redis).__name__ == "RedisCluster":
            cluster: Any = self.redis
            for script in self.scripts.values():
                cluster.execute_command(
                    "SCRIPT LOAD", script.source, target_nodes=cluster.get_primaries()
                )
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for script in self.scripts.values():
                pipe.script_load(script.source)
            pipe.execute()

    def _load(self, script: Script) -> None:
        """As Store._load, blocking."""
        try:
            self._load_all()
        except rex.NoPermissionError:
            deadline = time.monotonic() + SCRIPT_WAIT_S
            while not self.redis.script_exists(script.sha)[0]:
                if time.monotonic() >= deadline:
                    raise StoreUnavailable(_NOT_LOADED.format(name=script.name)) from None
                time.sleep(0.1)

    def get(self, task_id: str) -> Task | None:
        _, task_key = self.ops._task(task_id)
        request_key = self.keys.request(shard_of(task_id), task_id)
        with (
            _mapped("get"),
            _reading_task(task_id),
            self.redis.pipeline(transaction=False) as pipe,
        ):
            pipe.get(request_key)
            pipe.hgetall(task_key)
            request, raw = pipe.execute()
        return _task_reply(task_or_request(raw, request, task_id), task_id)

    def counts(self) -> dict[str, int]:
        from .reads import count_reads, counted, read_many_sync  # reads imports this module

        with _mapped("counts"):
            return counted(self.keys.shards, read_many_sync(self, count_reads(self.keys)))


def redis_credentials() -> dict[str, str]:
    """Username and password from REDIS_USERNAME / REDIS_PASSWORD or systemd credentials
    (files redis-username, redis-password in $CREDENTIALS_DIRECTORY); never from config."""
    out: dict[str, str] = {}
    cred_dir = os.environ.get("CREDENTIALS_DIRECTORY")
    for name, env in (("username", "REDIS_USERNAME"), ("password", "REDIS_PASSWORD")):
        value = os.environ.get(env)
        if value is None and cred_dir:
            path = os.path.join(cred_dir, f"redis-{name}")
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    value = f.read().strip()
        if value:
            out[name] = value
    return out


def open_redis(
    url: str, *, max_connections: int = 64, socket_timeout: float | None = 10.0
) -> redis.asyncio.Redis:
    """An asyncio client whose pool waits for a free connection instead of failing.

    Redis runs commands one at a time, so a few dozen connections serve thousands of
    concurrent handler calls; callers queue for a connection rather than erroring.
    Any URL `connection.open_async` takes (TLS options in the URL, redis+sentinel://).
    """
    from asynctaskd.connection import open_async

    return open_async(
        url,
        credentials=redis_credentials(),
        max_connections=max_connections,
        socket_timeout=socket_timeout,
    )
