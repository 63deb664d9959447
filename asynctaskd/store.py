"""The only code that talks to Redis about tasks: one method per Lua script, typed results.

Each operation is built once as a `Call` (script, keys, arguments, reply decoder) by a
pure function, then run by `Store` (asyncio) or `SyncStore` (blocking, for producers in
sync web apps). redis-py exceptions never leave this module: they become
`StoreUnavailable` or `ScriptError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Final, Generic, TypeVar

import anyio
import msgspec
import redis.asyncio
import redis.asyncio.cluster as redis_cluster
import redis.exceptions as rex
from redis import Redis as SyncRedis

from .codec import decode_request, decode_task, pairs_to_dict
from .errors import ConfigError, CorruptTask, NotPermitted, ScriptError, StoreUnavailable
from .keys import HANDLER_KEY_RE, PROTOCOL_VERSION, Keys, deployment_problem, settings_problem
from .model import Phase, Status, Task, shard_of
from .scripts import Script, load_scripts
from .wire import closed_under_io, exchange, pack, refresh_slots

__all__ = [
    "Batcher",
    "Call",
    "ClaimBatch",
    "Claimed",
    "Code",
    "Created",
    "Gate",
    "Lease",
    "Persistence",
    "Result",
    "Store",
    "SyncStore",
    "open_redis",
]

_AsyncRedis = redis.asyncio.Redis  # a name no parameter called `redis` shadows

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Code(enum.IntEnum):
    """Reply codes shared by every script (docs/protocol.md lists the same table)."""

    OK = 1
    ACCEPTED = 2  # create: deduped to a live task; cancel: requested from the holder
    NOT_FOUND = -1
    STALE_FENCE = -2
    WRONG_VERSION = -3
    NO_LEASE = -4
    EXISTS = -5
    CANCEL_REQUESTED = -6
    ILLEGAL = -7
    STARTED = -8
    TERMINAL = -9
    DEDUP_STALE = -12  # create: the dedup key names a task that is gone; a daemon frees it


class Result(msgspec.Struct, frozen=True):
    """Outcome of a single-task write. Rejections are values, not exceptions."""

    code: Code
    version: int = 0
    status: Status | None = None

    @property
    def ok(self) -> bool:
        return self.code is Code.OK


class Created(msgspec.Struct, frozen=True):
    task_id: str
    deduped: bool
    version: int = 1
    created_ms: int = 0
    due_ms: int = 0
    # deduped to a task that no longer exists (task_id): a daemon frees the dedup key when it
    # next takes in requests, so the create can be sent again (Code.DEDUP_STALE)
    stale: bool = False


class Lease(msgspec.Struct, frozen=True):
    """What a worker holds while it works on a task: the fence and the version it read."""

    task_id: str
    fence: int
    version: int

    @property
    def shard(self) -> int:
        return shard_of(self.task_id)


class Claimed(msgspec.Struct, frozen=True):
    lease: Lease
    task: Task


class ClaimBatch(msgspec.Struct, frozen=True):
    claimed: list[Claimed]
    next_due_ms: int | None  # earliest due time still waiting in the phase, None if none
    ready_left: int  # due tasks still waiting to be claimed
    dropped: int  # entries found unclaimable (gone, timed out, canceled, quarantined, held)
    corrupt: list[CorruptTask] = []
    lanes: dict[str, tuple[int, int]] = {}  # rate lane -> (tokens used, tasks waiting)
    taken: int = 0  # producer requests taken in (submit phase; lua/_intake.lua)
    refused: list[tuple[str, str]] = []  # (task id, why) of create requests dropped


class LookupBatch(msgspec.Struct, frozen=True):
    """What `lookup` claimed: parked tasks leased for a vendor lookup (lua/lookup.lua)."""

    claimed: list[Claimed]
    next_due_ms: int | None  # earliest lookup still scheduled in the shard, None if none
    due_left: int  # due lookups left (of handlers this daemon does not serve, or beyond n)
    dropped: int  # entries that were no lookups to do (gone, settled, unreadable, leased)
    corrupt: list[CorruptTask] = []
    lookups: list[int] = []  # per claimed task: its lookups so far, this one included


class Reconciled(msgspec.Struct, frozen=True):
    """Outcome of a `reconcile`: a Result, and what the lookup settled."""

    code: Code
    version: int = 0
    status: Status | None = None
    what: str = ""  # found, resubmitted, again, gave_up

    @property
    def ok(self) -> bool:
        return self.code is Code.OK


class Call(Generic[T]):
    """One script invocation: everything needed to run it and read its reply."""

    __slots__ = ("args", "decode", "keys", "script")

    def __init__(
        self, script: str, keys: list[str], args: list[Any], decode: Callable[[Any], T]
    ) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.decode = decode


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# Every write's reply goes through _result: the usual values are looked up (~0.5 us a
# reply, not ~1.2), anything else is parsed as before, and refused with the same error.
_CODES: Final = {code.value: code for code in Code}
_STATUS_OF: Final = {status.value.encode(): status for status in Status}
_WITH_VERSION: Final = frozenset((Code.OK, Code.ACCEPTED, Code.CANCEL_REQUESTED))


def _status_of(value: Any) -> Status:
    return _STATUS_OF.get(value) or Status(_s(value))


def _result(reply: Any) -> Result:
    try:
        code = _CODES.get(reply[0]) or Code(int(reply[0]))
        if code in _WITH_VERSION and len(reply) > 1:
            status = _status_of(reply[2]) if len(reply) > 2 else None
            return Result(code, int(reply[1]), status)
        if code in (Code.ILLEGAL, Code.TERMINAL) and len(reply) > 1:
            return Result(code, 0, _status_of(reply[1]))
        return Result(code)
    except (ValueError, TypeError, IndexError) as exc:
        raise ScriptError(f"unexpected reply {reply!r}: {exc}") from None


def _outcome(call: Call[Any], reply: Any) -> Any:
    """A call's decoded reply, or the exception (ours) that stands in for it."""
    if isinstance(reply, Exception):
        try:
            with _mapped(call.script):
                raise reply
        except (StoreUnavailable, ScriptError) as exc:
            return exc
    try:
        return call.decode(reply)
    except Exception as exc:
        return exc


def _codes(reply: Any) -> list[Code]:
    try:
        return [Code(int(c)) for c in reply]
    except (ValueError, TypeError) as exc:
        raise ScriptError(f"unexpected reply {reply!r}: {exc}") from None


def _id_list(reply: Any) -> list[str]:
    count = int(reply[0])
    ids = [_s(x) for x in reply[1:]]
    if len(ids) != count:
        raise ScriptError(f"reply says {count} ids but has {len(ids)}")
    return ids


def _pairs(reply: Any) -> list[tuple[str, Status]]:
    count = int(reply[0])
    flat = reply[1:]
    out = [(_s(flat[i]), Status(_s(flat[i + 1]))) for i in range(0, len(flat), 2)]
    if len(out) != count:
        raise ScriptError(f"reply says {count} tasks but has {len(out)}")
    return out


PAUSE_KINDS: Final = ("handler", "provider", "tenant", "account")
# How long a user that may not load scripts (a producer) waits for a daemon to load them.
SCRIPT_WAIT_S: Final = 10.0
_NOT_LOADED: Final = (
    "the asynctaskd scripts of this version are not loaded in Redis ({name} is missing), "
    "and this Redis user may not load them: start a daemon of this version, or run "
    "`asynctaskd scripts load` as an operator"
)
PROMOTE_LIMIT: Final = 1000  # a claim moves at most this many newly due tasks to ready


def check_dimension(dimension: str) -> None:
    """Raise ValueError unless `dimension` is '<kind>:<name>' with a known kind."""
    kind, sep, name = dimension.partition(":")
    if not sep or kind not in PAUSE_KINDS or not HANDLER_KEY_RE.fullmatch(name):
        raise ValueError(
            f"cannot pause {dimension!r}: use handler:<key>, provider:<name>, "
            "tenant:<name> or account:<name> (letters, digits, '_', '.', ':', '-')"
        )


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))


class Ops:
    """Builds every Call for one namespace. Pure: no I/O."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    def _prefix(self, shard: int) -> str:
        return self.keys.tag(shard) + ":"

    def _task(self, task_id: str) -> tuple[str, str]:
        shard = shard_of(task_id)
        if shard >= self.keys.shards:
            raise ValueError(
                f"task id {task_id!r} is on shard {shard}, but only {self.keys.shards} "
                "shard(s) are configured"
            )
        return self._prefix(shard), self.keys.task(shard, task_id)

    def create(
        self,
        task_id: str,
        handler: str,
        params_json: bytes,
        *,
        timeout_ms: int,
        provider: str = "",
        tenant: str = "",
        account: str = "",
        priority: int = 0,
        delay_ms: int = 0,
        not_before_ms: int = 0,
        metadata_json: bytes = b"",
        dedup_key: str = "",
    ) -> Call[Created]:
        prefix, task_key = self._task(task_id)
        shard = shard_of(task_id)
        dedup = (
            self.keys.dedup(shard, tenant, dedup_key) if dedup_key else self.keys.no_dedup(shard)
        )

        def decode(reply: Any) -> Created:
            code = int(reply[0])
            if code == 1:
                return Created(task_id, False, int(reply[1]), int(reply[2]), int(reply[3]))
            if code == 2:
                return Created(_s(reply[1]), True)
            if code == Code.DEDUP_STALE:
                return Created(_s(reply[1]), True, stale=True)
            if code == Code.EXISTS:
                raise ScriptError(f"task id {task_id} already exists: ids must be unique")
            raise ScriptError(f"unexpected create reply {reply!r}")

        args = [
            task_id,
            handler,
            provider,
            tenant,
            account,
            priority,
            delay_ms,
            not_before_ms,
            timeout_ms,
            params_json,
            metadata_json,
            dedup_key,
        ]
        return Call("create", [prefix, task_key, dedup], args, decode)

    def claim(
        self,
        shard: int,
        phase: Phase,
        n: int,
        lease_ms: int,
        owner: str,
        promote_limit: int,
        grants: Mapping[str, int] | None = None,
    ) -> Call[ClaimBatch]:
        def decode(reply: Any) -> ClaimBatch:
            next_due = int(reply[0]) or None
            claimed: list[Claimed] = []
            corrupt: list[CorruptTask] = []
            info = reply[3]
            lanes = {
                _s(info[i]): (int(info[i + 1]), int(info[i + 2])) for i in range(0, len(info), 3)
            }
            intake = reply[4]
            refused = [(_s(intake[i]), _s(intake[i + 1])) for i in range(1, len(intake) - 1, 2)]
            for item in reply[5:]:
                task_id = _s(item[0])
                try:
                    task = decode_task(pairs_to_dict(item[3]), task_id)
                except CorruptTask as exc:
                    corrupt.append(exc)
                    continue
                claimed.append(Claimed(Lease(task_id, int(item[1]), int(item[2])), task))
            return ClaimBatch(
                claimed, next_due, int(reply[1]), int(reply[2]), corrupt, lanes,
                int(intake[0]), refused,
            )  # fmt: skip

        args: list[Any] = [phase, n, lease_ms, owner, promote_limit]
        for lane, tokens in (grants or {}).items():
            args += (lane, tokens)
        return Call("claim", [self._prefix(shard)], args, decode)

    def start(
        self, lease: Lease, idempotent: bool, token: str = "", find_visible_ms: int | None = None
    ) -> Call[Result]:
        """Mark the submit started; `token` (unique to this start) lets `withdraw` take
        the mark back. `find_visible_ms` (a handler that can `find` its vendor job): how
        long after the mark a created job is visible to the lookup; a task parked under
        this mark is then due for lookups (lua/lookup.lua)."""
        prefix, task_key = self._task(lease.task_id)
        args = [lease.task_id, lease.fence, lease.version, "1" if idempotent else "0"]
        if token or find_visible_ms is not None:
            args.append(token)
        if find_visible_ms is not None:
            args.append(find_visible_ms)
        return Call("start", [prefix, task_key], args, _result)

    def lookup(
        self, shard: int, n: int, lease_ms: int, owner: str, handlers: Sequence[str]
    ) -> Call[LookupBatch]:
        """Lease up to n parked tasks of `handlers` whose vendor lookup is due."""

        def decode(reply: Any) -> LookupBatch:
            claimed: list[Claimed] = []
            corrupt: list[CorruptTask] = []
            lookups: list[int] = []
            for item in reply[3:]:
                task_id = _s(item[0])
                fields = pairs_to_dict(item[3])
                try:
                    task = decode_task(fields, task_id)
                except CorruptTask as exc:
                    corrupt.append(exc)
                    continue
                claimed.append(Claimed(Lease(task_id, int(item[1]), int(item[2])), task))
                lookups.append(int(fields.get(b"lookups", b"1")))
            return LookupBatch(
                claimed, int(reply[0]) or None, int(reply[1]), int(reply[2]), corrupt, lookups
            )

        args: list[Any] = [n, lease_ms, owner, *handlers]
        return Call("lookup", [self._prefix(shard)], args, decode)

    def reconcile(
        self,
        lease: Lease,
        outcome: str,
        *,
        retry_ms: int,
        max_lookups: int,
        give_up_ms: int,
        external_id: str = "",
        handle_json: bytes = b"",
        message: str = "",
    ) -> Call[Reconciled]:
        """Settle a parked task from a lookup: `outcome` is found, none or error."""

        def decode(reply: Any) -> Reconciled:
            code = Code(int(reply[0]))
            if code is not Code.OK:
                return Reconciled(code)
            return Reconciled(code, int(reply[1]), _status_of(reply[2]), _s(reply[3]))

        prefix, task_key = self._task(lease.task_id)
        args = [lease.task_id, lease.fence, lease.version, outcome, retry_ms, max_lookups,
                give_up_ms, external_id, handle_json, message]  # fmt: skip
        return Call("reconcile", [prefix, task_key], args, decode)

    def withdraw(
        self,
        lease: Lease,
        token: str,
        *,
        delay_ms: int = 0,
        fields: dict[str, str | bytes | int | float] | None = None,
    ) -> Call[Result]:
        """Take back the start mark `token` made (if it is there) and the lease: the task
        goes back to PENDING_SUBMIT, due in `delay_ms`. Only for a submit whose vendor call
        did not happen."""
        prefix, task_key = self._task(lease.task_id)
        args: list[Any] = [lease.task_id, lease.fence, token, delay_ms]
        for name, value in (fields or {}).items():
            args.append(name)
            args.append(value)
        return Call("withdraw", [prefix, task_key], args, _result)

    def save(
        self,
        lease: Lease,
        status: Status,
        *,
        delay_ms: int = 0,
        fields: dict[str, str | bytes | int | float] | None = None,
    ) -> Call[Result]:
        prefix, task_key = self._task(lease.task_id)
        args: list[Any] = [lease.task_id, lease.fence, lease.version, status.value, delay_ms]
        for name, value in (fields or {}).items():
            args.append(name)
            args.append(value)
        return Call("save", [prefix, task_key], args, _result)

    def create_many(self, creates: Sequence[Call[Created]]) -> Call[list[Any]]:
        """`create` calls of tasks of one shard as one call (see `_many`)."""
        return self._many("create_many", creates)

    def start_many(self, starts: Sequence[Call[Result]]) -> Call[list[Any]]:
        """`start` calls to tasks of one shard as one call (see `_many`)."""
        return self._many("start_many", starts)

    def save_many(self, saves: Sequence[Call[Result]]) -> Call[list[Any]]:
        """`save` calls to tasks of one shard as one call (see `_many`)."""
        return self._many("save_many", saves)

    def _many(self, script: str, calls: Sequence[Call[Any]]) -> Call[list[Any]]:
        """Calls of one single-task script (`create`, `start`, `save`) to tasks of one
        shard as one call of its `_many` script: the prefix, then each call's other keys.
        Its reply is each call's reply in order, undecoded: a call that raised has its
        error reply in its place."""
        one = _ONE_OF[script]
        prefix = calls[0].keys[0]
        keys = [prefix]
        args: list[Any] = []
        for call in calls:
            if call.script != one or call.keys[0] != prefix:
                raise ValueError(f"{script} takes {one} calls to tasks of one shard")
            keys.extend(call.keys[1:])
            args.append(len(call.args))
            args.extend(call.args)
        count = len(calls)

        def decode(reply: Any) -> list[Any]:
            if not isinstance(reply, list) or len(reply) != count:
                raise ScriptError(f"{script}: expected {count} replies, got {reply!r}")
            return reply

        return Call(script, keys, args, decode)

    def renew(self, shard: int, lease_ms: int, leases: Sequence[Lease]) -> Call[list[Code]]:
        args: list[Any] = [lease_ms]
        for lease in leases:
            args.append(lease.task_id)
            args.append(lease.fence)
        return Call("renew", [self._prefix(shard)], args, _codes)

    def release(self, shard: int, leases: Sequence[Lease]) -> Call[list[Code]]:
        args: list[Any] = []
        for lease in leases:
            args.extend((lease.task_id, lease.fence, lease.version))
        return Call("release", [self._prefix(shard)], args, _codes)

    def cancel(self, task_id: str, tenant: str | None = None) -> Call[Result]:
        prefix, task_key = self._task(task_id)
        args = [task_id, "0" if tenant is None else "1", tenant or ""]
        return Call("cancel", [prefix, task_key], args, _result)

    def reap(self, shard: int, limit: int, max_reclaims: int) -> Call[list[tuple[str, Status]]]:
        return Call("reap", [self._prefix(shard)], [limit, max_reclaims], _pairs)

    def time_out(self, shard: int, limit: int) -> Call[list[str]]:
        return Call("time_out", [self._prefix(shard)], [limit], _id_list)

    def resolve(
        self,
        task_id: str,
        target: Status,
        *,
        external_id: str = "",
        handle_json: bytes = b"",
        message: str = "",
    ) -> Call[Result]:
        prefix, task_key = self._task(task_id)
        args = [task_id, target.value, external_id, handle_json, message]
        return Call("resolve", [prefix, task_key], args, _result)

    def purge(self, shard: int, older_than_ms: int, limit: int) -> Call[list[str]]:
        """An operator's purge of terminal tasks (the daemons' retention is `expire`)."""
        return Call("purge", [self._prefix(shard)], [older_than_ms, limit], _id_list)

    def expire(self, shard: int, retention_ms: int, limit: int) -> Call[list[str]]:
        """The daemons' retention: delete terminal tasks older than `retention_ms`."""
        return Call("expire", [self._prefix(shard)], [retention_ms, limit], _id_list)

    def pause(self, shard: int, dimension: str, note: str = "") -> Call[bool]:
        """Hold back new submits for `dimension` ('tenant:t1', 'handler:ocr', ...)."""
        check_dimension(dimension)
        return Call("pause", [self._prefix(shard)], [dimension, note[:200]],
                    lambda reply: int(reply[0]) == 1)  # fmt: skip

    def resume(self, shard: int, dimension: str, limit: int = 1000) -> Call[tuple[int, int]]:
        """Lift a pause; returns (moved back, still held). Call again while still held."""
        check_dimension(dimension)
        return Call("resume", [self._prefix(shard)], [dimension, limit],
                    lambda reply: (int(reply[0]), int(reply[1])))  # fmt: skip

    def quarantine(self, task_id: str, reason: str) -> Call[Result]:
        prefix, task_key = self._task(task_id)
        return Call("quarantine", [prefix, task_key], [task_id, reason[:500]], _result)

    # Admission (asynctaskd.admission): the {adm} slot, then each shard's copy.

    def take(self, mode: str, lanes: Mapping[str, int]) -> Call[dict[str, tuple[int, int]]]:
        """Take (or refund) tokens per rate lane; lane -> (granted, ms until the next)."""
        names = list(lanes)

        def decode(reply: Any) -> dict[str, tuple[int, int]]:
            return {
                lane: (int(reply[2 * i]), int(reply[2 * i + 1])) for i, lane in enumerate(names)
            }

        args: list[Any] = [mode]
        for lane, count in lanes.items():
            args += (lane, count)
        return Call("take", [self.keys.admission()], args, decode)

    def quota(self, tenant: str) -> Call[tuple[bool | None, int]]:
        """Count one submit against the tenant's quota: (True, 0) counted, (False, wait_ms)
        refused, (None, 0) no quota applies (lua/quota.lua)."""

        def decode(reply: Any) -> tuple[bool | None, int]:
            code = int(reply[0])
            return (None if code == 2 else code == 1), int(reply[1])

        return Call("quota", [self.keys.admission()], [tenant], decode)

    def limits(
        self, mode: str, entries: Sequence[tuple[str, bytes | str]]
    ) -> Call[tuple[int, int, list[str]]]:
        """Write limit entries (scope, JSON or '' to delete); returns the new version, how
        many scopes changed, and the scopes a runtime entry kept (mode 'config')."""
        args: list[Any] = [mode]
        for scope, raw in entries:
            args += (scope, raw)

        def decode(reply: Any) -> tuple[int, int, list[str]]:
            return int(reply[0]), int(reply[1]), [_s(x) for x in reply[2:]]

        return Call("limits", [self.keys.admission()], args, decode)

    def stage_limits(
        self,
        shard: int,
        version: int,
        token: str,
        lease_ms: int,
        first: bool,
        pairs: Sequence[tuple[str, str]],
    ) -> Call[int]:
        """Stage one chunk (at most 1000 fields) of a shard's next admission table; returns
        1 staged, 0 the shard is up to date already, -1 another build owns the shard (or
        this one lost it)."""
        args: list[Any] = [version, token, lease_ms, "1" if first else "0"]
        for field, value in pairs:
            args += (field, value)
        return Call("stage_limits", [self._prefix(shard)], args, lambda reply: int(reply[0]))

    def sync_limits(
        self, shard: int, version: int, limit: int = 1000, token: str = "", size: int = 0
    ) -> Call[tuple[int, int, int]]:
        """Swap in the table staged under `token` (`size` fields), then lift holds; returns
        (applied: 1, 0 or -1 for a staged table that was not whole, moved back, still to
        move). Token '' only lifts holds."""
        return Call("sync_limits", [self._prefix(shard)], [version, limit, token, size],
                    lambda reply: (int(reply[0]), int(reply[1]), int(reply[2])))  # fmt: skip


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


def task_or_request(raw: Any, request: Any, task_id: str) -> Any:
    """The task hash as read, or, while it does not exist yet, the fields of its create
    request (lua/_intake.lua): a task reads as PENDING_SUBMIT from the moment it is
    submitted. Read the request first, then the hash (one pipeline): a daemon that takes
    the request in between leaves the hash to be read. Raises CorruptTask if the request
    cannot be read."""
    if raw or not request:
        return raw
    return decode_request(request, task_id)


def _task_reply(raw: Any, task_id: str) -> Task | None:
    if not raw:
        return None
    return decode_task(raw, task_id)


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


# Single-task scripts whose calls to one shard, sent together, go as one call of a script
# that runs several (each script call costs Redis a fixed amount before its first command).
_MANY_OF: Final = {"create": "create_many", "start": "start_many", "save": "save_many"}
_ONE_OF: Final = {many: one for one, many in _MANY_OF.items()}
# At most this many calls go in one such call. One script call holds the server for its
# whole run (a save ~0.1 ms), so other clients wait behind it at most a few milliseconds.
_CALLS_PER_MANY: Final = 32


class Store(_Base):
    """Asyncio access to tasks in Redis. One instance per daemon or client."""

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
        with _mapped(call.script):
            try:
                reply = await self._evalsha(call)
            except rex.NoScriptError:
                # The server lost its script cache (restart, failover): NOSCRIPT means it
                # did not run, so loading and running again is safe.
                await self._load(script)
                reply = await self._evalsha(call)
        self._timed(call.script, started)
        return call.decode(reply)

    async def _evalsha(self, call: Call[Any]) -> Any:
        if self.cluster:  # redis-py routes it to the node of its slot
            script = self.scripts[call.script]
            return await self.redis.evalsha(script.sha, len(call.keys), *call.keys, *call.args)
        reply = (await self._send_packed((call,), None, 0.0))[0]
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
        """Close the per-node clients of cluster mode (the main client is the caller's)."""
        for client in self._nodes.values():
            with contextlib.suppress(Exception):
                await client.aclose()
        self._nodes.clear()

    async def run_many(self, calls: Sequence[Call[Any]]) -> list[Any]:
        """Run several calls in one round trip; each result is a value or the exception."""
        results, _, _ = await self.pipeline(calls)
        return results

    async def pipeline(
        self,
        calls: Sequence[Call[Any]],
        trailer: tuple[Any, ...] | None = None,
        trailer_wait: float = 0.0,
        *,
        name: str = "pipeline",
    ) -> tuple[list[Any], list[bool], Any]:
        """Run calls in one round trip, then `trailer` (e.g. WAITAOF) on the same connection.
        The replies may take the socket timeout plus `trailer_wait` (the trailer's own wait).
        `name` is what the round trip is counted, timed and reported as.

        Returns (results, rerun, trailer reply): each result is a value or the exception;
        rerun[i] is True when call i hit NOSCRIPT and was sent again, with the others that
        did, after the trailer (so a durability gate in the trailer did not cover it).
        """
        if not calls:
            return [], [], []
        self._count(name)
        started = time.perf_counter()
        wire, carried = self._coalesced(calls)
        if self.cluster:
            replies, trailers = await self._pipeline_by_node(wire, trailer, trailer_wait)
        else:
            with _mapped(name):
                replies = await self._send_packed(wire, trailer, trailer_wait)
            trailers = [replies.pop() if trailer is not None else None] * len(wire)
        self._timed(name, started)
        missing = [isinstance(reply, rex.NoScriptError) for reply in replies]
        if any(missing):
            again = [i for i, m in enumerate(missing) if m]
            reloaded = await self._reloaded([wire[i] for i in again], name)
            for i, reply in zip(again, reloaded, strict=True):
                replies[i] = reply
        if carried is None:
            return [_outcome(c, r) for c, r in zip(calls, replies, strict=True)], missing, trailers
        out: list[Any] = [None] * len(calls)
        rerun, trailed = [False] * len(calls), [None] * len(calls)
        sent = zip(wire, carried, replies, missing, trailers, strict=True)
        for call, indexes, reply, sent_again, end in sent:
            for i in indexes:
                rerun[i], trailed[i] = sent_again, end
            if len(indexes) == 1 and call is calls[indexes[0]]:
                out[indexes[0]] = _outcome(call, reply)
                continue
            items = _outcome(call, reply)
            for j, i in enumerate(indexes):
                out[i] = items if isinstance(items, Exception) else _outcome(calls[i], items[j])
        return out, rerun, trailed

    def _coalesced(
        self, calls: Sequence[Call[Any]]
    ) -> tuple[list[Call[Any]], list[list[int]] | None]:
        """The calls to send for `calls`: where several are `create` (`start`, `save`)
        calls to one shard, they go as `create_many` (`start_many`, `save_many`) calls of
        at most _CALLS_PER_MANY each, where the first of them was. Returns them and, for
        each, the indexes in `calls` it carries (None: `calls` as they are)."""
        groups: dict[tuple[str, str], list[int]] = {}
        carried: list[list[int]] = []
        for i, call in enumerate(calls):
            if call.script in _MANY_OF:
                key = (call.script, call.keys[0])
                group = groups.get(key)
                if group is not None and len(group) < _CALLS_PER_MANY:
                    group.append(i)
                    continue
                groups[key] = group = [i]
                carried.append(group)
            else:
                carried.append([i])
        if len(carried) == len(calls):
            return list(calls), None
        wire = [
            calls[g[0]]
            if len(g) == 1
            else self.ops._many(_MANY_OF[calls[g[0]].script], [calls[i] for i in g])
            for g in carried
        ]
        return wire, carried

    async def _send_packed(
        self,
        calls: Sequence[Call[Any]],
        trailer: tuple[Any, ...] | None,
        trailer_wait: float,
        client: redis.asyncio.Redis | None = None,
    ) -> list[Any]:
        """One write of every EVALSHA (and the trailer) on one pooled connection of
        `client` (a cluster node's own client; by default ours), then one reply per
        command; an error reply is returned in its place, not raised.

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
        pool = (client or self.redis).connection_pool
        return await exchange(pool, b"".join(commands), len(commands), trailer_wait)

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

    async def _reloaded(self, calls: Sequence[Call[Any]], name: str) -> list[Any]:
        """Replies to calls that met NOSCRIPT (the server lost its script cache: restart,
        failover), so did not run: each script is loaded once, and the calls sent again
        together, counted as `name`. An error stands in for the replies it prevented."""
        self._count(name)
        try:
            with _mapped(calls[0].script):
                await self._load(self.scripts[calls[0].script])
            if self.cluster:
                return (await self._pipeline_by_node(calls, None, 0.0))[0]
            with _mapped(name):
                return await self._send_packed(calls, None, 0.0)
        except (StoreUnavailable, ScriptError) as exc:
            return [exc] * len(calls)

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
        out: dict[str, int] = {}
        with _mapped("counts"):
            for shard in range(self.keys.shards):
                raw = await self.redis.hgetall(self.keys.counts(shard))
                for k, v in raw.items():
                    name = _s(k)
                    out[name] = out.get(name, 0) + int(v)
        return out

    async def server_time(self) -> float:
        with _mapped("time"):
            sec, usec = await self.redis.time()
        return float(sec) + usec / 1e6

    # Convenience wrappers over Ops, one per script.

    async def claim(
        self,
        shard: int,
        phase: Phase,
        n: int,
        lease_ms: int,
        owner: str,
        promote_limit: int = PROMOTE_LIMIT,
        grants: Mapping[str, int] | None = None,
    ) -> ClaimBatch:
        """Claim up to n due tasks; corrupt ones are quarantined and reported, not returned."""
        call = self.ops.claim(shard, phase, n, lease_ms, owner, promote_limit, grants)
        batch = await self.run(call)
        await self._quarantine(batch)
        return batch

    async def claim_each(self, calls: Sequence[Call[ClaimBatch]]) -> list[ClaimBatch | Exception]:
        """Claim calls (`Ops.claim`: a shard's phases, say) in one round trip: each one's
        batch, or the error it met; raises StoreUnavailable if the round trip itself
        failed. Corrupt tasks are quarantined as `claim` does."""
        results, _, _ = await self.pipeline(calls, name="claim")
        for batch in results:
            if isinstance(batch, ClaimBatch):
                await self._quarantine(batch)
        return results

    async def _quarantine(self, batch: ClaimBatch) -> None:
        for bad in batch.corrupt:
            logger.error(
                "quarantining corrupt task: %s", bad.reason, extra={"task_id": bad.task_id}
            )
            await self.run(self.ops.quarantine(bad.task_id, bad.reason))

    async def lookup(
        self, shard: int, n: int, lease_ms: int, owner: str, handlers: Sequence[str]
    ) -> LookupBatch:
        """Lease up to n due lookups; corrupt tasks are quarantined, not returned."""
        batch = await self.run(self.ops.lookup(shard, n, lease_ms, owner, handlers))
        for bad in batch.corrupt:
            logger.error(
                "quarantining corrupt task: %s", bad.reason, extra={"task_id": bad.task_id}
            )
            await self.run(self.ops.quarantine(bad.task_id, bad.reason))
        return batch

    async def parked(self) -> dict[str, int]:
        """Parked tasks (SUBMIT_UNKNOWN) over all shards: those a lookup will settle
        ("lookup": scheduled in due:find, or being looked up) and those left to an
        operator ("operator")."""
        reads: list[Read] = []
        for shard in range(self.keys.shards):
            reads.append(("hget", (self.keys.counts(shard), Status.SUBMIT_UNKNOWN.value), {}))
            reads.append(("zcard", (self.keys.lookups(shard),), {}))
        replies = await read_many(self, reads)
        parked = sum(int(r or 0) for r in replies[0::2])
        lookup = sum(int(r or 0) for r in replies[1::2])
        return {"lookup": min(lookup, parked), "operator": max(0, parked - lookup)}

    async def start(self, lease: Lease, idempotent: bool) -> Result:
        return await self.run(self.ops.start(lease, idempotent))

    async def save(
        self,
        lease: Lease,
        status: Status,
        *,
        delay_ms: int = 0,
        fields: dict[str, str | bytes | int | float] | None = None,
    ) -> Result:
        return await self.run(self.ops.save(lease, status, delay_ms=delay_ms, fields=fields))

    async def renew(self, lease_ms: int, leases: Sequence[Lease]) -> dict[str, Code]:
        """Renew many leases, one call per shard; returns each task's code."""
        return await self._per_shard(leases, lambda shard, group: self.ops.renew(
            shard, lease_ms, group))  # fmt: skip

    async def release(self, leases: Sequence[Lease]) -> dict[str, Code]:
        """Give leases back without an outcome, one call per shard; each task's code."""
        return await self._per_shard(leases, self.ops.release)

    async def _per_shard(
        self, leases: Sequence[Lease], build: Callable[[int, list[Lease]], Call[list[Code]]]
    ) -> dict[str, Code]:
        by_shard: dict[int, list[Lease]] = {}
        for lease in leases:
            by_shard.setdefault(lease.shard, []).append(lease)
        out: dict[str, Code] = {}
        for shard, group in by_shard.items():
            codes = await self.run(build(shard, group))
            out.update(zip((lease.task_id for lease in group), codes, strict=True))
        return out

    async def cancel(self, task_id: str, tenant: str | None = None) -> Result:
        return await self.run(self.ops.cancel(task_id, tenant))

    async def reap(self, shard: int, limit: int, max_reclaims: int) -> list[tuple[str, Status]]:
        return await self.run(self.ops.reap(shard, limit, max_reclaims))

    async def time_out(self, shard: int, limit: int) -> list[str]:
        return await self.run(self.ops.time_out(shard, limit))

    async def resolve(
        self,
        task_id: str,
        target: Status,
        *,
        external_id: str = "",
        handle_json: bytes = b"",
        message: str = "",
    ) -> Result:
        return await self.run(
            self.ops.resolve(
                task_id, target, external_id=external_id, handle_json=handle_json, message=message
            )
        )

    async def expire(self, shard: int, retention_ms: int, limit: int) -> list[str]:
        return await self.run(self.ops.expire(shard, retention_ms, limit))

    async def purge(self, shard: int, older_than_ms: int, limit: int) -> list[str]:
        return await self.run(self.ops.purge(shard, older_than_ms, limit))

    # Pauses (submit phase), on every shard.

    async def pause(self, dimension: str, note: str = "") -> bool:
        """Hold back new submits for a dimension on every shard; True if newly paused."""
        results = [await self.run(self.ops.pause(s, dimension, note))
                   for s in range(self.keys.shards)]  # fmt: skip
        return any(results)

    async def resume(self, dimension: str) -> int:
        """Lift a pause on every shard; returns how many held tasks went back."""
        moved = 0
        for shard in range(self.keys.shards):
            while True:
                n, left = await self.run(self.ops.resume(shard, dimension))
                moved += n
                if not left:
                    break
        return moved

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

    async def publish_daemon(
        self, daemon_id: str, handler_keys: Sequence[str], record: bytes, ttl_ms: int
    ) -> None:
        """Heartbeat: this daemon and the handler keys it serves, valid for ttl_ms."""
        expiry = str(int(time.time() * 1000) + ttl_ms)
        with _mapped("heartbeat"):
            async with self.redis.pipeline(transaction=False) as pipe:
                if handler_keys:
                    pipe.hset(self.keys.handlers(), mapping=dict.fromkeys(handler_keys, expiry))
                pipe.hset(self.keys.daemons(), daemon_id, record)
                await pipe.execute()

    async def remove_daemon(self, daemon_id: str) -> None:
        with _mapped("heartbeat"):
            await self.redis.hdel(self.keys.daemons(), daemon_id)

    async def register_deployment(self) -> None:
        """Record this namespace's protocol version and shard count, or check them against
        what the first daemon recorded: ConfigError when they differ (a daemon with another
        shard count would leave tasks on shards nobody claims, and break dedup)."""
        key = self.keys.deployment()
        mine = {"protocol": PROTOCOL_VERSION, "shards": self.keys.shards}
        with _mapped("deployment"):
            await self.redis.set(key, msgspec.json.encode(mine), nx=True)
            stored = await self.redis.get(key)
        problem = deployment_problem(stored, self.keys)
        if problem:
            raise ConfigError(f"{problem}: set [redis] shards to match")


class _Pending:
    __slots__ = ("call", "done", "durable", "gated")

    def __init__(self, call: Call[Any], gated: bool) -> None:
        self.call = call
        self.gated = gated
        # Resolves to the decoded reply or the exception to raise. A future, not an
        # anyio Event: one per saved outcome, and an Event costs several times as much.
        self.done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.durable = True

    def resolve(self, result: Any) -> None:
        if not self.done.done():  # cancelled when the caller stopped waiting
            self.done.set_result(result)


class Batcher:
    """Sends the calls that many coroutines make at the same moment as one pipeline.

    A daemon with a thousand handler calls in flight saves their outcomes through this:
    one round trip (and one durability gate) carries everything queued since the last
    one, with up to `max_pipelines` round trips in flight. `run()` must be running in
    a task group for `call()` to make progress.

    With `standalone=True` nothing needs to run: each call schedules the sending on the
    event loop's next pass (a producer's client has no task of its own), a call alone
    goes out as it is, and a call whose caller stopped waiting before it went out is
    not sent. Calls queued on an event loop that stopped before sending them are dropped.
    """

    def __init__(
        self,
        store: Store,
        gate: Gate | None = None,
        *,
        max_batch: int = 256,
        max_pipelines: int = 4,
        standalone: bool = False,
    ) -> None:
        self.store = store
        self.gate = gate
        self.max_batch = max_batch
        self.max_pipelines = max_pipelines
        self.standalone = standalone
        self._queue: list[_Pending] = []
        # asyncio's own primitives: a flush per batch of saves, many a second, and anyio's
        # start_soon costs ~22 us here (a TaskGroup task ~3), a Semaphore acquire ~4 us.
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # standalone: the queue's loop
        self._flushes: set[asyncio.Task[None]] = set()  # standalone: held, the loop won't
        self.gate_seconds = 0.0

    async def call(self, call: Call[T], *, gated: bool = False) -> tuple[T, bool]:
        """Run `call` in the next pipeline. Returns (result, durable); raises what it raised.

        With gated=True and a gate configured, durable says whether the gate confirmed
        the write (False also when the server had to be sent the call again).
        """
        pending = _Pending(call, gated and self.gate is not None)
        if self.standalone:
            self._enqueue_here(pending)
        else:
            self._queue.append(pending)
            self._wake.set()
        result = await pending.done
        if isinstance(result, BaseException):
            raise result
        return result, pending.durable

    async def run(self) -> None:
        slots = asyncio.Semaphore(self.max_pipelines)
        async with asyncio.TaskGroup() as tg:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._queue:
                    await slots.acquire()
                    batch = self._queue[: self.max_batch]
                    del self._queue[: self.max_batch]
                    tg.create_task(self._flush(batch, slots))

    def _enqueue_here(self, pending: _Pending) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # first use, or a new loop: the old one's callers are gone
            self._loop, self._queue = loop, []
        if not self._queue:
            loop.call_soon(self._send)
        self._queue.append(pending)

    def _send(self) -> None:
        queued, self._queue = [p for p in self._queue if not p.done.done()], []
        for start in range(0, len(queued), self.max_batch):
            flush = asyncio.ensure_future(self._flush(queued[start : start + self.max_batch]))
            self._flushes.add(flush)
            flush.add_done_callback(self._flushes.discard)

    async def _flush(self, batch: list[_Pending], slots: asyncio.Semaphore | None = None) -> None:
        # The gate rides along only when a call in the batch asked for it.
        gate = self.gate if any(p.gated for p in batch) else None
        try:
            if self.standalone and gate is None and len(batch) == 1:
                results: list[Any] = [await self.store.run(batch[0].call)]
            else:
                t0 = time.perf_counter()
                results, rerun, replies = await self.store.pipeline(
                    [p.call for p in batch],
                    None if gate is None else gate.command(),
                    0.0 if gate is None else gate.timeout_ms / 1000,
                )
                if gate is not None:
                    self.gate_seconds = time.perf_counter() - t0
                    for p, again, reply in zip(batch, rerun, replies, strict=True):
                        ok = not isinstance(reply, Exception) and gate.satisfied(reply)
                        p.durable = ok and not again
        except Exception as exc:
            results = [exc] * len(batch)
        except BaseException:  # cancelled: the writes may or may not have happened
            stopped = StoreUnavailable("pipeline: stopped before Redis answered")
            for p in batch:
                p.resolve(stopped)
            raise
        finally:
            if slots is not None:
                slots.release()
        for p, result in zip(batch, results, strict=True):
            p.resolve(result)


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


class Gate(msgspec.Struct, frozen=True):
    """A durability gate: WAITAOF numlocal numreplicas timeout, or WAIT numreplicas timeout."""

    kind: str
    local: int
    replicas: int
    timeout_ms: int

    def command(self) -> tuple[str | int, ...]:
        if self.kind == "WAITAOF":
            return ("WAITAOF", self.local, self.replicas, self.timeout_ms)
        return ("WAIT", self.replicas, self.timeout_ms)

    def satisfied(self, reply: Any) -> bool:
        if self.kind == "WAITAOF":
            return int(reply[0]) >= self.local and int(reply[1]) >= self.replicas
        return int(reply) >= self.replicas


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
        out: dict[str, int] = {}
        with _mapped("counts"):
            for shard in range(self.keys.shards):
                raw: dict[bytes, bytes] = self.redis.hgetall(self.keys.counts(shard))  # type: ignore[assignment]  # sync client returns a dict
                for k, v in raw.items():
                    name = _s(k)
                    out[name] = out.get(name, 0) + int(v)
        return out


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
    from .connection import open_async

    return open_async(
        url,
        credentials=redis_credentials(),
        max_connections=max_connections,
        socket_timeout=socket_timeout,
    )


# ---------------------------------------------------------------------------------------
# Plain reads for asynctaskd.client (snapshots, indexes, the event stream, registries).
# Added for the client; the scripts above stay the only writers. Each read is a redis-py
# method name with its arguments, so both clients share one description of the work.

Read = tuple[str, tuple[Any, ...], dict[str, Any]]


# Commands without a key cannot be pipelined on Redis Cluster (no slot to route them by).
_KEYLESS: Final = frozenset({"time"})


def _split(cluster: bool, reads: Sequence[Read]) -> tuple[list[int], list[int]]:
    """Indexes of the reads to pipeline and of those to send on their own."""
    if not cluster:
        return list(range(len(reads))), []
    alone = [i for i, r in enumerate(reads) if r[0] in _KEYLESS]
    return [i for i in range(len(reads)) if i not in alone], alone


async def read_many(store: Store, reads: Sequence[Read]) -> list[Any]:
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
