"""The audit stream: who did what, and when, for every operator action made through the
API or the console, in the Redis stream `<ns>:web:audit` (capped near `MAXLEN` entries).

An entry is written after the action's client call returned, so the stream never claims
an action that did not happen (a refused one writes nothing). Writing it must not undo or hide the
action: if Redis refuses the entry, the action stands and the failure is logged (an
operator reading the log then knows the stream missed one). The entry id is the time.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import msgspec
import redis.exceptions
from aiohttp import web

from asynctaskd.web.common import _CLIENT, _SETTINGS, _via
from asynctaskd.web.tokens import TokenRecord

__all__ = ["MAXLEN", "audit_key", "read_audit", "write_audit"]

logger = logging.getLogger(__name__)

MAXLEN: Final = 100_000  # entries kept, about (XADD MAXLEN ~)
_DETAIL_BYTES: Final = 2048  # an entry's detail is cut here: the audit is not a payload store


def audit_key(namespace: str) -> str:
    return f"{namespace}:web:audit"


async def write_audit(
    request: web.Request, who: TokenRecord, action: str, target: str, detail: Any = None
) -> None:
    """One entry for `action` on `target` by `who` (the record `_auth` returned)."""
    body = msgspec.json.encode(detail) if detail is not None else b""
    fields: dict[Any, Any] = {
        "action": action,
        "target": target,
        "token": who.id,
        "role": who.role,
        "note": who.note,
        "via": _via(request),
        "remote": request.remote or "",
        "detail": body[:_DETAIL_BYTES],
    }
    try:
        await request.app[_CLIENT].redis.xadd(audit_key(request.app[_SETTINGS].namespace), fields,
                         maxlen=MAXLEN, approximate=True)  # fmt: skip
    except redis.exceptions.RedisError as exc:
        logger.error("audit entry lost: %s %s by token %s: %s", action, target,
                     who.id, exc)  # fmt: skip


async def read_audit(redis: Any, namespace: str, count: int, before: str | None) -> dict[str, Any]:
    """Up to `count` entries, newest first, older than the entry id `before` if given."""
    top = "+" if before is None else f"({before}"
    raw = await redis.xrevrange(audit_key(namespace), top, "-", count=count)
    entries = []
    for entry_id, fields in raw:
        text = {k.decode(): v.decode(errors="replace") for k, v in fields.items()}
        detail = text.pop("detail", "")
        try:
            text["detail"] = msgspec.json.decode(detail) if detail else None
        except msgspec.DecodeError:
            text["detail"] = detail  # cut at _DETAIL_BYTES: shown as it is
        at = int(entry_id.split(b"-")[0]) / 1000.0
        entries.append({"id": entry_id.decode(), "at": at, **text})
    more = len(raw) == count
    return {"entries": entries, "before": entries[-1]["id"] if more and entries else None}
