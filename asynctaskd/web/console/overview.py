"""The overview page's data: counts, daemons, pauses, the durability gate, what needs a
human, and the last hour's throughput, read from what the daemons already keep (counters,
heartbeats, the ready sets, the quarantine, the events stream); nothing extra is written
on the daemons' path for it.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from asynctaskd.client import AsyncClient
from asynctaskd.keys import Keys, ready_due_ms
from asynctaskd.model import Status

__all__ = ["overview"]

STALL_S: Final = 30.0  # the next task in line waited this long since due: claims lag
HOUR_MS: Final = 3_600_000
BUCKET_MS: Final = 60_000
EVENTS_READ: Final = 20_000  # events read per shard for the series, at most (newest first)
_PAGE: Final = 5_000
_FAILURES: Final = {b"FAILED", b"TRACKING_TIMED_OUT"}


async def _series(redis: Any, keys: Keys, now_ms: int) -> dict[str, Any]:
    """Tasks that ended per minute over the last hour, from the shards' events streams.
    A stream trimmed inside the hour, or one read only up to EVENTS_READ entries, covers
    less: `since` says from when the counts are whole."""
    start = now_ms - HOUR_MS
    succeeded, failed = [0] * 60, [0] * 60
    since = start
    for shard in range(keys.shards):
        top: str | bytes = "+"
        read = 0
        while True:
            entries = await redis.xrevrange(keys.events(shard), top, start, count=_PAGE)
            for entry_id, fields in entries:
                at = int(entry_id.split(b"-")[0])
                minute = min(59, max(0, (at - start) // BUCKET_MS))
                status = fields.get(b"status")
                if status == b"SUCCEEDED":
                    succeeded[minute] += 1
                elif status in _FAILURES:
                    failed[minute] += 1
            read += len(entries)
            if len(entries) < _PAGE:
                break
            if read >= EVENTS_READ:
                since = max(since, int(entries[-1][0].split(b"-")[0]))
                break
            top = b"(" + entries[-1][0]
    return {"start": start / 1000, "bucket": BUCKET_MS / 1000, "since": since / 1000,
            "succeeded": succeeded, "failed": failed}  # fmt: skip


async def overview(client: AsyncClient, keys: Keys) -> dict[str, Any]:
    stats = await client.stats()
    paused = await client.paused()
    redis = client.redis
    seconds, micros = await redis.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    async with redis.pipeline(transaction=False) as pipe:
        for shard in range(keys.shards):
            pipe.zcard(keys.quarantine(shard))
            for phase in ("submit", "query"):
                pipe.zrange(keys.ready(shard, phase), 0, 0, withscores=True)
                pipe.zcard(keys.ready(shard, phase))
        replies = await pipe.execute()
    quarantined, stalls = 0, []
    for shard in range(keys.shards):
        quarantined += int(replies[5 * shard])
        for i, phase in enumerate(("submit", "query")):
            first, waiting = replies[5 * shard + 1 + 2 * i], int(replies[5 * shard + 2 + 2 * i])
            if first:
                lag = (now_ms - ready_due_ms(first[0][1])) / 1000
                if lag >= STALL_S:
                    stalls.append({"shard": shard, "phase": phase, "waited": lag,
                                   "ready": waiting})  # fmt: skip
    daemons = []
    for d in stats.daemons:
        report = d.get("durability")
        gate: dict[str, Any] = report if isinstance(report, dict) else {}
        daemons.append({
            "id": d.get("id"), "version": d.get("version"), "inflight": d.get("inflight"),
            "completed": d.get("completed"), "handlers": d.get("handlers", []),
            "draining": bool(d.get("draining")),
            "heartbeat_age": max(0.0, now_ms / 1000 - float(d.get("heartbeat_at", 0))),
            "gate": gate.get("mode"), "marks": gate.get("marks"), "gate_detail": gate.get("detail"),
        })  # fmt: skip
    attention = []
    if stats.parked_for_operator:
        n = stats.parked_for_operator
        attention.append({"kind": "submit_unknown", "count": n,
                          "text": f"{n} SUBMIT_UNKNOWN task(s) wait for an operator"})  # fmt: skip
    if quarantined:
        attention.append({"kind": "quarantined", "count": quarantined,
                          "text": f"{quarantined} corrupt task(s) quarantined"})  # fmt: skip
    attention += [
        {"kind": "stall", "count": s["ready"],
         "text": f"{s['ready']} {s['phase']} task(s) ready on shard {s['shard']}; the next "
                 f"waited {s['waited']:.0f} s since due: claims are behind"}
        for s in stalls
    ]  # fmt: skip
    if not daemons:
        attention.append({"kind": "no_daemon", "count": 0, "text": "no live daemon"})
    at_risk = [d["id"] for d in daemons if d["marks"] in ("at_risk", "unknown")]
    if at_risk:
        text = (f"{len(at_risk)} daemon(s) cannot count on Redis keeping 'call started' marks "
                "through a crash (durability gate)")  # fmt: skip
        attention.append({"kind": "durability", "count": len(at_risk), "text": text})
    return {
        "now": now_ms / 1000,
        "attention": attention,
        "by_status": {s.value: stats.by_status.get(s, 0) for s in Status},
        "by_handler": {
            h: {s.value: n for s, n in row.items()} for h, row in stats.by_handler.items()
        },
        "requests": stats.requests,
        "parked_for_lookup": stats.parked_for_lookup,
        "parked_for_operator": stats.parked_for_operator,
        "quarantined": quarantined,
        "stalls": stalls,
        "daemons": daemons,
        "paused": msgspec.to_builtins(paused),
        "series": await _series(redis, keys, now_ms),
    }
