"""Every Redis key name asynctaskd uses: namespace, shard hash tag, one method per key."""

from __future__ import annotations

import os
import re
import time
from typing import Final

from .model import Phase, Status

__all__ = ["HANDLER_KEY_RE", "Keys", "new_task_id"]

# Handler keys, tenants and accounts end up inside key names and counter fields.
HANDLER_KEY_RE: Final = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")

_CROCKFORD: Final = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_task_id(shard: int = 0, *, now_ms: int | None = None) -> str:
    """A time-ordered ULID, with `-<shard>` appended when the shard is not 0."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    value = (ms << 80) | int.from_bytes(os.urandom(10), "big")
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    ulid = "".join(reversed(chars))
    return ulid if shard == 0 else f"{ulid}-{shard}"


class Keys:
    """Key names for one namespace. Keys of one shard share the `{sN}` hash tag."""

    __slots__ = ("namespace", "shards")

    def __init__(self, namespace: str = "atd", shards: int = 1) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,32}", namespace):
            raise ValueError(
                f"namespace {namespace!r} must be 1-32 letters, digits, '_', '.' or '-'"
            )
        if not 1 <= shards <= 1024:
            raise ValueError(f"shards must be between 1 and 1024, got {shards}")
        self.namespace = namespace
        self.shards = shards

    def tag(self, shard: int) -> str:
        return f"{self.namespace}:{{s{shard}}}"

    def task_prefix(self, shard: int) -> str:
        return f"{self.tag(shard)}:task:"

    def task(self, shard: int, task_id: str) -> str:
        return f"{self.tag(shard)}:task:{task_id}"

    def scheduled(self, shard: int, phase: Phase) -> str:
        """ZSET of tasks waiting for their due time: id -> due ms."""
        return f"{self.tag(shard)}:due:{phase}"

    def ready(self, shard: int, phase: Phase) -> str:
        """ZSET of due tasks: id -> priority-then-FIFO score."""
        return f"{self.tag(shard)}:ready:{phase}"

    def leases(self, shard: int) -> str:
        return f"{self.tag(shard)}:leases"

    def deadlines(self, shard: int) -> str:
        return f"{self.tag(shard)}:deadlines"

    def index(self, shard: int, status: Status) -> str:
        """ZSET of tasks in one status: id -> ms when they entered it."""
        return f"{self.tag(shard)}:idx:{status.value}"

    def counts(self, shard: int) -> str:
        return f"{self.tag(shard)}:counts"

    def events(self, shard: int) -> str:
        return f"{self.tag(shard)}:events"

    def wake(self, shard: int) -> str:
        return f"{self.tag(shard)}:wake"

    def quarantine(self, shard: int) -> str:
        return f"{self.tag(shard)}:quarantine"

    def dedup(self, shard: int, tenant: str, dedup_key: str) -> str:
        return f"{self.tag(shard)}:dedup:{len(tenant)}:{tenant}:{dedup_key}"

    def no_dedup(self, shard: int) -> str:
        """Placeholder passed where a script takes a dedup key but none applies."""
        return f"{self.tag(shard)}:dedup:-"

    def handlers(self) -> str:
        """HASH of handler keys that live daemons serve: key -> expiry ms."""
        return f"{self.namespace}:handlers"

    def daemons(self) -> str:
        """HASH of live daemons: id -> JSON heartbeat."""
        return f"{self.namespace}:daemons"
