"""`Ops`: every script call of one namespace, built as a `Call` (script, keys, arguments,
reply decoder). Pure: no I/O."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Final

from asynctaskd.codec import decode_flat_task, decode_task, pairs_to_dict
from asynctaskd.errors import CorruptTask, ScriptError
from asynctaskd.keys import HANDLER_KEY_RE, Keys
from asynctaskd.model import Phase, Status, shard_of

from .replies import (
    Call,
    ClaimBatch,
    Claimed,
    Code,
    Created,
    Lease,
    LookupBatch,
    Reconciled,
    Result,
    Sweep,
    _codes,
    _id_list,
    _intake,
    _pairs,
    _result,
    _s,
    _status_of,
    _sweep,
)

PAUSE_KINDS: Final = ("handler", "provider", "tenant", "account")
PROMOTE_LIMIT: Final = 1000  # a claim moves at most this many newly due tasks to ready


def check_dimension(dimension: str) -> None:
    """Raise ValueError unless `dimension` is '<kind>:<name>' with a known kind."""
    kind, sep, name = dimension.partition(":")
    if not sep or kind not in PAUSE_KINDS or not HANDLER_KEY_RE.fullmatch(name):
        raise ValueError(
            f"cannot pause {dimension!r}: use handler:<key>, provider:<name>, "
            "tenant:<name> or account:<name> (letters, digits, '_', '.', ':', '-')"
        )


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))


class Ops:
    """Builds every Call for one namespace. Pure: no I/O."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        # Each shard's key prefix and task key prefix, formatted once: every save and
        # claim names them, and formatting them per call cost a poll ~1.5% of its work.
        self._prefixes = [keys.tag(shard) + ":" for shard in range(keys.shards)]
        self._task_prefixes = [keys.task_prefix(shard) for shard in range(keys.shards)]

    def _prefix(self, shard: int) -> str:
        if 0 <= shard < len(self._prefixes):
            return self._prefixes[shard]
        return self.keys.tag(shard) + ":"

    def _task(self, task_id: str) -> tuple[str, str]:
        shard = shard_of(task_id)
        if shard >= self.keys.shards:
            raise ValueError(
                f"task id {task_id!r} is on shard {shard}, but only {self.keys.shards} "
                "shard(s) are configured"
            )
        return self._prefixes[shard], self._task_prefixes[shard] + task_id

    def create(
        self,
        task_id: str,
        handler: str,
        params_json: bytes,
        *,
        timeout_ms: int,
        provider: str = "",
        tenant: str = "",
        account: str = "",
        priority: int = 0,
        delay_ms: int = 0,
        not_before_ms: int = 0,
        metadata_json: bytes = b"",
        dedup_key: str = "",
        trace: str = "",
    ) -> Call[Created]:
        prefix, task_key = self._task(task_id)
        shard = shard_of(task_id)
        dedup = (
            self.keys.dedup(shard, tenant, dedup_key) if dedup_key else self.keys.no_dedup(shard)
        )

        def decode(reply: Any) -> Created:
            code = int(reply[0])
            if code == 1:
                return Created(task_id, False, int(reply[1]), int(reply[2]), int(reply[3]))
            if code == 2:
                return Created(_s(reply[1]), True)
            if code == Code.DEDUP_STALE:
                return Created(_s(reply[1]), True, stale=True)
            if code == Code.EXISTS:
                raise ScriptError(f"task id {task_id} already exists: ids must be unique")
            raise ScriptError(f"unexpected create reply {reply!r}")

        args = [
            task_id,
            handler,
            provider,
            tenant,
            account,
            priority,
            delay_ms,
            not_before_ms,
            timeout_ms,
            params_json,
            metadata_json,
            dedup_key,
        ]
        if trace:  # the optional 13th ARGV: a create without one is the 12 of before
            args.append(trace)
        return Call("create", [prefix, task_key, dedup], args, decode)

    def claim(
        self,
        shard: int,
        phase: Phase,
        n: int,
        lease_ms: int,
        owner: str,
        promote_limit: int,
        grants: Mapping[str, int] | None = None,
    ) -> Call[ClaimBatch]:
        def decode(reply: Any) -> ClaimBatch:
            next_due = int(reply[0]) or None
            claimed: list[Claimed] = []
            corrupt: list[CorruptTask] = []
            info = reply[3]
            lanes = {
                _s(info[i]): (int(info[i + 1]), int(info[i + 2])) for i in range(0, len(info), 3)
            }
            taken, refused = _intake(reply[4])
            for item in reply[5:]:
                task_id = _s(item[0])
                try:
                    task = decode_flat_task(item[3], task_id)
                except CorruptTask as exc:
                    corrupt.append(exc)
                    continue
                claimed.append(Claimed(Lease(task_id, int(item[1]), int(item[2])), task))
            return ClaimBatch(
                claimed, next_due, int(reply[1]), int(reply[2]), corrupt, lanes,
                taken, refused,
            )  # fmt: skip

        args: list[Any] = [phase, n, lease_ms, owner, promote_limit]
        for lane, tokens in (grants or {}).items():
            args += (lane, tokens)
        return Call("claim", [self._prefix(shard)], args, decode)

    def start(
        self, lease: Lease, idempotent: bool, token: str = "", find_visible_ms: int | None = None
    ) -> Call[Result]:
        """Mark the submit started; `token` (unique to this start) lets `withdraw` take
        the mark back. `find_visible_ms` (a handler that can `find` its vendor job): how
        long after the mark a created job is visible to the lookup; a task parked under
        this mark is then due for lookups (lua/lookup.lua)."""
        prefix, task_key = self._task(lease.task_id)
        args = [lease.task_id, lease.fence, lease.version, "1" if idempotent else "0"]
        if token or find_visible_ms is not None:
            args.append(token)
        if find_visible_ms is not None:
            args.append(find_visible_ms)
        return Call("start", [prefix, task_key], args, _result)

    def lookup(
        self, shard: int, n: int, lease_ms: int, owner: str, handlers: Sequence[str]
    ) -> Call[LookupBatch]:
        """Lease up to n parked tasks of `handlers` whose vendor lookup is due."""

        def decode(reply: Any) -> LookupBatch:
            claimed: list[Claimed] = []
            corrupt: list[CorruptTask] = []
            lookups: list[int] = []
            for item in reply[3:]:
                task_id = _s(item[0])
                fields = pairs_to_dict(item[3])
                try:
                    task = decode_task(fields, task_id)
                except CorruptTask as exc:
                    corrupt.append(exc)
                    continue
                claimed.append(Claimed(Lease(task_id, int(item[1]), int(item[2])), task))
                lookups.append(int(fields.get(b"lookups", b"1")))
            return LookupBatch(
                claimed, int(reply[0]) or None, int(reply[1]), int(reply[2]), corrupt, lookups
            )

        args: list[Any] = [n, lease_ms, owner, *handlers]
        return Call("lookup", [self._prefix(shard)], args, decode)

    def reconcile(
        self,
        lease: Lease,
        outcome: str,
        *,
        retry_ms: int,
        max_lookups: int,
        give_up_ms: int,
        external_id: str = "",
        handle_json: bytes = b"",
        message: str = "",
    ) -> Call[Reconciled]:
        """Settle a parked task from a lookup: `outcome` is found, none or error."""

        def decode(reply: Any) -> Reconciled:
            code = Code(int(reply[0]))
            if code is not Code.OK:
                return Reconciled(code)
            return Reconciled(code, int(reply[1]), _status_of(reply[2]), _s(reply[3]))

        prefix, task_key = self._task(lease.task_id)
        args = [lease.task_id, lease.fence, lease.version, outcome, retry_ms, max_lookups,
                give_up_ms, external_id, handle_json, message]  # fmt: skip
        return Call("reconcile", [prefix, task_key], args, decode)

    def withdraw(
        self,
        lease: Lease,
        token: str,
        *,
        delay_ms: int = 0,
        fields: dict[str, str | bytes | int | float] | None = None,
    ) -> Call[Result]:
        """Take back the start mark `token` made (if it is there) and the lease: the task
        goes back to PENDING_SUBMIT, due in `delay_ms`. Only for a submit whose vendor call
        did not happen."""
        prefix, task_key = self._task(lease.task_id)
        args: list[Any] = [lease.task_id, lease.fence, token, delay_ms]
        for name, value in (fields or {}).items():
            args.append(name)
            args.append(value)
        return Call("withdraw", [prefix, task_key], args, _result)

    def save(
        self,
        lease: Lease,
        status: Status,
        *,
        delay_ms: int = 0,
        fields: dict[str, str | bytes | int | float] | None = None,
    ) -> Call[Result]:
        prefix, task_key = self._task(lease.task_id)
        # `_value_`, not `.value` (a descriptor in Python code), and the fields' names and
        # values added in one C call: every poll builds one.
        args: list[Any] = [lease.task_id, lease.fence, lease.version, status._value_, delay_ms]
        if fields:
            args.extend(itertools.chain.from_iterable(fields.items()))
        return Call("save", [prefix, task_key], args, _result)

    def create_many(self, creates: Sequence[Call[Created]]) -> Call[list[Any]]:
        """`create` calls of tasks of one shard as one call (see `_many`)."""
        return self._many("create_many", creates)

    def start_many(self, starts: Sequence[Call[Result]]) -> Call[list[Any]]:
        """`start` calls to tasks of one shard as one call (see `_many`)."""
        return self._many("start_many", starts)

    def save_many(self, saves: Sequence[Call[Result]]) -> Call[list[Any]]:
        """`save` calls to tasks of one shard as one call (see `_many`)."""
        return self._many("save_many", saves)

    def _many(self, script: str, calls: Sequence[Call[Any]]) -> Call[list[Any]]:
        """Calls of one single-task script (`create`, `start`, `save`) to tasks of one
        shard as one call of its `_many` script: the prefix, then each call's other keys.
        Its reply is each call's reply in order, undecoded: a call that raised has its
        error reply in its place."""
        one = _ONE_OF[script]
        prefix = calls[0].keys[0]
        keys = [prefix]
        args: list[Any] = []
        for call in calls:
            if call.script != one or call.keys[0] != prefix:
                raise ValueError(f"{script} takes {one} calls to tasks of one shard")
            keys.extend(call.keys[1:])
            args.append(len(call.args))
            args.extend(call.args)
        count = len(calls)

        def decode(reply: Any) -> list[Any]:
            if not isinstance(reply, list) or len(reply) != count:
                raise ScriptError(f"{script}: expected {count} replies, got {reply!r}")
            return reply

        return Call(script, keys, args, decode)

    def renew(self, shard: int, lease_ms: int, leases: Sequence[Lease]) -> Call[list[Code]]:
        args: list[Any] = [lease_ms]
        for lease in leases:
            args.append(lease.task_id)
            args.append(lease.fence)
        return Call("renew", [self._prefix(shard)], args, _codes)

    def release(self, shard: int, leases: Sequence[Lease]) -> Call[list[Code]]:
        args: list[Any] = []
        for lease in leases:
            args.extend((lease.task_id, lease.fence, lease.version))
        return Call("release", [self._prefix(shard)], args, _codes)

    def cancel(self, task_id: str, tenant: str | None = None) -> Call[Result]:
        prefix, task_key = self._task(task_id)
        args = [task_id, "0" if tenant is None else "1", tenant or ""]
        return Call("cancel", [prefix, task_key], args, _result)

    def reap(self, shard: int, limit: int, max_reclaims: int) -> Call[list[tuple[str, Status]]]:
        return Call("reap", [self._prefix(shard)], [limit, max_reclaims], _pairs)

    def time_out(self, shard: int, limit: int) -> Call[Sweep]:
        return Call("time_out", [self._prefix(shard)], [limit], _sweep)

    def resolve(
        self,
        task_id: str,
        target: Status,
        *,
        external_id: str = "",
        handle_json: bytes = b"",
        message: str = "",
    ) -> Call[Result]:
        prefix, task_key = self._task(task_id)
        args = [task_id, target.value, external_id, handle_json, message]
        return Call("resolve", [prefix, task_key], args, _result)

    def purge(self, shard: int, older_than_ms: int, limit: int) -> Call[list[str]]:
        """An operator's purge of terminal tasks (the daemons' retention is `expire`)."""
        return Call("purge", [self._prefix(shard)], [older_than_ms, limit], _id_list)

    def expire(self, shard: int, retention_ms: int, limit: int) -> Call[list[str]]:
        """The daemons' retention: delete terminal tasks older than `retention_ms`."""
        return Call("expire", [self._prefix(shard)], [retention_ms, limit], _id_list)

    def pause(self, shard: int, dimension: str, note: str = "") -> Call[bool]:
        """Hold back new submits for `dimension` ('tenant:t1', 'handler:ocr', ...)."""
        check_dimension(dimension)
        return Call("pause", [self._prefix(shard)], [dimension, note[:200]],
                    lambda reply: int(reply[0]) == 1)  # fmt: skip

    def resume(self, shard: int, dimension: str, limit: int = 1000) -> Call[tuple[int, int]]:
        """Lift a pause; returns (moved back, still held). Call again while still held."""
        check_dimension(dimension)
        return Call("resume", [self._prefix(shard)], [dimension, limit],
                    lambda reply: (int(reply[0]), int(reply[1])))  # fmt: skip

    def quarantine(self, task_id: str, reason: str) -> Call[Result]:
        prefix, task_key = self._task(task_id)
        return Call("quarantine", [prefix, task_key], [task_id, reason[:500]], _result)

    # Admission (asynctaskd.admission): the {adm} slot, then each shard's copy.

    def take(self, mode: str, lanes: Mapping[str, int]) -> Call[dict[str, tuple[int, int]]]:
        """Take (or refund) tokens per rate lane; lane -> (granted, ms until the next)."""
        names = list(lanes)

        def decode(reply: Any) -> dict[str, tuple[int, int]]:
            return {
                lane: (int(reply[2 * i]), int(reply[2 * i + 1])) for i, lane in enumerate(names)
            }

        args: list[Any] = [mode]
        for lane, count in lanes.items():
            args += (lane, count)
        return Call("take", [self.keys.admission()], args, decode)

    def quota(self, tenant: str) -> Call[tuple[bool | None, int]]:
        """Count one submit against the tenant's quota: (True, 0) counted, (False, wait_ms)
        refused, (None, 0) no quota applies (lua/quota.lua)."""

        def decode(reply: Any) -> tuple[bool | None, int]:
            code = int(reply[0])
            return (None if code == 2 else code == 1), int(reply[1])

        return Call("quota", [self.keys.admission()], [tenant], decode)

    def limits(
        self, mode: str, entries: Sequence[tuple[str, bytes | str]]
    ) -> Call[tuple[int, int, list[str]]]:
        """Write limit entries (scope, JSON or '' to delete); returns the new version, how
        many scopes changed, and the scopes a runtime entry kept (mode 'config')."""
        args: list[Any] = [mode]
        for scope, raw in entries:
            args += (scope, raw)

        def decode(reply: Any) -> tuple[int, int, list[str]]:
            return int(reply[0]), int(reply[1]), [_s(x) for x in reply[2:]]

        return Call("limits", [self.keys.admission()], args, decode)

    def stage_limits(
        self,
        shard: int,
        version: int,
        token: str,
        lease_ms: int,
        first: bool,
        pairs: Sequence[tuple[str, str]],
    ) -> Call[int]:
        """Stage one chunk (at most 1000 fields) of a shard's next admission table; returns
        1 staged, 0 the shard is up to date already, -1 another build owns the shard (or
        this one lost it)."""
        args: list[Any] = [version, token, lease_ms, "1" if first else "0"]
        for field, value in pairs:
            args += (field, value)
        return Call("stage_limits", [self._prefix(shard)], args, lambda reply: int(reply[0]))

    def sync_limits(
        self, shard: int, version: int, limit: int = 1000, token: str = "", size: int = 0
    ) -> Call[tuple[int, int, int]]:
        """Swap in the table staged under `token` (`size` fields), then lift holds; returns
        (applied: 1, 0 or -1 for a staged table that was not whole, moved back, still to
        move). Token '' only lifts holds."""
        return Call("sync_limits", [self._prefix(shard)], [version, limit, token, size],
                    lambda reply: (int(reply[0]), int(reply[1]), int(reply[2])))  # fmt: skip


# Single-task scripts whose calls to one shard, sent together, go as one call of a script
# that runs several (each script call costs Redis a fixed amount before its first command).
_MANY_OF: Final = {"create": "create_many", "start": "start_many", "save": "save_many"}
_ONE_OF: Final = {many: one for one, many in _MANY_OF.items()}
