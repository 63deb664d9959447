"""The daemon's own lock-free collectors expose exactly what prometheus_client's would."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from asynctaskd.metrics import LoopCounter, LoopHistogram, Metrics

BUCKETS = (0.001, 0.005, 0.1, 1, 30)
# Bounds themselves (le is inclusive), between, below the first, above the last, zero.
AMOUNTS = (0.0, 0.001, 0.0011, 0.005, 0.05, 0.1, 1, 1.5, 30, 31, 1e9, 0.0005)


def _exposition(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


def test_a_histogram_exposes_the_same_samples_as_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("x_seconds", "Doc.", ["op", "outcome"], buckets=BUCKETS, registry=ours)
    reference = Histogram("x_seconds", "Doc.", ["op", "outcome"], buckets=BUCKETS, registry=theirs)
    for i, amount in enumerate(AMOUNTS):
        labels = ("submit", "ok") if i % 3 else ("query", "error")
        loop.labels(*labels).observe(amount)
        reference.labels(*labels).observe(amount)

    assert _exposition(ours) == _exposition(theirs)
    assert ours.get_sample_value(
        "x_seconds_bucket", {"op": "submit", "outcome": "ok", "le": "0.005"}
    ) == theirs.get_sample_value(
        "x_seconds_bucket", {"op": "submit", "outcome": "ok", "le": "0.005"}
    )


def test_a_counter_exposes_the_same_samples_as_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopCounter("y_total", "Doc.", ["handler", "status"], registry=ours)
    reference = Counter("y_total", "Doc.", ["handler", "status"], registry=theirs)
    for labels, amount in (
        (("a", "SUCCEEDED"), 1),
        (("a", "FAILED"), 2.5),
        (("a", "SUCCEEDED"), 3),
    ):
        loop.labels(*labels).inc(amount)
        reference.labels(*labels).inc(amount)

    assert _exposition(ours) == _exposition(theirs)


def test_wrong_labels_and_negative_increments_are_refused_as_prometheus_client_does() -> None:
    registry = CollectorRegistry()
    counter = LoopCounter("z_total", "Doc.", ["handler"], registry=registry)
    with pytest.raises(ValueError, match="takes labels"):
        counter.labels("a", "b")
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("a").inc(-1)
    assert registry.get_sample_value("z_total", {"handler": "a"}) == 0


def test_the_daemon_registry_still_names_every_hot_metric() -> None:
    metrics = Metrics()
    metrics.calls.labels("demo", "query", "ok").observe(0.02)
    metrics.due_lag.labels("query").observe(0.3)
    metrics.transitions.labels("demo", "SUCCEEDED").inc()
    metrics.claimed.labels("query").inc(4)
    metrics.observe_redis_call("claim", 0.001)
    text = generate_latest(metrics.registry).decode()
    for line in (
        "# TYPE asynctaskd_handler_call_seconds histogram",
        'asynctaskd_handler_call_seconds_count{handler="demo",op="query",outcome="ok"} 1.0',
        'asynctaskd_due_lag_seconds_bucket{le="0.5",phase="query"} 1.0',
        'asynctaskd_transitions_total{handler="demo",status="SUCCEEDED"} 1.0',
        'asynctaskd_claimed_total{phase="query"} 4.0',
        'asynctaskd_redis_call_seconds_bucket{le="0.001",script="claim"} 1.0',
    ):
        assert line in text, line
