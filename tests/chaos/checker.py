"""A history checker for chaos runs, independent of the daemon's code paths.

It reads Redis directly with redis-py (key names are spelled out here from
docs/protocol.md, not taken from `asynctaskd.keys`; nothing is decoded by
`asynctaskd.codec` or `asynctaskd.store`), takes the fake vendor's submit log and what
the producers were told, and checks the guarantees of docs/reliability.md:

- no vendor job created twice for a task of a non-idempotent handler;
- no request reaches the vendor's submit without a durable "call started" mark
  (vendor submits seen for a task <= its `submit_attempts`);
- nothing lost: every acknowledged task exists, and every task is terminal or
  SUBMIT_UNKNOWN, and got there by its deadline plus a slack;
- SUBMIT_UNKNOWN only where a submit call was marked started (`submit_attempts >= 1`);
- a parked task waits for a lookup (`due:find`) only if its start recorded `find`;
- every status change in the events stream is a legal transition
  (`asynctaskd.model.LEGAL_TRANSITIONS`, any actor), versions strictly increase per task,
  the stream agrees with the hash (first event is the create, last status is the status);
- status counters and status indexes equal the real counts (summed over the shards, and
  shard by shard); every task hash sits on the shard its id names; no lease, ready, due,
  held or quarantine entry left behind;
- a task canceled while nothing could be in flight (PENDING_SUBMIT -> CANCELED, not
  idempotent) never gets a vendor job created after that cancel;
- two live tasks never share a (tenant, dedup key);
- a SUCCEEDED task carries the result of its own vendor job (the fake vendor echoes the
  task's params and id), and every external id names a vendor job of that task.

`read_history` takes the snapshot, `check` judges it and returns a `Report` that prints
the counts it checked and, for every violation, the task's whole history. On Redis Cluster
give it a `redis.cluster.RedisCluster` client: SCAN then goes to every primary, and the
hash, sorted-set and stream reads are routed by key (each shard's keys share one slot).

Secrets (docs/reliability.md: never stored in Redis or logs): a `SecretScan` looks for a
secret the daemons were given, or either half of it (a message cut short), in every key
name and value of every database of a Redis server (`scan_redis`, over SCAN: strings,
hash fields and values, list, set and sorted-set members, stream entries), in files
(`scan_files`: daemon logs, the server's append-only files) and in any text (the report
itself). Each place it is found is a `secret_leak` violation naming the place, never the
text around it.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.cluster

from asynctaskd.model import LEGAL_TRANSITIONS, Status

SETTLED = frozenset(s.value for s in Status if s.is_settled)
TERMINAL = frozenset(s.value for s in Status if s.is_terminal)
STATUSES = tuple(s.value for s in Status)
# Any actor: the stream does not say who made a write.
LEGAL: frozenset[tuple[str | None, str]] = frozenset(
    (t.source.value if t.source is not None else None, t.target.value) for t in LEGAL_TRANSITIONS
)
REACHED_VENDOR = frozenset({"created", "ambiguous", "deduped", "error", "throttled"})
JOB_CREATED = frozenset({"created", "ambiguous"})
LEFTOVER_INDEXES = (
    "leases",
    "quarantine",
    "due:submit",
    "due:query",
    "ready:submit",
    "ready:query",
)
# Parked tasks a vendor lookup will settle (lua/lookup.lua): only SUBMIT_UNKNOWN tasks whose
# start recorded `find` may be in it, and a run may end with some still waiting.
LOOKUPS = "due:find"
MAX_PRINTED = 25  # violations printed with their whole history


@dataclass(frozen=True)
class Event:
    """One entry of a shard's events stream, in stream order (`pos` is global order)."""

    pos: int
    ms: int
    status: str
    version: int
    fields: dict[str, str]


@dataclass(frozen=True)
class Submission:
    """What a producer was told: this task id exists (possibly a dedup hit)."""

    task_id: str
    tenant: str | None = None
    dedup_key: str | None = None
    deduped: bool = False


@dataclass
class History:
    """Everything the checker looks at, read once at the end of a run."""

    tasks: dict[str, dict[str, str]]
    events: dict[str, list[Event]]
    counts: dict[str, int]
    indexes: dict[str, dict[str, float]]  # "idx:<STATUS>", "leases", ... -> member -> score
    stream_complete: bool  # nothing was trimmed from the events stream
    vendor_log: list[dict[str, Any]] = field(default_factory=list)
    submissions: list[Submission] = field(default_factory=list)
    idempotent_handlers: frozenset[str] = frozenset()
    pause_windows: list[tuple[str, int, int]] = field(default_factory=list)  # dim, from, to ms
    stray_events: int = 0  # entries whose task hash does not exist
    # Per shard (several shards): each shard's counters, and the shard each hash was on.
    shard_counts: dict[int, dict[str, int]] = field(default_factory=dict)
    task_shards: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Violation:
    kind: str
    task_id: str | None
    message: str


@dataclass
class Report:
    """The verdict: counts of what was checked, figures, and violations."""

    checked: Counter[str] = field(default_factory=Counter)
    figures: dict[str, Any] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    histories: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def kinds(self) -> Counter[str]:
        return Counter(v.kind for v in self.violations)

    def format(self) -> str:
        lines = ["history checker: " + ("OK" if self.ok else f"{len(self.violations)} VIOLATIONS")]
        lines.append("checked: " + ", ".join(f"{k}={v}" for k, v in sorted(self.checked.items())))
        for k, v in self.figures.items():
            lines.append(f"  {k}: {v}")
        if self.violations:
            lines.append("violations by kind: " + json.dumps(dict(self.kinds())))
        for i, v in enumerate(self.violations):
            if i == MAX_PRINTED:
                lines.append(f"... and {len(self.violations) - MAX_PRINTED} more")
                break
            lines.append(f"- [{v.kind}] {v.task_id or '-'}: {v.message}")
            if v.task_id is not None and v.task_id in self.histories:
                lines.append(self.histories[v.task_id])
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Reading


def _s(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def read_history(
    client: redis.Redis | redis.cluster.RedisCluster,
    namespace: str = "atd",
    shards: int = 1,
    *,
    scan_count: int = 1000,
) -> History:
    """Snapshot every task hash, the events streams, counters and indexes of `namespace`.

    `shards`: how many shards to read (`<ns>:{s0}:` .. `<ns>:{s<shards-1>}:`). With a
    `RedisCluster` client every SCAN goes to all primaries; the other reads name a key
    and are routed to the primary of its slot. Event `pos` is the order of reading:
    stream order within a shard, shard after shard.
    """
    r: Any = client  # redis-py's return types are unions over RESP versions: read as Any
    where: dict[str, Any] = {}
    if isinstance(client, redis.cluster.RedisCluster):
        where["target_nodes"] = redis.cluster.RedisCluster.PRIMARIES
    tasks: dict[str, dict[str, str]] = {}
    task_shards: dict[str, int] = {}
    events: dict[str, list[Event]] = defaultdict(list)
    counts: Counter[str] = Counter()
    shard_counts: dict[int, dict[str, int]] = {}
    indexes: dict[str, dict[str, float]] = defaultdict(dict)
    complete = True
    pos = 0
    stray = 0
    for shard in range(shards):
        tag = f"{namespace}:{{s{shard}}}:"
        prefix = tag + "task:"
        names = [_s(k) for k in r.scan_iter(match=prefix + "*", count=scan_count, **where)]
        for start in range(0, len(names), 500):
            chunk = names[start : start + 500]
            pipe = r.pipeline(transaction=False)
            for name in chunk:
                pipe.type(name)
                pipe.hgetall(name)
            replies = pipe.execute(raise_on_error=False)
            for i, name in enumerate(chunk):
                kind, raw = replies[2 * i], replies[2 * i + 1]
                tid = name[len(prefix) :]
                task_shards[tid] = shard
                if _s(kind) != "hash" or isinstance(raw, Exception):
                    tasks[tid] = {"<type>": _s(kind)}
                else:
                    tasks[tid] = {_s(k): _s(v) for k, v in raw.items()}
        # the counters are per status and handler; a status's total is its index's size
        own: dict[str, int] = {}
        for k, v in r.hgetall(tag + "counts").items():
            if "@" in _s(k):
                counts[_s(k)] += int(v)
                own[_s(k)] = int(v)
        shard_counts[shard] = own
        for name in (*(f"idx:{s}" for s in STATUSES), *LEFTOVER_INDEXES, LOOKUPS):
            members = r.zrange(tag + name, 0, -1, withscores=True)
            for member, score in members:
                indexes[name][_s(member)] = float(score)
            if name.startswith("idx:") and members:
                counts[name[4:]] += len(members)
                own[name[4:]] = len(members)
        for key in r.scan_iter(match=tag + "held:*", count=scan_count, **where):
            name = _s(key)[len(tag) :]
            for member, score in r.zrange(key, 0, -1, withscores=True):
                indexes[name][_s(member)] = float(score)
        stream = tag + "events"
        if r.exists(stream):
            info = r.xinfo_stream(stream)
            added = info.get("entries-added")
            if added is not None and int(added) != int(info["length"]):
                complete = False
        last = "-"
        while True:
            batch = r.xrange(stream, min=last, max="+", count=10_000)
            if last != "-":
                batch = batch[1:]  # the first entry is the one we ended on
            if not batch:
                break
            for entry_id, raw_fields in batch:
                eid = _s(entry_id)
                f = {_s(k): _s(v) for k, v in raw_fields.items()}
                tid = f.get("task", "")
                try:
                    ev = Event(pos, int(eid.split("-")[0]), f["status"], int(f["version"]), f)
                except (KeyError, ValueError):
                    ev = Event(pos, int(eid.split("-")[0]), f.get("status", "?"), -1, f)
                events[tid].append(ev)
                pos += 1
                last = eid
    for tid in events:
        if tid not in tasks:
            stray += len(events[tid])
    return History(
        tasks=tasks,
        events=dict(events),
        counts=dict(counts),
        indexes=dict(indexes),
        stream_complete=complete,
        stray_events=stray,
        shard_counts=shard_counts,
        task_shards=task_shards,
    )


# ---------------------------------------------------------------------------------------
# Checking


def _int(h: Mapping[str, str], name: str, default: int = 0) -> int:
    try:
        return int(h.get(name, default))
    except ValueError:
        return default


def task_history(history: History, task_id: str, vendor: Iterable[dict[str, Any]] = ()) -> str:
    """The whole story of one task: hash, events, vendor log lines."""
    lines = [f"  task {task_id}"]
    h = history.tasks.get(task_id)
    if h is None:
        lines.append("    hash: <missing>")
    else:
        shown = {k: (v if len(v) < 200 else v[:200] + "...") for k, v in sorted(h.items())}
        lines.append("    hash: " + json.dumps(shown, sort_keys=True))
    for ev in history.events.get(task_id, []):
        extra = {k: v for k, v in ev.fields.items() if k not in ("task", "status", "version")}
        lines.append(f"    event @{ev.ms} #{ev.pos} v{ev.version} {ev.status} {extra or ''}")
    lines.extend(f"    vendor {json.dumps(entry, sort_keys=True)}" for entry in vendor)
    return "\n".join(lines)


def check(
    history: History,
    *,
    slack_s: float = 15.0,
    expect_empty_quarantine: bool = True,
    check_results: bool = True,
) -> Report:
    """Judge a history. `slack_s`: how long after its deadline a task may still settle."""
    report = Report()
    out = report.violations
    tasks = history.tasks
    by_ref: dict[str, list[dict[str, Any]]] = defaultdict(list)
    job_ref: dict[str, str | None] = {}
    for entry in history.vendor_log:
        ref = entry.get("ref")
        if ref is not None:
            by_ref[ref].append(entry)
        if entry.get("job_id") is not None and entry.get("outcome") in JOB_CREATED:
            job_ref[entry["job_id"]] = ref
    idem = history.idempotent_handlers

    def flag(kind: str, tid: str | None, message: str) -> None:
        out.append(Violation(kind, tid, message))

    # Vendor side: duplicates, calls without a started mark, jobs of unknown tasks.
    for ref, entries in by_ref.items():
        report.checked["vendor refs"] += 1
        created = [e for e in entries if e.get("outcome") in JOB_CREATED]
        reached = [e for e in entries if e.get("outcome") in REACHED_VENDOR]
        h = tasks.get(ref)
        if h is None:
            flag("vendor_call_for_unknown_task", ref, f"{len(reached)} vendor submits")
            continue
        if len(created) > 1 and h.get("handler") not in idem:
            jobs = [e.get("job_id") for e in created]
            flag("duplicate_vendor_job", ref, f"{len(created)} vendor jobs created: {jobs}")
        attempts = _int(h, "submit_attempts")
        if len(reached) > attempts:
            flag(
                "vendor_call_without_start_mark",
                ref,
                f"{len(reached)} submits reached the vendor, submit_attempts={attempts}",
            )

    # Producers: nothing acknowledged is lost.
    for sub in history.submissions:
        report.checked["acknowledged submits"] += 1
        if sub.task_id not in tasks:
            flag("lost_task", sub.task_id, "acknowledged to a producer, absent from Redis")

    # Per task.
    real: Counter[str] = Counter()
    parked = Counter[str]()
    dedup_groups: dict[str, list[str]] = defaultdict(list)
    for tid, h in tasks.items():
        report.checked["tasks"] += 1
        if "<type>" in h:
            flag("not_a_hash", tid, f"task key holds a {h['<type>']}")
            continue
        status = h.get("status", "")
        real[status] += 1
        real[f"{status}@{h.get('handler', '')}"] += 1
        evs = history.events.get(tid, [])
        report.checked["events"] += len(evs)
        deadline = _int(h, "deadline_ms", -1)

        if status not in SETTLED:
            flag("unsettled", tid, f"still {status!r} at the end of the run")
        else:
            settled_at = _settled_at(history, tid, h, status, evs)
            report.checked["settled tasks"] += 1
            if deadline >= 0 and settled_at is not None and settled_at > deadline + slack_s * 1000:
                late = (settled_at - deadline) / 1000
                flag("settled_late", tid, f"{status} {late:.1f}s after its deadline")

        if status == "SUBMIT_UNKNOWN":
            report.checked["SUBMIT_UNKNOWN"] += 1
            if _int(h, "submit_attempts") < 1:
                flag("parked_without_start", tid, "SUBMIT_UNKNOWN but submit_attempts < 1")
            outcomes = {e.get("outcome") for e in by_ref.get(tid, [])}
            code = h.get("error_code", "-")
            if outcomes & JOB_CREATED:
                parked[f"vendor job exists ({code})"] += 1
            elif outcomes:
                parked[f"vendor answered without a job ({code})"] += 1
            else:
                parked[f"no request reached the vendor ({code})"] += 1

        # The stream: legal transitions, increasing versions, agreement with the hash.
        prev: str | None = None
        prev_version = 0
        for i, ev in enumerate(evs):
            if ev.version <= prev_version:
                flag(
                    "version_not_increasing",
                    tid,
                    f"event #{ev.pos} has version {ev.version} after {prev_version}",
                )
            prev_version = max(prev_version, ev.version)
            if (
                i == 0
                and history.stream_complete
                and (ev.status, ev.version)
                != (
                    "PENDING_SUBMIT",
                    1,
                )
            ):
                flag("history_incomplete", tid, f"first event is {ev.status} v{ev.version}")
            if ev.status != prev:
                report.checked["transitions"] += 1
                if (prev, ev.status) not in LEGAL and not (i == 0 and not history.stream_complete):
                    flag("illegal_transition", tid, f"{prev} -> {ev.status} at event #{ev.pos}")
            prev = ev.status
        if evs:
            if evs[-1].status != status:
                flag("stream_disagrees", tid, f"last event {evs[-1].status}, hash {status}")
            if evs[-1].version > _int(h, "version"):
                flag("stream_disagrees", tid, "an event is newer than the hash")
        elif history.stream_complete:
            flag("history_incomplete", tid, "no event at all")

        # Cancels: nothing in flight when a PENDING_SUBMIT task is canceled.
        cancel_ms = _plain_cancel_ms(evs)
        if cancel_ms is not None:
            report.checked["cancels from PENDING_SUBMIT"] += 1
            if h.get("handler") not in idem:
                for e in by_ref.get(tid, []):
                    if e.get("outcome") in JOB_CREATED and float(e.get("at", 0)) * 1000 > cancel_ms:
                        flag(
                            "job_after_cancel",
                            tid,
                            f"vendor job {e.get('job_id')} created "
                            f"{float(e['at']) * 1000 - cancel_ms:.0f} ms after the cancel",
                        )

        # Results and handles name this task's own vendor job.
        if check_results and status == "SUCCEEDED":
            report.checked["results"] += 1
            problem = _result_problem(h, tid)
            if problem:
                flag("wrong_result", tid, problem)
        ext = h.get("external_id")
        if ext is not None and history.vendor_log:
            report.checked["external ids"] += 1
            if job_ref.get(ext, "<no such job>") != tid:
                flag("wrong_external_id", tid, f"{ext} is a job of {job_ref.get(ext)!r}")
        if (
            status == "SUCCEEDED"
            and history.vendor_log
            and not ({e.get("outcome") for e in by_ref.get(tid, [])} & JOB_CREATED)
        ):
            flag("succeeded_without_job", tid, "no vendor job was created for it")
        if "dedup" in h:
            dedup_groups[h["dedup"]].append(tid)

    # Pauses: no task of a paused tenant is claimed for submit inside a pause window; the
    # other tenants' claims go on (no head-of-line blocking: counted as a figure).
    others = 0
    for dim, start_ms, end_ms in history.pause_windows:
        kind, _, value = dim.partition(":")
        report.checked["pause windows"] += 1
        for tid, evs in history.events.items():
            for ev in evs:
                if ev.status != "SUBMITTING" or not start_ms < ev.ms < end_ms:
                    continue
                if tasks.get(tid, {}).get(kind) == value:
                    flag("claimed_while_paused", tid, f"claimed at {ev.ms} inside {dim} pause")
                else:
                    others += 1
    if history.pause_windows:
        report.figures["submit claims of other tenants during pauses"] = others

    # Two live tasks never share a dedup key (live: from create to terminal, parked counts).
    for key, ids in dedup_groups.items():
        report.checked["dedup keys"] += 1
        spans = sorted((*_live_span(history.events.get(t, [])), t) for t in ids)
        for (_s1, e1, t1), (s2, _e2, t2) in itertools.pairwise(spans):
            if s2 < e1:
                flag("dedup_overlap", t2, f"created while {t1} held dedup key {key!r}")

    # Counters and indexes against the real hashes.
    fields = set(history.counts) | {k for k in real if real[k]}
    for name in sorted(fields):
        report.checked["counters"] += 1
        if history.counts.get(name, 0) != real.get(name, 0):
            flag(
                "counter_drift",
                None,
                f"counts[{name}] = {history.counts.get(name, 0)}, real {real.get(name, 0)}",
            )
    for s in STATUSES:
        members = set(history.indexes.get(f"idx:{s}", {}))
        expected = {t for t, h in tasks.items() if h.get("status") == s}
        report.checked["status indexes"] += 1
        for t in sorted(members ^ expected)[:20]:
            where = "in" if t in members else "missing from"
            flag("index_disagrees", t if t in tasks else None, f"{t} {where} idx:{s}")
    held = [n for n in history.indexes if n.startswith("held:")]
    for name in (*LEFTOVER_INDEXES, *held):
        if name == "quarantine" and not expect_empty_quarantine:
            continue
        for t in sorted(history.indexes.get(name, {}))[:20]:
            kind = "lease_left" if name == "leases" else "index_left"
            flag(kind, t if t in tasks else None, f"{t} still in {name}")
    waiting = history.indexes.get(LOOKUPS, {})
    for t in sorted(waiting)[:20]:
        h = tasks.get(t, {})
        if h.get("status") != "SUBMIT_UNKNOWN" or "find" not in h:
            flag("index_left", t if t in tasks else None,
                 f"{t} in {LOOKUPS} but {h.get('status')!r}, find={h.get('find')!r}")  # fmt: skip
    report.figures["parked waiting for a lookup"] = len(waiting)
    reconciled = Counter(
        ev.fields.get("reconciled") for evs in history.events.values() for ev in evs
        if ev.fields.get("reconciled")
    )  # fmt: skip
    if reconciled:
        report.figures["reconciled (events)"] = dict(sorted(reconciled.items()))
    if history.stray_events:
        flag("stray_events", None, f"{history.stray_events} events of tasks that do not exist")
    _check_shards(history, report, flag)

    statuses = Counter(h.get("status", "?") for h in tasks.values())
    log_outcomes = Counter(str(e.get("outcome")) for e in history.vendor_log)
    report.figures["final statuses"] = dict(sorted(statuses.items()))
    report.figures["vendor submit log"] = dict(sorted(log_outcomes.items()))
    report.figures["SUBMIT_UNKNOWN breakdown"] = dict(parked.most_common())
    report.figures["events stream complete"] = history.stream_complete
    for v in out[: MAX_PRINTED * 2]:
        if v.task_id is not None and v.task_id not in report.histories:
            vendor = by_ref.get(v.task_id, [])
            report.histories[v.task_id] = task_history(history, v.task_id, vendor)
    return report


def _id_shard(task_id: str) -> int | None:
    """The shard an id names (docs/protocol.md section 3): no `-` is shard 0, else the
    digits after the last `-`; None if those are not digits."""
    _, dash, tail = task_id.rpartition("-")
    if not dash:
        return 0
    return int(tail) if tail.isdecimal() else None


def _check_shards(
    history: History, report: Report, flag: Callable[[str, str | None, str], None]
) -> None:
    """Several shards: each shard's counters against its own tasks, each hash on its shard."""
    if len(history.shard_counts) < 2:
        return
    real: dict[int, Counter[str]] = defaultdict(Counter)
    for tid, h in history.tasks.items():
        shard = history.task_shards.get(tid)
        report.checked["task shards"] += 1
        if shard is None or _id_shard(tid) != shard:
            flag("wrong_shard", tid, f"the hash is on shard {shard}, the id names {_id_shard(tid)}")
        if shard is not None and "<type>" not in h:
            status = h.get("status", "")
            real[shard][status] += 1
            real[shard][f"{status}@{h.get('handler', '')}"] += 1
    for shard, counts in sorted(history.shard_counts.items()):
        for name in sorted(set(counts) | {k for k, v in real[shard].items() if v}):
            report.checked["shard counters"] += 1
            if counts.get(name, 0) != real[shard].get(name, 0):
                flag(
                    "counter_drift",
                    None,
                    f"shard {shard}: counts[{name}] = {counts.get(name, 0)}, "
                    f"real {real[shard].get(name, 0)}",
                )


def _settled_at(
    history: History, tid: str, h: Mapping[str, str], status: str, evs: list[Event]
) -> int | None:
    """Server ms at which the task reached its final status."""
    if evs and evs[-1].status == status:
        i = len(evs) - 1
        while i > 0 and evs[i - 1].status == status:
            i -= 1
        return evs[i].ms
    if status in TERMINAL and "finished_ms" in h:
        return _int(h, "finished_ms")
    score = history.indexes.get(f"idx:{status}", {}).get(tid)
    return int(score) if score is not None else None


def _plain_cancel_ms(evs: list[Event]) -> int | None:
    """Time of a PENDING_SUBMIT -> CANCELED event (no vendor call can be in flight)."""
    for a, b in itertools.pairwise(evs):
        if a.status == "PENDING_SUBMIT" and b.status == "CANCELED":
            return b.ms
    return None


def _live_span(evs: list[Event]) -> tuple[int, float]:
    """(stream position of the create, position it became terminal or +inf)."""
    start = evs[0].pos if evs else -1
    for ev in evs:
        if ev.status in TERMINAL:
            return start, ev.pos
    return start, float("inf")


def _result_problem(h: Mapping[str, str], tid: str) -> str | None:
    """The fake vendor answers {"output": <the job's input>, "ref": <task id>}."""
    try:
        result = json.loads(h.get("result", "null"))
        params = json.loads(h.get("params", "null"))
    except ValueError as exc:
        return f"result or params is not JSON: {exc}"
    if not isinstance(result, dict):
        return f"result is {result!r:.80}"
    if result.get("ref") != tid:
        return f"result belongs to {result.get('ref')!r}"
    if result.get("output") != params:
        return "result output is not this task's params"
    return None


# ---------------------------------------------------------------------------------------
# Secrets


@dataclass
class SecretScan:
    """Where a secret was looked for (`checked`) and the places it was found (`found`)."""

    secret: str = field(repr=False)
    checked: Counter[str] = field(default_factory=Counter)
    found: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        whole = self.secret.encode()
        if len(whole) < 16 or b"\0" in whole:
            raise ValueError("use a secret of 16 characters or more (its halves are looked for)")
        half = len(whole) // 2
        # Either half: a value cut short (an excerpt, a truncated message) still shows one.
        self._pieces = (whole, whole[:half], whole[half:])

    def holds_secret(self, *data: bytes | str) -> bool:
        # One search over all of them: a NUL between them, which no secret holds.
        blob = b"\0".join(d.encode("utf-8", "replace") if isinstance(d, str) else d for d in data)
        return any(piece in blob for piece in self._pieces)

    def look(self, where: str, *data: bytes | str) -> None:
        """Record `where` as a leak if any of `data` holds the secret or half of it."""
        if self.holds_secret(*data):
            self.found.append(self.masked(where))

    def masked(self, text: str) -> str:
        """`text` with the secret and its halves replaced, for printing."""
        for piece in self._pieces:
            text = text.replace(piece.decode("utf-8", "replace"), "<secret>")
        return text

    def violations(self) -> list[Violation]:
        return [Violation("secret_leak", None, f"the secret is in {w}") for w in self.found]


def _databases(client: redis.Redis) -> Iterator[tuple[int, Any]]:
    """(number, client) for every database of the server that holds keys."""
    r: Any = client
    pool = client.connection_pool
    for name in sorted(r.info("keyspace")):
        n = int(name.removeprefix("db"))
        kwargs = {**pool.connection_kwargs, "db": n}
        other = redis.Redis(connection_pool=redis.ConnectionPool(pool.connection_class, **kwargs))
        try:
            yield n, other
        finally:
            other.close()


def scan_redis(
    client: redis.Redis, scan: SecretScan, *, scan_count: int = 1000, label: str = "Redis"
) -> None:
    """Look at every key name and value in every database of `client`'s server.

    On a cluster, call it once per node with a plain client of that node (`label` names
    the node in what is found).
    """
    for n, r in _databases(client):
        names = list(r.scan_iter(count=scan_count))
        for start in range(0, len(names), 500):
            chunk = names[start : start + 500]
            pipe = r.pipeline(transaction=False)
            for key in chunk:
                pipe.type(key)
            kinds = [_s(k) for k in pipe.execute()]
            pipe = r.pipeline(transaction=False)
            for key, kind in zip(chunk, kinds, strict=True):
                if kind == "string":
                    pipe.get(key)
                elif kind == "hash":
                    pipe.hgetall(key)
                elif kind == "list":
                    pipe.lrange(key, 0, -1)
                elif kind == "set":
                    pipe.smembers(key)
                elif kind == "zset":
                    pipe.zrange(key, 0, -1)
                else:  # streams are read below; anything else as its serialized value
                    pipe.dump(key)
            for key, kind, value in zip(chunk, kinds, pipe.execute(), strict=True):
                name = _s(key)
                scan.checked["secret scan: Redis keys"] += 1
                db = f"{label} db{n}"
                scan.look(f"{db}: the name of key {name!r}", key)
                if kind == "stream":
                    _scan_stream(r, db, key, scan)
                elif isinstance(value, dict):
                    scan.checked["secret scan: Redis values"] += len(value)
                    for f, v in value.items():
                        scan.look(f"{db}: hash {name!r} field {_s(f)!r}", f, v)
                elif isinstance(value, list | set):
                    scan.checked["secret scan: Redis values"] += len(value)
                    scan.look(f"{db}: {kind} {name!r}", *value)
                elif value is not None:  # None: the key expired meanwhile
                    scan.checked["secret scan: Redis values"] += 1
                    scan.look(f"{db}: {kind} {name!r}", value)


def _scan_stream(r: Any, db: str, key: bytes, scan: SecretScan) -> None:
    name = _s(key)
    last = "-"
    while True:
        batch = r.xrange(key, min=last, max="+", count=10_000)
        if last != "-":
            batch = batch[1:]  # the first entry is the one we ended on
        if not batch:
            return
        for entry_id, fields in batch:
            scan.checked["secret scan: stream entries"] += 1
            data = [b for kv in fields.items() for b in kv]
            scan.look(f"{db}: stream {name!r} entry {_s(entry_id)}", *data)
            last = _s(entry_id)


def scan_files(paths: Iterable[tuple[str, Path]], scan: SecretScan) -> None:
    """Look at each (label, path) file's bytes; a file that vanished is skipped."""
    for label, path in paths:
        try:
            data = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            continue
        scan.checked["secret scan: files"] += 1
        scan.checked["secret scan: file bytes"] += len(data)
        scan.look(label, data)
