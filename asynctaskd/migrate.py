"""Copy a deployment's namespace from one Redis to another (`asynctaskd migrate`).

Every key under `<ns>:` is copied as it is, with DUMP and PTTL on the source and RESTORE
(with the remaining TTL, never REPLACE) on the target: tasks keep their ids, so their
shard numbers, and the deployment record comes along. Nothing on the source must change
meanwhile, so the copy refuses while daemons of the namespace are alive there; producers
must be stopped too (they write create requests, not heartbeats). A Redis Cluster target
(`redis+cluster://`) gets each key on its own slot through the cluster client.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import redis

from asynctaskd.client.context import DAEMON_STALE_S
from asynctaskd.connection import local_url, open_sync
from asynctaskd.errors import ConfigError
from asynctaskd.keys import Keys
from asynctaskd.model import Status

__all__ = ["MigrationFailed", "MigrationRefused", "Report", "migrate"]

# Keys read or written per round trip.
BATCH: Final = 200
# Keys expiring sooner than this may vanish on one side between the copy and the check:
# the verification counts them apart and does not compare them.
SHORT_TTL_MS: Final = 60_000
_SHARD_RE: Final = re.compile(rb"^[^:]+:\{s(\d+)\}:")


class MigrationRefused(Exception):
    """Not possible now (live daemons, a non-empty target, too few shards): nothing written."""


class MigrationFailed(Exception):
    """The copy or its check went wrong (a RESTORE error, counts that differ)."""


@dataclass
class Report:
    source_shards: int = 0
    keys: int = 0  # copied (or, dry run, to copy)
    by_type: Counter[str] = field(default_factory=Counter)
    by_status: dict[str, int] = field(default_factory=dict)
    vanished: int = 0  # listed by SCAN, expired before DUMP
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # dry run: why it would be refused
    verified: bool = False
    # "dump" (DUMP/RESTORE), or "logical" (each key read and written with its type's
    # commands) when the target cannot read the source's DUMP format
    method: str = "dump"


def _say_nothing(_: str) -> None:
    pass


def migrate(
    source_url: str,
    target_url: str,
    namespace: str,
    *,
    target_shards: int | None = None,
    force: bool = False,
    dry_run: bool = False,
    count: int = BATCH,
    say: Callable[[str], None] = _say_nothing,
) -> Report:
    """Copy namespace `namespace` from `source_url` to `target_url`, then verify the copy.

    `target_shards`: the `[redis] shards` the daemons on the target will run with, when
    known; it must equal the source's shard count. Raises MigrationRefused before
    anything is written, MigrationFailed when the copy or the check fails.
    """
    Keys(namespace)  # the namespace's spelling, checked as everywhere
    with contextlib.ExitStack() as stack:
        for url in (source_url, target_url):
            stack.enter_context(_embedded_up(url, say))
        return _migrate(
            source_url, target_url, namespace, target_shards, force, dry_run, count, say
        )


@contextlib.contextmanager
def _embedded_up(url: str, say: Callable[[str], None]) -> Iterator[None]:
    """For an `embedded:///<data_dir>` URL whose daemon is stopped (its server went with
    it), that data dir's server, for the time of the copy. Its lock is the daemon's: while
    a daemon holds it, the daemon's own server is used (and the heartbeat check refuses)."""
    if not url.startswith("embedded:"):
        yield
        return
    from asynctaskd.embedded import EmbeddedServer, require_valkey_binary

    socket = Path(local_url(url).removeprefix("unix://").partition("?")[0])
    server = EmbeddedServer(require_valkey_binary(f"migrate {url}"), socket.parent)
    try:
        server.start()
    except ConfigError:  # a daemon runs there, with its server
        yield
        return
    say(f"asynctaskd: started the embedded server of {socket.parent.parent} for the copy")
    try:
        yield
    finally:
        server.stop()


def _migrate(
    source_url: str,
    target_url: str,
    namespace: str,
    target_shards: int | None,
    force: bool,
    dry_run: bool,
    count: int,
    say: Callable[[str], None],
) -> Report:
    report = Report()
    src = open_sync(source_url)
    dst = open_sync(target_url)
    try:
        problems = _preflight(src, dst, namespace, target_shards, force, report, say)
        if dry_run:
            report.problems = problems
            for _key, kind, _ttl in _typed(src, namespace, count):
                report.keys += 1
                report.by_type[kind] += 1
            report.by_status = _statuses(src, namespace, report.source_shards)
            return report
        if problems:
            raise MigrationRefused(problems[0])
        if not _restorable(src, dst, namespace):
            report.method = "logical"
            say(
                "asynctaskd: the target cannot read the source's DUMP format (an older RDB "
                "version: e.g. Valkey 8 or Redis 7.2+ to Redis 7.0); copying each key with "
                "its type's commands instead"
            )
        _copy(src, dst, namespace, count, report, say)
        report.by_status = _statuses(src, namespace, report.source_shards)
        _verify(src, dst, namespace, report.source_shards, count)
        report.verified = True
        return report
    finally:
        src.close()
        dst.close()


# ---- before: live daemons, an empty target, the shard count ----


def _preflight(
    src: redis.Redis,
    dst: redis.Redis,
    namespace: str,
    target_shards: int | None,
    force: bool,
    report: Report,
    say: Callable[[str], None],
) -> list[str]:
    """Why the copy must not start (empty: it may); warnings go to `report`."""
    keys = Keys(namespace)
    problems = []
    alive = _live_daemons(src, keys)
    if alive:
        text = (
            f"{len(alive)} daemon(s) of namespace {namespace!r} are alive on the source "
            f"({', '.join(alive[:3])}{', ...' if len(alive) > 3 else ''}): stop them (and "
            "the producers) first, so that nothing changes under the copy"
        )
        if force:
            report.warnings.append(f"--force: copying although {text.split(':')[0]}")
            say(f"asynctaskd: warning: {report.warnings[-1]}; the copy may be inconsistent")
        else:
            problems.append(f"{text}, or pass --force")
    report.source_shards = _source_shards(src, keys, namespace)
    if target_shards is not None and target_shards != report.source_shards:
        if target_shards < report.source_shards:
            why = (
                f"tasks keep their ids, and ids name their shard: tasks on shards "
                f"{target_shards}..{report.source_shards - 1} would never be claimed"
            )
        else:
            why = (
                "the deployment record comes along and daemons with another shard count "
                "refuse to start on it (dedup keys are placed by CRC-32 modulo the count)"
            )
        problems.append(
            f"the source namespace {namespace!r} has {report.source_shards} shard(s), the "
            f"target is configured with {target_shards}: {why}. Set [redis] shards = "
            f"{report.source_shards} for the target"
        )
    first = next(_scan(dst, namespace, BATCH), None)
    if first is not None:
        problems.append(
            f"the target already holds keys of namespace {namespace!r} (first: "
            f"{first.decode(errors='replace')}): migrate never overwrites. Point --to at an "
            "empty server or database, or delete the namespace's keys there first, or "
            "pick another --namespace"
        )
    return problems


def _live_daemons(src: redis.Redis, keys: Keys) -> list[str]:
    raw: dict[bytes, bytes] = src.hgetall(keys.daemons())  # type: ignore[assignment]
    now, alive = time.time(), []
    for daemon_id, record in sorted(raw.items()):
        try:
            beat = json.loads(record)
            fresh = now - float(beat["heartbeat_at"]) <= DAEMON_STALE_S
        except (ValueError, KeyError, TypeError):
            fresh = True  # a record this version cannot read: assume the worst
        if fresh:
            alive.append(daemon_id.decode(errors="replace"))
    return alive


def _source_shards(src: redis.Redis, keys: Keys, namespace: str) -> int:
    """The shard count of the deployment record; without one (no daemon ever ran), one more
    than the highest shard number among the keys."""
    raw = src.get(keys.deployment())
    if raw is not None:
        try:
            return int(json.loads(raw)["shards"])
        except (ValueError, KeyError, TypeError):
            raise MigrationRefused(
                f"{keys.deployment()} on the source is not a deployment record: {raw!r}"
            ) from None
    highest = -1
    for key in _scan(src, namespace, BATCH):
        if m := _SHARD_RE.match(key):
            highest = max(highest, int(m.group(1)))
    return highest + 1 if highest >= 0 else 1


# ---- the copy ----


def _scan(client: redis.Redis, namespace: str, count: int) -> Iterator[bytes]:
    # Namespaces are [A-Za-z0-9_.-]: nothing a glob would read as a pattern.
    yield from client.scan_iter(match=f"{namespace}:*", count=count)


def _batches(client: redis.Redis, namespace: str, count: int) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for key in _scan(client, namespace, count):
        batch.append(key)
        if len(batch) >= count:
            yield batch
            batch = []
    if batch:
        yield batch


def _pipelined(client: redis.Redis, calls: list[tuple[Any, ...]]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for name, *args in calls:
        getattr(pipe, name)(*args)
    replies: list[Any] = pipe.execute(raise_on_error=False)
    return replies


def _typed(client: redis.Redis, namespace: str, count: int) -> Iterator[tuple[bytes, str, int]]:
    """(key, type, pttl) of every key of the namespace; a key gone meanwhile is skipped."""
    for batch in _batches(client, namespace, count):
        calls: list[tuple[Any, ...]] = []
        for key in batch:
            calls += [("type", key), ("pttl", key)]
        replies = _pipelined(client, calls)
        for i, key in enumerate(batch):
            kind, ttl = replies[2 * i], replies[2 * i + 1]
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            if kind != "none":
                yield key, kind, int(ttl)


def _copy(
    src: redis.Redis,
    dst: redis.Redis,
    namespace: str,
    count: int,
    report: Report,
    say: Callable[[str], None],
) -> None:
    for batch in _batches(src, namespace, count):
        calls: list[tuple[Any, ...]] = []
        for key in batch:
            calls += [("type", key), ("pttl", key), ("dump", key)]
        replies = _pipelined(src, calls)
        restores: list[tuple[Any, ...]] = []
        kinds = []
        for i, key in enumerate(batch):
            kind, ttl, payload = replies[3 * i : 3 * i + 3]
            for reply in (kind, ttl, payload):
                if isinstance(reply, Exception):
                    raise MigrationFailed(f"reading {key!r} on the source: {reply}")
            if payload is None or int(ttl) == -2:
                report.vanished += 1  # expired between SCAN and DUMP
                continue
            # PTTL -1: no TTL (RESTORE's 0); a TTL that ran out meanwhile keeps 1 ms.
            restores.append(("restore", key, max(int(ttl), 0) if int(ttl) != 0 else 1, payload))
            kinds.append(kind.decode() if isinstance(kind, bytes) else str(kind))
        if report.method == "logical":
            restores = _rebuilt(src, restores)
        results = _pipelined(dst, restores)
        failed = [
            (call[1], result)
            for call, result in zip(restores, results, strict=True)
            if isinstance(result, Exception)
        ]
        if failed:
            raise MigrationFailed(_restore_problem(*failed[0], report.keys))
        report.keys += len(kinds)
        report.by_type.update(kinds)
        say(f"asynctaskd: {report.keys} keys copied")


def _restorable(src: redis.Redis, dst: redis.Redis, namespace: str) -> bool:
    """Whether the target reads the source's DUMP format: one key restored under a probe
    name (gone again at once, and in 10 s in any case). False on a version error."""
    key = next(_scan(src, namespace, BATCH), None)
    payload = src.dump(key) if key is not None else None
    if payload is None:
        return True  # nothing to copy
    probe = f"{namespace}:migrate-probe"
    try:
        dst.restore(probe, 10_000, payload)
    except redis.exceptions.ResponseError as exc:
        if "payload version" in str(exc) or "checksum" in str(exc):
            return False
        raise MigrationFailed(f"RESTORE on the target failed: {exc}; nothing was copied") from None
    dst.delete(probe)
    return True


def _rebuilt(src: redis.Redis, restores: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The RESTOREs of a batch as the commands that write each key's value: what the copy
    does when the target cannot read the source's DUMP format."""
    reads: list[tuple[Any, ...]] = []
    for _, key, _ttl, _payload in restores:
        reads += [("type", key), ("pttl", key)]
    meta = _pipelined(src, reads)
    calls: list[tuple[Any, ...]] = []
    for i, (_, key, _ttl, _payload) in enumerate(restores):
        kind, ttl = meta[2 * i].decode(), int(meta[2 * i + 1])
        if kind == "string":
            value = src.get(key)
            calls.append(("set", key, value))
        elif kind == "hash":
            calls.append(("hset", key, None, None, None, _pairs(src.hgetall(key))))
        elif kind == "zset":
            scored: Any = src.zrange(key, 0, -1, withscores=True)
            calls.append(("zadd", key, dict(scored)))
        elif kind == "set":
            calls.append(("sadd", key, *src.smembers(key)))
        elif kind == "list":
            calls.append(("rpush", key, *src.lrange(key, 0, -1)))
        elif kind == "stream":
            entries: Any = src.xrange(key, "-", "+")
            last = src.xinfo_stream(key)["last-generated-id"]
            if not entries:  # an empty stream: made with one entry, deleted again
                calls += [("xadd", key, {"-": "-"}, last), ("xdel", key, last)]
            calls += [("xadd", key, fields, entry_id) for entry_id, fields in entries]
            calls.append(("execute_command", "XSETID", key, last))
        else:
            raise MigrationFailed(f"{key!r} is a {kind}: no logical copy of that type")
        if ttl > 0:
            calls.append(("pexpire", key, ttl))
    return calls


def _pairs(mapping: dict[Any, Any]) -> list[Any]:
    return [item for pair in mapping.items() for item in pair]


def _restore_problem(key: bytes, exc: Exception, done: int) -> str:
    text = str(exc)
    name = key.decode(errors="replace")
    after = (
        f"after {done} key(s) and part of the next batch were copied: the target holds a "
        "partial copy; delete the namespace's keys there before another try"
    )
    if "payload version" in text or "checksum" in text:
        return (
            f"the target cannot read the source's DUMP of {name} ({text}): its RDB version "
            "is older than the source's. Use a target server of the same or a newer "
            f"version (Valkey and Redis are compatible within one RDB version); {after}"
        )
    if "BUSYKEY" in text:
        return f"{name} appeared on the target during the copy ({text}); {after}"
    return f"RESTORE of {name} on the target failed: {text}; {after}"


# ---- after: the check and the summary ----


def _tally(client: redis.Redis, namespace: str, count: int) -> tuple[Counter[str], int]:
    """Keys per type, not counting those about to expire; and how many those are."""
    kinds: Counter[str] = Counter()
    short = 0
    for _key, kind, ttl in _typed(client, namespace, count):
        if 0 <= ttl < SHORT_TTL_MS:
            short += 1
        else:
            kinds[kind] += 1
    return kinds, short


def _verify(src: redis.Redis, dst: redis.Redis, namespace: str, shards: int, count: int) -> None:
    problems = []
    before, _ = _tally(src, namespace, count)
    after, _ = _tally(dst, namespace, count)
    if before != after:
        diff = {k: (before[k], after[k]) for k in sorted(set(before) | set(after))}
        diff = {k: v for k, v in diff.items() if v[0] != v[1]}
        problems.append(f"keys per type differ (source, target): {diff}")
    keys = Keys(namespace)
    for shard in range(shards):
        one, other = src.hgetall(keys.counts(shard)), dst.hgetall(keys.counts(shard))
        if one != other:
            problems.append(f"{keys.counts(shard)} differs between source and target")
    if problems:
        raise MigrationFailed(
            "the copy does not match the source: "
            + "; ".join(problems)
            + " (did a daemon or producer write to the source meanwhile?)"
        )


def _statuses(client: redis.Redis, namespace: str, shards: int) -> dict[str, int]:
    """Tasks per status: the sizes of the status indexes (a status's exact total)."""
    keys = Keys(namespace)
    reads = [("zcard", keys.index(shard, s)) for shard in range(shards) for s in Status]
    out = dict.fromkeys((s.value for s in Status), 0)
    for (_, key), reply in zip(reads, _pipelined(client, reads), strict=True):
        if isinstance(reply, Exception):
            raise MigrationFailed(f"reading the status indexes on the source: {reply}")
        out[key.rsplit(":", 1)[1]] += int(reply)
    return {k: v for k, v in out.items() if v}
