"""Every Prometheus collector the daemon exports, named asynctaskd_*, on its own registry."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from . import __version__

__all__ = [
    "DURABILITY_FSYNC",
    "DURABILITY_MARKS",
    "DURABILITY_MODES",
    "LATENCY_BUCKETS",
    "LoopCounter",
    "LoopHistogram",
    "Metrics",
    "process_collectors",
]

# The states of the durability state sets (asynctaskd.durability says what each means).
DURABILITY_MODES = ("waitaof", "wait", "off")
DURABILITY_FSYNC = ("always", "everysec", "no", "off", "unknown")
DURABILITY_MARKS = ("fsynced", "replicated", "at_risk", "unknown")


C = TypeVar("C")


class _HistogramChild:
    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self._bounds, amount)] += 1  # le: amount <= bound
        self.sum += amount


class _CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class _LoopCollector(Collector, Generic[C]):
    """A labelled metric updated on every task, from the event loop's thread only.

    prometheus_client's children take a lock on every update (a histogram two), which
    showed at ~6% of the daemon's CPU per task. These children are plain numbers; the
    scrape (`collect`) runs on the same event loop, so nothing races. Same names, labels,
    buckets and samples as prometheus_client's, without the `_created` series.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        *,
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], C] = {}
        registry.register(self)

    def _new_child(self) -> C:
        raise NotImplementedError

    def labels(self, *values: object) -> C:
        """The child for these label values: a dict lookup, cheap enough per task that
        callers need no cache of their own."""
        child = self._children.get(values)  # type: ignore[arg-type]  # str labels: found as is
        if child is None:
            key = tuple(map(str, values))
            child = self._children.get(key)
            if child is None:
                if len(key) != len(self.labelnames):
                    raise ValueError(f"{self.name} takes labels {self.labelnames}, got {key}")
                child = self._children[key] = self._new_child()
        return child

    def describe(self) -> Iterable[Metric]:
        return self.collect()


class LoopHistogram(_LoopCollector[_HistogramChild]):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._bounds = tuple(float(b) for b in buckets)
        self._les = [_go_float(b) for b in (*self._bounds, math.inf)]
        super().__init__(name, documentation, labelnames, registry=registry)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self._bounds)

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, child in list(self._children.items()):
            cumulative = list(itertools.accumulate(child.counts))
            family.add_metric(list(key), list(zip(self._les, cumulative, strict=True)), child.sum)
        return [family]


class LoopCounter(_LoopCollector[_CounterChild]):
    def _new_child(self) -> _CounterChild:
        return _CounterChild()

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, child in list(self._children.items()):
            family.add_metric(list(key), child.value)
        return [family]


def _go_float(value: float) -> str:
    """A bucket bound as Prometheus prints it (`le="0.005"`, `le="+Inf"`)."""
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]
    return text


LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# One Redis round trip: a script on a local server takes ~0.1-1 ms; a pipeline or a busy
# server more. The top buckets catch stalls just under the socket timeout.
_REDIS_BUCKETS = (0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
# How late the event loop wakes a 0.25 s sleep: anything above ~10 ms means blocking code.
_LOOP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


def process_collectors(registry: CollectorRegistry) -> Gauge:
    """What every asynctaskd process exports (the daemon, `asynctaskd web`): the process
    as the host sees it (process_* memory, CPU, open files; Linux only), the interpreter
    (python_info) and its garbage collector (python_gc_*); returns `asynctaskd_build_info`."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    build_info = Gauge(
        "asynctaskd_build_info",
        "Always 1; the version label says which asynctaskd runs.",
        ["version"],
        registry=registry,
    )
    build_info.labels(__version__).set(1)
    return build_info


class Metrics:
    """Collectors with bounded labels: handler, op, outcome, status, code, script, phase.

    Names follow Prometheus conventions: `_total` counters, base units (`_seconds`).
    `asynctaskd_tasks*`, `asynctaskd_oldest_pending_age_seconds`, `asynctaskd_ready_tasks`
    and `asynctaskd_live_daemons` are cluster-wide: every daemon exports the same values,
    so dashboards and alerts aggregate them with `max`, never `sum`.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.build_info = process_collectors(r)
        self.transitions = LoopCounter(
            "asynctaskd_transitions_total",
            "Task status changes saved by this daemon.",
            ["handler", "status"],
            registry=r,
        )
        self.calls = LoopHistogram(
            "asynctaskd_handler_call_seconds",
            "Handler call latency by operation and outcome.",
            ["handler", "op", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(
            "asynctaskd_inflight_calls", "Handler calls in flight in this daemon.", registry=r
        )
        self.due_lag = LoopHistogram(
            "asynctaskd_due_lag_seconds",
            "How late a claimed task started compared with its due time.",
            ["phase"],
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.claimed = LoopCounter(
            "asynctaskd_claimed_total", "Tasks claimed, by phase.", ["phase"], registry=r
        )
        self.rejected_writes = Counter(
            "asynctaskd_rejected_writes_total",
            "Worker writes the store refused (stale fence, wrong version, no lease...).",
            ["op", "code"],
            registry=r,
        )
        self.leases_lost = Counter(
            "asynctaskd_leases_lost_total",
            "Leases found gone at renewal; the call was cancelled.",
            registry=r,
        )
        self.reaped = Counter(
            "asynctaskd_reaped_total",
            "Expired leases acted on by this daemon's reaper, by resulting status.",
            ["status"],
            registry=r,
        )
        self.timed_out = Counter(
            "asynctaskd_swept_timeouts_total",
            "Tasks the deadline sweep moved to TRACKING_TIMED_OUT.",
            registry=r,
        )
        self.quarantined = Counter(
            "asynctaskd_quarantined_total", "Corrupt tasks set aside.", registry=r
        )
        self.lookups = Counter(
            "asynctaskd_lookups_total",
            "Vendor lookups of parked (SUBMIT_UNKNOWN) tasks, by what find() answered: "
            "found, none or error.",
            ["handler", "outcome"],
            registry=r,
        )
        self.reconciled = Counter(
            "asynctaskd_reconciled_total",
            "Parked tasks a lookup settled: found (tracked with the vendor's job), "
            "resubmitted (no job: submitted again), gave_up (left to an operator).",
            ["handler", "outcome"],
            registry=r,
        )
        self.requests_dropped = Counter(
            "asynctaskd_requests_dropped_total",
            "Producers' create requests dropped because they were not what the create "
            "script writes (a producer writing to Redis by hand).",
            registry=r,
        )
        self.durability_gate = Histogram(
            "asynctaskd_durability_gate_seconds",
            "Time to make the started mark durable before a vendor submit.",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # State sets, one series per state (1 for the current one), so that an alert can
        # match a state and a dashboard can show it; per daemon: each has its own gate.
        self.durability_mode = Gauge(
            "asynctaskd_durability_gate",
            "What the durability gate enforces before a vendor submit: 1 for the current "
            "mode (waitaof: the started mark is fsynced; wait: replicas acknowledged it; "
            "off: nothing).",
            ["mode"],
            registry=r,
        )
        self.durability_fsync = Gauge(
            "asynctaskd_durability_aof",
            "The Redis server's AOF fsync policy as last checked: 1 for always, everysec, "
            "no, off (AOF disabled) or unknown (CONFIG GET refused).",
            ["fsync"],
            registry=r,
        )
        self.durability_marks = Gauge(
            "asynctaskd_durability_marks",
            'How a "call started" mark survives a crash of Redis when the vendor is called: '
            "1 for fsynced, replicated, at_risk (a crash can lose it: a second submit is "
            "possible) or unknown.",
            ["state"],
            registry=r,
        )
        self.handler_crashes = Counter(
            "asynctaskd_handler_crashes_total",
            "Unexpected exceptions contained while handling a task.",
            ["handler"],
            registry=r,
        )
        self.handler_exceptions = Counter(
            "asynctaskd_handler_exceptions_total",
            "Exceptions handlers raised from submit and query, by type (HandlerErrors too).",
            ["handler", "op", "exception"],
            registry=r,
        )
        self.store_errors = Counter(
            "asynctaskd_store_errors_total",
            "Redis calls that failed (unavailable or refused).",
            ["kind"],
            registry=r,
        )
        self.tasks = Gauge(
            "asynctaskd_tasks",
            "Tasks by status, exact and cluster-wide, from the script-maintained counters.",
            ["status"],
            registry=r,
        )
        self.parked = Gauge(
            "asynctaskd_parked_tasks",
            "SUBMIT_UNKNOWN tasks, cluster-wide, by what they wait for: a vendor lookup "
            "(kind=lookup) or an operator (kind=operator).",
            ["kind"],
            registry=r,
        )
        self.tasks_by_handler = Gauge(
            "asynctaskd_tasks_by_handler",
            "Tasks by status and handler, exact and cluster-wide.",
            ["status", "handler"],
            registry=r,
        )
        self.watchdog_ok = Gauge(
            "asynctaskd_watchdog_ok",
            "1 while the claim loop keeps up with due work, 0 when it stalls.",
            registry=r,
        )
        self.redis_calls = LoopHistogram(
            "asynctaskd_redis_call_seconds",
            "Round-trip time of one Redis script call (or pipeline), by script.",
            ["script"],
            buckets=_REDIS_BUCKETS,
            registry=r,
        )
        self.event_loop_lag = Histogram(
            "asynctaskd_event_loop_lag_seconds",
            "How much later than asked the event loop woke a 0.25 s sleep.",
            buckets=_LOOP_BUCKETS,
            registry=r,
        )
        self.oldest_pending_age = Gauge(
            "asynctaskd_oldest_pending_age_seconds",
            "Age of the most overdue unclaimed task, by phase (0 when nothing is overdue); "
            "cluster-wide.",
            ["phase"],
            registry=r,
        )
        self.ready_tasks = Gauge(
            "asynctaskd_ready_tasks",
            "Tasks due now and waiting for a claim (queue depth), by phase; cluster-wide.",
            ["phase"],
            registry=r,
        )
        self.live_daemons = Gauge(
            "asynctaskd_live_daemons",
            "Daemons whose heartbeat is under 30 s old; cluster-wide.",
            registry=r,
        )
        self.paused = Gauge(
            "asynctaskd_paused_dimensions",
            "Paused dimensions (new submits held back), by kind: handler, provider, "
            "tenant, account.",
            ["kind"],
            registry=r,
        )
        self.admission_waiting = Gauge(
            "asynctaskd_admission_waiting",
            "Due tasks set aside by admission, by what holds them (pause, cap, rate) and "
            "scope (tenant scopes are summed as 'tenant'); cluster-wide.",
            ["kind", "scope"],
            registry=r,
        )
        self.tokens = Counter(
            "asynctaskd_tokens",
            "Rate-limit tokens this daemon asked for, by lane (phase|provider|account) and "
            "outcome: granted, denied (none left), refunded (taken but not used).",
            ["lane", "outcome"],
            registry=r,
        )
        self.in_flight_capped = Gauge(
            "asynctaskd_cap_in_use",
            "Tasks holding a slot of an in-flight cap, by scope (tenant scopes summed as "
            "'tenant'); cluster-wide.",
            ["scope"],
            registry=r,
        )
        self.admission_sync_failures = Counter(
            "asynctaskd_admission_sync_failures_total",
            "Shard syncs of the admission limits this daemon could not finish, by kind: "
            "incomplete (the staged table was not whole at the swap), refused (Redis "
            "refused a call), unavailable. The shard kept the limits it had.",
            ["kind"],
            registry=r,
        )
        for kind in ("incomplete", "refused", "unavailable"):
            self.admission_sync_failures.labels(kind)
        self.admission_stale_shards = Gauge(
            "asynctaskd_admission_stale_shards",
            "Shards still enforcing limits older than the stored ones after this daemon's "
            "last sync pass (a change in flight, or syncs that fail); cluster-wide.",
            registry=r,
        )
        self.cap_limit = Gauge(
            "asynctaskd_cap_limit",
            "Configured in-flight caps, by scope (the default tenant cap as 'tenant:*').",
            ["scope"],
            registry=r,
        )

    def observe_durability(self, mode: str, fsync: str, marks: str) -> None:
        """Set the durability state sets: 1 for the given states, 0 for the others."""
        for gauge, states, current in (
            (self.durability_mode, DURABILITY_MODES, mode),
            (self.durability_fsync, DURABILITY_FSYNC, fsync),
            (self.durability_marks, DURABILITY_MARKS, marks),
        ):
            if current not in states:
                raise ValueError(f"unknown durability state {current!r}")
            for state in states:
                gauge.labels(state).set(1 if state == current else 0)

    def observe_redis_call(self, script: str, seconds: float) -> None:
        """`Store.on_call` hook: one Redis round trip of `script` took `seconds`."""
        # Script names are a fixed set (lua/*.lua plus a few op names): bounded labels.
        self.redis_calls.labels(script).observe(seconds)
