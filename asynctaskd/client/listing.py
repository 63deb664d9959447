"""`list()`: a bounded walk of the status indexes, newest first, and its cursor, sealed
with the namespace's cursor key (read, or made by the first client that needs it).
"""

from __future__ import annotations

import secrets
import time

from asynctaskd.cursors import (
    KEY_BYTES,
    Position,
    derive_key,
    filters_of,
    open_cursor,
    seal,
    sealed_with,
)
from asynctaskd.errors import CorruptTask, InvalidTask
from asynctaskd.model import Status, Task
from asynctaskd.plans import Reads
from asynctaskd.plans import read as _read

from .context import CURSOR_KEY_CACHE_S, Plan, TaskPage, _Context
from .tasks import _public, _visible
from .validation import _epoch_ms, _name, _status


def _list(
    ctx: _Context, status: Status | str | None, handler: str | None, tenant: str | None,
    limit: int, cursor: str | None, *, account: str | None = None, since: object = None,
    until: object = None, sealing: bytes | None = None,
) -> Plan[TaskPage]:  # fmt: skip
    """One page of the walk. `since`/`until` bound the index score (when the task entered
    its status), both included; `sealing`, when given, seals and opens the cursors instead
    of the namespace's cursor key (the console's, one per session)."""
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 1000:
        raise InvalidTask(f"limit must be an integer from 1 to 1000, got {limit!r}")
    statuses = list(Status) if status is None else [_status(status)]
    handler, tenant, account = (
        None if v is None else _name(v, what)
        for v, what in ((handler, "handler"), (tenant, "tenant"), (account, "account"))
    )
    low = None if since is None else _epoch_ms(since, "since")
    high = None if until is None else _epoch_ms(until, "until")
    if low is not None and high is not None and low > high:
        raise InvalidTask(f"since must not be after until, got since={since!r}, until={until!r}")
    filters = filters_of(None if status is None else statuses[0].value, handler, tenant,
                         account=account, since_ms=low, until_ms=high)  # fmt: skip
    si, shard, score, after = 0, 0, None, b""
    if cursor is not None:
        if sealing is None:
            sealing = yield from _cursor_key(ctx)
            if not sealed_with(sealing, cursor):  # the key may have changed since it was read
                sealing = yield from _cursor_key(ctx, reload=True)
        si, shard, score, after = open_cursor(sealing, filters, cursor)
        if si >= len(statuses) or shard >= ctx.keys.shards:
            raise InvalidTask(
                f"cursor {cursor!r:.40} was made by a client with more shards than this one"
            )
    top, bottom = "+inf" if high is None else high, "-inf" if low is None else low
    out: list[Task] = []
    budget = 20 * limit  # entries looked at per call, so a rare filter cannot stall a call
    batch = min(max(2 * limit, 50), 500)
    while si < len(statuses):
        st, offset, done = statuses[si], 0, False
        key = ctx.keys.index(shard, st)
        while budget > 0 and not done:
            (entries,) = yield Reads(
                _read("zrevrangebyscore", key, top if score is None else score, bottom,
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
                if (task and task.status is st and handler in (None, task.handler)
                        and account in (None, task.account)):  # fmt: skip
                    out.append(_public(task))
                    if len(out) == limit:
                        position = Position(si, shard, s, member)
                        return (yield from _page(ctx, out, filters, position, sealing))
        if not done:
            position = Position(si, shard, score, after)
            return (yield from _page(ctx, out, filters, position, sealing))
        shard, score, after = shard + 1, None, b""
        if shard == ctx.keys.shards:
            si, shard = si + 1, 0
    return TaskPage(out, None)


def _page(
    ctx: _Context, tasks: list[Task], filters: bytes, position: Position, sealing: bytes | None
) -> Plan[TaskPage]:
    """A page that goes on: its cursor seals the position, which may be at a task the caller
    must not learn about (another tenant's, where the budget ran out)."""
    if sealing is None:
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
