"""Where redis-py's errors become ours (`StoreUnavailable`, `NotPermitted`, `ScriptError`,
`CorruptTask`): no redis-py exception leaves the store package."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import redis.exceptions as rex

from asynctaskd.errors import CorruptTask, NotPermitted, ScriptError, StoreUnavailable
from asynctaskd.wire import closed_under_io

# An ACL refusal: at the call, or inside a script (Redis and Valkey word it differently).
_ACL_REFUSALS: Final = ("NOPERM", "The user executing the script can't", "ACL failure in script")
# Replies that say "not now": redis-py strips the code off an error reply it knows
# ("CLUSTERDOWN The cluster is down" arrives as ClusterDownError("The cluster is down")),
# so these are told by class, not by text. MasterDownError is a ClusterDownError,
# MovedError an AskError.
_UNAVAILABLE_REPLIES: Final = (
    rex.ReadOnlyError,
    rex.ClusterDownError,
    rex.TryAgainError,
    rex.AskError,
)


@contextmanager
def _mapped(what: str) -> Iterator[None]:
    """The one place redis-py errors become ours."""
    try:
        yield
    except rex.NoScriptError:
        raise
    except (
        rex.ConnectionError,
        rex.TimeoutError,
        rex.BusyLoadingError,
        *_UNAVAILABLE_REPLIES,
    ) as exc:
        raise StoreUnavailable(
            f"{what}: Redis is unavailable ({type(exc).__name__}: {exc})"
        ) from exc
    except rex.NoPermissionError as exc:
        raise NotPermitted(
            f"{what}: the Redis user may not do this ({exc}); the ACL users in "
            "docs/security.md list what daemons, producers and operators may do"
        ) from exc
    except rex.ResponseError as exc:
        text = str(exc)
        if any(m in text for m in _ACL_REFUSALS):
            # inside a script, an ACL refusal arrives as a plain error reply
            raise NotPermitted(
                f"{what}: the Redis user may not do this ({text}); the ACL users in "
                "docs/security.md list what daemons, producers and operators may do"
            ) from exc
        if "asynctaskd:" in text:
            raise ScriptError(f"{what}: {text}") from exc
        # NOREPLICAS: a master set to take no writes without replicas (min-replicas-to-write)
        # refuses at a script's first write, so the script wrote nothing.
        unavailable = (
            "MASTERDOWN",
            "LOADING",
            "READONLY",
            "NOREPLICAS",
            "CLUSTERDOWN",
            "TRYAGAIN",
            "MOVED",
            "ASK",
        )
        if any(m in text for m in unavailable):
            raise StoreUnavailable(f"{what}: {text}") from exc
        raise ScriptError(f"{what}: Redis refused the script: {text}") from exc
    except (rex.RedisError, rex.RedisClusterException) as exc:
        # RedisClusterException (no RedisError): a slot nobody serves during a failover
        raise StoreUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc
    except (OSError, RuntimeError) as exc:
        # Below redis-py: with uvloop, writing on a transport closed under a reconnect
        # raises RuntimeError("... the handler is closed"); sockets raise OSError.
        raise StoreUnavailable(f"{what}: connection failed ({type(exc).__name__}: {exc})") from exc
    except AttributeError as exc:
        if not closed_under_io(exc):
            raise
        raise StoreUnavailable(f"{what}: connection closed ({type(exc).__name__}: {exc})") from exc


@contextmanager
def _reading_task(task_id: str) -> Iterator[None]:
    """A task key that is not a hash is corrupt data, not a store failure."""
    try:
        yield
    except rex.ResponseError as exc:
        if "WRONGTYPE" in str(exc):
            raise CorruptTask(task_id, "the task key holds another Redis type") from None
        raise
