"""One reader of each shard's events stream for every open event stream of the process.

An event stream per watcher reading the shard's stream on its own (what
`AsyncClient.watch` does) makes the process read and decode every change once per
watcher, and hold a Redis connection per watcher: at thousands of watchers the events
reach their clients seconds late. Here one task per shard runs `XREAD BLOCK` on one
connection, started with the shard's first watcher and stopped with its last, and hands
each entry only to the watchers of its task: the work grows with the changes, not with
changes x watchers, and the Redis connections stay one per shard.

No change is lost between a watcher's snapshot and the shared position, because a
watcher is registered before it reads its snapshot (`subscribe` returns once the shard's
reader has a position): every entry the reader takes after that goes to the watcher,
every one before is already in the snapshot, and the watcher drops what its snapshot
already shows by version (docs/protocol.md, section 8, the same rule as watch()).

Where the reader cannot prove it saw every entry (the capped stream was trimmed past its
position, the stream was new, or the connection was lost and Redis may have restarted),
it sends each watcher of the shard a `Signal.GAP`: the watcher re-reads its task, as
watch() does. A watcher whose queue is full (a client that stopped reading) is dropped
(`Signal.END`, and its `on_drop` closes its connection) so that it never holds up the
others; it reconnects with Last-Event-ID and the replay fills what it missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import redis.exceptions

from asynctaskd.client import TaskEvent, event_from_entry, stream_entries
from asynctaskd.keys import Keys

__all__ = ["Feed", "Signal", "Subscription"]

logger = logging.getLogger(__name__)

BLOCK_S: Final = 5.0  # longest XREAD BLOCK: below the 10 s socket timeout of open_redis
READ_COUNT: Final = 1000  # entries per XREAD
QUEUE_LIMIT: Final = 256  # events waiting for one watcher before it is dropped
RECONNECT_BUDGET_S: Final = 30.0  # without Redis this long, every stream of the shard ends
READS: Final = 16  # snapshots and re-reads in flight at once: they queue here, not for connections
_TRANSIENT: Final = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
_START: Final = b"0-0"


class Signal(enum.Enum):
    GAP = "gap"  # changes may have been missed: re-read the task
    END = "end"  # the feed is closing, gave up on Redis, or dropped this watcher


class Subscription:
    """One watcher's queue of events and signals, filled by its shard's reader."""

    __slots__ = ("_items", "_limit", "_wake", "dropped", "on_drop", "shard", "task_id")

    def __init__(self, task_id: str, shard: int, limit: int) -> None:
        self.task_id, self.shard, self._limit = task_id, shard, limit
        self._items: deque[TaskEvent | Signal] = deque()
        self._wake = asyncio.Event()
        self.dropped = False  # True once the feed ended it for falling behind
        self.on_drop: Callable[[], None] | None = None  # e.g. abort the HTTP connection

    def _put(self, item: TaskEvent | Signal) -> bool:
        """Queue `item`; False if the queue is full (the watcher is not reading)."""
        if len(self._items) >= self._limit and item is not Signal.END:
            return False
        self._items.append(item)
        self._wake.set()
        return True

    async def get(self, timeout: float) -> TaskEvent | Signal | None:
        """The next event or signal, or None after `timeout` seconds without one."""
        if not self._items:
            self._wake.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                return None
        return self._items.popleft()


class _Reader:
    """A shard's reader task and the watchers it serves, by task id (bytes, as read)."""

    __slots__ = ("ready", "shard", "stopped", "task", "watchers")

    def __init__(self, shard: int) -> None:
        self.shard = shard
        self.watchers: dict[bytes, set[Subscription]] = {}
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Retrieved even when every subscriber waiting for it has gone.
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.task: asyncio.Task[None] | None = None
        self.stopped = False

    def each(self) -> list[Subscription]:
        return [sub for subs in self.watchers.values() for sub in subs]


class Feed:
    """The shared readers of one process, on `redis` (each running reader holds one of
    its pool's connections)."""

    def __init__(
        self, redis: Any, keys: Keys, *, limit: int = QUEUE_LIMIT, block_s: float = BLOCK_S
    ) -> None:
        self._redis, self._keys = redis, keys
        self.limit = limit  # per watcher; a setting for tests that fill it
        self._block_ms = max(1, int(block_s * 1000))
        self._readers: dict[int, _Reader] = {}
        self.reads = asyncio.Semaphore(READS)
        self.dropped = 0  # watchers ended for falling behind, since start

    @property
    def shards(self) -> list[int]:
        """The shards whose reader runs."""
        return sorted(self._readers)

    @property
    def watchers(self) -> int:
        return sum(len(r.each()) for r in self._readers.values())

    async def subscribe(self, task_id: str, shard: int) -> Subscription:
        """Register a watcher of `task_id` (its shard checked by the caller); returns once
        its shard's reader has a position, so a snapshot read after this misses nothing.
        Raises what Redis raised if the reader could not start."""
        reader = self._readers.get(shard)
        if reader is None:
            reader = self._readers[shard] = _Reader(shard)
            reader.task = asyncio.create_task(self._run(reader), name=f"events-feed-{shard}")
        sub = Subscription(task_id, shard, self.limit)
        reader.watchers.setdefault(task_id.encode(), set()).add(sub)
        try:
            await asyncio.shield(reader.ready)
        except BaseException:
            self.unsubscribe(sub)
            raise
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Forget `sub` (again is harmless); the last watcher of a shard stops its reader."""
        reader = self._readers.get(sub.shard)
        if reader is None:
            return
        key = sub.task_id.encode()
        subs = reader.watchers.get(key)
        if subs is None or sub not in subs:
            return
        subs.discard(sub)
        if not subs:
            del reader.watchers[key]
        if not reader.watchers:
            self._stop(reader)

    def _stop(self, reader: _Reader) -> None:
        reader.stopped = True
        if self._readers.get(reader.shard) is reader:
            del self._readers[reader.shard]
        if reader.task is not None and reader.task is not asyncio.current_task():
            reader.task.cancel()

    async def close(self) -> None:
        """End every watcher's stream and stop every reader."""
        readers = list(self._readers.values())
        for reader in readers:
            for sub in reader.each():
                sub._put(Signal.END)
            reader.watchers.clear()
            self._stop(reader)
        tasks = [r.task for r in readers if r.task is not None]
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _dispatch(self, reader: _Reader, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        watchers = reader.watchers
        for entry_id, fields in entries:
            tid = fields.get(b"task")
            subs = None if tid is None else watchers.get(tid)
            if not subs or tid is None:
                continue  # nobody watches that task here: not even decoded
            event = event_from_entry(tid.decode(), entry_id, fields)
            if event is None:
                continue
            for sub in list(subs):
                if not sub._put(event):
                    self._drop(sub)

    def _drop(self, sub: Subscription) -> None:
        self.dropped += 1
        logger.info("event stream of %s dropped: %d events waiting unread", sub.task_id,
                    len(sub._items))  # fmt: skip
        self.unsubscribe(sub)
        sub.dropped = True
        sub._items.clear()
        sub._put(Signal.END)
        if sub.on_drop is not None:
            sub.on_drop()

    def _signal(self, reader: _Reader, signal: Signal) -> None:
        for sub in reader.each():
            if not sub._put(signal):
                self._drop(sub)

    async def _run(self, reader: _Reader) -> None:
        conn = self._redis.client()  # one connection for the reader's whole life
        try:
            await self._read(reader, conn)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not reader.ready.done():
                reader.ready.set_exception(exc)  # the subscribers waiting raise it
            else:
                logger.warning("events feed of shard %d gave up: %s", reader.shard, exc)
            for sub in reader.each():
                sub._put(Signal.END)
            reader.watchers.clear()
            self._stop(reader)
        finally:
            if not reader.ready.done():
                reader.ready.cancel()
            with contextlib.suppress(Exception):
                await conn.aclose()

    async def _read(self, reader: _Reader, conn: Any) -> None:
        stream = self._keys.events(reader.shard)
        last: bytes | None = None  # None: take the stream's end as the position
        gap = False  # changes may have been missed: the watchers re-read once caught up
        failing: float | None = None
        # Also checked, not only cancelled: a cancel that lands in a redis-py command
        # can be lost (seen with redis-py 8.1 on Python 3.11, in the XREVRANGE after the
        # XREAD), and a reader that lived on would hold its connection for good.
        while not reader.stopped:
            try:
                if last is None:
                    top = await conn.xrevrange(stream, "+", "-", count=1)
                    last = top[0][0] if top else _START
                    if not reader.ready.done():
                        reader.ready.set_result(None)
                # Non-blocking after a failure or a gap: the watchers re-read at once.
                block = None if gap else self._block_ms
                entries = stream_entries(
                    await conn.xread({stream: last}, count=READ_COUNT, block=block)
                )
                # Proof that no entry after `last` was trimmed before the XREAD ran
                # (docs/protocol.md, section 8): the entry at `last` is still there.
                held = last == _START or bool(await conn.xrevrange(stream, last, last))
            except _TRANSIENT:
                if not reader.ready.done():
                    raise  # no position yet: the subscribers get the error now
                now = time.monotonic()
                failing = now if failing is None else failing
                if now - failing > RECONNECT_BUDGET_S:
                    raise
                gap = True  # Redis may have restarted without the latest writes
                await asyncio.sleep(min(1.0, max(0.05, (now - failing) / 4)))
                continue
            failing = None
            if entries:
                self._dispatch(reader, entries)
                gap = gap or last == _START  # the stream's first entries: no proof
                last = entries[-1][0]
            if not held:
                gap = True
                if not entries:
                    last = None  # the stream is gone or was replaced: take its end again
                    continue
            if gap and len(entries) < READ_COUNT:  # caught up: the re-reads see the rest
                gap = False
                self._signal(reader, Signal.GAP)
