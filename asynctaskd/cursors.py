"""Pure: list() cursors, a walk's position sealed so that it tells its holder nothing.

A walk over the status indexes stops where its budget runs out, which may be at another
tenant's task; the position (that task's index score and id) must not reach the caller.
A cursor is the position encrypted and authenticated with the namespace's cursor key
(`<ns>:cursor_key`, made by the first client that needs it), deterministically: the same
position under the same filters always gives the same cursor, any client of the
namespace can continue it, and it stays valid for as long as the key does.

The construction is SIV (deterministic authenticated encryption) over keyed BLAKE2b, a
PRF: the IV is the PRF of the filters and the position, and it is also the tag; the
position is XORed with a PRF keystream derived from the IV. Distinct personalisations
make the IV, keystream and filter-tag functions independent. A cursor is also bound to
the filters it was made for (status, handler, tenant, account, time range): its position
means nothing under others, so it is refused there with an error that says so. In clear
are a key id, a tag of the filters and the IV: keyed digests, which tell at most whether
two cursors share a key, filters or position.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import struct
from typing import Final, NamedTuple

import msgspec

from .errors import InvalidTask

__all__ = [
    "KEY_BYTES",
    "Position",
    "derive_key",
    "filters_of",
    "open_cursor",
    "seal",
    "sealed_with",
]

KEY_BYTES: Final = 32  # the random value stored at <ns>:cursor_key
_VERSION: Final = b"\x01"
_KEY_ID: Final = 3  # bytes naming the key a cursor was sealed with, for a clear error
_FILTER_TAG: Final = 4  # bytes of the filters' tag, kept in clear for a clear error
_IV: Final = 16
_HEAD: Final = struct.Struct(">HHBq")  # status position, shard, has a score, score
_MEMBER_BYTES: Final = 32  # task ids have at most 31 characters; shorter ones are padded
_CLEAR: Final = 1 + _KEY_ID + _FILTER_TAG + _IV  # 24 bytes: with a 45-byte position, a
# cursor is 69 bytes, 92 base64 characters with no spare bits (every character counts)


class Position(NamedTuple):
    """Where a walk goes on: the index of its status among the filter's statuses, the
    shard, and the last (score, member) looked at in that index (None, b"": its start)."""

    status: int
    shard: int
    score: int | None
    member: bytes


def derive_key(stored: bytes) -> bytes:
    """The sealing key from the value stored in Redis (any length works)."""
    return hashlib.blake2b(stored, digest_size=KEY_BYTES, person=b"atd-list-key").digest()


def filters_of(
    status: str | None, handler: str | None, tenant: str | None, *, account: str | None = None,
    since_ms: int | None = None, until_ms: int | None = None,
) -> bytes:  # fmt: skip
    """The bytes a cursor is bound to: the filters of the walk, unambiguously. Without an
    account or time range they are the three of the first cursors, which stay valid."""
    if account is None and since_ms is None and until_ms is None:
        return msgspec.json.encode((status, handler, tenant))
    return msgspec.json.encode((status, handler, tenant, account, since_ms, until_ms))


def seal(key: bytes, filters: bytes, position: Position) -> str:
    """The cursor for `position` of a walk under `filters` (from `filters_of`)."""
    member = position.member.ljust(_MEMBER_BYTES, b"\0")
    plain = _HEAD.pack(
        position.status, position.shard, position.score is not None, position.score or 0
    )
    plain += member + b"\0" * (-len(member) % _MEMBER_BYTES)
    iv = _iv(key, filters, plain)
    token = _VERSION + _key_id(key) + _filter_tag(key, filters) + iv
    token += _xor(plain, _stream(key, iv, len(plain)))
    return base64.urlsafe_b64encode(token).decode().rstrip("=")


def sealed_with(key: bytes, cursor: object) -> bool:
    """Whether `cursor` names `key` as the one it was sealed with (a client whose copy of
    the key is older than the cursor reads the key again)."""
    token = _token(cursor)
    return token[1 : 1 + _KEY_ID] == _key_id(key)


def open_cursor(key: bytes, filters: bytes, cursor: object) -> Position:
    """The position sealed in `cursor`, or InvalidTask saying why it cannot be used here:
    sealed with another key, made for other filters, or not made by list() at all."""
    token = _token(cursor)
    shown = f"{cursor!r:.40}" + ("..." if len(repr(cursor)) > 40 else "")
    if len(token) < _CLEAR + _HEAD.size + _MEMBER_BYTES or token[:1] != _VERSION:
        raise InvalidTask(f"cursor {shown} was not returned by list()")
    if not hmac.compare_digest(token[1 : 1 + _KEY_ID], _key_id(key)):
        raise InvalidTask(
            f"cursor {shown} is no longer valid: the namespace's cursor key has changed "
            "since it was made; start the walk again"
        )
    if not hmac.compare_digest(token[1 + _KEY_ID : _CLEAR - _IV], _filter_tag(key, filters)):
        raise InvalidTask(
            f"cursor {shown} was made by list() with other filters: continue a walk with "
            "the status, handler, tenant, account, since and until it started with"
        )
    iv = token[_CLEAR - _IV : _CLEAR]
    plain = _xor(token[_CLEAR:], _stream(key, iv, len(token) - _CLEAR))
    if not hmac.compare_digest(iv, _iv(key, filters, plain)):
        raise InvalidTask(f"cursor {shown} was not returned by list()")
    status, shard, has_score, score = _HEAD.unpack_from(plain)
    return Position(status, shard, score if has_score else None, plain[_HEAD.size :].rstrip(b"\0"))


def _token(cursor: object) -> bytes:
    text = cursor if isinstance(cursor, str) else ""
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return b""


def _key_id(key: bytes) -> bytes:
    return hashlib.blake2b(b"", key=key, digest_size=_KEY_ID, person=b"atd-list-keyid").digest()


def _filter_tag(key: bytes, filters: bytes) -> bytes:
    return hashlib.blake2b(
        filters, key=key, digest_size=_FILTER_TAG, person=b"atd-list-filter"
    ).digest()


def _iv(key: bytes, filters: bytes, plain: bytes) -> bytes:
    data = len(filters).to_bytes(4, "big") + filters + plain
    return hashlib.blake2b(data, key=key, digest_size=_IV, person=b"atd-list-siv").digest()


def _stream(key: bytes, iv: bytes, size: int) -> bytes:
    blocks = (
        hashlib.blake2b(iv + i.to_bytes(4, "big"), key=key, person=b"atd-list-stream").digest()
        for i in range(-(-size // 64))
    )
    return b"".join(blocks)[:size]


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).to_bytes(len(a), "big")
