"""Pure encoding: JSON-like payload checks, and task hashes to and from Task snapshots."""

from __future__ import annotations

import math
import operator
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


# Every field `_decode_task` reads, in the order `_read_fields` returns them. A task's
# fields are copied into a copy of `_FIELDS` (None where the hash has none), and read from it
# in one C call (`_read_fields`) by these very objects, each found by identity: a dict
# lookup by another bytes object of the same value compares the bytes, and 36 of them
# (`dict.get` per field) were a third of decoding a claimed task.
_NAMES: Final = (
    b"id", b"handler", b"status", b"handle", b"created_ms", b"deadline_ms", b"progress",
    b"updated_ms", b"due_ms", b"finished_ms", b"error_code", b"error_message", b"dedup",
    b"params", b"metadata", b"tenant", b"account", b"provider", b"priority", b"external_id",
    b"result", b"stage", b"message", b"version", b"submit_attempts", b"poll_count",
    b"consecutive_errors", b"throttles", b"lookups", b"cancel_requested", b"trace", b"fence",
    b"owner", b"started_fence", b"reclaims", b"idempotent",
)  # fmt: skip
_read_fields: Final = operator.itemgetter(*_NAMES)
# ... and the fields the scripts write that it does not read: a hash with no other name
# (len(fields) == len(_FIELDS)) has only these ASCII names, and needs no UTF-8 check.
_FIELDS: Final[dict[bytes, bytes | None]] = dict.fromkeys(
    (*_NAMES, b"timeout_ms", b"started_by", b"cancel_version", b"slots", b"held", b"quarantined")
)


def decode_task(hash_: Mapping[bytes, bytes], task_id: str | None = None) -> Task:
    """Build a Task from a task hash (HGETALL reply as a dict of bytes).

    Raises CorruptTask, naming the field, when anything cannot be read.
    """
    fields = _FIELDS.copy()
    fields.update(hash_)
    return _decode_fields(fields, task_id)


def decode_flat_task(flat: list[bytes], task_id: str | None = None) -> Task:
    """`decode_task` of a task hash as a script returns it (HGETALL's flat list of names and
    values: a claim's), without the dict of the hash on the way. An odd count raises
    ValueError (as `pairs_to_dict`)."""
    fields = _FIELDS.copy()
    pairs = iter(flat)
    fields.update(zip(pairs, pairs, strict=True))
    return _decode_fields(fields, task_id)


def _decode_fields(fields: dict[bytes, bytes | None], task_id: str | None) -> Task:
    """`_decode_task`, with a value that would not parse named in the CorruptTask raised."""
    try:
        return _decode_task(fields, task_id)
    except CorruptTask:
        raise
    except (ValueError, TypeError, OverflowError, msgspec.DecodeError) as exc:
        raise _diagnosis(fields, task_id, exc) from None


def _diagnosis(
    hash_: Mapping[bytes, bytes | None], task_id: str | None, exc: Exception
) -> CorruptTask:
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


def _decode_task(fields: dict[bytes, bytes | None], task_id: str | None) -> Task:
    """The Task of `fields`: a copy of `_FIELDS` updated with a hash's fields."""
    # Every field name must be UTF-8. NUL cannot complete a multi-byte sequence, so the
    # joined names decode exactly when each name does; ASCII (the usual case) needs no
    # decode. `_FIELDS` are ASCII: only a hash with other names is looked at.
    if len(fields) != len(_FIELDS):
        names = b"\0".join(fields)
        if not names.isascii():
            try:
                names.decode()
            except UnicodeDecodeError:
                raise CorruptTask(task_id or "?", "a field name is not UTF-8") from None
    # Inline on purpose: a helper call per field was half the cost. A value that does not
    # parse raises here, and _decode_fields has _diagnosis name its field.
    (
        v, handler_v, status_v, handle_v, created_v, deadline_v, progress_v, updated_v,
        due_v, finished_v, code_v, message_v, dedup_v, params_v, metadata_v, tenant_v,
        account_v, provider_v, priority_v, external_v, result_v, stage_v, text_v, version_v,
        attempts_v, polls_v, errors_v, throttles_v, lookups_v, cancel_v, trace_v, fence_v,
        owner_v, started_v, reclaims_v, idempotent_v,
    ) = _read_fields(fields)  # fmt: skip
    tid = v.decode("utf-8", "replace") if v else task_id or "?"
    if task_id is not None and tid != task_id:
        raise CorruptTask(task_id, f"field id is {tid!r}")
    if not handler_v:
        raise CorruptTask(tid, "field handler is missing")
    handler = handler_v.decode("utf-8", "replace")
    status = None if status_v is None else _STATUSES.get(status_v)
    if status is None:
        raise CorruptTask(tid, f"field status is {_text(status_v)!r}, not a status")
    handle = _DECODE(handle_v) if handle_v else None
    if handle is not None and not isinstance(handle, dict):
        raise CorruptTask(tid, "field handle is not a JSON object")
    created = int(created_v) if created_v else -1
    deadline = int(deadline_v) if deadline_v else -1
    if created < 0 or deadline < 0:
        raise CorruptTask(tid, "created_ms or deadline_ms is missing")
    created_at = created / 1000.0
    progress = None
    if progress_v:
        progress = float(progress_v)
        if not math.isfinite(progress):
            raise CorruptTask(tid, f"field progress is {progress_v[:40]!r}, not a finite number")
    n = int(updated_v) if updated_v else 0
    updated_at = n / 1000.0 if n > 0 else created_at
    n = int(due_v) if due_v else -1
    due_at = n / 1000.0 if n >= 0 else None
    n = int(finished_v) if finished_v else -1
    finished_at = n / 1000.0 if n >= 0 else None
    error = None
    if code_v is not None:
        code = code_v.decode("utf-8", "replace")
        error = TaskError(code, message_v.decode("utf-8", "replace") if message_v else "")
    dedup = None if dedup_v is None else _dedup_key(dedup_v.decode("utf-8", "replace"))
    return Task(
        id=tid,
        handler=handler,
        status=status,
        params=_DECODE(params_v) if params_v else None,
        metadata=_DECODE(metadata_v) if metadata_v else None,
        tenant=tenant_v.decode("utf-8", "replace") if tenant_v else "",
        account=account_v.decode("utf-8", "replace") if account_v else "",
        provider=provider_v.decode("utf-8", "replace") if provider_v else handler,
        priority=int(priority_v) if priority_v else 0,
        external_id=None if external_v is None else external_v.decode("utf-8", "replace"),
        handle=handle,
        result=_DECODE(result_v) if result_v else None,
        error=error,
        progress=progress,
        stage=None if stage_v is None else stage_v.decode("utf-8", "replace"),
        message=None if text_v is None else text_v.decode("utf-8", "replace"),
        created_at=created_at,
        updated_at=updated_at,
        deadline_at=deadline / 1000.0,
        due_at=due_at,
        finished_at=finished_at,
        version=int(version_v) if version_v else 0,
        submit_attempts=int(attempts_v) if attempts_v else 0,
        poll_count=int(polls_v) if polls_v else 0,
        consecutive_errors=int(errors_v) if errors_v else 0,
        throttles=int(throttles_v) if throttles_v else 0,
        lookups=int(lookups_v) if lookups_v else 0,
        cancel_requested=cancel_v == b"1",
        dedup_key=dedup,
        trace=None if trace_v is None else trace_v.decode("utf-8", "replace"),
        fence=int(fence_v) if fence_v else 0,
        owner=None if owner_v is None else owner_v.decode("utf-8", "replace"),
        started_fence=int(started_v) if started_v else 0,
        reclaims=int(reclaims_v) if reclaims_v else 0,
        idempotent=idempotent_v == b"1",
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
