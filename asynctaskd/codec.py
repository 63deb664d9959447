"""Pure encoding: JSON-like payload checks, and task hashes to and from Task snapshots."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
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
_DECODE: Final = _DECODER.decode


def _utf8(v: bytes) -> str:
    return v.decode("utf-8", "replace")


def _text(v: bytes | None) -> str | None:
    return None if v is None else _utf8(v)


# Every field _decode_task parses and how, in the order it parses them: when it fails, the
# first of these that does not parse is the field it failed on.
_CHECKS: Final[tuple[tuple[bytes, Callable[[bytes], object]], ...]] = (
    (b"handle", _DECODE),
    (b"created_ms", int),
    (b"deadline_ms", int),
    (b"progress", float),
    (b"updated_ms", int),
    (b"due_ms", int),
    (b"finished_ms", int),
    (b"params", _DECODE),
    (b"metadata", _DECODE),
    (b"priority", int),
    (b"result", _DECODE),
    (b"version", int),
    (b"submit_attempts", int),
    (b"poll_count", int),
    (b"consecutive_errors", int),
    (b"throttles", int),
    (b"lookups", int),
    (b"fence", int),
    (b"started_fence", int),
    (b"reclaims", int),
)


def decode_task(hash_: Mapping[bytes, bytes], task_id: str | None = None) -> Task:
    """Build a Task from a task hash (HGETALL reply as a dict of bytes).

    Raises CorruptTask, naming the field, when anything cannot be read.
    """
    try:
        return _decode_task(hash_, task_id)
    except CorruptTask:
        raise
    except (ValueError, TypeError, OverflowError, msgspec.DecodeError) as exc:
        raise _diagnosis(hash_, task_id, exc) from None  # a value would not parse: name it


def _diagnosis(hash_: Mapping[bytes, bytes], task_id: str | None, exc: Exception) -> CorruptTask:
    """What is wrong with a hash `_decode_task` could not read (it raised `exc`)."""
    tid = _text(hash_.get(b"id")) or task_id or "?"
    for name, parse in _CHECKS:
        v = hash_.get(name)
        if not v:
            continue
        try:
            parse(v)
        except (ValueError, msgspec.DecodeError) as bad:
            if parse is _DECODE:
                return CorruptTask(tid, f"field {name.decode()} is not valid JSON ({bad})")
            kind = "an integer" if parse is int else "a number"
            return CorruptTask(tid, f"field {name.decode()} is {v[:40]!r}, not {kind}")
    # Anything else a hostile hash can provoke is corrupt data too, never a crash.
    return CorruptTask(tid, f"unreadable ({type(exc).__name__}: {exc})"[:300])


def _decode_task(hash_: Mapping[bytes, bytes], task_id: str | None) -> Task:
    # Every field name must be UTF-8. NUL cannot complete a multi-byte sequence, so the
    # joined names decode exactly when each name does; ASCII (the usual case) needs no decode.
    names = b"\0".join(hash_)
    if not names.isascii():
        try:
            names.decode()
        except UnicodeDecodeError:
            raise CorruptTask(task_id or "?", "a field name is not UTF-8") from None
    # Inline on purpose: a helper call per field was half the cost. A value that does not
    # parse raises here, and decode_task's _diagnosis names its field.
    get = hash_.get
    v = get(b"id")
    tid = v.decode("utf-8", "replace") if v else task_id or "?"
    if task_id is not None and tid != task_id:
        raise CorruptTask(task_id, f"field id is {tid!r}")
    v = get(b"handler")
    if not v:
        raise CorruptTask(tid, "field handler is missing")
    handler = v.decode("utf-8", "replace")
    v = get(b"status")
    status = None if v is None else _STATUSES.get(v)
    if status is None:
        raise CorruptTask(tid, f"field status is {_text(v)!r}, not a status")
    v = get(b"handle")
    handle = _DECODE(v) if v else None
    if handle is not None and not isinstance(handle, dict):
        raise CorruptTask(tid, "field handle is not a JSON object")
    v = get(b"created_ms")
    created = int(v) if v else -1
    v = get(b"deadline_ms")
    deadline = int(v) if v else -1
    if created < 0 or deadline < 0:
        raise CorruptTask(tid, "created_ms or deadline_ms is missing")
    created_at = created / 1000.0
    v = get(b"progress")
    progress = None
    if v:
        progress = float(v)
        if not math.isfinite(progress):
            raise CorruptTask(tid, f"field progress is {v[:40]!r}, not a finite number")
    v = get(b"updated_ms")
    n = int(v) if v else 0
    updated_at = n / 1000.0 if n > 0 else created_at
    v = get(b"due_ms")
    n = int(v) if v else -1
    due_at = n / 1000.0 if n >= 0 else None
    v = get(b"finished_ms")
    n = int(v) if v else -1
    finished_at = n / 1000.0 if n >= 0 else None
    v = get(b"error_code")
    error = None
    if v is not None:
        code = v.decode("utf-8", "replace")
        v = get(b"error_message")
        error = TaskError(code, v.decode("utf-8", "replace") if v else "")
    v = get(b"dedup")
    dedup = None if v is None else _dedup_key(v.decode("utf-8", "replace"))
    return Task(
        id=tid,
        handler=handler,
        status=status,
        params=_DECODE(v) if (v := get(b"params")) else None,
        metadata=_DECODE(v) if (v := get(b"metadata")) else None,
        tenant=v.decode("utf-8", "replace") if (v := get(b"tenant")) else "",
        account=v.decode("utf-8", "replace") if (v := get(b"account")) else "",
        provider=v.decode("utf-8", "replace") if (v := get(b"provider")) else handler,
        priority=int(v) if (v := get(b"priority")) else 0,
        external_id=None if (v := get(b"external_id")) is None else v.decode("utf-8", "replace"),
        handle=handle,
        result=_DECODE(v) if (v := get(b"result")) else None,
        error=error,
        progress=progress,
        stage=None if (v := get(b"stage")) is None else v.decode("utf-8", "replace"),
        message=None if (v := get(b"message")) is None else v.decode("utf-8", "replace"),
        created_at=created_at,
        updated_at=updated_at,
        deadline_at=deadline / 1000.0,
        due_at=due_at,
        finished_at=finished_at,
        version=int(v) if (v := get(b"version")) else 0,
        submit_attempts=int(v) if (v := get(b"submit_attempts")) else 0,
        poll_count=int(v) if (v := get(b"poll_count")) else 0,
        consecutive_errors=int(v) if (v := get(b"consecutive_errors")) else 0,
        throttles=int(v) if (v := get(b"throttles")) else 0,
        lookups=int(v) if (v := get(b"lookups")) else 0,
        cancel_requested=get(b"cancel_requested") == b"1",
        dedup_key=dedup,
        trace=None if (v := get(b"trace")) is None else v.decode("utf-8", "replace"),
        fence=int(v) if (v := get(b"fence")) else 0,
        owner=None if (v := get(b"owner")) is None else v.decode("utf-8", "replace"),
        started_fence=int(v) if (v := get(b"started_fence")) else 0,
        reclaims=int(v) if (v := get(b"reclaims")) else 0,
        idempotent=get(b"idempotent") == b"1",
    )


def _dedup_key(stored: str) -> str:
    # stored as "<len(tenant)>:<tenant>:<dedup_key>"
    n, _, rest = stored.partition(":")
    if not n.isdigit() or len(n) > 6:
        return stored
    return rest[int(n) + 1 :]


def decode_request(packed: bytes, task_id: str) -> dict[bytes, bytes]:
    """The first fields of a task whose create request a daemon has not taken in yet
    (`new:<id>`, a cmsgpack array of field, value pairs), as a task hash would hold them."""
    try:
        flat = msgspec.msgpack.decode(packed)
    except msgspec.DecodeError as exc:
        raise CorruptTask(task_id, f"its create request is unreadable ({exc})") from None
    if not isinstance(flat, list) or len(flat) % 2 or not all(isinstance(x, str) for x in flat):
        raise CorruptTask(task_id, "its create request is not a list of field, value pairs")
    return {flat[i].encode(): flat[i + 1].encode() for i in range(0, len(flat), 2)}


def pairs_to_dict(flat: list[bytes]) -> dict[bytes, bytes]:
    """HGETALL as returned inside a Lua reply (a flat list) -> dict."""
    pairs = iter(flat)
    return dict(zip(pairs, pairs, strict=True))  # an odd count raises ValueError
