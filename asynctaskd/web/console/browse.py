"""The task browser's reads: a filtered walk of the status indexes, and finding a task by
id, dedup key, external id or a metadata field.

Walk: the client's `list()` (asynctaskd.client.listing): a time range is a score range of
the per-shard status indexes, the filters they do not hold (handler, tenant, account) are
checked on at most `20 * limit` task hashes per request, and a page that ran out of that
budget comes back short with a cursor. Its cursors are sealed with a key of the session
(asynctaskd.cursors): one names no task and cannot be replayed with other filters or in
another session.

Find: a task id is one read, a dedup key of a live task one GET of its dedup key. External
ids and metadata are in no index (adding one would cost every save on the daemons' path):
they are found by reading that one field of the newest tasks first, `SORT_RO ... BY nosort
GET` fetching an index page's fields in one command (or, where the server refuses GET
patterns, a pipeline of HMGETs), up to `FIND_SCAN` tasks or `FIND_BUDGET_S` per request
(docs/console.md has the figures); the answer says how many were looked at, and `next`
goes on from there.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Final

import msgspec
import redis.exceptions

from asynctaskd.client import AsyncClient
from asynctaskd.cursors import derive_key
from asynctaskd.errors import InvalidTask
from asynctaskd.keys import Keys, shard_for_dedup
from asynctaskd.model import Status, Task

__all__ = ["FIND_ORDER", "FIND_SCAN", "Filter", "browse", "find", "read_page", "row"]

FIND_SCAN: Final = 200_000  # tasks whose field is read per find request, at most
FIND_BUDGET_S: Final = 1.0  # and no new page is read after this long (the HMGET fallback)
_FIND_PAGE: Final = 5_000
_FIND_MAX: Final = 50  # matches returned, at most
# Live and parked tasks first (few, and what an operator most often looks for), then the
# settled ones; newest first within each.
FIND_ORDER: Final = sorted(Status, key=lambda s: s.is_terminal)


class Filter(msgspec.Struct, frozen=True, kw_only=True):
    status: Status | None = None
    handler: str | None = None
    tenant: str | None = None
    account: str | None = None
    since: float | None = None  # epoch seconds
    until: float | None = None


def sealing_key(seed: str) -> bytes:
    return derive_key(hashlib.sha256(seed.encode()).digest())


def row(task: Task) -> dict[str, Any]:
    """What a table row shows of a task."""
    return {
        "id": task.id, "status": task.status.value, "handler": task.handler,
        "tenant": task.tenant, "account": task.account, "external_id": task.external_id,
        "created_at": task.created_at, "updated_at": task.updated_at,
        "progress": task.progress, "stage": task.stage,
        "error": task.error.code if task.error else None,
        "error_message": task.error.message if task.error else None,
        "submit_attempts": task.submit_attempts, "message": task.message,
    }  # fmt: skip


async def browse(
    client: AsyncClient, f: Filter, limit: int, key: bytes, cursor: str | None
) -> dict[str, Any]:
    """One page of tasks matching `f`, newest first within each status: the client's
    `list()`, its cursors sealed with the session's key."""
    filters = msgspec.structs.asdict(f)
    page = await client._list_sealed(key, limit=limit, cursor=cursor, **filters)
    return {"tasks": [row(t) for t in page.tasks], "cursor": page.cursor}


def _metadata_match(name: str, want: str) -> Any:
    quick = want.encode()

    def match(raw: bytes) -> bool:
        if quick not in raw:  # most do not hold the value at all: no JSON decode for them
            return False
        try:
            value = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return False
        if not isinstance(value, dict) or name not in value:
            return False
        got = value[name]
        return (got if isinstance(got, str) else msgspec.json.encode(got).decode()) == want

    return match


async def find(
    client: Any, keys: Keys, kind: str, text: str, tenant: str | None, start: int
) -> dict[str, Any]:
    """Tasks whose `kind` (id, dedup_key, external_id, metadata) is `text`; `tenant` is
    the token's tenant (viewers) or a filter (operators), `start` how many tasks earlier
    calls looked at already (the cursor of a bounded search)."""
    if kind == "id":
        task = await client.get(text, tenant)
        return {"tasks": [row(task)] if task else [], "scanned": 1, "next": None}
    if kind == "dedup_key":
        owner = tenant or ""
        shard = shard_for_dedup(owner, text, keys.shards)
        task_id = await client.redis.get(keys.dedup(shard, owner, text))
        if task_id is not None:
            task = await client.get(task_id.decode(), tenant)
            if task is not None:
                return {"tasks": [row(task)], "scanned": 1, "next": None}
        # A settled task freed its dedup key: its hash still names it.
        stored = f"{len(owner)}:{owner}:{text}".encode()
        return await _scan(client, keys, b"dedup", stored.__eq__, tenant, start)
    if kind == "external_id":
        return await _scan(client, keys, b"external_id", text.encode().__eq__, tenant, start)
    if kind == "metadata":
        name, sep, want = text.partition("=")
        if not sep or not name:
            raise InvalidTask("find by metadata as field=value, e.g. order=42")
        return await _scan(client, keys, b"metadata", _metadata_match(name, want), tenant, start)
    raise InvalidTask(f"find by id, dedup_key, external_id or metadata, not {kind!r:.40}")


async def read_page(
    server: Any, index: str, prefix: str, offset: int, n: int, field: str, tenant: bool,
    sort: list[bool],
) -> list[tuple[bytes, bytes | None, bytes | None]]:  # fmt: skip
    """(id, field, tenant) of `n` index entries from `offset`, newest first. One SORT_RO
    with GET patterns where the server allows it; Redis refuses them to an ACL user
    without read access to every key (the operator's of docs/security.md), and then
    (`sort[0]` turns False for the rest of the search) an index page and a pipeline of
    HMGETs do the same, a few times slower."""
    if sort[0]:
        gets = ["GET", "#", "GET", f"{prefix}*->{field}"]
        if tenant:
            gets += ["GET", f"{prefix}*->tenant"]
        try:
            flat = await server.execute_command(
                "SORT_RO", index, "BY", "nosort", "DESC", "LIMIT", offset, n, *gets
            )
        except redis.exceptions.ResponseError:
            sort[0] = False
        else:
            width = len(gets) // 2
            return [(flat[i], flat[i + 1], flat[i + 2] if tenant else None)
                    for i in range(0, len(flat), width)]  # fmt: skip
    # ZRANGE ... REV: the operator's ACL user has ZRANGE, not ZREVRANGE.
    members = await server.execute_command("ZRANGE", index, offset, offset + n - 1, "REV")
    async with server.pipeline(transaction=False) as pipe:
        for member in members:
            pipe.hmget(prefix + member.decode(), field, "tenant")
        values = await pipe.execute()
    return [(m, v[0], v[1]) for m, v in zip(members, values, strict=True)]


async def _scan(
    client: Any, keys: Keys, field: bytes, match: Any, tenant: str | None, start: int
) -> dict[str, Any]:
    """Read `field` (and, for a tenant, the tenant) of tasks, newest first per status and
    shard (live statuses first), from position `start` of that walk; stop after the page
    of the first match, at FIND_SCAN tasks or after FIND_BUDGET_S. `next` is where a
    further call goes on."""
    server, sort = client.redis, [True]
    deadline = time.monotonic() + FIND_BUDGET_S
    owner = None if tenant is None else tenant.encode()
    ids: list[str] = []
    position, scanned = 0, 0
    for st in FIND_ORDER:
        for shard in range(keys.shards):
            index = keys.index(shard, st)
            size = int(await server.zcard(index))
            if position + size <= start:
                position += size
                continue
            offset = max(0, start - position)
            while offset < size:
                if scanned >= FIND_SCAN or ids or time.monotonic() > deadline:
                    return await _found(client, ids, tenant, scanned, position + offset)
                n = min(_FIND_PAGE, FIND_SCAN - scanned)
                entries = await read_page(server, index, keys.task_prefix(shard), offset, n,
                                      field.decode(), owner is not None, sort)  # fmt: skip
                ids += [m.decode() for m, value, who in entries
                        if value is not None and match(value) and owner in (None, who)]  # fmt: skip
                scanned += len(entries)
                offset += len(entries)
                if len(entries) < n:
                    break
            position += size
    return await _found(client, ids, tenant, scanned, None)


async def _found(
    client: Any, ids: list[str], tenant: str | None, scanned: int, resume: int | None
) -> dict[str, Any]:
    tasks = [await client.get(i, tenant) for i in ids[:_FIND_MAX]]  # one page's matches
    return {"tasks": [row(t) for t in tasks if t is not None], "scanned": scanned,
            "next": resume}  # fmt: skip
