"""Every Prometheus collector the daemon exports, named asynctaskd_*, on its own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    """Collectors with bounded labels: handler, op, outcome, status, code, script."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.transitions = Counter(
            "asynctaskd_transitions_total",
            "Task status changes saved by this daemon.",
            ["handler", "status"],
            registry=r,
        )
        self.calls = Histogram(
            "asynctaskd_handler_call_seconds",
            "Handler call latency by operation and outcome.",
            ["handler", "op", "outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(
            "asynctaskd_inflight_calls", "Handler calls in flight in this daemon.", registry=r
        )
        self.due_lag = Histogram(
            "asynctaskd_due_lag_seconds",
            "How late a claimed task started compared with its due time.",
            ["phase"],
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.claimed = Counter(
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
        self.durability_gate = Histogram(
            "asynctaskd_durability_gate_seconds",
            "Time to make the started mark durable before a vendor submit.",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.handler_crashes = Counter(
            "asynctaskd_handler_crashes_total",
            "Unexpected exceptions contained while handling a task.",
            ["handler"],
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
