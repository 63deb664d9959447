"""`GET /tasks/{id}/events`: a task's changes as Server-Sent Events, ids being versions.

First the current state, then every change until the task settles; a reconnect with
`Last-Event-ID` gets the states it missed, replayed from the events stream (`replay`),
then the live ones. The live changes come from the process's shared reader of the
shard's events stream (`feed`): the watcher is registered there before its snapshot is
read, so the replay and the live feed overlap rather than leave a hole, and the version
filter (`seen`) shows each version at most once, in order.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import msgspec
from aiohttp import web

from asynctaskd.client import TaskEvent, task_event, task_shard

from .common import (
    _ANY,
    _CLIENT,
    _FEED,
    _KEYS,
    _METRICS,
    _SETTINGS,
    ApiError,
    _auth,
    _scope,
    _task_id,
)
from .feed import Signal, Subscription
from .metrics import route_of
from .replay import missed_events

__all__ = ["events"]

logger = logging.getLogger(__name__)

_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-store",
    "X-Accel-Buffering": "no",  # nginx: pass each event on at once
}


def _last_event_id(request: web.Request) -> int:
    text = request.headers.get("Last-Event-ID", "").strip()
    if not text:
        return 0
    if not text.isdigit() or len(text) > 18:
        raise ApiError(422, "invalid", f"Last-Event-ID must be a task version, got {text!r:.40}")
    return int(text)


def _shows(event: TaskEvent) -> tuple[Any, ...]:
    """What a watcher sees change: versions also move silently (a start, a query claim)."""
    return event.status, event.progress, event.stage, event.message


def _frame(event: TaskEvent) -> bytes:
    data = msgspec.json.encode(event)
    return b"event: task\nid: %d\ndata: %s\n\n" % (event.version, data)


async def events(request: web.Request) -> web.StreamResponse:
    """SSE of the task's changes; a reconnect with Last-Event-ID gets only newer states."""
    record = await _auth(request, _ANY)
    seen = _last_event_id(request)
    task_id, feed = _task_id(request), request.app[_FEED]
    shard = task_shard(request.app[_KEYS], task_id)  # InvalidTask (422) before any byte
    sub = await feed.subscribe(task_id, shard)
    try:
        return await _stream(request, sub, seen, _scope(record))
    finally:
        feed.unsubscribe(sub)


async def _backlog(request: web.Request, first: TaskEvent, seen: int) -> list[TaskEvent]:
    """The current state, after the changes a reconnecting client missed if the events
    stream still holds them all (else the current state stands in for them)."""
    if not seen or first.version <= seen:
        return [first]
    client = request.app[_CLIENT]
    missed = await missed_events(client.redis, request.app[_KEYS], first.task_id, seen)
    if not missed:
        return [first]
    # The current state closes the replay unless the last missed event shows it.
    last = missed[-1]
    same = _shows(last) == _shows(first) or last.version >= first.version
    return missed if same else [*missed, first]


async def _stream(
    request: web.Request, sub: Subscription, seen: int, tenant: str | None
) -> web.StreamResponse:
    client, feed = request.app[_CLIENT], request.app[_FEED]
    async with feed.reads:  # a burst of opens queues here, not for a pool connection each
        task = await client.get(sub.task_id, tenant)
        if task is None:
            raise ApiError(404, "not_found", f"no task {sub.task_id}")
        backlog = await _backlog(request, task_event(task), seen)
    if backlog[-1].status.is_settled and backlog[-1].version <= seen:
        return web.Response(status=204)  # tells an EventSource to stop reconnecting
    response = web.StreamResponse(headers=_HEADERS)
    transport = request.transport
    if transport is not None:
        sub.on_drop = transport.abort  # a client that stopped reading: no flush to wait for
    try:
        await response.prepare(request)
    except ConnectionError:  # the client left already
        return response
    metrics = request.app[_METRICS]
    metrics.stream_opened(request, route_of(request))
    try:
        return await _follow(request, response, sub, backlog, seen, tenant)
    finally:
        metrics.streams_open -= 1


async def _follow(
    request: web.Request, response: web.StreamResponse, sub: Subscription,
    backlog: list[TaskEvent], seen: int, tenant: str | None,
) -> web.StreamResponse:  # fmt: skip
    """Write the backlog, then the live changes until the task settles or the feed ends."""
    client, feed, metrics = request.app[_CLIENT], request.app[_FEED], request.app[_METRICS]
    keepalive = request.app[_SETTINGS].keepalive
    shown = backlog[0]
    try:
        out = [b"retry: 1000\n\n"]
        for event in backlog:
            if event.version > seen:
                seen, shown = event.version, event
                out.append(_frame(event))
        await response.write(b"".join(out))
        metrics.events_sent += len(out) - 1
        while not shown.status.is_settled:
            item = await sub.get(keepalive)
            if item is None:
                await response.write(b": keep-alive\n\n")
                continue
            if item is Signal.END:
                break
            if item is Signal.GAP:  # changes may be missing: the task itself says
                async with feed.reads:
                    fresh = await client.get(sub.task_id, tenant)
                if fresh is None:
                    break  # purged meanwhile
                current = task_event(fresh)
                if _shows(current) == _shows(shown):
                    seen = max(seen, current.version)  # a silent bump: nothing to show
                    continue
                item = current
            if isinstance(item, TaskEvent) and item.version > seen:
                seen, shown = item.version, item
                await response.write(_frame(item))
                metrics.events_sent += 1
    except ConnectionError:  # the client left, or the feed dropped it for falling behind
        return response
    except Exception as exc:  # Redis failing a GAP re-read: the client reconnects
        logger.warning("event stream of %s ended early: %s", sub.task_id, exc)
    if not sub.dropped:
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
    return response
