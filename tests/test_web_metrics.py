"""The web process's metrics (asynctaskd/web/metrics.py) over real sockets: `serve_web`, the
process's own entry point, with `[web] metrics_listen`, a private Redis behind it, httpx
in front; every figure read back by scraping /metrics and parsing the exposition."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import redis.asyncio
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from asynctaskd.client import AsyncClient
from asynctaskd.config import parse_config
from asynctaskd.errors import ConfigError
from asynctaskd.keys import Keys, new_task_id
from asynctaskd.store import Store
from asynctaskd.web import WebSettings, make_app
from asynctaskd.web.common import _METRICS
from asynctaskd.web.metrics import WebMetrics
from asynctaskd.web.server import serve_web
from asynctaskd.web.tokens import Role, mint, tokens_key
from tests.conftest import wait_until
from tests.lua.helpers import ingest

pytestmark = pytest.mark.anyio

API = "/api/v1"
TASKS = f"{API}/tasks"
EVENTS = f"{API}/tasks/{{id}}/events"
KEYS = Keys("atd", 1)
ROOT = Path(__file__).resolve().parents[1]


class Web(msgspec.Struct):
    http: httpx.AsyncClient  # the API's listener
    scraper: httpx.AsyncClient  # the metrics listener
    redis: redis.asyncio.Redis

    async def token(self, role: Role, tenant: str | None = None, **limits: Any) -> dict[str, str]:
        token, record = mint(role, tenant, **limits)
        await self.redis.hset(tokens_key("atd"), record.id, msgspec.json.encode(record))
        return {"Authorization": f"Bearer {token}"}

    async def submit(self, auth: dict[str, str]) -> httpx.Response:
        body = {"handler": "demo", "params": {"n": 1}, "tracking_timeout": 600, "strict": False}
        return await self.http.post(TASKS, json=body, headers=auth)

    async def scrape(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Every sample of /metrics by (name, labels)."""
        r = await self.scraper.get("/metrics")
        assert r.status_code == 200, r.text
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text)
            for s in family.samples
        }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    """One sample; 0 for a labelled series not yet made (a counter that never moved)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def requests(samples: dict[Any, float], route: str, method: str, code: int) -> float:
    return value(samples, "asynctaskd_web_requests_total", route=route, method=method,
                 code=str(code))  # fmt: skip


def timed(samples: dict[Any, float], route: str) -> float:
    return value(samples, "asynctaskd_web_request_duration_seconds_count", route=route)


@pytest.fixture
async def api(redis_url: str, redis_client: redis.asyncio.Redis) -> AsyncIterator[Web]:
    config = parse_config(
        f'[redis]\nurl = "{redis_url}"\n'
        '[web]\nlisten = "127.0.0.1:0"\nmetrics_listen = "127.0.0.1:0"\n'
        'token_cache = "50ms"\nkeepalive = "1s"\n'
    )
    loop = asyncio.get_running_loop()
    started: asyncio.Future[int] = loop.create_future()
    metrics_started: asyncio.Future[int] = loop.create_future()
    server = asyncio.create_task(
        serve_web(config, started=started, metrics_started=metrics_started)
    )
    try:
        done, _ = await asyncio.wait({started, server}, timeout=20,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        assert started in done, server.exception() if server.done() else "no start in 20 s"
        port, metrics_port = started.result(), metrics_started.result()
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as http,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{metrics_port}", timeout=20) as s,
        ):
            yield Web(http, s, redis_client)
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


async def test_requests_are_counted_by_route_template_method_and_code(api: Web) -> None:
    auth = await api.token("producer", "t1")
    before = await api.scrape()
    ids = []
    for _ in range(5):
        r = await api.submit(auth)
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    for task_id in ids[:3]:
        assert (await api.http.get(f"{TASKS}/{task_id}", headers=auth)).status_code == 200
    missing = f"{TASKS}/{new_task_id()}"
    assert (await api.http.get(missing, headers=auth)).status_code == 404
    assert (await api.http.get("/no/such/path")).status_code == 404
    assert (await api.http.request("PROPFIND", TASKS, headers=auth)).status_code == 405
    after = await api.scrape()

    def moved(route: str, method: str, code: int) -> float:
        return requests(after, route, method, code) - requests(before, route, method, code)

    one = f"{TASKS}/{{id}}"
    assert moved(TASKS, "POST", 201) == 5
    assert moved(one, "GET", 200) == 3
    assert moved(one, "GET", 404) == 1
    assert moved("unmatched", "GET", 404) == 1
    assert moved("unmatched", "other", 405) == 1  # aiohttp matches no route on a 405
    assert timed(after, TASKS) - timed(before, TASKS) == 5
    assert timed(after, one) - timed(before, one) == 4
    total = "asynctaskd_web_request_duration_seconds_sum"
    assert value(after, total, route=TASKS) > value(before, total, route=TASKS)
    # Bounded labels: no task id, no raw path, no method a client made up.
    text = (await api.scraper.get("/metrics")).text
    assert not any(task_id in text for task_id in ids)
    assert "/no/such/path" not in text and "PROPFIND" not in text


async def test_an_open_event_stream_is_counted_until_it_ends(api: Web) -> None:
    auth = await api.token("producer", "t1")
    r = await api.submit(auth)
    task_id = r.json()["id"]
    store = Store(api.redis, KEYS)
    await store.prepare()
    await ingest(store)  # a daemon takes the request in: PENDING_SUBMIT, with its event
    before = await api.scrape()
    assert value(before, "asynctaskd_web_event_streams") == 0
    assert value(before, "asynctaskd_web_event_readers") == 0
    sent = value(before, "asynctaskd_web_events_sent_total")
    route = EVENTS
    async with api.http.stream("GET", f"{TASKS}/{task_id}/events", headers=auth) as stream:
        assert stream.status_code == 200
        lines = stream.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):
                break  # the first state
        during = await api.scrape()
        assert value(during, "asynctaskd_web_event_streams") == 1
        assert value(during, "asynctaskd_web_event_readers") == 1
        assert value(during, "asynctaskd_web_events_sent_total") == sent + 1
        assert timed(during, route) - timed(before, route) == 1  # timed once open
        assert requests(during, route, "GET", 200) == requests(before, route, "GET", 200)
        cancel = await api.http.post(f"{TASKS}/{task_id}/cancel", headers=auth)
        assert cancel.status_code == 202
        await ingest(store)  # CANCELED, with its event: the stream shows it and ends
        shown = [line async for line in lines if line.startswith("data: ")]
        assert len(shown) == 1 and '"CANCELED"' in shown[0]

    async def ended() -> dict[Any, float] | None:
        samples = await api.scrape()
        return samples if value(samples, "asynctaskd_web_event_streams") == 0 else None

    after = await wait_until(ended, "the stream to be counted as ended")
    assert value(after, "asynctaskd_web_events_sent_total") == sent + 2
    assert requests(after, route, "GET", 200) - requests(before, route, "GET", 200) == 1
    assert timed(after, route) == timed(during, route)  # its lifetime is no latency
    await wait_until(
        lambda: _gone(api, "asynctaskd_web_event_readers"), "the shard's reader to stop"
    )


async def test_a_stream_its_client_left_is_no_longer_counted_as_open(api: Web) -> None:
    auth = await api.token("producer", "t1")
    task_id = (await api.submit(auth)).json()["id"]
    store = Store(api.redis, KEYS)
    await store.prepare()
    await ingest(store)
    async with api.http.stream("GET", f"{TASKS}/{task_id}/events", headers=auth) as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data: "):
                break
        assert value(await api.scrape(), "asynctaskd_web_event_streams") == 1
    # The task never settles: the server finds the client gone at a keep-alive (1 s).
    await wait_until(lambda: _gone(api, "asynctaskd_web_event_streams"), "the stream to close")
    await wait_until(lambda: _gone(api, "asynctaskd_web_event_readers"), "the reader to stop")


async def _gone(api: Web, name: str) -> bool:
    return value(await api.scrape(), name) == 0


async def test_auth_failures_by_reason_and_rate_limited_requests(api: Web) -> None:
    viewer = await api.token("viewer", "t1")
    limited = await api.token("producer", "t1", rate=0.001, burst=1)
    before = await api.scrape()
    assert (await api.http.get(TASKS)).status_code == 401
    assert (await api.http.get(TASKS, headers={"Authorization": "Basic x"})).status_code == 401
    bad = {"Authorization": "Bearer atd_0123456789abcdef_" + "x" * 43}
    assert (await api.http.get(TASKS, headers=bad)).status_code == 401
    assert (await api.submit(viewer)).status_code == 403
    assert (await api.submit(limited)).status_code == 201
    assert (await api.submit(limited)).status_code == 429
    assert (await api.submit(limited)).status_code == 429
    after = await api.scrape()

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    failures = "asynctaskd_web_auth_failures_total"
    assert moved(failures, reason="missing") == 2
    assert moved(failures, reason="invalid_token") == 1
    assert moved(failures, reason="role") == 1
    assert moved(failures, reason="csrf") == 0
    assert moved("asynctaskd_web_rate_limited_total") == 2
    assert requests(after, TASKS, "POST", 429) - requests(before, TASKS, "POST", 429) == 2


async def test_the_metrics_listener_serves_process_collectors_health_and_readiness(
    api: Web,
) -> None:
    samples = await api.scrape()
    assert any(name == "asynctaskd_build_info" for name, _ in samples)
    assert any(name.startswith("python_gc_") for name, _ in samples)
    assert any(name.startswith("process_") for name, _ in samples)  # Linux
    assert (await api.scraper.get("/healthz")).status_code == 200
    ready = await api.scraper.get("/readyz")
    assert ready.status_code == 200 and ready.text == "ready\n"
    # The API's listener serves no metrics: a scrape there is an unknown route.
    r = await api.http.get("/metrics")
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_route"


async def test_answers_no_middleware_made_are_counted_too(
    redis_client: redis.asyncio.Redis,
) -> None:
    """A redirect raised as an exception, and a bug's exception (aiohttp's 500): both pass
    the API's error middleware untouched and are still counted, with their route."""

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPFound("/elsewhere")

    async def broken(request: web.Request) -> web.Response:
        raise RuntimeError("a bug")

    app = make_app(AsyncClient(redis_client, "atd"), WebSettings())
    app.router.add_get("/moved", moved)
    app.router.add_get("/broken/{x}", broken)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with httpx.AsyncClient(base_url=url, timeout=20) as http:
            assert (await http.get("/moved")).status_code == 302
            assert (await http.get("/broken/1")).status_code == 500
            assert (await http.get("/broken/2")).status_code == 500
    finally:
        await runner.cleanup()
    text = generate_latest(app[_METRICS].registry).decode()
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert requests(samples, "/moved", "GET", 302) == 1
    assert requests(samples, "/broken/{x}", "GET", 500) == 2
    assert timed(samples, "/broken/{x}") == 2


@pytest.mark.parametrize(
    "web_section",
    [
        'metrics_listen = "9465"',
        'metrics_listen = "127.0.0.1:99999"',
        'listen = "127.0.0.1:8080"\nmetrics_listen = "127.0.0.1:8080"',
    ],
)
def test_a_bad_metrics_listen_is_refused_naming_the_key(web_section: str) -> None:
    with pytest.raises(ConfigError, match=r"web\.metrics_listen"):
        parse_config(f"[web]\n{web_section}\n")


def test_metrics_are_not_served_unless_asked_for() -> None:
    assert parse_config("").web.metrics_listen == ""


def test_docs_list_every_web_metric_and_names_follow_the_conventions() -> None:
    text = generate_latest(WebMetrics().registry).decode()
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE "))
    ours = {n for n in types if n.startswith("asynctaskd_web_") and not n.endswith("_created")}
    doc = (ROOT / "docs" / "api.md").read_text()
    assert set(re.findall(r"^\| `(asynctaskd_web_[a-z_]+)`", doc, re.M)) == ours
    for name in ours:
        if types[name] == "counter":
            assert name.endswith("_total"), name
        if types[name] == "histogram":
            assert name.endswith("_seconds"), name
    # The daemon's process collectors and build info, as docs/deploy.md lists them.
    assert "asynctaskd_build_info" in types
    for prefix in ("process_", "python_gc_", "python_info"):
        assert any(name.startswith(prefix) for name in types), prefix
