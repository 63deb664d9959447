"""Producer and operator API: AsyncClient and Client (blocking).

Both clients share every rule. A method builds a *plan*: a generator that validates its
arguments, yields the Redis work it needs (a script `Call`, a batch of `Reads`, a
`Pause`, or a `TaskEvent` for `watch`), gets each reply back, and returns the result.
Plans do no I/O; `AsyncClient` runs them with asyncio and `Client` with blocking sockets.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import hashlib
import math
import os
import random
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from typing import IO, Any, Final, Literal, Self, TypeAlias, TypeVar, cast

import msgspec
import redis
import redis.asyncio
import redis.exceptions

from asynctaskd import admission
from asynctaskd.admission import Entry
from asynctaskd.codec import DEFAULT_MAX_PAYLOAD, check_json_like, decode_task, encode_payload
from asynctaskd.config import HandlerConfig, LimitConfig
from asynctaskd.cursors import (
    KEY_BYTES,
    Position,
    derive_key,
    filters_of,
    open_cursor,
    seal,
    sealed_with,
)
from asynctaskd.errors import (
    ConfigError,
    CorruptTask,
    IllegalTransition,
    InvalidTask,
    QuotaExceeded,
    ScriptError,
    StoreUnavailable,
    TaskNotFound,
    UnknownHandler,
)
from asynctaskd.keys import HANDLER_KEY_RE, Keys, deployment_problem, new_task_id, shard_for_dedup
from asynctaskd.model import Status, Task
from asynctaskd.plans import Pause, Reads
from asynctaskd.plans import advance as _advance
from asynctaskd.plans import read as _read
from asynctaskd.routing import (
    MAX_ROUTE_KEY,
    Group,
    MemberSpec,
    active_fields,
    choose,
    decode_group,
    encode_group,
    loads,
    make_group,
)
from asynctaskd.store import (
    Batcher,
    Call,
    Code,
    Created,
    Ops,
    Read,
    Result,
    Store,
    SyncStore,
    check_dimension,
    open_redis,
    read_many,
    read_many_sync,
    redis_credentials,
    task_or_request,
)

__all__ = ["AsyncClient", "Client", "Stats", "TaskEvent", "TaskPage"]

T = TypeVar("T")

HANDLER_CACHE_S: Final = 5.0  # how long a client trusts its copy of the live handler keys
GROUP_CACHE_S: Final = 5.0  # how long a client trusts its copy of the handler groups
QUOTA_CACHE_S: Final = 1.0  # how long a client trusts its list of tenants with a quota
CURSOR_KEY_CACHE_S: Final = 60.0  # how long a client trusts its copy of the cursor key
STALE_DEDUP_WAIT_S: Final = 5.0  # how long a submit waits for a daemon to free a stale dedup key
BLOCK_S: Final = 5.0  # longest XREAD BLOCK; below the 10 s socket timeout of from_url
REPLY_MARGIN_S: Final = 5.0  # client-side bound on a blocking read: BLOCK plus this
RECONNECT_BUDGET_S: Final = 30.0  # watch() gives up after this long without Redis
DAEMON_STALE_S: Final = 30.0
MAX_SECONDS: Final = 10 * 366 * 86400.0  # keeps every ms figure an exact integer in Lua
XREAD_COUNT: Final = 500
_ID_RE: Final = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}(?:-([1-9][0-9]{0,3}))?")
_PURGED: Final = (Status.SUCCEEDED, Status.FAILED, Status.CANCELED, Status.TRACKING_TIMED_OUT)
_RESOLVABLE: Final = (Status.SUBMITTED, Status.PENDING_SUBMIT, Status.FAILED, Status.CANCELED)
_REQUEUE: Final = (Status.FAILED, Status.TRACKING_TIMED_OUT)
_TRANSIENT: Final = (
    StoreUnavailable,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)


class TaskEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One status or progress change, as `watch()` yields it. `at` is epoch seconds."""

    task_id: str
    status: Status
    version: int
    progress: float | None = None
    stage: str | None = None
    message: str | None = None
    at: float = 0.0


class TaskPage(msgspec.Struct, frozen=True):
    """One page of `list()`; pass `cursor` back to continue, None when the walk is done."""

    tasks: list[Task]
    cursor: str | None = None


class Stats(msgspec.Struct, frozen=True):
    """Exact counts (every status in `by_status`; only non-zero ones per handler) and the
    heartbeats of daemons seen in the last 30 seconds. `requests`: producers' creates and
    cancels that no daemon has taken in yet (their tasks read as PENDING_SUBMIT but are
    counted once a daemon takes them in, within milliseconds while one runs)."""

    by_status: dict[Status, int]
    by_handler: dict[str, dict[Status, int]]
    daemons: list[dict[str, Any]]
    requests: int = 0


Step: TypeAlias = Call[Any] | Reads | Pause | TaskEvent
Plan: TypeAlias = Generator[Step, Any, T]


class _Context:
    """What plans need from a client: key names, script calls, limits, the handler cache."""

    def __init__(self, namespace: str, shards: int, max_payload: int) -> None:
        self.keys = Keys(namespace, shards)
        self.ops = Ops(self.keys)
        self.max_payload = max_payload
        self.live_until_ms: dict[str, int] = {}
        self.live_read_at = -math.inf  # monotonic seconds of the last HGETALL handlers
        self.groups: dict[str, bytes] = {}  # group name -> its JSON definition, decoded on use
        self.groups_read_at = -math.inf  # monotonic seconds of the last HGETALL groups
        self.quotas: set[str] = set()  # tenants with a submit quota ("*": every tenant)
        self.quotas_read_at = -math.inf
        self.cursor_key = b""  # derived from <ns>:cursor_key; empty until first needed
        self.cursor_key_read_at = -math.inf
        self.deployment_problem = ""  # keys.deployment_problem of <ns>:deployment, as read
        self.deployment_read_at = -math.inf  # monotonic seconds, with the groups and handlers

    def remember_handlers(self, raw: dict[bytes, bytes]) -> dict[str, int]:
        out = {}
        for k, v in raw.items():
            try:
                out[k.decode()] = int(v)
            except ValueError:
                continue  # not ours to judge; an unreadable entry just does not count
        self.live_until_ms = out
        self.live_read_at = time.monotonic()
        return out

    def remember_groups(self, raw: dict[bytes, bytes]) -> dict[str, bytes]:
        self.groups = {k.decode(): v for k, v in raw.items()}
        self.groups_read_at = time.monotonic()
        return self.groups


# Validation and argument building.


def _name(value: object, what: str) -> str:
    if value is None and what != "handler":
        return ""
    if not isinstance(value, str) or not HANDLER_KEY_RE.fullmatch(value):
        raise InvalidTask(
            f"{what} must be 1-64 characters from letters, digits, '_', '.', ':' and '-', "
            f"got {value!r}"
        )
    return value


def _seconds(value: object, what: str, *, positive: bool) -> float:
    if isinstance(value, dt.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf  # an int too large for a float: refused just below
    else:
        raise InvalidTask(
            f"{what} must be a number of seconds or a datetime.timedelta, "
            f"got {type(value).__name__}"
        )
    low_ok = seconds > 0 if positive else seconds >= 0
    if not (math.isfinite(seconds) and low_ok and seconds <= MAX_SECONDS):
        bound = "more than 0" if positive else "at least 0"
        raise InvalidTask(f"{what} must be {bound} seconds and at most 10 years, got {value!r}")
    return seconds


def _epoch_ms(value: object) -> int:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise InvalidTask(
                "not_before must be timezone-aware, e.g. datetime.now(timezone.utc) + ..."
            )
        seconds = value.timestamp()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf  # refused just below
    else:
        raise InvalidTask(
            f"not_before must be an aware datetime or epoch seconds, got {type(value).__name__}"
        )
    if not (math.isfinite(seconds) and 0 <= seconds <= time.time() + MAX_SECONDS):
        raise InvalidTask(
            f"not_before must be epoch seconds (not milliseconds) within 10 years, got {value!r}"
        )
    return round(seconds * 1000)


def _shard(keys: Keys, task_id: object) -> int:
    """The shard of a task id, or InvalidTask if the id is not one of ours."""
    m = _ID_RE.fullmatch(task_id) if isinstance(task_id, str) else None
    if m is None:
        raise InvalidTask(
            f"{task_id!r} is not a task id: expected 26 Crockford base32 characters "
            "(a ULID), with '-<shard>' appended for shards above 0"
        )
    shard = int(m[1] or 0)
    if shard >= keys.shards:
        raise InvalidTask(
            f"task id {task_id} is on shard {shard}, but this client is configured with "
            f"{keys.shards} shard(s): use the same `shards` as the daemons"
        )
    return shard


def _status(value: object) -> Status:
    try:
        return Status(value)
    except ValueError:
        names = ", ".join(s.value for s in Status)
        raise InvalidTask(f"{value!r} is not a status; one of {names}") from None


def content_dedup_key(handler: str, params: Any) -> str:
    """The dedup key `submit(dedup="content")` uses: "content:" and the SHA-256 of the
    handler key and the params as JSON with sorted object keys, so the same request of the
    same tenant finds the live task whatever order its keys were written in."""
    try:
        canonical = msgspec.json.encode(params, order="sorted")
    except (TypeError, msgspec.EncodeError, RecursionError) as exc:
        raise InvalidTask(f"params cannot be hashed for dedup='content': {exc}") from None
    digest = hashlib.sha256(handler.encode() + b"\0" + canonical).hexdigest()
    return f"content:{digest}"


def _dedup(handler: str, params: Any, dedup: object, dedup_key: str | None) -> str | None:
    if dedup is None:
        return dedup_key
    if dedup != "content":
        raise InvalidTask(f"dedup must be 'content' or None, got {dedup!r:.60}")
    if dedup_key is not None:
        raise InvalidTask("give dedup_key or dedup='content', not both")
    return content_dedup_key(handler, params)


def _prepare_submit(
    ctx: _Context,
    handler: str,
    params: Any,
    tracking_timeout: float | dt.timedelta,
    tenant: str | None,
    account: str | None,
    provider: str | None,
    priority: int,
    dedup_key: str | None,
    metadata: Any,
    not_before: dt.datetime | float | None,
    delay: float | dt.timedelta | None,
    route_key: str | None,
) -> tuple[Callable[[str], tuple[Call[Created], Task]], int]:
    """Validate a submit; return a builder of the create call and the task it writes for a
    given handler key (the one named, or the member a group routes to), and timeout_ms."""
    _name(handler, "handler")
    tenant_s, account_s = _name(tenant, "tenant"), _name(account, "account")
    provider_s = _name(provider, "provider")
    timeout_ms = max(1, round(_seconds(tracking_timeout, "tracking_timeout", positive=True) * 1000))
    if not isinstance(priority, int) or isinstance(priority, bool) or not -100 <= priority <= 100:
        raise InvalidTask(f"priority must be an integer from -100 to 100, got {priority!r}")
    if not_before is not None and delay is not None:
        raise InvalidTask("give not_before or delay, not both")
    delay_ms = 0 if delay is None else round(_seconds(delay, "delay", positive=False) * 1000)
    not_before_ms = 0 if not_before is None else _epoch_ms(not_before)
    if dedup_key is not None and not (isinstance(dedup_key, str) and 0 < len(dedup_key) <= 200):
        raise InvalidTask(f"dedup_key must be a non-empty str of at most 200 characters, "
                          f"got {dedup_key!r:.60}")  # fmt: skip
    if dedup_key is not None:
        check_json_like(dedup_key, "dedup_key")  # refuses text that cannot be UTF-8
    if route_key is not None and not (
        isinstance(route_key, str) and 0 < len(route_key) <= MAX_ROUTE_KEY
    ):
        raise InvalidTask(f"route_key must be a non-empty str of at most {MAX_ROUTE_KEY} "
                          f"characters, got {route_key!r:.60}")  # fmt: skip
    params_json = encode_payload(params, "params", ctx.max_payload)
    metadata_json = (
        b"" if metadata is None else encode_payload(metadata, "metadata", ctx.max_payload)
    )
    shards = ctx.keys.shards
    if dedup_key:  # the same tenant and key always land on the same shard, so dedup works
        shard = shard_for_dedup(tenant_s, dedup_key, shards)
    else:
        shard = random.randrange(shards) if shards > 1 else 0

    def build(handler: str) -> tuple[Call[Created], Task]:
        task_id = new_task_id(shard)
        call = ctx.ops.create(
            task_id, handler, params_json, timeout_ms=timeout_ms, provider=provider_s,
            tenant=tenant_s, account=account_s, priority=priority, delay_ms=delay_ms,
            not_before_ms=not_before_ms, metadata_json=metadata_json, dedup_key=dedup_key or "",
        )  # fmt: skip
        task = Task(
            id=task_id, handler=handler, status=Status.PENDING_SUBMIT,
            params=msgspec.json.decode(params_json),
            metadata=msgspec.json.decode(metadata_json) if metadata_json else None,
            tenant=tenant_s, account=account_s, provider=provider_s or handler,
            priority=priority, dedup_key=dedup_key,
        )  # fmt: skip
        return call, task

    return build, timeout_ms


# Decoding.


def _public(task: Task) -> Task:
    return msgspec.structs.replace(
        task, fence=0, owner=None, started_fence=0, reclaims=0, idempotent=False
    )


def _visible(raw: dict[bytes, bytes], task_id: str, tenant: str | None) -> Task | None:
    if not raw:
        return None
    task = decode_task(raw, task_id)
    return None if tenant is not None and task.tenant != tenant else task


def _entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """XREAD reply entries, whichever shape redis-py gave (RESP2 list or RESP3 dict)."""
    if not reply:
        return []
    groups = reply.values() if isinstance(reply, dict) else (g[1] for g in reply)
    out: list[tuple[bytes, dict[bytes, bytes]]] = []
    for entries in groups:
        if entries and isinstance(entries[0], list):
            entries = entries[0]
        out.extend(entries)
    return out


def event_from_entry(task_id: str, entry_id: bytes, fields: dict[bytes, bytes]) -> TaskEvent | None:
    """One events-stream entry of `task_id` as a TaskEvent; None if our scripts did not
    write it."""
    try:
        progress = fields.get(b"progress")
        return TaskEvent(
            task_id=task_id,
            status=Status(fields[b"status"].decode()),
            version=int(fields[b"version"]),
            progress=None if progress is None else float(progress),
            stage=(fields.get(b"stage") or b"").decode() or None,
            message=(fields.get(b"message") or b"").decode() or None,
            at=int(entry_id.split(b"-")[0]) / 1000,
        )
    except (KeyError, ValueError):
        return None  # written by something that is not our scripts: not an event of ours


def _task_event(task: Task) -> TaskEvent:
    """The task's state as an event, shaped as the stream's are (progress, stage and
    message come with RUNNING only), so that a state reads the same whether watch() took
    it from the stream or from the hash."""
    if task.status is not Status.RUNNING:
        return TaskEvent(
            task_id=task.id, status=task.status, version=task.version, at=task.updated_at
        )
    return TaskEvent(
        task_id=task.id, status=task.status, version=task.version, progress=task.progress,
        stage=task.stage, message=task.message, at=task.updated_at,
    )  # fmt: skip


def _xread(stream: str, last: bytes, seconds: float) -> Reads:
    """The entries after `last`, then (same pipeline, so the server runs it after the XREAD
    returns) the entry at `last` itself, which `_continuous` needs."""
    block_ms = max(1, int(seconds * 1000))
    return Reads(
        _read("xread", {stream: last}, count=XREAD_COUNT, block=block_ms),
        _read("xrevrange", stream, last, last),
        bound=seconds + REPLY_MARGIN_S,
    )


def _continuous(at_last: Any) -> bool:
    """Whether the XREAD of `_xread` saw every entry ever added after `last`.

    XREAD returns the entries after `last` that are still there: it cannot tell whether
    the capped stream (MAXLEN ~, section 8 of docs/protocol.md) was trimmed past `last`
    before it ran, so a change could be lost. Trimming only ever removes the oldest entries
    (no script deletes one), so if the entry at `last` is still there after the XREAD,
    every entry after it is too, and the XREAD saw them all. If it is gone (trimmed, the
    stream deleted, a server that took over without it), the caller re-reads the task.
    The proof costs one lookup in the round trip the XREAD makes anyway; a needless
    re-read happens only when `last` is 0-0 (the stream was empty at the snapshot) or was
    itself trimmed while its successors were not.
    """
    return bool(at_last)


# Plans: every operation, as Redis work to do and what to make of the replies.


def _check_deployment(ctx: _Context) -> Plan[None]:
    """Before a create: the namespace's shard count and protocol are this client's
    (keys.deployment_problem). Read with the groups and handlers (`_find_group`), so it
    costs no round trip of its own."""
    if ctx.deployment_read_at == -math.inf:
        (raw,) = yield Reads(_read("get", ctx.keys.deployment()))
        ctx.deployment_problem = deployment_problem(raw, ctx.keys)
        ctx.deployment_read_at = time.monotonic()
    if ctx.deployment_problem:
        raise ConfigError(f"{ctx.deployment_problem}: pass shards= to match; nothing was written")


def _check_handler(ctx: _Context, handler: str) -> Plan[None]:
    now_ms = time.time() * 1000
    fresh = time.monotonic() - ctx.live_read_at < HANDLER_CACHE_S
    if fresh and ctx.live_until_ms.get(handler, 0) > now_ms:
        return
    # Stale, or not known yet: a daemon may have just started, so ask before refusing.
    (raw,) = yield Reads(_read("hgetall", ctx.keys.handlers()), share="handlers")
    live = ctx.remember_handlers(raw)
    if live.get(handler, 0) > now_ms:
        return
    names = ", ".join(sorted(k for k, until in live.items() if until > now_ms)) or "none"
    raise UnknownHandler(
        f"no live daemon serves handler {handler!r} (live handlers: {names}); start a daemon "
        "that registers it, or submit with strict=False"
    )


def _group_name(value: object) -> str:
    return _name("" if value is None else value, "group name")


def _find_group(ctx: _Context, name: str) -> Plan[Group | None]:
    """The group called `name`, or None if it is a plain handler key."""
    now = time.monotonic()
    if now - ctx.groups_read_at < GROUP_CACHE_S:
        if name in ctx.groups:
            return decode_group(name, ctx.groups[name])
        if (now - ctx.live_read_at < HANDLER_CACHE_S
                and ctx.live_until_ms.get(name, 0) > time.time() * 1000):  # fmt: skip
            return None  # a live handler, and no group had that name a moment ago
    # A miss: the group may have just been defined. Refresh the handlers too, in the same
    # round trip, so the strict check that follows usually needs none.
    groups, handlers, deployment = yield Reads(
        _read("hgetall", ctx.keys.groups()),
        _read("hgetall", ctx.keys.handlers()),
        _read("get", ctx.keys.deployment()),
        share="groups+handlers",
    )
    ctx.deployment_problem = deployment_problem(deployment, ctx.keys)
    ctx.deployment_read_at = time.monotonic()
    ctx.remember_handlers(handlers)
    raw = ctx.remember_groups(groups).get(name)
    return None if raw is None else decode_group(name, raw)


def _route(ctx: _Context, name: str, route_key: str | None) -> Plan[str]:
    """The handler key a submit to `name` creates its task with: `name` itself, or the one
    member its group's policy picks (workers never re-route)."""
    group = yield from _find_group(ctx, name)
    if group is None:
        return name
    if group.policy == "consistent_hash":
        if route_key is None:
            raise InvalidTask(
                f"handler group {name!r} routes by consistent_hash: submit with a route_key "
                "(the business key, e.g. a customer id)"
            )
        return choose(group, route_key=route_key)
    if group.policy == "least_active":
        fields = active_fields(group.members)
        replies = yield Reads(
            *(_read("hmget", ctx.keys.counts(s), fields) for s in range(ctx.keys.shards))
        )
        return choose(group, active=loads(group.members, replies))
    # INCR itself, not redis-py's INCRBY: a producer's ACL user may only count up
    (counter,) = yield Reads(_read("execute_command", "INCR", ctx.keys.group_counter(name)))
    return choose(group, counter=int(counter))


def _set_group(ctx: _Context, name: str, policy: str, members: Sequence[MemberSpec]) -> Plan[Group]:
    group = make_group(name, policy, members)
    raw_groups, raw_handlers = yield Reads(
        _read("hgetall", ctx.keys.groups()), _read("hgetall", ctx.keys.handlers())
    )
    live, known = ctx.remember_handlers(raw_handlers), ctx.remember_groups(raw_groups)
    if live.get(name, 0) > time.time() * 1000:
        raise InvalidTask(
            f"{name!r} is the key of a live handler: a group cannot have the same name, or "
            "submits to it would be ambiguous"
        )
    for m in group.members:
        if m.handler == name or m.handler in known:
            raise InvalidTask(
                f"group {name!r}: member {m.handler!r} is a group; members are handler keys"
            )
    for other, raw in known.items():
        try:
            used = other != name and any(
                m.handler == name for m in decode_group(other, raw).members
            )
        except InvalidTask:
            continue  # a corrupt group is reported when it is used, not here
        if used:
            raise InvalidTask(
                f"{name!r} is a member of group {other!r}: a group cannot have a handler's name"
            )
    encoded = encode_group(group)
    yield Reads(_read("hset", ctx.keys.groups(), name, encoded))
    ctx.groups[name] = encoded
    return group


def _groups(ctx: _Context) -> Plan[dict[str, Group]]:
    (raw,) = yield Reads(_read("hgetall", ctx.keys.groups()))
    known = ctx.remember_groups(raw)
    return {name: decode_group(name, known[name]) for name in sorted(known)}


def _delete_group(ctx: _Context, name: str) -> Plan[bool]:
    name = _group_name(name)
    removed, _ = yield Reads(
        _read("hdel", ctx.keys.groups(), name), _read("delete", ctx.keys.group_counter(name))
    )
    ctx.groups.pop(name, None)
    return bool(removed)


def _submit(ctx: _Context, strict: bool, args: tuple[Any, ...]) -> Plan[Task]:
    build, timeout_ms = _prepare_submit(ctx, *args)  # everything is checked before routing,
    handler = yield from _route(ctx, args[0], args[-1])  # which may write (INCR)
    yield from _check_deployment(ctx)
    call, task = build(handler)
    if strict:
        yield from _check_handler(ctx, task.handler)
    if task.tenant and (yield from _has_quota(ctx, task.tenant)):
        # A duplicate of a live task is no new submit: answer with it before counting.
        existing = yield from _deduplicated(ctx, task)
        if existing is not None:
            return existing
        counted, wait_ms = yield ctx.ops.quota(task.tenant)
        if counted is False:
            raise QuotaExceeded(task.tenant, wait_ms / 1000)
    stale_since: float | None = None
    vanished = 0
    while vanished < 3:
        created: Created = yield call
        if created.stale:
            # The dedup key names a task that is gone; the create asked the daemons to free
            # it (only they may), which takes them a moment. Nothing was written.
            now = time.monotonic()
            stale_since = now if stale_since is None else stale_since
            if now - stale_since > STALE_DEDUP_WAIT_S:
                raise StoreUnavailable(
                    f"dedup key {task.dedup_key!r} of tenant {task.tenant!r} still names task "
                    f"{created.task_id}, which no longer exists, after "
                    f"{STALE_DEDUP_WAIT_S:.0f}s: no daemon is taking in requests"
                )
            yield Pause(0.05)
            continue
        if not created.deduped:
            at = created.created_ms / 1000
            return msgspec.structs.replace(
                task, version=created.version, created_at=at, updated_at=at,
                deadline_at=(created.created_ms + timeout_ms) / 1000,
                due_at=created.due_ms / 1000,
            )  # fmt: skip
        existing = yield from _get(ctx, created.task_id, None, False)
        if existing is not None:
            return existing
        vanished += 1  # the live duplicate vanished between the two calls: create again
    raise ScriptError(f"create kept deduplicating {task.id} to tasks that do not exist")


def _deduplicated(ctx: _Context, task: Task) -> Plan[Task | None]:
    """The live task a submit with the same tenant and dedup key would return, if any."""
    if not task.dedup_key:
        return None
    (existing,) = yield Reads(_read("get", ctx.keys.dedup(task.shard, task.tenant, task.dedup_key)))
    if existing is None:
        return None
    found = yield from _get(ctx, existing.decode(), None, False)
    return found if found is not None and not found.status.is_terminal else None


def _task_reads(ctx: _Context, shard: int, task_id: str) -> tuple[Read, Read]:
    """The task's create request, then its hash: `task_or_request` picks from the two."""
    return (
        _read("get", ctx.keys.request(shard, task_id)),
        _read("hgetall", ctx.keys.task(shard, task_id)),
    )


def _get(ctx: _Context, task_id: str, tenant: str | None, internals: bool) -> Plan[Task | None]:
    request, raw = yield Reads(*_task_reads(ctx, _shard(ctx.keys, task_id), task_id))
    task = _visible(task_or_request(raw, request, task_id), task_id, tenant)
    return task if task is None or internals else _public(task)


def _open(ctx: _Context, task_id: str, tenant: str | None) -> Plan[tuple[Task, bytes]]:
    """Snapshot plus the stream position it is current at."""
    shard = _shard(ctx.keys, task_id)
    # The stream id is read before the hash in the same pipeline, so any change after that
    # id is in the stream; one between the two is also in the snapshot (version filter).
    last, request, raw = yield Reads(
        _read("xrevrange", ctx.keys.events(shard), "+", "-", count=1),
        *_task_reads(ctx, shard, task_id),
    )
    task = _visible(task_or_request(raw, request, task_id), task_id, tenant)
    if task is None:
        raise TaskNotFound(f"no task {task_id}")
    return _public(task), (last[0][0] if last else b"0-0")


def _wait(ctx: _Context, task_id: str, timeout: float, tenant: str | None) -> Plan[Task]:
    deadline = time.monotonic() + _seconds(timeout, "timeout", positive=False)
    task, last = yield from _open(ctx, task_id, tenant)
    stream, tid, changed = ctx.keys.events(task.shard), task_id.encode(), False
    while not task.status.is_settled:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        reply, at_last = yield _xread(stream, last, min(remaining, BLOCK_S))
        settled = False
        for entry_id, fields in _entries(reply):
            last = entry_id
            if fields.get(b"task") == tid:
                changed = True
                event = event_from_entry(task_id, entry_id, fields)
                settled = settled or (event is not None and event.status.is_settled)
        if settled or not _continuous(at_last):
            task, changed = (yield from _reread(ctx, task)), False
    if changed:
        task = yield from _reread(ctx, task)
    return task


def _reread(ctx: _Context, task: Task) -> Plan[Task]:
    request, raw = yield Reads(*_task_reads(ctx, task.shard, task.id))
    fresh = _visible(task_or_request(raw, request, task.id), task.id, None)
    if fresh is None:
        raise TaskNotFound(f"task {task.id} was purged")
    return _public(fresh)


def _backoff(since: float | None, exc: Exception) -> Generator[Step, Any, float]:
    now = time.monotonic()
    since = now if since is None else since
    if now - since > RECONNECT_BUDGET_S:
        raise StoreUnavailable(
            f"watch gave up after {RECONNECT_BUDGET_S:.0f}s without Redis: {exc}"
        ) from exc
    yield Pause(min(1.0, max(0.05, (now - since) / 4)))
    return since


def _watch(ctx: _Context, task_id: str, tenant: str | None) -> Plan[None]:
    failing: float | None = None
    opened: tuple[Task, bytes] | None = None
    while opened is None:
        try:
            opened = yield from _open(ctx, task_id, tenant)
        except _TRANSIENT as exc:
            failing = yield from _backoff(failing, exc)
    task, last = opened
    shown = _task_event(task)
    yield shown
    stream, tid, version = ctx.keys.events(task.shard), task_id.encode(), task.version
    reconnected = False
    while not shown.status.is_settled:
        fresh: Task | None = None
        try:
            # Just after a reconnect, take what the stream has without blocking, then
            # re-read the task: `_continuous` proves that no entry after `last` was
            # trimmed, and the re-read also covers one missing for any other reason while
            # the client was away. It costs one read, on a rare path.
            reply, at_last = yield _xread(stream, last, 0 if reconnected else BLOCK_S)
            if reconnected or not _continuous(at_last):
                fresh = yield from _reread(ctx, task)
        except _TRANSIENT as exc:
            failing = yield from _backoff(failing, exc)
            reconnected = True
            continue  # resume from the last id seen
        failing, reconnected = None, False
        for entry_id, fields in _entries(reply):
            last = entry_id
            event = (
                event_from_entry(task_id, entry_id, fields) if fields.get(b"task") == tid else None
            )
            if event is not None and event.version > version:
                version, shown = event.version, event
                yield event
                if event.status.is_settled:
                    return
        if fresh is not None:  # read after these entries: at least as new as any of them
            task, version = fresh, fresh.version
            current = _task_event(fresh)
            if _shows(current) != _shows(shown):
                shown = current
                yield shown


def _shows(event: TaskEvent) -> tuple[Any, ...]:
    """What a watcher sees change: versions also move silently (a start, a query claim)."""
    return event.status, event.progress, event.stage, event.message


def _cancel(ctx: _Context, task_id: str, tenant: str | None) -> Plan[bool]:
    _shard(ctx.keys, task_id)
    result: Result = yield ctx.ops.cancel(task_id, tenant)
    if result.code is Code.NOT_FOUND:
        raise TaskNotFound(f"no task {task_id}")
    return result.code is not Code.TERMINAL


def _list(
    ctx: _Context, status: Status | str | None, handler: str | None, tenant: str | None,
    limit: int, cursor: str | None,
) -> Plan[TaskPage]:  # fmt: skip
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 1000:
        raise InvalidTask(f"limit must be an integer from 1 to 1000, got {limit!r}")
    statuses = list(Status) if status is None else [_status(status)]
    filters = filters_of(None if status is None else statuses[0].value, handler, tenant)
    si, shard, score, after = 0, 0, None, b""
    if cursor is not None:
        sealing = yield from _cursor_key(ctx)
        if not sealed_with(sealing, cursor):  # the key may have changed since it was read
            sealing = yield from _cursor_key(ctx, reload=True)
        si, shard, score, after = open_cursor(sealing, filters, cursor)
        if si >= len(statuses) or shard >= ctx.keys.shards:
            raise InvalidTask(
                f"cursor {cursor!r:.40} was made by a client with more shards than this one"
            )
    out: list[Task] = []
    budget = 20 * limit  # entries looked at per call, so a rare filter cannot stall a call
    batch = min(max(2 * limit, 50), 500)
    while si < len(statuses):
        st, offset, done = statuses[si], 0, False
        key = ctx.keys.index(shard, st)
        while budget > 0 and not done:
            (entries,) = yield Reads(
                _read("zrevrangebyscore", key, "+inf" if score is None else score, "-inf",
                      start=offset, num=batch, withscores=True)
            )  # fmt: skip
            # Ties on the score are ordered by id, descending: skip those already seen.
            fresh = [(m, int(s)) for m, s in entries
                     if score is None or int(s) != score or m < after]  # fmt: skip
            if not fresh and len(entries) == batch:
                offset += batch
                continue
            offset, done = 0, len(entries) < batch and len(fresh) <= budget
            fresh = fresh[:budget]
            raws = yield Reads(*(_read("hgetall", ctx.keys.task(shard, m.decode()))
                                 for m, _ in fresh))  # fmt: skip
            for (member, s), raw in zip(fresh, raws, strict=True):
                budget, score, after = budget - 1, s, member
                try:
                    task = _visible(raw, member.decode(), tenant)
                except CorruptTask:
                    continue  # the worker quarantines it; a listing should not fail on it
                if task and task.status is st and handler in (None, task.handler):
                    out.append(_public(task))
                    if len(out) == limit:
                        return (yield from _page(ctx, out, filters, Position(si, shard, s, member)))
        if not done:
            return (yield from _page(ctx, out, filters, Position(si, shard, score, after)))
        shard, score, after = shard + 1, None, b""
        if shard == ctx.keys.shards:
            si, shard = si + 1, 0
    return TaskPage(out, None)


def _page(ctx: _Context, tasks: list[Task], filters: bytes, position: Position) -> Plan[TaskPage]:
    """A page that goes on: its cursor seals the position, which may be at a task the caller
    must not learn about (another tenant's, where the budget ran out)."""
    sealing = yield from _cursor_key(ctx)
    return TaskPage(tasks, seal(sealing, filters, position))


def _cursor_key(ctx: _Context, *, reload: bool = False) -> Plan[bytes]:
    """The namespace's cursor key: read (cached), or made by the first client that needs it."""
    now = time.monotonic()
    if ctx.cursor_key and now - ctx.cursor_key_read_at < CURSOR_KEY_CACHE_S and not reload:
        return ctx.cursor_key
    name = ctx.keys.cursor_key()
    (stored,) = yield Reads(_read("get", name), share="cursor_key")
    if stored is None:
        # SETNX, then GET in the same pipeline: of clients that make one at the same moment,
        # all keep the first one set. SETNX, not SET NX GET: a producer's ACL user may only
        # add a key, never overwrite one (docs/security.md).
        mine = secrets.token_bytes(KEY_BYTES)
        _, stored = yield Reads(_read("setnx", name, mine), _read("get", name))
    ctx.cursor_key, ctx.cursor_key_read_at = derive_key(stored), now
    return ctx.cursor_key


def _stats(ctx: _Context) -> Plan[Stats]:
    shards = range(ctx.keys.shards)
    *counts, daemons = yield Reads(
        *(_read("hgetall", ctx.keys.counts(s)) for s in shards),
        *(_read("llen", ctx.keys.intake(s)) for s in shards),
        _read("hgetall", ctx.keys.daemons()),
    )
    requests = sum(int(n) for n in counts[len(shards) :])
    counts = counts[: len(shards)]
    by_status = dict.fromkeys(Status, 0)
    by_handler: dict[str, dict[Status, int]] = {}
    for raw in counts:
        for field, value in raw.items():
            name, _, handler = field.decode().partition("@")
            if name not in Status.__members__ or not int(value):
                continue
            if handler:
                row = by_handler.setdefault(handler, {})
                row[Status(name)] = row.get(Status(name), 0) + int(value)
            else:
                by_status[Status(name)] += int(value)
    alive = []
    for daemon_id, record in sorted(daemons.items()):
        try:
            beat = msgspec.json.decode(record)
            fresh = time.time() - float(beat["heartbeat_at"]) <= DAEMON_STALE_S
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            continue  # a daemon of another version; its record is informational only
        if fresh:
            alive.append({"id": daemon_id.decode(), **beat})
    by_handler = {h: row for h, row in sorted(by_handler.items()) if any(row.values())}
    return Stats(by_status, by_handler, alive, requests)


def _handlers(ctx: _Context) -> Plan[dict[str, float]]:
    (raw,) = yield Reads(_read("hgetall", ctx.keys.handlers()))
    now_ms = time.time() * 1000
    return {k: ms / 1000 for k, ms in sorted(ctx.remember_handlers(raw).items()) if ms > now_ms}


def _dimension(
    handler: str | None, provider: str | None, tenant: str | None, account: str | None
) -> str:
    named = (("handler", handler), ("provider", provider), ("tenant", tenant), ("account", account))
    given = [(k, v) for k, v in named if v is not None]
    if len(given) != 1:
        raise InvalidTask("name exactly one of handler=, provider=, tenant= or account=")
    dimension = f"{given[0][0]}:{given[0][1]}"
    try:
        check_dimension(dimension)
    except ValueError as exc:
        raise InvalidTask(str(exc)) from None
    return dimension


def _pause(ctx: _Context, dimension: str, note: str) -> Plan[bool]:
    if not isinstance(note, str) or len(note) > 200:
        raise InvalidTask("note must be text of at most 200 characters")
    newly = False
    for shard in range(ctx.keys.shards):
        newly = bool((yield ctx.ops.pause(shard, dimension, note))) or newly
    return newly


def _resume(ctx: _Context, dimension: str) -> Plan[int]:
    moved = 0
    for shard in range(ctx.keys.shards):
        while True:
            n, left = yield ctx.ops.resume(shard, dimension)
            moved += n
            if not left:
                break
    return moved


def _paused(ctx: _Context) -> Plan[dict[str, dict[str, Any]]]:
    (raw,) = yield Reads(_read("hgetall", ctx.keys.paused(0)))
    out: dict[str, dict[str, Any]] = {}
    for k, v in raw.items():
        try:
            out[k.decode()] = msgspec.json.decode(v)
        except msgspec.DecodeError:
            out[k.decode()] = {"note": "(unreadable)"}
    return out


def _limits(ctx: _Context) -> Plan[dict[str, Entry]]:
    _, stored = yield from admission.read_limits(ctx.keys)
    return {
        scope: Entry(scope, entry.source, admission.limit_from_stored(scope, entry))
        for scope, entry in sorted(stored.items())
        if entry.source != "handler"
    }


def _set_limit(ctx: _Context, options: dict[str, Any]) -> Plan[Entry]:
    limit = admission.limit_from_options(**options)
    entry = admission.encode_limit(limit, "runtime")
    yield from admission.write(ctx.ops, "set", [(limit.scope, entry)])
    return Entry(limit.scope, "runtime", limit)


def _clear_limit(ctx: _Context, scope: str) -> Plan[bool]:
    admission.check_scope(scope)
    _, changed, _ = yield from admission.write(ctx.ops, "set", [(scope, "")])
    return changed > 0


def _has_quota(ctx: _Context, tenant: str) -> Plan[bool]:
    """Whether a submit quota may apply to the tenant (the list is cached for a second):
    tenants without one skip the quota script's round trip."""
    now = time.monotonic()
    if now - ctx.quotas_read_at >= QUOTA_CACHE_S:
        (names,) = yield Reads(_read("hkeys", ctx.keys.admission() + "rates"), share="quotas")
        prefix = b"quota:tenant:"
        ctx.quotas = {n[len(prefix) :].decode() for n in names if n.startswith(prefix)}
        ctx.quotas_read_at = now
    return tenant in ctx.quotas or "*" in ctx.quotas


def _resolve(
    ctx: _Context, task_id: str, target: Status | str, external_id: str | None,
    query: dict[str, Any] | None, message: str, only_from: tuple[Status, ...] = (),
) -> Plan[Task]:  # fmt: skip
    shard, to = _shard(ctx.keys, task_id), _status(target)
    if to not in _RESOLVABLE:
        raise InvalidTask(f"a task can be resolved as {', '.join(_RESOLVABLE)}, not {to}")
    handle = b""
    if to is Status.SUBMITTED:
        if not isinstance(external_id, str) or not external_id:
            raise InvalidTask("resolving as SUBMITTED needs the vendor's external_id")
        if query is not None and not isinstance(query, dict):
            raise InvalidTask(f"query must be a dict, got {type(query).__name__}")
        handle = encode_payload({"external_id": external_id, "query": query or {}}, "query")
    elif external_id is not None or query is not None:
        raise InvalidTask("external_id and query are only used when resolving as SUBMITTED")
    if only_from:
        (raw,) = yield Reads(_read("hget", ctx.keys.task(shard, task_id), "status"))
        if raw is not None and Status(raw.decode()) not in only_from:
            raise IllegalTransition(f"task {task_id} is {raw.decode()}; only "
                                    f"{' or '.join(only_from)} tasks can be requeued")  # fmt: skip
    result: Result = yield ctx.ops.resolve(
        task_id, to, external_id=external_id or "", handle_json=handle, message=message
    )
    if result.code is Code.NOT_FOUND:
        raise TaskNotFound(f"no task {task_id}")
    if result.code is Code.ILLEGAL:
        raise IllegalTransition(f"task {task_id} is {result.status}: it cannot be resolved as {to}")
    task = yield from _get(ctx, task_id, None, False)
    if task is None:
        raise TaskNotFound(f"task {task_id} vanished after it was resolved")
    return task


ArchiveTarget: TypeAlias = str | os.PathLike[str] | IO[str]


def _purge(
    ctx: _Context, older_than: float, archive: ArchiveTarget | None, limit: int
) -> Plan[int]:
    older_ms = round(_seconds(older_than, "older_than", positive=False) * 1000)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 10_000:
        raise InvalidTask(f"limit must be an integer from 1 to 10000, got {limit!r}")
    started = time.monotonic()
    if archive is not None:
        ((sec, usec),) = yield Reads(_read("time"))
        cutoff_ms = sec * 1000 + usec // 1000 - older_ms
        lines: list[bytes] = []
        for shard in range(ctx.keys.shards):
            # purge.lua takes, per terminal status, the oldest entries up to its limit; up
            # to `limit` per status at a cutoff no earlier than its own is a superset.
            idx = yield Reads(*(_read("zrangebyscore", ctx.keys.index(shard, s), "-inf",
                                      cutoff_ms, start=0, num=limit) for s in _PURGED))  # fmt: skip
            found = [m.decode() for members in idx for m in members]
            raws = yield Reads(*(_read("hgetall", ctx.keys.task(shard, i)) for i in found))
            lines += [msgspec.json.encode(decode_task(raw, i))
                      for i, raw in zip(found, raws, strict=True) if raw]  # fmt: skip
        _write_archive(archive, lines)
    purged = 0
    for shard in range(ctx.keys.shards):
        if purged >= limit:
            break
        # The script's clock is later than the archive's cutoff: widen older_than by the
        # time spent since, so it never deletes a task the archive did not get.
        slack_ms = math.ceil((time.monotonic() - started) * 1000) + 1 if archive is not None else 0
        ids: list[str] = yield ctx.ops.purge(shard, older_ms + slack_ms, limit - purged)
        purged += len(ids)
    return purged


def _write_archive(archive: ArchiveTarget, lines: list[bytes]) -> None:
    text = "".join(line.decode() + "\n" for line in lines)
    if isinstance(archive, str | os.PathLike):
        with open(archive, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    else:
        archive.write(text)
        archive.flush()


class AsyncClient:
    """Asyncio client for producers and operators.

    One per process is enough: it pools connections and may be shared between tasks, and
    the calls its tasks make at the same moment (a burst of submits) go out together as
    one pipeline. All task ids it returns or takes are strings; times are epoch seconds.
    """

    def __init__(
        self,
        redis: redis.asyncio.Redis,
        namespace: str = "atd",
        *,
        shards: int = 1,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> None:
        """Use an existing client (`decode_responses=False`); `aclose()` leaves it open.
        One made with `protocol=2` (what `from_url` makes) sends its batches on the store's
        fast path; on RESP3, redis-py 8's default, they are read through redis-py's own
        `read_response` (asynctaskd.wire says why).

        `namespace` and `shards` must be those the daemons use; `max_payload` is the limit
        in bytes for params and for metadata, each as compact JSON.
        """
        self._ctx = _Context(namespace, shards, max_payload)
        self.redis = redis
        self._store = Store(redis, self._ctx.keys)
        self._owned = False
        self._sharing: dict[str, asyncio.Future[Sequence[Any]]] = {}
        self._calls = Batcher(self._store, standalone=True)  # calls made together, piped

    @classmethod
    def from_url(
        cls,
        url: str,
        namespace: str = "atd",
        *,
        shards: int = 1,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> AsyncClient:
        """Connect to `url` (redis://, rediss://; credentials from REDIS_USERNAME and
        REDIS_PASSWORD or systemd credentials). No I/O happens until the first call."""
        client = cls(open_redis(url), namespace, shards=shards, max_payload=max_payload)
        client._owned = True
        return client

    async def aclose(self) -> None:
        """Close the connections this client opened (not a client passed in)."""
        if self._owned:
            await self.redis.aclose()
            await self.redis.connection_pool.disconnect()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def submit(
        self,
        handler: str,
        params: Any,
        *,
        tracking_timeout: float | dt.timedelta,
        tenant: str | None = None,
        account: str | None = None,
        provider: str | None = None,
        priority: int = 0,
        dedup_key: str | None = None,
        metadata: Any = None,
        not_before: dt.datetime | float | None = None,
        delay: float | dt.timedelta | None = None,
        strict: bool = True,
        route_key: str | None = None,
        dedup: Literal["content"] | None = None,
    ) -> Task:
        """Store a new task as PENDING_SUBMIT and return its snapshot; no vendor is called.

        Everything is checked before anything is written (InvalidTask, PayloadTooLarge,
        UnknownHandler). `tracking_timeout` (seconds) counts from now; the task is due at
        `not_before` (aware datetime or epoch seconds) or after `delay` seconds. With a
        `dedup_key`, a live task of the same tenant and key is returned instead;
        `dedup="content"` makes that key from the handler and params
        (`content_dedup_key`), so the same request is one task. With `strict`, the
        handler must be served by a live daemon.

        `handler` may name a handler group (`set_group`): one member is picked now, by the
        group's policy, and the task is created with that member as its `handler` (and
        provider, unless given), so workers never re-route; `metadata` is left as given.
        `route_key` is the business key a `consistent_hash` group needs (other policies
        and plain handlers ignore it). With `strict`, the picked member must be live.
        """
        dedup_key = _dedup(handler, params, dedup, dedup_key)
        args = (handler, params, tracking_timeout, tenant, account, provider, priority,
                dedup_key, metadata, not_before, delay, route_key)  # fmt: skip
        return await self._run(_submit(self._ctx, strict, args))

    async def get(
        self, task_id: str, tenant: str | None = None, *, internals: bool = False
    ) -> Task | None:
        """The task's snapshot, or None if it does not exist or belongs to another tenant."""
        return await self._run(_get(self._ctx, task_id, tenant, internals))

    async def cancel(self, task_id: str, tenant: str | None = None) -> bool:
        """Cancel now, or ask the task's worker to: True; False if it had already finished.

        Raises TaskNotFound if there is no such task (or it is another tenant's).
        """
        return await self._run(_cancel(self._ctx, task_id, tenant))

    async def wait(self, task_id: str, timeout: float, tenant: str | None = None) -> Task:
        """Return as soon as the task is terminal or SUBMIT_UNKNOWN, or its snapshot after
        `timeout` seconds. Follows the events stream, and re-reads the task if the capped
        stream was trimmed past its position: no polling, no missed change."""
        return await self._run(_wait(self._ctx, task_id, timeout, tenant))

    async def watch(self, task_id: str, tenant: str | None = None) -> AsyncIterator[TaskEvent]:
        """Yield the current state, then every change, until the task is settled.

        Where changes may have been missed (the capped events stream was trimmed past the
        last event seen, or the connection was lost), it re-reads the task and yields its
        current state if that differs from the last one yielded. Survives connection loss:
        it resumes from the last event seen, and raises StoreUnavailable only after 30
        seconds without Redis.
        """
        plan = _watch(self._ctx, task_id, tenant)
        reply: Any = None
        error: Exception | None = None
        while True:
            more, step = _advance(plan, reply, error)
            if not more:
                return
            if isinstance(step, TaskEvent):
                yield step
            reply, error = await self._step(step)

    async def list(
        self,
        *,
        status: Status | str | None = None,
        handler: str | None = None,
        tenant: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> TaskPage:
        """Tasks newest first per status (all statuses in a fixed order if None), filtered.

        Each call looks at a bounded number of tasks, so a page may be short; continue
        with its cursor until the cursor is None. A cursor is opaque (it names no task),
        the same for the same place in the walk, valid in any client of the namespace, and
        refused (InvalidTask) with a status, handler or tenant other than its walk's.
        """
        return await self._run(_list(self._ctx, status, handler, tenant, limit, cursor))

    async def stats(self) -> Stats:
        """Exact task counts by status and by handler, and the live daemons."""
        return await self._run(_stats(self._ctx))

    async def pause(
        self, *, handler: str | None = None, provider: str | None = None,
        tenant: str | None = None, account: str | None = None, note: str = "",
    ) -> bool:  # fmt: skip
        """Hold back new vendor submits for one handler, provider, tenant or account, on
        every daemon within a second. Queries of submitted jobs go on; held tasks still time
        out and can be canceled. True if it was not paused before."""
        return await self._run(_pause(self._ctx, _dimension(handler, provider, tenant, account),
                                      note))  # fmt: skip

    async def resume(
        self, *, handler: str | None = None, provider: str | None = None,
        tenant: str | None = None, account: str | None = None,
    ) -> int:  # fmt: skip
        """Lift a pause; returns how many held tasks went back, in their original order."""
        return await self._run(_resume(self._ctx, _dimension(handler, provider, tenant, account)))

    async def paused(self) -> dict[str, dict[str, Any]]:
        """Paused dimensions ('tenant:t1', ...) with when (`at`, epoch ms) and `note`."""
        return await self._run(_paused(self._ctx))

    async def handlers(self) -> dict[str, float]:
        """Handler keys some live daemon serves, with their expiry (epoch seconds)."""
        return await self._run(_handlers(self._ctx))

    async def limits(self) -> dict[str, Entry]:
        """Admission limits stored in Redis, by scope ('provider:openai', 'tenant:*', ...)."""
        return await self._run(_limits(self._ctx))

    async def set_limit(self, **options: Any) -> Entry:
        """Operator: set the limits of one scope at runtime, for every daemon within a second.

        Options are those of a `[[limits]]` table: provider (and account) or tenant, then
        submit_rate, submit_burst, query_rate, query_burst, max_in_flight, quota,
        quota_period (seconds or "1d"), note. It replaces the scope's entry and wins over
        the config file until `clear_limit`. InvalidTask if the options are wrong.
        """
        return await self._run(_set_limit(self._ctx, options))

    async def clear_limit(self, scope: str) -> bool:
        """Operator: delete a scope's limits (a config file sets them again at its next
        load); True if there were any."""
        return await self._run(_clear_limit(self._ctx, scope))

    async def sync_limits(self, *, force: bool = False) -> admission.SyncReport:
        """Bring every shard's copy of the limits up to date (daemons do this each second);
        with `force` also lift holds that no longer apply. Reports how many held tasks
        moved, the shards still on older limits, and the shards it could not finish."""
        return await self._run(admission.sync(self._ctx.ops, force=force))

    async def apply_config_limits(
        self, limits: Sequence[LimitConfig], handlers: Sequence[HandlerConfig] = ()
    ) -> tuple[str, ...]:
        """Write a config file's [[limits]] (daemons do this at start and on SIGHUP);
        returns the scopes whose runtime entry was kept."""
        entries = admission.config_entries(limits, handlers)
        _, _, kept = await self._run(admission.write(self._ctx.ops, "config", entries))
        return tuple(kept)

    async def set_group(self, name: str, policy: str, members: Sequence[MemberSpec]) -> Group:
        """Operator: define (or replace) the handler group `name`, persisted in Redis.

        `policy` is round_robin, weighted, consistent_hash or least_active; `members` are
        handler keys or (handler key, weight) tuples (weights: positive integers, used by
        weighted and consistent_hash). Group names share the handler keys' namespace: a
        live handler's key, a group as a member, or a member's name as a group is refused
        (InvalidTask). Clients see a change within 5 seconds.
        """
        return await self._run(_set_group(self._ctx, name, policy, members))

    async def groups(self) -> dict[str, Group]:
        """Every handler group by name; InvalidTask names a corrupt one."""
        return await self._run(_groups(self._ctx))

    async def delete_group(self, name: str) -> bool:
        """Operator: remove a handler group (and its counter); False if there was none."""
        return await self._run(_delete_group(self._ctx, name))

    async def resolve(
        self,
        task_id: str,
        as_: Status | str,
        *,
        external_id: str | None = None,
        query: dict[str, Any] | None = None,
        message: str = "",
    ) -> Task:
        """Operator: settle a SUBMIT_UNKNOWN task as SUBMITTED (with the vendor's
        `external_id` and `query`), PENDING_SUBMIT (resubmit knowingly), FAILED or CANCELED.

        Raises IllegalTransition (naming the current status) or TaskNotFound.
        """
        return await self._run(_resolve(self._ctx, task_id, as_, external_id, query, message))

    async def requeue(self, task_id: str) -> Task:
        """Operator: run a FAILED or TRACKING_TIMED_OUT task again, with a fresh deadline."""
        plan = _resolve(self._ctx, task_id, Status.PENDING_SUBMIT, None, None, "", _REQUEUE)
        return await self._run(plan)

    async def load_scripts(self) -> int:
        """Load every Lua script of this version into Redis (operators and daemons; a
        producer's ACL user may only run them). Returns how many were loaded."""
        await self._store.load_scripts()
        return len(self._store.scripts)

    async def purge(
        self, older_than: float, *, archive: ArchiveTarget | None = None, limit: int = 1000
    ) -> int:
        """Operator: delete up to `limit` tasks that finished over `older_than` seconds ago.

        With `archive` (a path, appended to, or a writable text file) each candidate is
        first written as one JSON line (the full Task) and the file flushed (and fsynced
        for a path). The archive may also hold a few tasks that finished just around the
        cutoff or beyond the limit; they are written again when they are purged.
        Returns how many tasks were deleted.
        """
        return await self._run(_purge(self._ctx, older_than, archive, limit))

    async def _run(self, plan: Plan[T]) -> T:
        reply: Any = None
        error: Exception | None = None
        while True:
            more, step = _advance(plan, reply, error)
            if not more:
                return cast(T, step)
            reply, error = await self._step(step)

    async def _step(self, step: Step) -> tuple[Any, Exception | None]:
        try:
            if isinstance(step, Call):
                return (await self._calls.call(step))[0], None
            if isinstance(step, Reads):
                return (await self._execute(step) if step.cmds else []), None
            if isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
        except Exception as exc:  # handed to the plan, which re-raises it
            return None, exc
        return None, None

    async def _execute(self, reads: Reads) -> Sequence[Any]:
        if reads.share is None:
            return await self._read(reads)
        # Many submits at once (a producer's first burst) all find the caches cold: one
        # refresh answers them all, instead of one HGETALL each.
        shared = self._sharing.get(reads.share)
        if shared is None or shared.get_loop() is not asyncio.get_running_loop():
            shared = asyncio.ensure_future(self._read(reads))
            self._sharing[reads.share] = shared
            shared.add_done_callback(functools.partial(self._unshare, reads.share))
        return await asyncio.shield(shared)  # one caller giving up cancels nobody else's

    def _unshare(self, name: str, done: asyncio.Future[Sequence[Any]]) -> None:
        if self._sharing.get(name) is done:
            del self._sharing[name]
        if not done.cancelled():
            done.exception()  # seen, even if every caller stopped waiting for it

    async def _read(self, reads: Reads) -> Sequence[Any]:
        if reads.bound is None:
            return await read_many(self._store, reads.cmds)
        try:
            async with asyncio.timeout(reads.bound):
                return await read_many(self._store, reads.cmds)
        except TimeoutError:
            raise StoreUnavailable(f"Redis did not answer within {reads.bound:.1f}s") from None


class Client:
    """Blocking client with the same methods as AsyncClient, for sync web apps and scripts.

    Safe to share between threads (redis-py's pool hands each call its own connection).
    """

    def __init__(
        self,
        redis: redis.Redis,
        namespace: str = "atd",
        *,
        shards: int = 1,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> None:
        """Use an existing client (`decode_responses=False`, and a `socket_timeout` above
        5 s so blocking reads are bounded); `close()` leaves it open."""
        self._ctx = _Context(namespace, shards, max_payload)
        self.redis = redis
        self._store = SyncStore(redis, self._ctx.keys)
        self._owned = False

    @classmethod
    def from_url(
        cls,
        url: str,
        namespace: str = "atd",
        *,
        shards: int = 1,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> Client:
        """Connect to `url`, as `AsyncClient.from_url`."""
        from asynctaskd.connection import open_sync

        conn = open_sync(
            url, credentials=redis_credentials(), socket_timeout=BLOCK_S + REPLY_MARGIN_S
        )
        client = cls(conn, namespace, shards=shards, max_payload=max_payload)
        client._owned = True
        return client

    def close(self) -> None:
        """Close the connections this client opened (not a client passed in)."""
        if self._owned:
            self.redis.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self,
        handler: str,
        params: Any,
        *,
        tracking_timeout: float | dt.timedelta,
        tenant: str | None = None,
        account: str | None = None,
        provider: str | None = None,
        priority: int = 0,
        dedup_key: str | None = None,
        metadata: Any = None,
        not_before: dt.datetime | float | None = None,
        delay: float | dt.timedelta | None = None,
        strict: bool = True,
        route_key: str | None = None,
        dedup: Literal["content"] | None = None,
    ) -> Task:
        """Store a new task (or route it through a handler group); see `AsyncClient.submit`."""
        dedup_key = _dedup(handler, params, dedup, dedup_key)
        args = (handler, params, tracking_timeout, tenant, account, provider, priority,
                dedup_key, metadata, not_before, delay, route_key)  # fmt: skip
        return self._run(_submit(self._ctx, strict, args))

    def get(
        self, task_id: str, tenant: str | None = None, *, internals: bool = False
    ) -> Task | None:
        """The task's snapshot, or None; see `AsyncClient.get`."""
        return self._run(_get(self._ctx, task_id, tenant, internals))

    def cancel(self, task_id: str, tenant: str | None = None) -> bool:
        """Cancel a task; see `AsyncClient.cancel`."""
        return self._run(_cancel(self._ctx, task_id, tenant))

    def wait(self, task_id: str, timeout: float, tenant: str | None = None) -> Task:
        """Block until the task is settled or `timeout`; see `AsyncClient.wait`."""
        return self._run(_wait(self._ctx, task_id, timeout, tenant))

    def watch(self, task_id: str, tenant: str | None = None) -> Iterator[TaskEvent]:
        """Iterate over the task's changes until it is settled; see `AsyncClient.watch`."""
        plan = _watch(self._ctx, task_id, tenant)
        reply: Any = None
        error: Exception | None = None
        while True:
            more, step = _advance(plan, reply, error)
            if not more:
                return
            if isinstance(step, TaskEvent):
                yield step
            reply, error = self._step(step)

    def list(
        self,
        *,
        status: Status | str | None = None,
        handler: str | None = None,
        tenant: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> TaskPage:
        """One page of tasks; see `AsyncClient.list`."""
        return self._run(_list(self._ctx, status, handler, tenant, limit, cursor))

    def stats(self) -> Stats:
        """Exact counts and live daemons; see `AsyncClient.stats`."""
        return self._run(_stats(self._ctx))

    def pause(
        self, *, handler: str | None = None, provider: str | None = None,
        tenant: str | None = None, account: str | None = None, note: str = "",
    ) -> bool:  # fmt: skip
        """Hold back new submits for one dimension; see `AsyncClient.pause`."""
        return self._run(_pause(self._ctx, _dimension(handler, provider, tenant, account), note))

    def resume(
        self, *, handler: str | None = None, provider: str | None = None,
        tenant: str | None = None, account: str | None = None,
    ) -> int:  # fmt: skip
        """Lift a pause; see `AsyncClient.resume`."""
        return self._run(_resume(self._ctx, _dimension(handler, provider, tenant, account)))

    def paused(self) -> dict[str, dict[str, Any]]:
        """Paused dimensions; see `AsyncClient.paused`."""
        return self._run(_paused(self._ctx))

    def handlers(self) -> dict[str, float]:
        """Live handler keys and their expiry; see `AsyncClient.handlers`."""
        return self._run(_handlers(self._ctx))

    def limits(self) -> dict[str, Entry]:
        """Stored admission limits; see `AsyncClient.limits`."""
        return self._run(_limits(self._ctx))

    def set_limit(self, **options: Any) -> Entry:
        """Set one scope's limits at runtime; see `AsyncClient.set_limit`."""
        return self._run(_set_limit(self._ctx, options))

    def clear_limit(self, scope: str) -> bool:
        """Delete one scope's limits; see `AsyncClient.clear_limit`."""
        return self._run(_clear_limit(self._ctx, scope))

    def set_group(self, name: str, policy: str, members: Sequence[MemberSpec]) -> Group:
        """Operator: define or replace a handler group; see `AsyncClient.set_group`."""
        return self._run(_set_group(self._ctx, name, policy, members))

    def groups(self) -> dict[str, Group]:
        """Every handler group by name; see `AsyncClient.groups`."""
        return self._run(_groups(self._ctx))

    def delete_group(self, name: str) -> bool:
        """Operator: remove a handler group; see `AsyncClient.delete_group`."""
        return self._run(_delete_group(self._ctx, name))

    def resolve(
        self,
        task_id: str,
        as_: Status | str,
        *,
        external_id: str | None = None,
        query: dict[str, Any] | None = None,
        message: str = "",
    ) -> Task:
        """Operator: settle a SUBMIT_UNKNOWN task; see `AsyncClient.resolve`."""
        return self._run(_resolve(self._ctx, task_id, as_, external_id, query, message))

    def requeue(self, task_id: str) -> Task:
        """Operator: run a failed or timed-out task again; see `AsyncClient.requeue`."""
        return self._run(
            _resolve(self._ctx, task_id, Status.PENDING_SUBMIT, None, None, "", _REQUEUE)
        )

    def load_scripts(self) -> int:
        """Load every Lua script of this version into Redis (see AsyncClient)."""
        self._store.load_scripts()
        return len(self._store.scripts)

    def purge(
        self, older_than: float, *, archive: ArchiveTarget | None = None, limit: int = 1000
    ) -> int:
        """Operator: delete (and archive) finished tasks; see `AsyncClient.purge`."""
        return self._run(_purge(self._ctx, older_than, archive, limit))

    def _run(self, plan: Plan[T]) -> T:
        reply: Any = None
        error: Exception | None = None
        while True:
            more, step = _advance(plan, reply, error)
            if not more:
                return cast(T, step)
            reply, error = self._step(step)

    def _step(self, step: Step) -> tuple[Any, Exception | None]:
        try:
            if isinstance(step, Call):
                return self._store.run(step), None
            if isinstance(step, Reads):
                return (self._execute(step) if step.cmds else []), None
            if isinstance(step, Pause):
                time.sleep(step.seconds)
        except Exception as exc:  # handed to the plan, which re-raises it
            return None, exc
        return None, None

    def _execute(self, reads: Reads) -> Sequence[Any]:
        # The socket timeout of from_url (BLOCK_S + REPLY_MARGIN_S) bounds blocking reads.
        return read_many_sync(self._store, reads.cmds)
