"""The only code that talks to Redis about tasks: one method per Lua script, typed results.

Each operation is built once as a `Call` (script, keys, arguments, reply decoder) by a
pure function, then run by `Store` (asyncio) or `SyncStore` (blocking, for producers in
sync web apps). redis-py exceptions never leave this package: they become
`StoreUnavailable` or `ScriptError`.

    replies       Call, the reply types (Code, Result, Created, Lease, ...), reply decoding
    ops           Ops: a Call per script (pure)
    failures      where redis-py's errors become ours
    runner        running a Call: NOSCRIPT, loading scripts, cluster nodes; SyncStore
    batcher       pipelines of many calls, `_many` grouping, Batcher, Gate
    reads         snapshots, counts, pauses, server time and settings; read_many
    aio           Store: the wrappers over Ops, the daemon registry, the deployment record
"""

from __future__ import annotations

from .aio import Store
from .batcher import Batcher, Gate
from .ops import PAUSE_KINDS, PROMOTE_LIMIT, Ops, check_dimension
from .reads import Persistence, Read, read_many, read_many_sync
from .replies import (
    Call,
    ClaimBatch,
    Claimed,
    Code,
    Created,
    Lease,
    LookupBatch,
    Reconciled,
    Result,
    Sweep,
    task_or_request,
)
from .runner import SCRIPT_WAIT_S, SyncStore, open_redis, redis_credentials

# Every name other modules import (the one module this was had them all).
__all__ = [
    "PAUSE_KINDS",
    "PROMOTE_LIMIT",
    "SCRIPT_WAIT_S",
    "Batcher",
    "Call",
    "ClaimBatch",
    "Claimed",
    "Code",
    "Created",
    "Gate",
    "Lease",
    "LookupBatch",
    "Ops",
    "Persistence",
    "Read",
    "Reconciled",
    "Result",
    "Store",
    "Sweep",
    "SyncStore",
    "check_dimension",
    "open_redis",
    "read_many",
    "read_many_sync",
    "redis_credentials",
    "task_or_request",
]
