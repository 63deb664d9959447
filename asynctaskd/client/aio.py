"""`AsyncClient`: the plans run with asyncio. A script call made while none of the
client's others is on its way goes out at once, from the caller's task; calls made while
some are go out together as one pipeline (`Batcher`). Concurrent cache refreshes share
one read.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Literal, Self, cast

import redis.asyncio

from asynctaskd import admission
from asynctaskd.admission import Entry
from asynctaskd.codec import DEFAULT_MAX_PAYLOAD
from asynctaskd.config import HandlerConfig, LimitConfig
from asynctaskd.errors import StoreUnavailable
from asynctaskd.model import Status, Task
from asynctaskd.plans import Pause, Reads
from asynctaskd.plans import advance as _advance
from asynctaskd.routing import Group, MemberSpec
from asynctaskd.store import Batcher, Call, Store, open_redis, read_many
from asynctaskd.tracing import stored

from .context import _REQUEUE, Plan, Stats, Step, T, TaskEvent, TaskPage, _Context
from .groups import _delete_group, _groups, _set_group
from .listing import _list
from .operator import (
    ArchiveTarget,
    _clear_limit,
    _handlers,
    _limits,
    _pause,
    _paused,
    _purge,
    _resolve,
    _resume,
    _set_limit,
    _stats,
)
from .submit import _submit
from .tasks import _cancel, _get
from .validation import _dedup, _dimension
from .watch import _wait, _watch


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
        # Script calls of this client on their way (sent or queued), on `_busy_loop`: a
        # call made when there are none has no pipeline to join (`_call`).
        self._busy = 0
        self._busy_loop: asyncio.AbstractEventLoop | None = None

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
        """Close the connections this client opened (not a client passed in), and give
        back the one its lone calls keep out of the client's pool."""
        await self._store.close()
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
        trace: Mapping[str, str] | None = None,
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

        `trace` is the W3C trace context the daemons' vendor call spans are children of
        (`{"traceparent": ..., "tracestate": ...}`); by default the caller's current
        OpenTelemetry span, if the process traces, and `{}` stores none (docs/tracing.md).
        """
        dedup_key = _dedup(handler, params, dedup, dedup_key)
        args = (handler, params, tracking_timeout, tenant, account, provider, priority,
                dedup_key, metadata, not_before, delay, stored(trace), route_key)  # fmt: skip
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
        account: str | None = None,
        since: float | dt.datetime | None = None,
        until: float | dt.datetime | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> TaskPage:
        """Tasks newest first per status (all statuses in a fixed order if None), filtered.

        `since` and `until` (epoch seconds or aware datetimes, both included) bound when
        a task entered its status: a range of the status index, read as such. `handler`,
        `tenant` and `account` are checked on the tasks themselves. Each call looks at a
        bounded number of tasks (20 x `limit`), so a page may be short; continue with its
        cursor until the cursor is None. A cursor is opaque (it names no task), the same
        for the same place in the walk, valid in any client of the namespace, and refused
        (InvalidTask) with filters other than its walk's.
        """
        return await self._run(_list(
            self._ctx, status, handler, tenant, limit, cursor, account=account, since=since,
            until=until,
        ))  # fmt: skip

    async def _list_sealed(self, sealing: bytes, **filters: Any) -> TaskPage:
        """`list()` whose cursors are sealed with `sealing` rather than the namespace's key:
        the console's, one per session, so that a cursor works in that session only."""
        status, handler, tenant = (filters.pop(k, None) for k in ("status", "handler", "tenant"))
        limit, cursor = filters.pop("limit", 100), filters.pop("cursor", None)
        plan = _list(self._ctx, status, handler, tenant, limit, cursor, sealing=sealing, **filters)
        return await self._run(plan)

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
                return await self._call(step), None
            if isinstance(step, Reads):
                return (await self._execute(step) if step.cmds else []), None
            if isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
        except Exception as exc:  # handed to the plan, which re-raises it
            return None, exc
        return None, None

    async def _call(self, call: Call[T]) -> T:
        """Run a script call. Alone (none of this client's others on its way: a producer
        awaiting one submit after the other) it goes out now, from the caller's task;
        the batcher's hop (a callback, then a task of its own) would wait for nothing
        and cost a sequential submit about a tenth of its CPU. Otherwise it joins the
        batcher's next pipeline, with the calls made at the same moment as it."""
        loop = asyncio.get_running_loop()
        if loop is not self._busy_loop:  # first use, or a new loop: the old one's are gone
            self._busy_loop, self._busy = loop, 0
        alone = self._busy == 0
        self._busy += 1
        try:
            if alone:
                return await self._store.run(call)
            return (await self._calls.call(call))[0]
        finally:
            if self._busy_loop is loop:
                self._busy -= 1

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
