"""Every Redis key name asynctaskd uses: namespace, shard hash tag, one method per key."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import zlib
from typing import Final

from .model import Phase, Status

__all__ = [
    "HANDLER_KEY_RE",
    "PROTOCOL_VERSION",
    "READY_BAND",
    "SETTINGS",
    "Keys",
    "deployment_problem",
    "new_task_id",
    "next_ready_band",
    "ready_due_ms",
    "settings_problem",
    "shard_for_dedup",
]

PROTOCOL_VERSION: Final = 1  # docs/protocol.md, section 1
# ready:<phase> scores are (100 - priority) * READY_BAND + due_ms: a band per priority,
# FIFO by due time within it (lua/_schedule.lua's PRIO_SPAN, checked equal by a test).
READY_BAND: Final = 1 << 42


def ready_due_ms(score: float) -> float:
    """The due time (ms) a ready:<phase> score holds (READY_BAND)."""
    return score % READY_BAND


def next_ready_band(score: float) -> float:
    """The lowest score of the band after the one `score` is in (the next lower priority)."""
    return (score // READY_BAND + 1) * READY_BAND


# Handler keys, tenants and accounts end up inside key names and counter fields.
HANDLER_KEY_RE: Final = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")

# The fields of <ns>:{s<N>}:settings and the integers each may hold: what settings() in
# lua/_settings.lua accepts (a script raises on anything else, before writing).
SETTINGS: Final = {
    "retention_ms": (1, 316_224_000_000),  # 10 years, as the longest delay
    "expiry_grace_ms": (0, 316_224_000_000),
    "events_maxlen": (1, 1_000_000_000),
}


def settings_problem(name: str, value: object) -> str | None:
    """Why `value` cannot be stored as setting `name`, or None if it can."""
    if name not in SETTINGS:
        return f"unknown setting {name!r}: the settings are {', '.join(SETTINGS)}"
    lo, hi = SETTINGS[name]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        return f"setting {name} must be an integer from {lo} to {hi}, got {value!r}"
    return None


_CROCKFORD: Final = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def shard_for_dedup(tenant: str, dedup_key: str, shards: int) -> int:
    """The shard of a task with a dedup key: CRC-32 (IEEE, as zlib) of the UTF-8 bytes of
    tenant, NUL, dedup key, modulo the shard count. Every producer must use this function,
    or the same tenant and key can land on two shards and dedup fails
    (docs/protocol.md, section 3, has test vectors)."""
    return zlib.crc32(f"{tenant}\0{dedup_key}".encode()) % shards


def deployment_problem(raw: bytes | str | None, keys: Keys) -> str:
    """What is wrong with writing to `keys`' namespace given its deployment record (the
    value of `keys.deployment()`), or '' (nothing, or no record yet: no daemon ran)."""
    if raw is None:
        return ""
    try:
        record = json.loads(raw)
        protocol, shards = int(record["protocol"]), int(record["shards"])
    except (ValueError, TypeError, KeyError):
        return f"{keys.deployment()} is not a deployment record: {raw[:80]!r}"
    if protocol != PROTOCOL_VERSION:
        return (
            f"namespace {keys.namespace!r} speaks protocol {protocol}, this asynctaskd "
            f"speaks {PROTOCOL_VERSION}: upgrade it to the daemons' version"
        )
    if shards != keys.shards:
        return (
            f"namespace {keys.namespace!r} has {shards} shard(s) (its daemons' [redis] "
            f"shards), but this client was configured with {keys.shards}"
        )
    return ""


_last: list[int] = [0, 0]  # (ms, random) of the previous id made in this process
_lock = threading.Lock()  # sync producers may make ids from several threads


def new_task_id(shard: int = 0, *, now_ms: int | None = None) -> str:
    """A ULID, with `-<shard>` appended when the shard is not 0.

    Monotonic within a process: ids made in the same millisecond increment the random
    part, so the ready sets' FIFO tie-break (equal scores sort by member) keeps the order
    in which one producer created its tasks.
    """
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    with _lock:
        if ms <= _last[0]:
            ms = _last[0]
            rand = (_last[1] + 1) & ((1 << 80) - 1)
        else:
            rand = int.from_bytes(os.urandom(10), "big") >> 1  # leave room to increment
        _last[0], _last[1] = ms, rand
    ulid = ulid_text((ms << 80) | rand)
    return ulid if shard == 0 else f"{ulid}-{shard}"


# Two characters of Crockford's base 32 for each 10 bits, and where a ULID's 13 pairs sit
_PAIRS: Final = tuple(a + b for a in _CROCKFORD for b in _CROCKFORD)
_SHIFTS: Final = tuple(range(120, -1, -10))


def ulid_text(value: int) -> str:
    """A 128-bit value as a ULID's 26 characters of Crockford's base 32, most significant
    first (the first character carries 3 bits): 13 lookups of two characters each, half
    the cost of 26 shifts of five bits (a submit makes one id)."""
    return "".join([_PAIRS[(value >> s) & 1023] for s in _SHIFTS])


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

    def request(self, shard: int, task_id: str) -> str:
        """STRING: a producer's create request until a daemon takes it in (lua/_intake.lua)."""
        return f"{self.tag(shard)}:new:{task_id}"

    def intake(self, shard: int) -> str:
        """LIST of producer requests for the daemons: 'c:<id>', 'x:<id>', 'd:<dedup>'."""
        return f"{self.tag(shard)}:intake"

    def scheduled(self, shard: int, phase: Phase) -> str:
        """ZSET of tasks waiting for their due time: id -> due ms."""
        return f"{self.tag(shard)}:due:{phase}"

    def ready(self, shard: int, phase: Phase) -> str:
        """ZSET of due tasks: id -> priority-then-FIFO score."""
        return f"{self.tag(shard)}:ready:{phase}"

    def lookups(self, shard: int) -> str:
        """ZSET of parked tasks a vendor lookup can settle: id -> when the next is due (ms)."""
        return f"{self.tag(shard)}:due:find"

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

    def settings(self, shard: int) -> str:
        """HASH of the settings the scripts read (SETTINGS says which, and their ranges)."""
        return f"{self.tag(shard)}:settings"

    def paused(self, shard: int) -> str:
        """HASH of paused dimensions (handler:<k>, tenant:<t>, ...) -> JSON note."""
        return f"{self.tag(shard)}:paused"

    def admission_version(self, shard: int) -> str:
        """STRING: the version of the limits this shard's admission table was built from."""
        return f"{self.tag(shard)}:admission_version"

    def lanes(self, shard: int) -> str:
        """SET of rate lanes that hold tasks back on this shard."""
        return f"{self.tag(shard)}:lanes"

    def capholds(self, shard: int) -> str:
        """SET of cap:<scope> dimensions that hold tasks back on this shard."""
        return f"{self.tag(shard)}:capholds"

    def held(self, shard: int, dim: str) -> str:
        """ZSET of tasks one dimension holds back (the ready score kept)."""
        return f"{self.tag(shard)}:held:{dim}"

    def inflight(self, shard: int, scope: str) -> str:
        """SET of task ids holding a slot of an in-flight cap."""
        return f"{self.tag(shard)}:inflight:{scope}"

    def no_dedup(self, shard: int) -> str:
        """Placeholder passed where a script takes a dedup key but none applies."""
        return f"{self.tag(shard)}:dedup:-"

    def admission(self) -> str:
        """Prefix of the admission keys (limits, rates, version, bucket:<name>): one slot."""
        return f"{self.namespace}:{{adm}}:"

    def limits(self) -> str:
        """HASH of the stored limits: scope -> JSON (lua/limits.lua)."""
        return self.admission() + "limits"

    def limits_version(self) -> str:
        """STRING: the version of the stored limits, bumped on every change."""
        return self.admission() + "version"

    def quota_windows(self) -> str:
        """SET of the tenant quota window counters' names after 'quota:' (lua/quota.lua)."""
        return self.admission() + "quota_windows"

    def quota_window(self, window: str) -> str:
        """Counter of one tenant quota window, `window` a member of quota_windows."""
        return self.admission() + "quota:" + window

    def handlers(self) -> str:
        """HASH of handler keys that live daemons serve: key -> expiry ms."""
        return f"{self.namespace}:handlers"

    def daemons(self) -> str:
        """HASH of live daemons: id -> JSON heartbeat."""
        return f"{self.namespace}:daemons"

    def deployment(self) -> str:
        """STRING: JSON {"protocol": 1, "shards": N}, written once by the first daemon; every
        producer checks its own shard count against it before it writes."""
        return f"{self.namespace}:deployment"

    def groups(self) -> str:
        """HASH of handler groups: name -> JSON definition (policy and members)."""
        return f"{self.namespace}:groups"

    def cursor_key(self) -> str:
        """STRING: random bytes that list() cursors are sealed with (asynctaskd.cursors)."""
        return f"{self.namespace}:cursor_key"

    def group_counter(self, name: str) -> str:
        """Counter of a round-robin or weighted group: INCR once per routed submit."""
        return f"{self.namespace}:group:{name}:rr"
