"""Expired leases, deadlines of unclaimed tasks, retention, and the exact status gauges."""

from __future__ import annotations

import logging
import time

import anyio

from .config import Config
from .errors import ScriptError, StoreUnavailable
from .metrics import Metrics
from .model import Status
from .store import Store

__all__ = ["run_reaper", "observe"]

logger = logging.getLogger(__name__)


async def reap_once(store: Store, config: Config, metrics: Metrics) -> int:
    """One bounded pass over every shard; returns how many tasks it acted on."""
    acted = 0
    limit = config.reaper.batch
    for shard in range(store.keys.shards):
        for task_id, status in await store.reap(shard, limit, config.worker.max_reclaims):
            metrics.reaped.labels(status.value).inc()
            logger.info("reaped an expired lease -> %s", status, extra={"task_id": task_id})
            acted += 1
        timed_out = await store.time_out(shard, limit)
        metrics.timed_out.inc(len(timed_out))
        acted += len(timed_out)
    return acted


async def purge_once(store: Store, config: Config) -> int:
    older_than_ms = round(float(config.reaper.retention) * 1000)
    purged = 0
    for shard in range(store.keys.shards):
        purged += len(await store.purge(shard, older_than_ms, config.reaper.batch))
    return purged


async def observe(store: Store, metrics: Metrics) -> None:
    """Refresh the cluster-wide status gauges from the script-maintained counters."""
    counts = await store.counts()
    for status in Status:
        metrics.tasks.labels(status.value).set(counts.get(status.value, 0))
    for name, value in counts.items():
        status_name, sep, handler = name.partition("@")
        if sep:
            metrics.tasks_by_handler.labels(status_name, handler).set(value)


async def run_reaper(store: Store, config: Config, metrics: Metrics) -> None:
    """Run forever: reap and sweep every interval, purge every purge_interval."""
    interval = float(config.reaper.interval)
    purge_every = float(config.reaper.purge_interval)
    next_purge = time.monotonic() + purge_every
    while True:
        try:
            acted = await reap_once(store, config, metrics)
            await observe(store, metrics)
            if time.monotonic() >= next_purge:
                next_purge = time.monotonic() + purge_every
                purged = await purge_once(store, config)
                if purged:
                    logger.info("purged %d tasks past retention", purged)
        except (StoreUnavailable, ScriptError) as exc:
            metrics.store_errors.labels("reaper").inc()
            logger.warning("reaper pass failed: %s", exc)
            acted = 0
        # A full batch means more may be waiting: go again at once.
        if acted < config.reaper.batch:
            await anyio.sleep(interval)
