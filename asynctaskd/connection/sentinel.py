"""Sentinel and Cluster: the waiting pool that hands out only connections to the master
the sentinels named last, `follow_master` to ask them again every so often,
`master_address`, and the connection options of Sentinel and Cluster nodes."""

from __future__ import annotations

import logging
from typing import Any, Final

import anyio
import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.exceptions

from .urls import _Target

__all__ = ["follow_master", "master_address"]

# The package's logger, as before it was split: log lines keep their logger name.
logger = logging.getLogger("asynctaskd.connection")

SENTINEL_CONNECT_TIMEOUT_S: Final = 2.0


class _BlockingSentinelPool(
    redis.asyncio.sentinel.SentinelConnectionPool, redis.asyncio.BlockingConnectionPool
):
    """Sentinel discovery with the waiting pool of `open_async` (redis-py's sentinel pool
    fails with "Too many connections" when every connection is busy), handing out only
    connections to the master the sentinels named last.

    redis-py asks the sentinels only when it opens a connection, drops only the idle
    connections when the answer changes, and takes a connection back as it is. After a
    failover whose old master is still alive (it stalled, or the sentinels lost sight of
    it), the connections opened before would go on writing to that old master, which takes
    writes until Sentinel demotes it and then throws them away, while new connections write
    to the new master: one client on two masters whose data diverge, each refusing the
    fences and leases the other handed out. A connection to any other address is closed
    here before it is used again, and reconnects through the sentinels.
    """

    _announced: tuple[str, int] | None = None  # the master last logged

    async def get_master_address(self) -> Any:
        after = await super().get_master_address()  # type: ignore[no-untyped-call]  # unannotated in redis-py
        before, self._announced = self._announced, after
        if before is not None and after != before:  # once, however many connections asked
            logger.warning(
                "Sentinel names a new master, %s:%s (was %s:%s): following it", *after, *before
            )
        return after

    async def ensure_connection(self, connection: Any) -> None:
        # One tuple comparison per connection handed out: the pool's own check that follows
        # costs more. `master_address` is None until the first discovery.
        if connection.is_connected and (connection.host, connection.port) != self.master_address:
            await connection.disconnect()
        await super().ensure_connection(connection)


class _AsyncSentinelRedis(redis.asyncio.Redis):
    """Closes the connections to the sentinels along with its own."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            manager = getattr(self.connection_pool, "sentinel_manager", None)
            if manager is not None:
                await manager.aclose()


class _SyncSentinelRedis(redis.Redis):
    """Closes the connections to the sentinels along with its own."""

    def close(self) -> None:
        try:
            super().close()
        finally:
            manager = getattr(self.connection_pool, "sentinel_manager", None)
            if manager is not None:
                manager.close()


def master_address(client: redis.asyncio.Redis) -> tuple[str, int] | None:
    """The master a Sentinel client talks to now (None before its first connection, and
    for any other client)."""
    pool = getattr(client, "connection_pool", None)  # a cluster client has none
    if isinstance(pool, _BlockingSentinelPool):
        address: tuple[str, int] | None = pool.master_address
        return address
    return None


async def follow_master(client: redis.asyncio.Redis, interval: float) -> None:
    """Ask the sentinels for the master every `interval` seconds, forever; returns at once
    for a client that does not go through Sentinel.

    Without it a client notices a failover only when a connection breaks. A master that
    dies breaks them all, but one that stalled, or that the sentinels lost sight of, comes
    back still a master and takes writes until Sentinel demotes it, and those writes are
    lost then. Once the sentinels name another master, every connection to the old one is
    closed before its next use (`_BlockingSentinelPool`). A failed question changes
    nothing: the next one, or the next new connection, asks again.
    """
    pool = getattr(client, "connection_pool", None)  # a cluster client has none
    if not isinstance(pool, _BlockingSentinelPool):
        return
    while True:
        await anyio.sleep(interval)
        try:
            await pool.get_master_address()
        except (redis.exceptions.RedisError, OSError) as exc:
            logger.debug("asking the sentinels for the master failed: %s", exc)


def _cluster_options(target: _Target, options: dict[str, Any]) -> dict[str, Any]:
    """Connection arguments for every node of a cluster: TLS to each node when asked."""
    kwargs = {**options, **target.userinfo}
    if target.tls:
        kwargs.update(target.tls, ssl=True)
    return kwargs


def _sentinel_options(
    target: _Target, options: dict[str, Any], no_retry: object
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Connection arguments for the master, and for the sentinels.

    Each sentinel is asked once (`no_retry`) with a short connect timeout: discovery moves
    on to the next sentinel by itself, while redis-py's default retry would back off for
    seconds on a sentinel that is down before trying the next.
    """
    node = {**options, **target.userinfo, "db": target.db, **target.tls}
    sentinel: dict[str, Any] = {
        "socket_timeout": options["socket_timeout"],
        "socket_connect_timeout": SENTINEL_CONNECT_TIMEOUT_S,
        "retry": no_retry,
    }
    if target.sentinel_auth:
        sentinel.update({k: node[k] for k in ("username", "password") if k in node})
    if target.tls:
        node["ssl"] = True  # the sentinel pool picks its TLS connection class from this
        sentinel.update(target.tls, ssl=True)
    return node, sentinel
