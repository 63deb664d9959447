"""`Client`: the same plans as `AsyncClient`, run on blocking sockets, for sync web apps
and scripts.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, Self, cast

import redis

from asynctaskd.admission import Entry
from asynctaskd.codec import DEFAULT_MAX_PAYLOAD
from asynctaskd.model import Status, Task
from asynctaskd.plans import Pause, Reads
from asynctaskd.plans import advance as _advance
from asynctaskd.routing import Group, MemberSpec
from asynctaskd.store import Call, SyncStore, read_many_sync, redis_credentials
from asynctaskd.tracing import stored

from .context import (
    _REQUEUE,
    BLOCK_S,
    REPLY_MARGIN_S,
    Plan,
    Stats,
    Step,
    T,
    TaskEvent,
    TaskPage,
    _Context,
)
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
        trace: Mapping[str, str] | None = None,
    ) -> Task:
        """Store a new task (or route it through a handler group); see `AsyncClient.submit`."""
        dedup_key = _dedup(handler, params, dedup, dedup_key)
        args = (handler, params, tracking_timeout, tenant, account, provider, priority,
                dedup_key, metadata, not_before, delay, stored(trace), route_key)  # fmt: skip
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
        account: str | None = None,
        since: float | dt.datetime | None = None,
        until: float | dt.datetime | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> TaskPage:
        """One page of tasks; see `AsyncClient.list`."""
        return self._run(_list(
            self._ctx, status, handler, tenant, limit, cursor, account=account, since=since,
            until=until,
        ))  # fmt: skip

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
