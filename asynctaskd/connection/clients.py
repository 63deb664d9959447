"""redis-py clients for a URL: `open_async` (a pool that waits for a free connection) and
`open_sync`, over TCP, TLS, a unix socket, Sentinel or Cluster; connection classes that
add to a failed handshake what to check (plain text on a TLS port, a missing client
certificate)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.connection
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.cluster
import redis.connection
import redis.exceptions
import redis.retry
import redis.sentinel
from redis.backoff import NoBackoff

from .sentinel import (
    _AsyncSentinelRedis,
    _BlockingSentinelPool,
    _cluster_options,
    _sentinel_options,
    _SyncSentinelRedis,
)
from .urls import TlsOptions, _checked, local_url

__all__ = ["open_async", "open_sync"]

# Per node: a cluster client cannot wait for a free connection, it fails, so allow many.
CLUSTER_MAX_CONNECTIONS: Final = 1000
CONNECT_TIMEOUT_S: Final = 5.0
HEALTH_CHECK_INTERVAL_S: Final = 30
RESP_VERSION: Final = 2  # what asyncio clients speak unless the URL asks otherwise


def open_async(
    url: str,
    tls: TlsOptions | None = None,
    *,
    credentials: Mapping[str, str] | None = None,
    max_connections: int = 64,
    socket_timeout: float | None = 10.0,
) -> redis.asyncio.Redis:
    """An asyncio client whose pool waits for a free connection instead of failing.

    Redis runs commands one at a time, so a few dozen connections serve thousands of
    concurrent handler calls; callers queue for a connection rather than erroring.
    `credentials` (username, password) are used unless the URL names its own.
    """
    url = local_url(url)
    target = _checked(url, tls)
    options = _options(credentials, socket_timeout)
    # RESP2, whatever redis-py's default (RESP3 from redis-py 8): the store reads replies
    # off the parser, which is only safe where no push frame can arrive (asynctaskd.wire).
    # A URL's protocol=3 still wins; the store then reads through redis-py's own path.
    options["protocol"] = RESP_VERSION
    if target.cluster:
        nodes = [redis.asyncio.cluster.ClusterNode(h, p) for h, p in target.hosts]
        cluster: redis.asyncio.Redis = redis.asyncio.RedisCluster(  # type: ignore[assignment]  # same commands, own class
            startup_nodes=nodes,
            max_connections=CLUSTER_MAX_CONNECTIONS,
            **_cluster_options(target, options),
        )
        return cluster
    if not target.sentinel:
        # As BlockingConnectionPool.from_url, whose URL options always win, except that
        # the connection class is ours (from_url would keep redis-py's for rediss://).
        arguments: dict[str, Any] = {
            **options,
            **target.tls,
            **redis.asyncio.connection.parse_url(url),
        }
        if target.scheme != "unix":
            secure = target.scheme == "rediss"
            arguments["connection_class"] = _AsyncTlsConnection if secure else _AsyncTcpConnection
        pool = redis.asyncio.BlockingConnectionPool(
            max_connections=max_connections, timeout=None, **arguments
        )
        return redis.asyncio.Redis(connection_pool=pool)
    node, sentinel = _sentinel_options(target, options, redis.asyncio.retry.Retry(NoBackoff(), 0))
    manager = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call]  # unannotated in redis-py
        target.hosts, sentinel_kwargs=sentinel, **node
    )
    client: redis.asyncio.Redis = manager.master_for(
        target.service,
        redis_class=_AsyncSentinelRedis,
        connection_pool_class=_BlockingSentinelPool,
        max_connections=max_connections,
        timeout=None,
    )
    return client


def open_sync(
    url: str,
    tls: TlsOptions | None = None,
    *,
    credentials: Mapping[str, str] | None = None,
    socket_timeout: float | None = 10.0,
) -> redis.Redis:
    """A blocking client for producers in sync code; the same URLs as `open_async`."""
    url = local_url(url)
    target = _checked(url, tls)
    options = _options(credentials, socket_timeout)
    if target.cluster:
        nodes = [redis.cluster.ClusterNode(h, p) for h, p in target.hosts]  # type: ignore[no-untyped-call]  # unannotated in redis-py
        cluster_sync: redis.Redis = redis.cluster.RedisCluster(  # type: ignore[assignment]  # same commands, own class
            startup_nodes=nodes, **_cluster_options(target, options)
        )
        return cluster_sync
    if not target.sentinel:
        if target.scheme != "unix":
            secure = target.scheme == "rediss"
            options["connection_class"] = _SyncTlsConnection if secure else _SyncTcpConnection
        return redis.Redis.from_url(url, **options, **target.tls)
    node, sentinel = _sentinel_options(target, options, redis.retry.Retry(NoBackoff(), 0))
    manager = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]  # unannotated in redis-py
        target.hosts, sentinel_kwargs=sentinel, **node
    )
    client: redis.Redis = manager.master_for(  # type: ignore[no-untyped-call]  # unannotated
        target.service, redis_class=_SyncSentinelRedis
    )
    return client


# ---- clients, pools and connections ----

_PLAIN_HINT: Final = (
    "the server hung up before answering: if this port speaks TLS, use a rediss:// URL"
)
_CERT_HINT: Final = (
    "if the server requires client certificates (tls-auth-clients), set tls_cert and "
    "tls_key, or ssl_certfile and ssl_keyfile in the URL"
)


def _dropped(exc: Exception) -> bool:
    """A connection that was accepted, then closed during the handshake."""
    text = str(exc)
    return any(m in text for m in ("while reading", "while writing", "closed by server"))


def _hinted(exc: Exception, hint: str) -> redis.exceptions.ConnectionError:
    return redis.exceptions.ConnectionError(f"{exc} ({hint})")


def _cert_missing(exc: Exception, certfile: object) -> bool:
    return not certfile and (_dropped(exc) or "certificate required" in str(exc))


# redis-py reports a TLS port answered in plain text, or a missing client certificate, as
# a bare "Connection reset by peer" or "EOF occurred in violation of protocol"; these
# connection classes add what to check.


class _AsyncTcpConnection(redis.asyncio.Connection):
    async def connect(self) -> None:
        try:
            await super().connect()  # type: ignore[no-untyped-call]  # unannotated in redis-py
        except redis.exceptions.ConnectionError as exc:
            if _dropped(exc):
                raise _hinted(exc, _PLAIN_HINT) from exc
            raise


class _AsyncTlsConnection(redis.asyncio.SSLConnection):
    async def connect(self) -> None:
        try:
            await super().connect()  # type: ignore[no-untyped-call]  # unannotated in redis-py
        except redis.exceptions.ConnectionError as exc:
            if _cert_missing(exc, self.certfile):
                raise _hinted(exc, _CERT_HINT) from exc
            raise


class _SyncTcpConnection(redis.connection.Connection):
    def connect(self) -> None:
        try:
            super().connect()  # type: ignore[no-untyped-call]  # unannotated in redis-py
        except redis.exceptions.ConnectionError as exc:
            if _dropped(exc):
                raise _hinted(exc, _PLAIN_HINT) from exc
            raise


class _SyncTlsConnection(redis.connection.SSLConnection):
    def connect(self) -> None:
        try:
            super().connect()  # type: ignore[no-untyped-call]  # unannotated in redis-py
        except redis.exceptions.ConnectionError as exc:
            if _cert_missing(exc, self.certfile):
                raise _hinted(exc, _CERT_HINT) from exc
            raise


def _options(credentials: Mapping[str, str] | None, socket_timeout: float | None) -> dict[str, Any]:
    return {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        **(credentials or {}),
    }
