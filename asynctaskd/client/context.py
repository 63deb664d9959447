"""What every plan of the clients shares: the tunables, the results the clients return
(`TaskEvent`, `TaskPage`, `Stats`), the plan types (`Step`, `Plan`) and `_Context`: key
names, script calls, limits and the caches of one client.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Generator
from typing import Any, Final, TypeAlias, TypeVar

import msgspec
import redis.exceptions

from asynctaskd.errors import StoreUnavailable
from asynctaskd.keys import Keys
from asynctaskd.model import Status, Task
from asynctaskd.plans import Pause, Reads
from asynctaskd.store import Call, Ops

T = TypeVar("T")

HANDLER_CACHE_S: Final = 5.0  # how long a client trusts its copy of the live handler keys
GROUP_CACHE_S: Final = 5.0  # how long a client trusts its copy of the handler groups
QUOTA_CACHE_S: Final = 1.0  # how long a client trusts its list of tenants with a quota
CURSOR_KEY_CACHE_S: Final = 60.0  # how long a client trusts its copy of the cursor key
STALE_DEDUP_WAIT_S: Final = 5.0  # how long a submit waits for a daemon to free a stale dedup key
BLOCK_S: Final = 5.0  # longest XREAD BLOCK; below the 10 s socket timeout of from_url
REPLY_MARGIN_S: Final = 5.0  # client-side bound on a blocking read: BLOCK plus this
RECONNECT_BUDGET_S: Final = 30.0  # watch() gives up after this long without Redis
DAEMON_STALE_S: Final = 30.0
MAX_SECONDS: Final = 10 * 366 * 86400.0  # keeps every ms figure an exact integer in Lua
XREAD_COUNT: Final = 500
_ID_RE: Final = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}(?:-([1-9][0-9]{0,3}))?")
_PURGED: Final = (Status.SUCCEEDED, Status.FAILED, Status.CANCELED, Status.TRACKING_TIMED_OUT)
_RESOLVABLE: Final = (Status.SUBMITTED, Status.PENDING_SUBMIT, Status.FAILED, Status.CANCELED)
_REQUEUE: Final = (Status.FAILED, Status.TRACKING_TIMED_OUT)
_TRANSIENT: Final = (
    StoreUnavailable,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)


class TaskEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One status or progress change, as `watch()` yields it. `at` is epoch seconds."""

    task_id: str
    status: Status
    version: int
    progress: float | None = None
    stage: str | None = None
    message: str | None = None
    at: float = 0.0


class TaskPage(msgspec.Struct, frozen=True):
    """One page of `list()`; pass `cursor` back to continue, None when the walk is done."""

    tasks: list[Task]
    cursor: str | None = None


class Stats(msgspec.Struct, frozen=True):
    """Exact counts (every status in `by_status`; only non-zero ones per handler) and the
    heartbeats of daemons seen in the last 30 seconds. `requests`: producers' creates and
    cancels that no daemon has taken in yet (their tasks read as PENDING_SUBMIT but are
    counted once a daemon takes them in, within milliseconds while one runs).
    `parked_for_lookup`: of the SUBMIT_UNKNOWN tasks, those a vendor lookup will settle (their
    handler can `find`); the others wait for an operator (`parked_for_operator`)."""

    by_status: dict[Status, int]
    by_handler: dict[str, dict[Status, int]]
    daemons: list[dict[str, Any]]
    requests: int = 0
    parked_for_lookup: int = 0

    @property
    def parked_for_operator(self) -> int:
        return max(0, self.by_status.get(Status.SUBMIT_UNKNOWN, 0) - self.parked_for_lookup)


Step: TypeAlias = Call[Any] | Reads | Pause | TaskEvent
Plan: TypeAlias = Generator[Step, Any, T]


class _Context:
    """What plans need from a client: key names, script calls, limits, the handler cache."""

    def __init__(self, namespace: str, shards: int, max_payload: int) -> None:
        self.keys = Keys(namespace, shards)
        self.ops = Ops(self.keys)
        self.max_payload = max_payload
        self.live_until_ms: dict[str, int] = {}
        self.live_read_at = -math.inf  # monotonic seconds of the last HGETALL handlers
        self.groups: dict[str, bytes] = {}  # group name -> its JSON definition, decoded on use
        self.groups_read_at = -math.inf  # monotonic seconds of the last HGETALL groups
        self.quotas: set[str] = set()  # tenants with a submit quota ("*": every tenant)
        self.quotas_read_at = -math.inf
        self.cursor_key = b""  # derived from <ns>:cursor_key; empty until first needed
        self.cursor_key_read_at = -math.inf
        self.deployment_problem = ""  # keys.deployment_problem of <ns>:deployment, as read
        self.deployment_read_at = -math.inf  # monotonic seconds, with the groups and handlers

    def remember_handlers(self, raw: dict[bytes, bytes]) -> dict[str, int]:
        out = {}
        for k, v in raw.items():
            try:
                out[k.decode()] = int(v)
            except ValueError:
                continue  # not ours to judge; an unreadable entry just does not count
        self.live_until_ms = out
        self.live_read_at = time.monotonic()
        return out

    def remember_groups(self, raw: dict[bytes, bytes]) -> dict[str, bytes]:
        self.groups = {k.decode(): v for k, v in raw.items()}
        self.groups_read_at = time.monotonic()
        return self.groups
