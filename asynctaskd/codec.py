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


def _text(raw: Mapping[str, bytes], name: str) -> str | None:
    v = raw.get(name)
    return None if v is None else v.decode("utf-8", "replace")


def _int(raw: Mapping[str, bytes], task_id: str, name: str, default: int = 0) -> int:
    v = raw.get(name)
    if v is None or v == b"":
        return default
    try:
        return int(v)
    except ValueError:
        raise CorruptTask(task_id, f"field {name} is {v[:40]!r}, not an integer") from None


def _float(raw: Mapping[str, bytes], task_id: str, name: str) -> float | None:
    v = raw.get(name)
    if v is None or v == b"":
        return None
    try:
        out = float(v)
    except ValueError:
        raise CorruptTask(task_id, f"field {name} is {v[:40]!r}, not a number") from None
    if not math.isfinite(out):
        raise CorruptTask(task_id, f"field {name} is {v[:40]!r}, not a finite number")
    return out


def _json(raw: Mapping[str, bytes], task_id: str, name: str) -> Any:
    v = raw.get(name)
    if v is None or v == b"":
        return None
    try:
        return _DECODER.decode(v)
    except msgspec.DecodeError as exc:
        raise CorruptTask(task_id, f"field {name} is not valid JSON ({exc})") from None


def _ms(raw: Mapping[str, bytes], task_id: str, name: str) -> float | None:
    v = _int(raw, task_id, name, -1)
    return None if v < 0 else v / 1000.0


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
    try:
        raw = {k.decode(): v for k, v in hash_.items()}
    except UnicodeDecodeError:
        raise CorruptTask(task_id or "?", "a field name is not UTF-8") from None
    tid = _text(raw, "id") or task_id or "?"
    if task_id is not None and tid != task_id:
        raise CorruptTask(task_id, f"field id is {tid!r}")
    handler = _text(raw, "handler")
    if not handler:
        raise CorruptTask(tid, "field handler is missing")
    status_text = _text(raw, "status")
    try:
        status = Status(status_text)
    except ValueError:
        raise CorruptTask(tid, f"field status is {status_text!r}, not a status") from None
    handle = _json(raw, tid, "handle")
    if handle is not None and not isinstance(handle, dict):
        raise CorruptTask(tid, "field handle is not a JSON object")
    code = _text(raw, "error_code")
    error = None if code is None else TaskError(code, _text(raw, "error_message") or "")
    created = _ms(raw, tid, "created_ms")
    deadline = _ms(raw, tid, "deadline_ms")
    if created is None or deadline is None:
        raise CorruptTask(tid, "created_ms or deadline_ms is missing")
    return Task(
        id=tid,
        handler=handler,
        status=status,
        params=_json(raw, tid, "params"),
        metadata=_json(raw, tid, "metadata"),
        tenant=_text(raw, "tenant") or "",
        account=_text(raw, "account") or "",
        provider=_text(raw, "provider") or handler,
        priority=_int(raw, tid, "priority"),
        external_id=_text(raw, "external_id"),
        handle=handle,
        result=_json(raw, tid, "result"),
        error=error,
        progress=_float(raw, tid, "progress"),
        stage=_text(raw, "stage"),
        message=_text(raw, "message"),
        created_at=created,
        updated_at=_ms(raw, tid, "updated_ms") or created,
        deadline_at=deadline,
        due_at=_ms(raw, tid, "due_ms"),
        finished_at=_ms(raw, tid, "finished_ms"),
        version=_int(raw, tid, "version"),
        submit_attempts=_int(raw, tid, "submit_attempts"),
        poll_count=_int(raw, tid, "poll_count"),
        consecutive_errors=_int(raw, tid, "consecutive_errors"),
        cancel_requested=_text(raw, "cancel_requested") == "1",
        dedup_key=_dedup_key(_text(raw, "dedup")),
        fence=_int(raw, tid, "fence"),
        owner=_text(raw, "owner"),
        started_fence=_int(raw, tid, "started_fence"),
        reclaims=_int(raw, tid, "reclaims"),
        idempotent=_text(raw, "idempotent") == "1",
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
    return dict(zip(flat[::2], flat[1::2], strict=True))
