"""Plans on one task's snapshot: the reads (its create request, then its hash), `get`,
`cancel`, and what a caller may see of a task (`_visible`: its tenant's only;
`_public`: without the worker's bookkeeping).
"""

from __future__ import annotations

import msgspec

from asynctaskd.codec import decode_task
from asynctaskd.errors import TaskNotFound
from asynctaskd.model import Task
from asynctaskd.plans import Reads
from asynctaskd.plans import read as _read
from asynctaskd.store import Code, Read, Result, task_or_request

from .context import Plan, _Context
from .validation import _shard


def _public(task: Task) -> Task:
    return msgspec.structs.replace(
        task, fence=0, owner=None, started_fence=0, reclaims=0, idempotent=False
    )


def _visible(raw: dict[bytes, bytes], task_id: str, tenant: str | None) -> Task | None:
    if not raw:
        return None
    task = decode_task(raw, task_id)
    return None if tenant is not None and task.tenant != tenant else task


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


def _cancel(ctx: _Context, task_id: str, tenant: str | None) -> Plan[bool]:
    _shard(ctx.keys, task_id)
    result: Result = yield ctx.ops.cancel(task_id, tenant)
    if result.code is Code.NOT_FOUND:
        raise TaskNotFound(f"no task {task_id}")
    return result.code is not Code.TERMINAL
