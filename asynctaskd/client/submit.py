"""The submit plan: routing, the deployment and live-handler checks, the tenant's quota
(and the dedup answer that comes before it), then the create script, retried while a
stale dedup key is being freed.
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec

from asynctaskd.errors import (
    ConfigError,
    QuotaExceeded,
    ScriptError,
    StoreUnavailable,
    UnknownHandler,
)
from asynctaskd.keys import deployment_problem
from asynctaskd.model import Task
from asynctaskd.plans import Pause, Reads
from asynctaskd.plans import read as _read
from asynctaskd.store import Created

from .context import HANDLER_CACHE_S, QUOTA_CACHE_S, STALE_DEDUP_WAIT_S, Plan, _Context
from .groups import _route
from .tasks import _get
from .validation import _prepare_submit


def _check_deployment(ctx: _Context) -> Plan[None]:
    """Before a create: the namespace's shard count and protocol are this client's
    (keys.deployment_problem). Read with the groups and handlers (`_find_group`), so it
    costs no round trip of its own."""
    if ctx.deployment_read_at == -math.inf:
        (raw,) = yield Reads(_read("get", ctx.keys.deployment()))
        ctx.deployment_problem = deployment_problem(raw, ctx.keys)
        ctx.deployment_read_at = time.monotonic()
    if ctx.deployment_problem:
        raise ConfigError(f"{ctx.deployment_problem}: pass shards= to match; nothing was written")


def _check_handler(ctx: _Context, handler: str) -> Plan[None]:
    now_ms = time.time() * 1000
    fresh = time.monotonic() - ctx.live_read_at < HANDLER_CACHE_S
    if fresh and ctx.live_until_ms.get(handler, 0) > now_ms:
        return
    # Stale, or not known yet: a daemon may have just started, so ask before refusing.
    (raw,) = yield Reads(_read("hgetall", ctx.keys.handlers()), share="handlers")
    live = ctx.remember_handlers(raw)
    if live.get(handler, 0) > now_ms:
        return
    names = ", ".join(sorted(k for k, until in live.items() if until > now_ms)) or "none"
    raise UnknownHandler(
        f"no live daemon serves handler {handler!r} (live handlers: {names}); start a daemon "
        "that registers it, or submit with strict=False"
    )


def _submit(ctx: _Context, strict: bool, args: tuple[Any, ...]) -> Plan[Task]:
    build, timeout_ms = _prepare_submit(ctx, *args)  # everything is checked before routing,
    handler = yield from _route(ctx, args[0], args[-1])  # which may write (INCR)
    yield from _check_deployment(ctx)
    call, task = build(handler)
    if strict:
        yield from _check_handler(ctx, task.handler)
    if task.tenant and (yield from _has_quota(ctx, task.tenant)):
        # A duplicate of a live task is no new submit: answer with it before counting.
        existing = yield from _deduplicated(ctx, task)
        if existing is not None:
            return existing
        counted, wait_ms = yield ctx.ops.quota(task.tenant)
        if counted is False:
            raise QuotaExceeded(task.tenant, wait_ms / 1000)
    stale_since: float | None = None
    vanished = 0
    while vanished < 3:
        created: Created = yield call
        if created.stale:
            # The dedup key names a task that is gone; the create asked the daemons to free
            # it (only they may), which takes them a moment. Nothing was written.
            now = time.monotonic()
            stale_since = now if stale_since is None else stale_since
            if now - stale_since > STALE_DEDUP_WAIT_S:
                raise StoreUnavailable(
                    f"dedup key {task.dedup_key!r} of tenant {task.tenant!r} still names task "
                    f"{created.task_id}, which no longer exists, after "
                    f"{STALE_DEDUP_WAIT_S:.0f}s: no daemon is taking in requests"
                )
            yield Pause(0.05)
            continue
        if not created.deduped:
            at = created.created_ms / 1000
            return msgspec.structs.replace(
                task, version=created.version, created_at=at, updated_at=at,
                deadline_at=(created.created_ms + timeout_ms) / 1000,
                due_at=created.due_ms / 1000,
            )  # fmt: skip
        existing = yield from _get(ctx, created.task_id, None, False)
        if existing is not None:
            return existing
        vanished += 1  # the live duplicate vanished between the two calls: create again
    raise ScriptError(f"create kept deduplicating {task.id} to tasks that do not exist")


def _deduplicated(ctx: _Context, task: Task) -> Plan[Task | None]:
    """The live task a submit with the same tenant and dedup key would return, if any."""
    if not task.dedup_key:
        return None
    (existing,) = yield Reads(_read("get", ctx.keys.dedup(task.shard, task.tenant, task.dedup_key)))
    if existing is None:
        return None
    found = yield from _get(ctx, existing.decode(), None, False)
    return found if found is not None and not found.status.is_terminal else None


def _has_quota(ctx: _Context, tenant: str) -> Plan[bool]:
    """Whether a submit quota may apply to the tenant (the list is cached for a second):
    tenants without one skip the quota script's round trip."""
    now = time.monotonic()
    if now - ctx.quotas_read_at >= QUOTA_CACHE_S:
        (names,) = yield Reads(_read("hkeys", ctx.keys.admission() + "rates"), share="quotas")
        prefix = b"quota:tenant:"
        ctx.quotas = {n[len(prefix) :].decode() for n in names if n.startswith(prefix)}
        ctx.quotas_read_at = now
    return tenant in ctx.quotas or "*" in ctx.quotas
