"""`wait` and `watch`: a task's snapshot and the position in its shard's events stream it
is current at, then the stream (XREAD), with the proof that no entry was trimmed unseen
(`_continuous`), re-reads where one may have been, and `watch`'s reconnect backoff.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

from asynctaskd.errors import StoreUnavailable, TaskNotFound
from asynctaskd.model import Status, Task
from asynctaskd.plans import Pause, Reads
from asynctaskd.plans import read as _read
from asynctaskd.store import task_or_request

from .context import (
    _TRANSIENT,
    BLOCK_S,
    RECONNECT_BUDGET_S,
    REPLY_MARGIN_S,
    XREAD_COUNT,
    Plan,
    Step,
    TaskEvent,
    _Context,
)
from .tasks import _public, _task_reads, _visible
from .validation import _seconds, _shard


def stream_entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
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


def task_event(task: Task) -> TaskEvent:
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
        for entry_id, fields in stream_entries(reply):
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
    shown = task_event(task)
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
        for entry_id, fields in stream_entries(reply):
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
            current = task_event(fresh)
            if _shows(current) != _shows(shown):
                shown = current
                yield shown


def _shows(event: TaskEvent) -> tuple[Any, ...]:
    """What a watcher sees change: versions also move silently (a start, a query claim)."""
    return event.status, event.progress, event.stage, event.message
