"""Operators' plans: stats, live handlers, pause and resume, admission limits, resolving
and requeueing a task, and purge (with its archive).
"""

from __future__ import annotations

import math
import os
import time
from typing import IO, Any, TypeAlias

import msgspec

from asynctaskd import admission
from asynctaskd.admission import Entry
from asynctaskd.codec import decode_task, encode_payload
from asynctaskd.errors import IllegalTransition, InvalidTask, TaskNotFound
from asynctaskd.model import Status, Task
from asynctaskd.plans import Reads
from asynctaskd.plans import read as _read
from asynctaskd.store import Code, Result

from .context import _PURGED, _RESOLVABLE, DAEMON_STALE_S, Plan, Stats, _Context
from .tasks import _get
from .validation import _seconds, _shard, _status


def _stats(ctx: _Context) -> Plan[Stats]:
    shards = range(ctx.keys.shards)
    n = len(shards)
    statuses = len(Status)
    *counts, daemons = yield Reads(
        *(_read("hgetall", ctx.keys.counts(s)) for s in shards),
        *(_read("llen", ctx.keys.intake(s)) for s in shards),
        *(_read("zcard", ctx.keys.lookups(s)) for s in shards),
        # a status's total is the size of its index (the scripts count per handler only)
        *(_read("zcard", ctx.keys.index(s, status)) for s in shards for status in Status),
        _read("hgetall", ctx.keys.daemons()),
    )
    requests = sum(int(x) for x in counts[n : 2 * n])
    # parked tasks a vendor lookup will settle, shard by shard (at most the shard's parked)
    lookups = [int(x) for x in counts[2 * n : 3 * n]]
    sizes = [int(x) for x in counts[3 * n :]]
    counts = counts[:n]
    by_status = dict.fromkeys(Status, 0)
    parked: list[int] = []
    for shard in shards:
        row = sizes[shard * statuses : (shard + 1) * statuses]
        for status, size in zip(Status, row, strict=True):
            by_status[status] += size
        parked.append(row[list(Status).index(Status.SUBMIT_UNKNOWN)])
    parked_for_lookup = sum(min(a, b) for a, b in zip(lookups, parked, strict=True))
    by_handler: dict[str, dict[Status, int]] = {}
    for raw in counts:
        for field, value in raw.items():
            name, _, handler = field.decode().partition("@")
            # a field without a handler: a total an older release kept (the index says it)
            if not handler or name not in Status.__members__ or not int(value):
                continue
            mine = by_handler.setdefault(handler, {})
            mine[Status(name)] = mine.get(Status(name), 0) + int(value)
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
    return Stats(by_status, by_handler, alive, requests, parked_for_lookup)


def _handlers(ctx: _Context) -> Plan[dict[str, float]]:
    (raw,) = yield Reads(_read("hgetall", ctx.keys.handlers()))
    now_ms = time.time() * 1000
    return {k: ms / 1000 for k, ms in sorted(ctx.remember_handlers(raw).items()) if ms > now_ms}


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
