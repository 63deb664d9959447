"""Pipelining: the calls of many coroutines sent as one round trip (`Batcher`, `pipeline`),
with calls of one single-task script to one shard grouped into its `_many` script, and
the durability gate that rides along (`Gate`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import msgspec
import redis.exceptions as rex

from asynctaskd.errors import ScriptError, StoreUnavailable

from .failures import _mapped
from .ops import _MANY_OF
from .replies import Call
from .runner import _Runner

if TYPE_CHECKING:
    from .aio import Store

T = TypeVar("T")


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


# At most this many calls go in one such call. One script call holds the server for its
# whole run (a save ~0.1 ms), so other clients wait behind it at most a few milliseconds.
_CALLS_PER_MANY: Final = 32


class _Pipelines(_Runner):
    """`Store`'s round trips of several calls: `pipeline`, `run_many`."""

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


class _Pending(msgspec.Struct, eq=False):
    """A call waiting for its pipeline: `done` resolves to the decoded reply or the
    exception to raise (a future, not an anyio Event: one per saved outcome, and an Event
    costs several times as much). A msgspec Struct for its C constructor."""

    call: Call[Any]
    gated: bool
    done: asyncio.Future[Any]
    durable: bool = True

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
        # start_soon and Semaphore cost several times asyncio's TaskGroup and Event.
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # standalone: the queue's loop
        self._running: asyncio.AbstractEventLoop | None = None  # run()'s, while it runs
        self._flushes: set[asyncio.Task[None]] = set()  # standalone: held, the loop won't
        self.gate_seconds = 0.0

    async def call(self, call: Call[T], *, gated: bool = False) -> tuple[T, bool]:
        """Run `call` in the next pipeline. Returns (result, durable); raises what it raised.

        With gated=True and a gate configured, durable says whether the gate confirmed
        the write (False also when the server had to be sent the call again).
        """
        # run()'s loop while it runs (the one the calls are on): asking asyncio for the
        # running loop is a getpid system call on Python 3.11, once per save.
        loop = self._running or asyncio.get_running_loop()
        pending = _Pending(call, gated and self.gate is not None, loop.create_future())
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
        self._running = asyncio.get_running_loop()
        try:
            async with asyncio.TaskGroup() as tg:
                while True:
                    await self._wake.wait()
                    self._wake.clear()
                    while self._queue:
                        await slots.acquire()
                        batch = self._queue[: self.max_batch]
                        del self._queue[: self.max_batch]
                        tg.create_task(self._flush(batch, slots))
        finally:
            self._running = None

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
