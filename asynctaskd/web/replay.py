"""The changes a reconnecting event-stream client missed, read back from the events stream.

An event stream (`sse`) starts from the task's current state: right for a new watcher,
but a client that reconnects with `Last-Event-ID` would see the states it missed folded
into one. The shard's events stream (docs/protocol.md, section 8) still holds them unless
it was trimmed: this module reads it backwards, newest first, until it meets an entry of
the task at or below the client's version, which proves that nothing in between was
trimmed. Without that proof (the stream was trimmed past it, or the task changed too long
ago to find cheaply) it returns None, and the caller falls back to the current state.
"""

from __future__ import annotations

from typing import Any, Final

from asynctaskd.client import TaskEvent, event_from_entry
from asynctaskd.keys import Keys
from asynctaskd.model import shard_of

__all__ = ["missed_events"]

PAGE: Final = 1000
MAX_SCAN: Final = 20_000  # stream entries looked at per reconnect, at most


async def missed_events(redis: Any, keys: Keys, task_id: str, after: int) -> list[TaskEvent] | None:
    """The task's events with a version above `after`, oldest first; None if the stream
    cannot prove it still holds all of them."""
    stream = keys.events(shard_of(task_id))
    tid = task_id.encode()
    found: list[TaskEvent] = []
    top: bytes | str = "+"
    scanned = 0
    while scanned < MAX_SCAN:
        entries = await redis.xrevrange(stream, top, "-", count=PAGE)
        for entry_id, fields in entries:
            if fields.get(b"task") != tid:
                continue
            event = event_from_entry(task_id, entry_id, fields)
            if event is None:
                continue
            if event.version > after:
                found.append(event)
            # The boundary: an entry the client had, or the task's first (the take-in of
            # its create, version 1). Trimming removes only the oldest entries, so every
            # later one is still in the stream.
            if event.version <= max(after, 1):
                found.reverse()
                return found
        scanned += len(entries)
        if len(entries) < PAGE:
            return None  # the stream's start, and no boundary: trimmed, or never there
        # The next page ends just before the oldest entry seen (exclusive range).
        top = b"(" + entries[-1][0]
    return None
