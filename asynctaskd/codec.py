"""Pure encoding: JSON-like payload checks, and task hashes to and from Task snapshots."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from .errors import CorruptTask, InvalidTask, PayloadTooLarge
from .model import Status, Task, TaskError

__all__ = ["DEFAULT_MAX_PAYLOAD", "check_json_like", "decode_task", "encode_payload"]

DEFAULT_MAX_PAYLOAD: Final = 256 * 1024

_ENCODER: Final = msgspec.json.Encoder()
_DECODER: Final = msgspec.json.Decoder()
_MAX_DEPTH: Final = 64


def check_json_like(value: Any, what: str, path: str = "", depth: int = 0) -> None:
    """Raise InvalidTask unless `value` is plain JSON data: dict with str keys, list,
    str, int, finite float, bool or None. Tuples are accepted as lists."""
    where = f"{what}{path}" if path else what
    if depth > _MAX_DEPTH:
        raise InvalidTask(f"{where} is nested more than {_MAX_DEPTH} levels deep")
    if isinstance(value, str):
        if not _is_utf8(value):
            raise InvalidTask(
                f"{where} contains a lone surrogate (text that cannot be UTF-8): fix the string"
            )
        return
    if value is None or isinstance(value, (bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidTask(f"{where} is {value!r}: JSON has no NaN or Infinity; use null")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidTask(
                    f"{where} has a key {k!r} of type {type(k).__name__}: keys must be strings"
                )
            if not _is_utf8(k):
                raise InvalidTask(
                    f"{where} has a key {k!r} with a lone surrogate (not UTF-8): fix the key"
                )
            check_json_like(v, what, f"{path}.{k}", depth + 1)
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_json_like(v, what, f"{path}[{i}]", depth + 1)
        return
    kind = type(value).__name__
    hint = {
        "bytes": "encode binary data as base64 text, or store it elsewhere and pass a URL",
        "bytearray": "encode binary data as base64 text, or store it elsewhere and pass a URL",
        "set": "use a list",
        "frozenset": "use a list",
    }.get(kind, "pass plain JSON data: dict, list, str, int, float, bool or None")
    raise InvalidTask(f"{where} is a {kind}, which is not JSON data: {hint}")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def encode_payload(value: Any, what: str, max_bytes: int = DEFAULT_MAX_PAYLOAD) -> bytes:
    """Check and encode params or metadata as compact JSON, within `max_bytes`."""
    check_json_like(value, what)
    data = _ENCODER.encode(value)
    if len(data) > max_bytes:
        raise PayloadTooLarge(
            f"{what} is {len(data)} bytes as JSON, over the limit of {max_bytes}: "
            "store large inputs elsewhere and pass a reference"
        )
    return data


def encode_json(value: Any) -> bytes:
    """Encode already-trusted data (handler outcomes) as compact JSON."""
    return _ENCODER.encode(value)


# The task hash decoder runs for every claimed task (a busy daemon decodes thousands a
# second), so it reads the hash by its bytes field names, without building a second dict
# with str keys, and keeps the per-field work inline. What counts as corrupt is exactly
# what docs/protocol.md section 4 says.
_STATUSES: Final = {s.value.encode(): s for s in Status}


def _text(v: bytes | None) -> str | None:
    return None if v is None else v.decode("utf-8", "replace")


def _int(v: bytes | None, task_id: str, name: str, default: int = 0) -> int:
    if v is None or v == b"":
        return default
    try:
        return int(v)
    except ValueError:
        raise CorruptTask(task_id, f"field {name} is {v[:40]!r}, not an integer") from None


def _float(v: bytes | None, task_id: str, name: str) -> float | None:
    if v is None or v == b"":
        return None
    try:
        out = float(v)
    except ValueError:
        raise CorruptTask(task_id, f"field {name} is {v[:40]!r}, not a number") from None
    if not math.isfinite(out):
        raise CorruptTask(task_id, f"field {name} is {v[:40]!r}, not a finite number")
    return out


def _json(v: bytes | None, task_id: str, name: str) -> Any:
    if v is None or v == b"":
        return None
    try:
        return _DECODER.decode(v)
    except msgspec.DecodeError as exc:
        raise CorruptTask(task_id, f"field {name} is not valid JSON ({exc})") from None


def _ms(v: bytes | None, task_id: str, name: str) -> float | None:
    n = _int(v, task_id, name, -1)
    return None if n < 0 else n / 1000.0


def decode_task(hash_: Mapping[bytes, bytes], task_id: str | None = None) -> Task:
    """Build a Task from a task hash (HGETALL reply as a dict of bytes).

    Raises CorruptTask, naming the field, when anything cannot be read.
    """
    try:
        return _decode_task(hash_, task_id)
    except CorruptTask:
        raise
    except (ValueError, TypeError, OverflowError, msgspec.ValidationError) as exc:
        # Anything else a hostile hash can provoke is corrupt data too, never a crash.
        raise CorruptTask(
            task_id or "?", f"unreadable ({type(exc).__name__}: {exc})"[:300]
        ) from None


def _decode_task(hash_: Mapping[bytes, bytes], task_id: str | None) -> Task:
    # Every field name must be UTF-8. NUL cannot complete a multi-byte sequence, so the
    # joined names decode exactly when each name does; ASCII (the usual case) needs no decode.
    names = b"\0".join(hash_)
    if not names.isascii():
        try:
            names.decode()
        except UnicodeDecodeError:
            raise CorruptTask(task_id or "?", "a field name is not UTF-8") from None
    get = hash_.get
    tid = _text(get(b"id")) or task_id or "?"
    if task_id is not None and tid != task_id:
        raise CorruptTask(task_id, f"field id is {tid!r}")
    handler = _text(get(b"handler"))
    if not handler:
        raise CorruptTask(tid, "field handler is missing")
    raw_status = get(b"status")
    status = None if raw_status is None else _STATUSES.get(raw_status)
    if status is None:
        raise CorruptTask(tid, f"field status is {_text(raw_status)!r}, not a status")
    handle = _json(get(b"handle"), tid, "handle")
    if handle is not None and not isinstance(handle, dict):
        raise CorruptTask(tid, "field handle is not a JSON object")
    code = _text(get(b"error_code"))
    error = None if code is None else TaskError(code, _text(get(b"error_message")) or "")
    created = _ms(get(b"created_ms"), tid, "created_ms")
    deadline = _ms(get(b"deadline_ms"), tid, "deadline_ms")
    if created is None or deadline is None:
        raise CorruptTask(tid, "created_ms or deadline_ms is missing")
    return Task(
        id=tid,
        handler=handler,
        status=status,
        params=_json(get(b"params"), tid, "params"),
        metadata=_json(get(b"metadata"), tid, "metadata"),
        tenant=_text(get(b"tenant")) or "",
        account=_text(get(b"account")) or "",
        provider=_text(get(b"provider")) or handler,
        priority=_int(get(b"priority"), tid, "priority"),
        external_id=_text(get(b"external_id")),
        handle=handle,
        result=_json(get(b"result"), tid, "result"),
        error=error,
        progress=_float(get(b"progress"), tid, "progress"),
        stage=_text(get(b"stage")),
        message=_text(get(b"message")),
        created_at=created,
        updated_at=_ms(get(b"updated_ms"), tid, "updated_ms") or created,
        deadline_at=deadline,
        due_at=_ms(get(b"due_ms"), tid, "due_ms"),
        finished_at=_ms(get(b"finished_ms"), tid, "finished_ms"),
        version=_int(get(b"version"), tid, "version"),
        submit_attempts=_int(get(b"submit_attempts"), tid, "submit_attempts"),
        poll_count=_int(get(b"poll_count"), tid, "poll_count"),
        consecutive_errors=_int(get(b"consecutive_errors"), tid, "consecutive_errors"),
        cancel_requested=get(b"cancel_requested") == b"1",
        dedup_key=_dedup_key(_text(get(b"dedup"))),
        fence=_int(get(b"fence"), tid, "fence"),
        owner=_text(get(b"owner")),
        started_fence=_int(get(b"started_fence"), tid, "started_fence"),
        reclaims=_int(get(b"reclaims"), tid, "reclaims"),
        idempotent=get(b"idempotent") == b"1",
    )


def _dedup_key(stored: str | None) -> str | None:
    # stored as "<len(tenant)>:<tenant>:<dedup_key>"
    if stored is None:
        return None
    n, _, rest = stored.partition(":")
    if not n.isdigit() or len(n) > 6:
        return stored
    return rest[int(n) + 1 :]


def pairs_to_dict(flat: list[bytes]) -> dict[bytes, bytes]:
    """HGETALL as returned inside a Lua reply (a flat list) -> dict."""
    pairs = iter(flat)
    return dict(zip(pairs, pairs, strict=True))  # an odd count raises ValueError
