"""The Prometheus collectors of `asynctaskd web`, named asynctaskd_web_*, on a registry of
the process's own, and the middleware that counts every request.

The same conventions as the daemon's (`asynctaskd.metrics`): `_total` counters, seconds,
bounded labels only. A request is labelled by its route template (`/api/v1/tasks/{id}`,
never the id), its method (one of the methods HTTP defines, else "other") and its status
code; a request no route matched is `route="unmatched"`. Per-request numbers are the
daemon's event-loop children (no lock per update: the scrape runs on the same loop); the
event streams' numbers are read from the process's state when scraped.

Served on `[web] metrics_listen` by the daemon's health server (`asynctaskd.health`), a
listener of its own, not the API's (docs/api.md, Metrics).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Final

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from asynctaskd.metrics import LATENCY_BUCKETS, LoopCounter, LoopHistogram, process_collectors

from .feed import Feed

__all__ = ["AUTH_FAILURES", "UNMATCHED", "WebMetrics", "measure"]

UNMATCHED: Final = "unmatched"
# Why a request was refused before its route ran (401, 403): no bearer token (or not
# one), an unknown or revoked token, a console session that ended, a session whose token
# was revoked, a change without the session's CSRF token, a role that may not do this.
AUTH_FAILURES: Final = ("missing", "invalid_token", "session_ended", "session_revoked",
                        "csrf", "role")  # fmt: skip
_METHODS: Final = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
# The request's start (perf_counter), for a route that answers before it returns (events).
STARTED: Final = web.RequestKey("asynctaskd_started", float)


class WebMetrics:
    """The web process's collectors; `feed` is set by `make_app` (the event streams)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.build_info = process_collectors(r)
        self.requests = LoopCounter(
            "asynctaskd_web_requests_total",
            "HTTP requests answered, by route template, method and status code (an event "
            "stream when it ends).",
            ["route", "method", "code"],
            registry=r,
        )
        self.latency = LoopHistogram(
            "asynctaskd_web_request_duration_seconds",
            "Time from a request to its answer, by route template (an event stream: to "
            "its headers, once open).",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.auth_failures = Counter(
            "asynctaskd_web_auth_failures_total",
            "Requests refused 401 or 403 before their route ran, by reason: missing, "
            "invalid_token, session_ended, session_revoked, csrf, role.",
            ["reason"],
            registry=r,
        )
        for reason in AUTH_FAILURES:
            self.auth_failures.labels(reason)
        self.rate_limited = Counter(
            "asynctaskd_web_rate_limited_total",
            "Requests refused 429 for going over their token's rate.",
            registry=r,
        )
        self.streams_open = 0  # event streams whose headers went out and that still run
        self.events_sent = 0
        self.feed: Feed | None = None
        r.register(_Streams(self))

    def stream_opened(self, request: web.Request, route: str) -> None:
        """An event stream sent its headers: its latency is the time to get there."""
        self.streams_open += 1
        started = request.get(STARTED)
        if started is not None:
            self.latency.labels(route).observe(time.perf_counter() - started)


class _Streams(Collector):
    """The event streams' numbers, read when scraped."""

    def __init__(self, metrics: WebMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        m, feed = self._metrics, self._metrics.feed
        yield GaugeMetricFamily(
            "asynctaskd_web_event_streams", "Event streams open now.", value=m.streams_open
        )
        yield CounterMetricFamily(
            "asynctaskd_web_events_sent",
            "Task events written to event streams (the first state and every change).",
            value=m.events_sent,
        )
        yield CounterMetricFamily(
            "asynctaskd_web_event_streams_dropped",
            "Event streams ended for falling behind (a client that stopped reading while "
            "their queue filled); they reconnect with Last-Event-ID.",
            value=0 if feed is None else feed.dropped,
        )
        yield GaugeMetricFamily(
            "asynctaskd_web_event_readers",
            "Shared readers of a shard's events stream running: one per shard with open "
            "event streams, each on one Redis connection.",
            value=0 if feed is None else len(feed.shards),
        )

    def describe(self) -> Iterable[Metric]:
        return self.collect()


def route_of(request: web.Request) -> str:
    """The template of the route that matched `request`, or "unmatched"."""
    resource = request.match_info.route.resource
    return UNMATCHED if resource is None else resource.canonical


def measure(metrics: WebMetrics) -> Middleware:
    """The outermost middleware: every request counted and timed, refusals included (a
    request cancelled by its client leaving, which aiohttp does not do by default, is not
    counted)."""

    # The children of each (route, method, code) of the app's routes, found once: a
    # request then costs one dict lookup. Bounded: the routes are the app's, the methods
    # those llhttp parses, the codes 100-599. A request no route matched has a route
    # object of its own, so it is looked up by name.
    children: dict[tuple[object, str, int], tuple[Any, Any]] = {}

    def count(request: web.Request, code: int, started: float | None) -> None:
        route, method = request.match_info.route, request.method
        found = children.get((route, method, code))
        if found is None:
            resource = route.resource
            name = UNMATCHED if resource is None else resource.canonical
            label = method if method in _METHODS else "other"
            found = metrics.requests.labels(name, label, str(code)), metrics.latency.labels(name)
            if resource is not None:
                children[route, method, code] = found
        found[0].inc()
        if started is not None:
            found[1].observe(time.perf_counter() - started)

    @web.middleware
    async def _measure(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = request[STARTED] = time.perf_counter()
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            count(request, exc.status, started)
            raise
        except Exception:
            count(request, 500, started)  # no middleware answered it: aiohttp's 500
            raise
        # An event stream was timed when it opened (WebMetrics.stream_opened).
        count(request, response.status, None if response.prepared else started)
        return response

    return _measure
