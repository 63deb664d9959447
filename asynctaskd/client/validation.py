"""Validation and argument building: the checks every client method makes before it
touches Redis (names, durations, times, task ids, statuses, dimensions), the content
dedup key, and `_prepare_submit`, which turns a submit's arguments into its create call.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import random
import time
from collections.abc import Callable
from typing import Any

import msgspec

from asynctaskd.codec import check_json_like, encode_payload
from asynctaskd.errors import InvalidTask
from asynctaskd.keys import HANDLER_KEY_RE, Keys, new_task_id, shard_for_dedup
from asynctaskd.model import Status, Task
from asynctaskd.routing import MAX_ROUTE_KEY
from asynctaskd.store import Call, Created, check_dimension

from .context import _ID_RE, MAX_SECONDS, _Context


def _name(value: object, what: str) -> str:
    if value is None and what != "handler":
        return ""
    if not isinstance(value, str) or not HANDLER_KEY_RE.fullmatch(value):
        raise InvalidTask(
            f"{what} must be 1-64 characters from letters, digits, '_', '.', ':' and '-', "
            f"got {value!r}"
        )
    return value


def _seconds(value: object, what: str, *, positive: bool) -> float:
    if isinstance(value, dt.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf  # an int too large for a float: refused just below
    else:
        raise InvalidTask(
            f"{what} must be a number of seconds or a datetime.timedelta, "
            f"got {type(value).__name__}"
        )
    low_ok = seconds > 0 if positive else seconds >= 0
    if not (math.isfinite(seconds) and low_ok and seconds <= MAX_SECONDS):
        bound = "more than 0" if positive else "at least 0"
        raise InvalidTask(f"{what} must be {bound} seconds and at most 10 years, got {value!r}")
    return seconds


def _epoch_ms(value: object, what: str = "not_before") -> int:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise InvalidTask(
                f"{what} must be timezone-aware, e.g. datetime.now(timezone.utc) + ..."
            )
        seconds = value.timestamp()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf  # refused just below
    else:
        raise InvalidTask(
            f"{what} must be an aware datetime or epoch seconds, got {type(value).__name__}"
        )
    if not (math.isfinite(seconds) and 0 <= seconds <= time.time() + MAX_SECONDS):
        raise InvalidTask(
            f"{what} must be epoch seconds (not milliseconds) within 10 years, got {value!r}"
        )
    return round(seconds * 1000)


def _shard(keys: Keys, task_id: object) -> int:
    """The shard of a task id, or InvalidTask if the id is not one of ours."""
    m = _ID_RE.fullmatch(task_id) if isinstance(task_id, str) else None
    if m is None:
        raise InvalidTask(
            f"{task_id!r} is not a task id: expected 26 Crockford base32 characters "
            "(a ULID), with '-<shard>' appended for shards above 0"
        )
    shard = int(m[1] or 0)
    if shard >= keys.shards:
        raise InvalidTask(
            f"task id {task_id} is on shard {shard}, but this client is configured with "
            f"{keys.shards} shard(s): use the same `shards` as the daemons"
        )
    return shard


task_shard = _shard  # the public name: the web's event streams check ids the same way


def _status(value: object) -> Status:
    try:
        return Status(value)
    except ValueError:
        names = ", ".join(s.value for s in Status)
        raise InvalidTask(f"{value!r} is not a status; one of {names}") from None


def content_dedup_key(handler: str, params: Any) -> str:
    """The dedup key `submit(dedup="content")` uses: "content:" and the SHA-256 of the
    handler key and the params as JSON with sorted object keys, so the same request of the
    same tenant finds the live task whatever order its keys were written in."""
    try:
        canonical = msgspec.json.encode(params, order="sorted")
    except (TypeError, msgspec.EncodeError, RecursionError) as exc:
        raise InvalidTask(f"params cannot be hashed for dedup='content': {exc}") from None
    digest = hashlib.sha256(handler.encode() + b"\0" + canonical).hexdigest()
    return f"content:{digest}"


def _dedup(handler: str, params: Any, dedup: object, dedup_key: str | None) -> str | None:
    if dedup is None:
        return dedup_key
    if dedup != "content":
        raise InvalidTask(f"dedup must be 'content' or None, got {dedup!r:.60}")
    if dedup_key is not None:
        raise InvalidTask("give dedup_key or dedup='content', not both")
    return content_dedup_key(handler, params)


def _prepare_submit(
    ctx: _Context,
    handler: str,
    params: Any,
    tracking_timeout: float | dt.timedelta,
    tenant: str | None,
    account: str | None,
    provider: str | None,
    priority: int,
    dedup_key: str | None,
    metadata: Any,
    not_before: dt.datetime | float | None,
    delay: float | dt.timedelta | None,
    trace: str,
    route_key: str | None,
) -> tuple[Callable[[str], tuple[Call[Created], Task]], int]:
    """Validate a submit; return a builder of the create call and the task it writes for a
    given handler key (the one named, or the member a group routes to), and timeout_ms."""
    _name(handler, "handler")
    tenant_s, account_s = _name(tenant, "tenant"), _name(account, "account")
    provider_s = _name(provider, "provider")
    timeout_ms = max(1, round(_seconds(tracking_timeout, "tracking_timeout", positive=True) * 1000))
    if not isinstance(priority, int) or isinstance(priority, bool) or not -100 <= priority <= 100:
        raise InvalidTask(f"priority must be an integer from -100 to 100, got {priority!r}")
    if not_before is not None and delay is not None:
        raise InvalidTask("give not_before or delay, not both")
    delay_ms = 0 if delay is None else round(_seconds(delay, "delay", positive=False) * 1000)
    not_before_ms = 0 if not_before is None else _epoch_ms(not_before)
    if dedup_key is not None and not (isinstance(dedup_key, str) and 0 < len(dedup_key) <= 200):
        raise InvalidTask(f"dedup_key must be a non-empty str of at most 200 characters, "
                          f"got {dedup_key!r:.60}")  # fmt: skip
    if dedup_key is not None:
        check_json_like(dedup_key, "dedup_key")  # refuses text that cannot be UTF-8
    if route_key is not None and not (
        isinstance(route_key, str) and 0 < len(route_key) <= MAX_ROUTE_KEY
    ):
        raise InvalidTask(f"route_key must be a non-empty str of at most {MAX_ROUTE_KEY} "
                          f"characters, got {route_key!r:.60}")  # fmt: skip
    params_json = encode_payload(params, "params", ctx.max_payload)
    metadata_json = (
        b"" if metadata is None else encode_payload(metadata, "metadata", ctx.max_payload)
    )
    shards = ctx.keys.shards
    if dedup_key:  # the same tenant and key always land on the same shard, so dedup works
        shard = shard_for_dedup(tenant_s, dedup_key, shards)
    else:
        shard = random.randrange(shards) if shards > 1 else 0

    def build(handler: str) -> tuple[Call[Created], Task]:
        task_id = new_task_id(shard)
        call = ctx.ops.create(
            task_id, handler, params_json, timeout_ms=timeout_ms, provider=provider_s,
            tenant=tenant_s, account=account_s, priority=priority, delay_ms=delay_ms,
            not_before_ms=not_before_ms, metadata_json=metadata_json, dedup_key=dedup_key or "",
            trace=trace,
        )  # fmt: skip
        task = Task(
            id=task_id, handler=handler, status=Status.PENDING_SUBMIT,
            params=msgspec.json.decode(params_json),
            metadata=msgspec.json.decode(metadata_json) if metadata_json else None,
            tenant=tenant_s, account=account_s, provider=provider_s or handler,
            priority=priority, dedup_key=dedup_key, trace=trace or None,
        )  # fmt: skip
        return call, task

    return build, timeout_ms


def _dimension(
    handler: str | None, provider: str | None, tenant: str | None, account: str | None
) -> str:
    named = (("handler", handler), ("provider", provider), ("tenant", tenant), ("account", account))
    given = [(k, v) for k, v in named if v is not None]
    if len(given) != 1:
        raise InvalidTask("name exactly one of handler=, provider=, tenant= or account=")
    dimension = f"{given[0][0]}:{given[0][1]}"
    try:
        check_dimension(dimension)
    except ValueError as exc:
        raise InvalidTask(str(exc)) from None
    return dimension
