"""The HTTP API over real sockets: a real aiohttp server on a free loopback port, the test
Redis behind it, httpx in front; a real Worker for the lifecycle the event stream shows."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import msgspec
import pytest
import redis.asyncio
import redis.exceptions
from aiohttp import web

from asynctaskd.client import AsyncClient, content_dedup_key
from asynctaskd.config import parse_config
from asynctaskd.errors import ConfigError, InvalidTask, PayloadTooLarge
from asynctaskd.handlers import HandlerContext, HandlerEntry, Running, Submitted, Succeeded
from asynctaskd.model import Status
from asynctaskd.store import Store
from asynctaskd.web import WebSettings, make_app
from asynctaskd.web.tokens import Role, TokenCache, mint, tokens_key
from asynctaskd.worker import Worker
from tests.conftest import wait_until
from tests.lua.helpers import ingest

pytestmark = pytest.mark.anyio

API = "/api/v1"
MAX_BODY = 4096
MAX_PAYLOAD = 1024  # the server's client's limit on params and metadata


class Api(msgspec.Struct):
    """The running server: its base URL, a plain client, and a way to mint tokens."""

    url: str
    http: httpx.AsyncClient
    redis: redis.asyncio.Redis
    client: AsyncClient

    async def token(self, role: Role, tenant: str | None = None) -> dict[str, str]:
        token, record = mint(role, tenant)
        await self.redis.hset(tokens_key("atd"), record.id, msgspec.json.encode(record))
        return {"Authorization": f"Bearer {token}"}

    async def submit(self, auth: dict[str, str], **body: Any) -> httpx.Response:
        fields = {"handler": "demo", "params": {"n": 1}, "tracking_timeout": 60, "strict": False}
        return await self.http.post(f"{API}/tasks", json={**fields, **body}, headers=auth)


@pytest.fixture
async def api(redis_client: redis.asyncio.Redis) -> AsyncIterator[Api]:
    client = AsyncClient(redis_client, "atd", max_payload=MAX_PAYLOAD)
    settings = WebSettings(max_body=MAX_BODY, token_cache=0.05, keepalive=1.0)
    runner = web.AppRunner(make_app(client, settings), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            yield Api(url, http, redis_client, client)
    finally:
        await runner.cleanup()


def error_code(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    return str(body["error"]["code"])


# Submit and read.


async def test_submit_then_get_as_the_producer_tenant(api: Api) -> None:
    auth = await api.token("producer", "t1")
    r = await api.submit(auth, priority=5, metadata={"who": "node"})
    assert r.status_code == 201, r.text
    task = r.json()
    assert task["status"] == "PENDING_SUBMIT" and task["tenant"] == "t1"
    assert task["priority"] == 5 and task["metadata"] == {"who": "node"}
    assert "fence" not in task and "owner" not in task  # worker internals stay hidden
    assert r.headers["Location"] == f"{API}/tasks/{task['id']}"
    got = await api.http.get(f"{API}/tasks/{task['id']}", headers=auth)
    assert got.status_code == 200 and got.json()["id"] == task["id"]
    stored = await api.client.get(task["id"])
    assert stored is not None and stored.tenant == "t1" and stored.handler == "demo"


async def test_idempotency_key_returns_the_live_task_with_200(api: Api) -> None:
    auth = await api.token("producer", "t1")
    key = {"Idempotency-Key": "order-42"}
    first = await api.submit({**auth, **key})
    again = await api.submit({**auth, **key})
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    other = await api.submit({**auth, "Idempotency-Key": "order-43"})
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]


async def test_dedup_by_content_is_one_task_per_handler_and_params(api: Api) -> None:
    auth = await api.token("producer", "t1")
    params = {"prompt": "a cat", "size": 512}
    first = await api.submit(auth, params=params, dedup="content")
    again = await api.submit(auth, params={"size": 512, "prompt": "a cat"}, dedup="content")
    assert (first.status_code, again.status_code) == (201, 200), again.text
    assert first.json()["id"] == again.json()["id"]
    stored = await api.client.get(first.json()["id"])
    assert stored is not None and stored.dedup_key == content_dedup_key("demo", params)
    other = await api.submit(auth, params={**params, "size": 1024}, dedup="content")
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]
    plain = await api.submit(auth, params=params)  # no dedup asked: a task of its own
    assert plain.status_code == 201 and plain.json()["id"] != first.json()["id"]
    assert len(await api.redis.keys("atd:{s*}:new:*")) == 3  # create requests, no daemon
    schema = (await api.http.get(f"{API}/openapi.json")).json()["components"]["schemas"]
    assert "content" in msgspec.json.encode(schema["SubmitBody"]["properties"]["dedup"]).decode()


async def test_dedup_by_content_refusals_are_422_and_write_nothing(
    api: Api, redis_client: redis.asyncio.Redis
) -> None:
    auth = await api.token("producer", "t1")
    python = AsyncClient(redis_client, "atd")
    with pytest.raises(InvalidTask) as both:
        await python.submit("demo", {"n": 1}, tracking_timeout=60, strict=False,
                            dedup_key="k", dedup="content")  # fmt: skip
    before = await _snapshot(redis_client)
    r = await api.submit({**auth, "Idempotency-Key": "k"}, dedup="content")
    assert r.status_code == 422 and error_code(r) == "invalid"
    assert r.json()["error"]["message"] == str(both.value)
    for bad in ("hash", "", 1, True, ["content"]):
        r = await api.submit(auth, dedup=bad)
        assert r.status_code == 422 and error_code(r) == "invalid", (bad, r.text)
        assert "$.dedup" in r.json()["error"]["message"]
    assert await _snapshot(redis_client) == before


@pytest.mark.parametrize(
    ("body", "kwargs"),
    [
        ({"priority": 500}, {"priority": 500}),
        ({"handler": "no spaces"}, {"handler": "no spaces"}),
        ({"tracking_timeout": -1}, {"tracking_timeout": -1}),
        ({"delay": 5, "not_before": 1e9}, {"delay": 5, "not_before": 1e9}),
        ({"account": "a/b"}, {"account": "a/b"}),
        ({"params": "x" * 2000}, {"params": "x" * 2000}),
        ({"metadata": ["y"] * 600}, {"metadata": ["y"] * 600}),
    ],
)
async def test_invalid_input_is_422_with_the_clients_message(
    api: Api, redis_client: redis.asyncio.Redis, body: dict[str, Any], kwargs: dict[str, Any]
) -> None:
    auth = await api.token("producer", "t1")
    python = AsyncClient(redis_client, "atd", max_payload=MAX_PAYLOAD)
    call: dict[str, Any] = {"handler": "demo", "params": {"n": 1}, "tracking_timeout": 60}
    call.update(kwargs)
    with pytest.raises(InvalidTask) as raised:
        await python.submit(call.pop("handler"), call.pop("params"), strict=False, **call)
    r = await api.submit(auth, **body)
    code = "payload_too_large" if isinstance(raised.value, PayloadTooLarge) else "invalid"
    assert r.status_code == 422 and error_code(r) == code
    assert r.json()["error"]["message"] == str(raised.value)


async def test_strict_submit_of_a_handler_no_daemon_serves_is_422(api: Api) -> None:
    auth = await api.token("producer", "t1")
    r = await api.submit(auth, strict=True)
    assert r.status_code == 422 and error_code(r) == "unknown_handler"


async def test_quota_refusal_is_429_with_retry_after(api: Api) -> None:
    await api.client.set_limit(tenant="q", quota=1, quota_period="1h")
    auth = await api.token("producer", "q")
    assert (await api.submit(auth)).status_code == 201
    r = await api.submit(auth)
    assert r.status_code == 429 and error_code(r) == "quota_exceeded"
    assert int(r.headers["Retry-After"]) >= 1  # whole seconds, rounded up


async def test_list_and_stats(api: Api, store: Store) -> None:
    p1, p2 = await api.token("producer", "t1"), await api.token("producer", "t2")
    mine = [(await api.submit(p1)).json()["id"] for _ in range(3)]
    theirs = (await api.submit(p2)).json()["id"]
    await ingest(store)  # listings show tasks a daemon has taken in
    r = await api.http.get(f"{API}/tasks", params={"limit": 2}, headers=p1)
    assert r.status_code == 200
    page = r.json()
    seen = [t["id"] for t in page["tasks"]]
    while page["cursor"]:
        r = await api.http.get(f"{API}/tasks", params={"cursor": page["cursor"], "limit": 2},
                               headers=p1)  # fmt: skip
        page = r.json()
        seen += [t["id"] for t in page["tasks"]]
    assert sorted(seen) == sorted(mine) and theirs not in seen
    r = await api.http.get(f"{API}/tasks", params={"status": "PENDING_SUBMIT"}, headers=p2)
    assert [t["id"] for t in r.json()["tasks"]] == [theirs]
    op = await api.token("operator")
    r = await api.http.get(f"{API}/tasks", params={"tenant": "t2"}, headers=op)
    assert [t["id"] for t in r.json()["tasks"]] == [theirs]
    stats = await api.http.get(f"{API}/stats", headers=op)
    assert stats.status_code == 200 and "by_status" in stats.json()


async def test_cancel_and_operator_requeue(api: Api, store: Store) -> None:
    auth = await api.token("producer", "t1")
    task_id = (await api.submit(auth)).json()["id"]
    r = await api.http.post(f"{API}/tasks/{task_id}/cancel", headers=auth)
    assert r.status_code == 202
    await ingest(store)  # a daemon takes the create and the cancel in
    task = await api.client.get(task_id)
    assert task is not None and task.status is Status.CANCELED
    again = await api.http.post(f"{API}/tasks/{task_id}/cancel", headers=auth)
    assert again.status_code == 409 and error_code(again) == "already_finished"
    op = await api.token("operator")
    r = await api.http.post(f"{API}/tasks/{task_id}/requeue", headers=op)
    assert r.status_code == 409 and error_code(r) == "illegal_transition"
    assert "CANCELED" in r.json()["error"]["message"]


async def test_operator_resolve(api: Api, store: Store) -> None:
    producer, op = await api.token("producer", "t1"), await api.token("operator")
    task_id = (await api.submit(producer)).json()["id"]
    await ingest(store)
    url = f"{API}/tasks/{task_id}/resolve"
    r = await api.http.post(url, headers=op, json={"status": "SUBMITTED", "external_id": "j"})
    assert r.status_code == 409 and error_code(r) == "illegal_transition"
    r = await api.http.post(url, headers=op, json={"status": "CANCELED", "message": "dup"})
    assert r.status_code == 200 and r.json()["status"] == "CANCELED"


# Roles and tenants.


async def test_anonymous_is_401_and_wrong_role_is_403(api: Api) -> None:
    r = await api.submit({})
    assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
    r = await api.submit({"Authorization": "Bearer atd_0000000000000000_" + "x" * 43})
    assert r.status_code == 401 and error_code(r) == "unauthorized"
    r = await api.submit({"Authorization": "Basic dXNlcjpwYXNz"})
    assert r.status_code == 401
    producer = await api.token("producer", "t1")
    viewer = await api.token("viewer", "t1")
    task_id = (await api.submit(producer)).json()["id"]
    assert (await api.submit(viewer)).status_code == 403
    r = await api.http.post(f"{API}/tasks/{task_id}/cancel", headers=viewer)
    assert r.status_code == 403 and error_code(r) == "forbidden"
    assert (await api.http.get(f"{API}/tasks/{task_id}", headers=viewer)).status_code == 200
    for who in (producer, viewer):
        assert (await api.http.get(f"{API}/stats", headers=who)).status_code == 403
        r = await api.http.post(f"{API}/tasks/{task_id}/requeue", headers=who)
        assert r.status_code == 403
        r = await api.http.post(f"{API}/tasks/{task_id}/resolve", headers=who,
                                json={"status": "FAILED"})  # fmt: skip
        assert r.status_code == 403
    for path in ("/tasks", f"/tasks/{task_id}", f"/tasks/{task_id}/events", "/stats"):
        assert (await api.http.get(API + path)).status_code == 401, path


async def test_another_tenants_task_is_a_404_like_a_missing_one(api: Api) -> None:
    a, b = await api.token("producer", "a"), await api.token("producer", "b")
    viewer_b = await api.token("viewer", "b")
    task_id = (await api.submit(a)).json()["id"]
    missing = "01ARZ3NDEKTSV4RRFFQ69G5FAV"
    for who in (b, viewer_b):
        for path in (f"/tasks/{task_id}", f"/tasks/{task_id}/events"):
            r = await api.http.get(API + path, headers=who)
            gone = await api.http.get(API + path.replace(task_id, missing), headers=who)
            assert r.status_code == gone.status_code == 404
            assert r.json()["error"]["message"].replace(task_id, "ID") == gone.json()["error"][
                "message"
            ].replace(missing, "ID")
    r = await api.http.post(f"{API}/tasks/{task_id}/cancel", headers=b)
    assert r.status_code == 404
    task = await api.client.get(task_id)
    assert task is not None and not task.cancel_requested and task.status is not Status.CANCELED
    assert await api.redis.llen("atd:{s0}:intake") == 1  # only the create: no cancel request
    r = await api.submit(b, tenant="a")
    assert r.status_code == 403
    r = await api.http.get(f"{API}/tasks", params={"tenant": "a"}, headers=b)
    assert r.status_code == 403
    op = await api.token("operator")
    assert (await api.http.get(f"{API}/tasks/{task_id}", headers=op)).status_code == 200
    r = await api.http.get(f"{API}/tasks", params={"cursor": "forged"}, headers=op)
    assert r.status_code == 422 and error_code(r) == "invalid"
    r = await api.submit(op, tenant="c")
    assert r.status_code == 201 and r.json()["tenant"] == "c"


async def test_a_revoked_token_stops_working_without_a_restart(api: Api) -> None:
    token, record = mint("producer", "t1")
    auth = {"Authorization": f"Bearer {token}"}
    assert (await api.http.get(f"{API}/tasks", headers=auth)).status_code == 401
    await api.redis.hset(tokens_key("atd"), record.id, msgspec.json.encode(record))

    async def status() -> int:
        return (await api.http.get(f"{API}/tasks", headers=auth)).status_code

    await wait_until(lambda: _is(status, 200), "the new token to work")
    await api.redis.hdel(tokens_key("atd"), record.id)
    await wait_until(lambda: _is(status, 401), "the revoked token to stop working")
    wrong = f"atd_{record.id}_{'A' * 43}"  # the right id with another secret
    await api.redis.hset(tokens_key("atd"), record.id, msgspec.json.encode(record))
    r = await api.http.get(f"{API}/tasks", headers={"Authorization": f"Bearer {wrong}"})
    assert r.status_code == 401


async def _is(status: Any, expected: int) -> bool:
    return bool(await status() == expected)


# Bad input: a clear 4xx, and nothing written.


async def _snapshot(redis_client: redis.asyncio.Redis) -> tuple[int, list[bytes]]:
    return await redis_client.dbsize(), sorted(await redis_client.keys("*"))


async def test_bad_input_gets_a_4xx_and_writes_nothing(
    api: Api, redis_client: redis.asyncio.Redis
) -> None:
    auth = await api.token("producer", "t1")
    op = await api.token("operator")
    good = {"handler": "demo", "params": {}, "tracking_timeout": 60, "strict": False}
    url = f"{API}/tasks"
    cases: list[tuple[str, int, str, dict[str, Any]]] = [
        ("huge body", 413, "body_too_large",
         {"content": msgspec.json.encode({**good, "params": "x" * MAX_BODY}),
          "headers": {"Content-Type": "application/json"}}),
        ("huge chunked body", 413, "body_too_large",
         {"content": _chunks(msgspec.json.encode({**good, "params": "x" * MAX_BODY})),
          "headers": {"Content-Type": "application/json"}}),
        ("form body", 415, "unsupported_media_type", {"data": {"handler": "demo"}}),
        ("no content type", 415, "unsupported_media_type", {"content": b"{}"}),
        ("malformed JSON", 400, "malformed_json",
         {"content": b'{"handler": ', "headers": {"Content-Type": "application/json"}}),
        ("not UTF-8", 400, "malformed_json",
         {"content": b'{"handler": "\xff"}', "headers": {"Content-Type": "application/json"}}),
        ("unknown field", 422, "invalid", {"json": {**good, "dedup_key": "k"}}),
        ("wrong type", 422, "invalid", {"json": {**good, "priority": "high"}}),
        ("missing field", 422, "invalid", {"json": {"handler": "demo", "params": {}}}),
        ("array body", 422, "invalid", {"json": [good]}),
        ("long idempotency key", 422, "invalid",
         {"json": good, "headers": {"Idempotency-Key": "k" * 201}}),
    ]  # fmt: skip
    viewer = await api.token("viewer", "t1")
    stranger = await api.token("producer", "t2")
    before = await _snapshot(redis_client)
    task_id = "01ARZ3NDEKTSV4RRFFQ69G5FAV"
    refused = [
        (f"{API}/tasks", {}, good, 401),
        (f"{API}/tasks", viewer, good, 403),
        (f"{API}/tasks", auth, {**good, "tenant": "t2"}, 403),
        (f"{API}/tasks/{task_id}/cancel", viewer, None, 403),
        (f"{API}/tasks/{task_id}/cancel", stranger, None, 404),
        (f"{API}/tasks/{task_id}/requeue", auth, None, 403),
    ]
    for path, who, body, status in refused:
        r = await api.http.post(path, headers=who, json=body)
        assert r.status_code == status, (path, r.text)
    for what, status, code, kwargs in cases:
        headers = {**auth, **kwargs.pop("headers", {})}
        r = await api.http.post(url, headers=headers, **kwargs)
        assert (r.status_code, error_code(r)) == (status, code), (what, r.text)
    gets = [
        (f"{API}/tasks/not-an-id", auth, 422),
        (f"{API}/tasks/not-an-id/events", auth, 422),
        (f"{API}/tasks/01ARZ3NDEKTSV4RRFFQ69G5FAV-7", auth, 422),  # a shard we do not have
        (f"{API}/tasks?limit=abc", auth, 422),
        (f"{API}/tasks?limit=0", auth, 422),
        (f"{API}/tasks?status=DONE", auth, 422),
        (f"{API}/tasks?sort=asc", auth, 422),
        (f"{API}/nothing", auth, 404),
    ]
    for path, who, status in gets:
        r = await api.http.get(path, headers=who)
        assert r.status_code == status, (path, r.text)
        error_code(r)
    posts = [
        (f"{API}/tasks/not-an-id/cancel", auth, None, 422),
        (f"{API}/tasks/not-an-id/requeue", op, None, 422),
        (f"{API}/tasks/01ARZ3NDEKTSV4RRFFQ69G5FAV/resolve", op, {"status": "DONE"}, 422),
        (f"{API}/tasks/01ARZ3NDEKTSV4RRFFQ69G5FAV/resolve", op, {"status": "RUNNING"}, 422),
        (f"{API}/stats", op, None, 405),
    ]
    for path, who, body, status in posts:
        r = await api.http.post(path, headers=who, json=body)
        assert r.status_code == status, (path, r.text)
        error_code(r)
    r = await api.http.get(
        f"{API}/tasks/01ARZ3NDEKTSV4RRFFQ69G5FAV/events", headers={**auth, "Last-Event-ID": "x"}
    )
    assert r.status_code == 422
    assert await _snapshot(redis_client) == before


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(data), 1000):
        yield data[start : start + 1000]


async def test_openapi_health_and_ready(api: Api) -> None:
    doc = (await api.http.get(f"{API}/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    assert {"/tasks", "/tasks/{id}", "/tasks/{id}/events", "/stats"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    assert "fence" not in schemas["Task"]["properties"]
    assert set(schemas["SubmitBody"]["required"]) == {"handler", "params", "tracking_timeout"}
    assert (await api.http.get("/healthz")).text == "ok\n"
    assert (await api.http.get("/readyz")).status_code == 200


# The event stream, with a real worker.


class Steps:
    """A handler that reports the progress steps given, then succeeds; each query waits
    until the test lets it go, so the test decides when the task moves."""

    idempotent_submit = False

    def __init__(self, progress: list[float]) -> None:
        self.progress = progress
        self.go = anyio.Event()

    async def submit(self, params: Any, ctx: HandlerContext) -> Submitted:
        return Submitted("x-" + ctx.task_id)

    async def query(self, handle: dict[str, Any], ctx: HandlerContext) -> Any:
        await self.go.wait()
        if self.progress:
            step = self.progress.pop(0)
            return Running(progress=step, stage=f"at {step}")
        return Succeeded({"ok": True})

    async def cancel(self, handle: dict[str, Any], ctx: HandlerContext) -> None:
        raise AssertionError("not canceled in these tests")


def _worker(store: Store, handler: Any, http: httpx.AsyncClient) -> Worker:
    config = parse_config(
        '[worker]\nlease = "2s"\nshutdown_grace = "5s"\n'
        '[retry]\npoll_interval = "20ms"\nfirst_error_delay = "20ms"\n'
        'max_error_delay = "200ms"\njitter = 0\n'
    )
    entry = {"demo": HandlerEntry(key="demo", handler=handler, provider="demo")}
    return Worker(store, entry, config, http=http)


async def _events(
    api: Api, task_id: str, auth: dict[str, str], last: int | None = None, upto: int = 1000
) -> AsyncIterator[dict[str, Any]]:
    """Each event of the stream as {"id", "event", "data"}; stops after `upto` events."""
    async for frame in event_frames(api.http, task_id, auth, last, upto):
        yield frame


async def event_frames(
    http: httpx.AsyncClient, task_id: str, auth: dict[str, str], last: int | None, upto: int
) -> AsyncIterator[dict[str, Any]]:
    """GET /tasks/{id}/events (from `Last-Event-ID` `last`): each event as {"id", "event",
    "data"}, until the stream ends or `upto` events came; keep-alive comments skipped."""
    headers = {**auth, **({"Last-Event-ID": str(last)} if last is not None else {})}
    async with http.stream("GET", f"{API}/tasks/{task_id}/events", headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        frame: dict[str, Any] = {}
        count = 0
        async for line in r.aiter_lines():
            if line == "":
                if "data" in frame:
                    frame["data"] = msgspec.json.decode(frame["data"])
                    yield frame
                    count += 1
                    if count == upto:
                        return
                frame = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(": ")
                frame[name] = value


async def test_event_stream_shows_every_state_through_succeeded(api: Api, store: Store) -> None:
    auth = await api.token("producer", "t1")
    task_id = (await api.submit(auth)).json()["id"]
    handler = Steps([0.25, 0.5, 0.75])
    seen: list[dict[str, Any]] = []
    first = anyio.Event()

    async def follow() -> None:
        async for event in _events(api, task_id, auth):
            seen.append(event)
            first.set()

    async with httpx.AsyncClient() as http, anyio.create_task_group() as tg:
        tg.start_soon(follow)
        await first.wait()  # subscribed and shown the current state: now let it run
        handler.go.set()
        with anyio.fail_after(30):
            await _worker(store, handler, http).run_until_idle()
    statuses = [e["data"]["status"] for e in seen]
    assert statuses[0] == "PENDING_SUBMIT" and statuses[-1] == "SUCCEEDED"
    assert "SUBMITTED" in statuses
    progress = [e["data"]["progress"] for e in seen if e["data"]["status"] == "RUNNING"]
    assert progress == [0.25, 0.5, 0.75]
    ids = [int(e["id"]) for e in seen]
    assert ids == sorted(set(ids)) and ids == [e["data"]["version"] for e in seen]
    assert all(e["event"] == "task" for e in seen)


async def test_reconnect_with_last_event_id_misses_nothing(api: Api, store: Store) -> None:
    auth = await api.token("viewer", "t1")
    producer = await api.token("producer", "t1")
    task_id = (await api.submit(producer)).json()["id"]
    handler = Steps([0.5])
    first = [e async for e in _events(api, task_id, auth, upto=1)]
    assert first[0]["data"]["status"] == "PENDING_SUBMIT"
    last = int(first[0]["id"])
    handler.go.set()  # the task runs to the end while no one watches
    async with httpx.AsyncClient() as http:
        with anyio.fail_after(30):
            await _worker(store, handler, http).run_until_idle()
    rest = [e async for e in _events(api, task_id, auth, last=last)]
    assert rest and all(int(e["id"]) > last for e in rest)
    # Every state it went through while no one watched, in order: replayed from the
    # events stream, not folded into the current one.
    shown = [(e["data"]["status"], e["data"]["progress"]) for e in rest]
    assert shown == [("SUBMITTING", None), ("SUBMITTED", None), ("RUNNING", 0.5),
                     ("SUCCEEDED", None)]  # fmt: skip
    final = await api.client.get(task_id)
    assert final is not None and int(rest[-1]["id"]) == final.version
    # Where the stream was trimmed past what the client had, the current state stands in
    # for what cannot be replayed.
    await api.redis.xtrim("atd:{s0}:events", maxlen=0)
    folded = [e async for e in _events(api, task_id, auth, last=last)]
    assert [(e["id"], e["data"]["status"]) for e in folded] == [(rest[-1]["id"], "SUCCEEDED")]
    # Reconnecting after the last event: 204 tells an EventSource to stop.
    r = await api.http.get(
        f"{API}/tasks/{task_id}/events", headers={**auth, "Last-Event-ID": rest[-1]["id"]}
    )
    assert r.status_code == 204


async def test_an_idle_stream_gets_keepalive_comments(api: Api) -> None:
    auth = await api.token("producer", "t1")
    task_id = (await api.submit(auth)).json()["id"]  # nobody runs it: the stream stays idle
    url = f"{API}/tasks/{task_id}/events"
    with anyio.fail_after(10):
        async with api.http.stream("GET", url, headers=auth) as r:
            assert r.headers["Cache-Control"] == "no-store"
            assert r.headers["X-Accel-Buffering"] == "no"
            async for line in r.aiter_lines():
                if line.startswith(": keep-alive"):
                    break


async def test_reconnect_mid_run_resumes_after_the_last_event(api: Api, store: Store) -> None:
    auth = await api.token("producer", "t1")
    task_id = (await api.submit(auth)).json()["id"]
    handler = Steps([0.3, 0.6])
    seen: list[dict[str, Any]] = []
    async with httpx.AsyncClient() as http, anyio.create_task_group() as tg:
        worker = _worker(store, handler, http)
        tg.start_soon(worker.run_until_idle)
        # Follow until the first progress event, then drop the connection.
        async with contextlib.aclosing(_events(api, task_id, auth)) as events:
            async for event in events:
                seen.append(event)
                handler.go.set()  # subscribed: the queries may answer now
                if event["data"]["status"] == "RUNNING":
                    break
        resumed = [e async for e in _events(api, task_id, auth, last=int(seen[-1]["id"]))]
    assert resumed[0]["id"] != seen[-1]["id"]
    progress = [e["data"]["progress"] for e in seen + resumed if e["data"]["progress"]]
    assert progress == [0.3, 0.6]  # each step once, none lost at the reconnect
    assert [e["data"]["status"] for e in resumed][-1] == "SUCCEEDED"
    ids = [int(e["id"]) for e in seen + resumed]
    assert ids == sorted(set(ids))  # no duplicate, nothing out of order


# Import direction.


@pytest.mark.parametrize(
    "module", ["asynctaskd", "asynctaskd.client", "asynctaskd.daemon", "asynctaskd.cli"]
)
def test_nothing_but_the_web_command_loads_the_web_package(module: str) -> None:
    loaded = "[m for m in sys.modules if m.startswith('asynctaskd.web')]"
    code = f"import sys, {module}; print({loaded})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


# The Redis user docs/api.md gives the web process: the producer's, plus the tokens hash.


async def test_the_producer_acl_user_plus_the_tokens_hash_serves_the_api(
    redis_client: redis.asyncio.Redis, redis_url: str, store: Store
) -> None:
    from tests.acl import acl_rules, user_url

    rules = [*acl_rules("asynctaskd-producer", "pw-web"), "%R~atd:web:tokens"]
    try:
        await redis_client.execute_command("ACL", "SETUSER", "asynctaskd-web", *rules)
    except redis.exceptions.ResponseError:  # Redis 7.0 does not know it (tests/acl.py)
        rules.remove("+client|setinfo")
        await redis_client.execute_command("ACL", "SETUSER", "asynctaskd-web", *rules)
    conn = redis.asyncio.Redis.from_url(user_url(redis_url, "asynctaskd-web", "pw-web"))
    runner = web.AppRunner(make_app(AsyncClient(conn, "atd"), WebSettings()), access_log=None)
    try:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            api = Api(url, http, redis_client, AsyncClient(redis_client, "atd"))
            auth = await api.token("producer", "t1")
            r = await api.submit({**auth, "Idempotency-Key": "k1"})
            assert r.status_code == 201, r.text
            task_id = r.json()["id"]
            assert (await api.submit({**auth, "Idempotency-Key": "k1"})).status_code == 200
            await ingest(store)
            assert (await http.get(f"{API}/tasks/{task_id}", headers=auth)).status_code == 200
            listed = (await http.get(f"{API}/tasks", headers=auth)).json()["tasks"]
            assert [t["id"] for t in listed] == [task_id]
            events = [e async for e in _events(api, task_id, auth, last=0, upto=1)]
            assert events[0]["data"]["status"] == "PENDING_SUBMIT"
            r = await http.post(f"{API}/tasks/{task_id}/cancel", headers=auth)
            assert r.status_code == 202
            assert (await http.get("/readyz")).status_code == 200
            # an operator route needs the operators' Redis user: said as such, nothing written
            op = await api.token("operator")
            r = await http.post(f"{API}/pause", headers=op, json={"tenant": "t1"})
            assert r.status_code == 503 and error_code(r) == "redis_not_permitted", r.text
            assert "operators' Redis user" in r.json()["error"]["message"]
            assert await api.client.paused() == {}
    finally:
        await runner.cleanup()
        await conn.aclose()
        await redis_client.execute_command("ACL", "DELUSER", "asynctaskd-web")


async def test_without_redis_answers_are_503_and_not_ready() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conn = redis.asyncio.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
    runner = web.AppRunner(make_app(AsyncClient(conn, "atd"), WebSettings()), access_log=None)
    try:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        token, _ = mint("producer", "t1")
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.get(f"{API}/tasks", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 503 and error_code(r) == "store_unavailable"
            ready = await http.get("/readyz")
            assert ready.status_code == 503 and "Redis unreachable" in ready.text
            assert (await http.get("/healthz")).status_code == 200
    finally:
        await runner.cleanup()
        await conn.aclose()


# Configuration.


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[web]\nlisten = "8080"', "web.listen"),
        ("[web]\nmax_body = 10", "web.max_body"),
        ('[web]\ntoken_cache = "1h"', "web.token_cache"),
        ('[web]\nkeepalive = "0s"', "web.keepalive"),
        ("[web]\nport = 8080", "port"),
    ],
)
def test_a_bad_web_section_is_refused_naming_the_key(text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(text)


def test_the_web_section_defaults_to_loopback() -> None:
    web_config = parse_config("").web
    assert web_config.listen == "127.0.0.1:8080" and web_config.max_body == 1024 * 1024


# Operators' runtime controls: pause, limits, groups, purge.


async def test_pause_and_resume(api: Api) -> None:
    op = await api.token("operator")
    r = await api.http.post(f"{API}/pause", headers=op, json={"tenant": "t1", "note": "vendor"})
    assert r.status_code == 200 and r.json() == {"dimension": "tenant:t1", "newly_paused": True}
    again = await api.http.post(f"{API}/pause", headers=op, json={"tenant": "t1"})
    assert again.json()["newly_paused"] is False
    assert "tenant:t1" in await api.client.paused()
    r = await api.http.get(f"{API}/pause", headers=op)
    assert r.status_code == 200 and r.json()["paused"]["tenant:t1"]["note"] == "vendor"
    r = await api.http.post(f"{API}/resume", headers=op, json={"tenant": "t1"})
    assert r.status_code == 200 and r.json() == {"dimension": "tenant:t1", "moved": 0}
    assert await api.client.paused() == {}


async def test_limits_set_show_and_clear(api: Api) -> None:
    op = await api.token("operator")
    body = {"provider": "openai", "submit_rate": 5, "quota_period": "1h", "note": "n"}
    r = await api.http.put(f"{API}/limits", headers=op, json=body)  # a period, no quota
    assert r.status_code == 422 and "quota_period applies to a quota" in r.text
    assert await api.client.limits() == {}
    del body["quota_period"]
    r = await api.http.put(f"{API}/limits", headers=op, json=body)
    assert r.status_code == 200, r.text
    entry = r.json()
    assert entry["scope"] == "provider:openai" and entry["source"] == "runtime"
    assert entry["limit"]["submit_rate"] == 5 and entry["limit"]["note"] == "n"
    assert (await api.client.limits())["provider:openai"].limit.submit_rate == 5
    r = await api.http.get(f"{API}/limits", headers=op)
    assert [e["scope"] for e in r.json()["limits"]] == ["provider:openai"]
    r = await api.http.delete(f"{API}/limits", headers=op, params={"scope": "provider:openai"})
    assert r.status_code == 200 and r.json() == {"scope": "provider:openai", "cleared": True}
    r = await api.http.delete(f"{API}/limits", headers=op, params={"scope": "provider:openai"})
    assert r.status_code == 404 and error_code(r) == "not_found"
    assert await api.client.limits() == {}


async def test_groups_define_read_and_delete(api: Api) -> None:
    op = await api.token("operator")
    body = {"policy": "weighted", "members": ["a", {"handler": "b", "weight": 3}]}
    r = await api.http.put(f"{API}/groups/g1", headers=op, json=body)
    assert r.status_code == 200, r.text
    shown = {"name": "g1", "policy": "weighted",
             "members": [{"handler": "a", "weight": 1}, {"handler": "b", "weight": 3}]}  # fmt: skip
    assert r.json() == shown
    assert (await api.client.groups())["g1"].policy == "weighted"
    assert (await api.http.get(f"{API}/groups/g1", headers=op)).json() == shown
    assert (await api.http.get(f"{API}/groups", headers=op)).json() == {"groups": [shown]}
    assert (await api.http.delete(f"{API}/groups/g1", headers=op)).status_code == 204
    r = await api.http.delete(f"{API}/groups/g1", headers=op)
    assert r.status_code == 404 and error_code(r) == "not_found"
    assert (await api.http.get(f"{API}/groups/g1", headers=op)).status_code == 404


async def test_purge_deletes_finished_tasks(api: Api, store: Store) -> None:
    producer, op = await api.token("producer", "t1"), await api.token("operator")
    task_id = (await api.submit(producer)).json()["id"]
    live_id = (await api.submit(producer)).json()["id"]
    await api.http.post(f"{API}/tasks/{task_id}/cancel", headers=producer)
    await ingest(store)
    r = await api.http.post(f"{API}/purge", headers=op, json={"older_than": 0, "limit": 10})
    assert r.status_code == 200 and r.json() == {"purged": 1}
    assert await api.client.get(task_id) is None and await api.client.get(live_id) is not None


_OPERATOR_CALLS: list[tuple[str, str, Any]] = [
    ("GET", "/pause", None),
    ("POST", "/pause", {"tenant": "t1"}),
    ("POST", "/resume", {"tenant": "t1"}),
    ("GET", "/limits", None),
    ("PUT", "/limits", {"provider": "openai", "submit_rate": 5}),
    ("DELETE", "/limits?scope=provider:openai", None),
    ("GET", "/groups", None),
    ("GET", "/groups/g1", None),
    ("PUT", "/groups/g1", {"policy": "round_robin", "members": ["a"]}),
    ("DELETE", "/groups/g1", None),
    ("POST", "/purge", {"older_than": 0}),
]


async def test_operator_controls_refuse_other_roles_and_bad_input_writing_nothing(
    api: Api, redis_client: redis.asyncio.Redis
) -> None:
    op = await api.token("operator")
    producer, viewer = await api.token("producer", "t1"), await api.token("viewer", "t1")
    python = api.client
    bad: list[tuple[str, str, Any, Any]] = [
        # (method, path, body, the client's call that refuses the same input)
        ("POST", "/pause", {}, lambda: python.pause()),
        ("POST", "/pause", {"tenant": "t1", "handler": "h"},
         lambda: python.pause(tenant="t1", handler="h")),
        ("POST", "/pause", {"tenant": "no spaces"}, lambda: python.pause(tenant="no spaces")),
        ("POST", "/pause", {"tenant": "t1", "note": "n" * 201},
         lambda: python.pause(tenant="t1", note="n" * 201)),
        ("POST", "/resume", {"provider": "a b"}, lambda: python.resume(provider="a b")),
        ("PUT", "/limits", {"provider": "p", "submit_rate": -1},
         lambda: python.set_limit(provider="p", submit_rate=-1)),
        ("PUT", "/limits", {"provider": "p", "speed": 1},
         lambda: python.set_limit(provider="p", speed=1)),
        ("PUT", "/limits", {}, lambda: python.set_limit()),
        ("DELETE", "/limits?scope=nowhere", None, lambda: python.clear_limit("nowhere")),
        ("PUT", "/groups/g1", {"policy": "random", "members": ["a"]},
         lambda: python.set_group("g1", "random", ["a"])),
        ("PUT", "/groups/g1", {"policy": "weighted", "members": [{"handler": "a", "weight": 0}]},
         lambda: python.set_group("g1", "weighted", [("a", 0)])),
        ("PUT", "/groups/no%20spaces", {"policy": "round_robin", "members": ["a"]},
         lambda: python.set_group("no spaces", "round_robin", ["a"])),
        ("POST", "/purge", {"older_than": -1}, lambda: python.purge(-1)),
        ("POST", "/purge", {"older_than": 0, "limit": 0}, lambda: python.purge(0, limit=0)),
    ]  # fmt: skip
    before = await _snapshot(redis_client)
    for method, path, body in _OPERATOR_CALLS:
        for who in (producer, viewer):
            r = await api.http.request(method, API + path, headers=who, json=body)
            assert (r.status_code, error_code(r)) == (403, "forbidden"), (method, path, r.text)
        r = await api.http.request(method, API + path, json=body)
        assert r.status_code == 401, (method, path)
    for method, path, body, call in bad:
        with pytest.raises(InvalidTask) as raised:
            await call()
        r = await api.http.request(method, API + path, headers=op, json=body)
        assert (r.status_code, error_code(r)) == (422, "invalid"), (method, path, r.text)
        assert r.json()["error"]["message"] == str(raised.value), (method, path)
    typed: list[tuple[str, str, Any]] = [
        ("POST", "/pause", {"tenant": 5}),
        ("POST", "/pause", {"tenant": "t1", "why": "x"}),
        ("POST", "/resume", {"tenant": "t1", "note": "x"}),
        ("PUT", "/limits", ["provider"]),
        ("PUT", "/groups/g1", {"policy": "round_robin"}),
        ("PUT", "/groups/g1", {"policy": "round_robin", "members": [{"handler": "a", "w": 1}]}),
        ("POST", "/purge", {"older_than": "old"}),
        ("DELETE", "/limits", None),
        ("DELETE", "/limits?scope=tenant:t1&x=1", None),
    ]
    for method, path, body in typed:
        r = await api.http.request(method, API + path, headers=op, json=body)
        assert (r.status_code, error_code(r)) == (422, "invalid"), (method, path, r.text)
    r = await api.http.request("POST", f"{API}/pause", headers=op, content=b"{")
    assert r.status_code == 415
    assert await _snapshot(redis_client) == before


def test_the_limit_body_documents_every_field_of_a_limits_table() -> None:
    from asynctaskd.config.tables import LimitConfig
    from asynctaskd.web.schemas import LimitBody

    assert LimitBody.__struct_fields__ == LimitConfig.__struct_fields__


# Bulk actions by filter.


async def _fail_all(store: Store, n: int) -> None:
    """Claim `n` submits and save each as FAILED (as a worker would)."""
    batch = await store.claim(0, "submit", n, 30_000, "w1")
    assert len(batch.claimed) == n, batch
    for claimed in batch.claimed:
        assert (await store.save(claimed.lease, Status.FAILED)).ok


async def _bulk(api: Api, auth: dict[str, str], **body: Any) -> httpx.Response:
    return await api.http.post(f"{API}/tasks/bulk", headers=auth, json=body)


async def test_bulk_requeue_counts_first_then_acts_within_the_limit(
    api: Api, store: Store, redis_client: redis.asyncio.Redis
) -> None:
    p1, p2 = await api.token("producer", "t1"), await api.token("producer", "t2")
    op = await api.token("operator")
    for auth in (p1, p1, p1, p2):
        assert (await api.submit(auth)).status_code == 201
    await ingest(store)
    await _fail_all(store, 4)
    before = await _snapshot(redis_client)
    r = await _bulk(api, op, action="requeue", filter={"tenant": "t1"}, dry_run=True)
    assert r.status_code == 200 and r.json()["matched"] == 3 and r.json()["acted"] is None
    r = await _bulk(api, op, action="requeue", filter={"status": "FAILED"}, dry_run=True)
    assert r.json()["matched"] == 4
    assert await _snapshot(redis_client) == before  # a dry run writes nothing
    r = await _bulk(api, op, action="requeue", filter={"tenant": "t1"}, limit=2)
    assert r.status_code == 200, r.text
    assert {k: r.json()[k] for k in ("matched", "capped", "acted", "failed")} == {
        "matched": 2, "capped": True, "acted": 2, "failed": 0,
    }  # fmt: skip
    page = await api.client.list(status="FAILED")
    assert sorted(t.tenant for t in page.tasks) == ["t1", "t2"]
    r = await _bulk(api, op, action="requeue", filter={"status": "CANCELED"})
    assert r.status_code == 422 and "FAILED, TRACKING_TIMED_OUT" in r.json()["error"]["message"]


async def test_bulk_cancel_respects_roles_and_tenants(
    api: Api, store: Store, redis_client: redis.asyncio.Redis
) -> None:
    p1, p2 = await api.token("producer", "t1"), await api.token("producer", "t2")
    viewer, op = await api.token("viewer", "t1"), await api.token("operator")
    mine = [(await api.submit(p1)).json()["id"] for _ in range(3)]
    theirs = (await api.submit(p2)).json()["id"]
    await ingest(store)
    before = await _snapshot(redis_client)
    refused = [
        (viewer, {"action": "cancel"}, 403),
        (viewer, {"action": "cancel", "dry_run": True}, 403),
        (p1, {"action": "requeue", "dry_run": True}, 403),
        (p1, {"action": "cancel", "filter": {"tenant": "t2"}}, 403),
        (p1, {"action": "cancel", "filter": {"tenant": "t2"}, "dry_run": True}, 403),
        ({}, {"action": "cancel"}, 401),
        (op, {"action": "delete"}, 422),
        (op, {"action": "cancel", "filter": {"status": "DONE"}}, 422),
        (op, {"action": "cancel", "filter": {"status": "SUCCEEDED"}}, 422),
        (op, {"action": "cancel", "filter": {"owner": "x"}}, 422),
        (op, {"action": "cancel", "limit": 0}, 422),
        (op, {"action": "cancel", "limit": 10_001}, 422),
        (op, {"action": "cancel", "dry_run": "yes"}, 422),
    ]
    for who, body, status in refused:
        r = await api.http.post(f"{API}/tasks/bulk", headers=who, json=body)
        assert r.status_code == status, (body, r.text)
        error_code(r)
    assert await _snapshot(redis_client) == before
    r = await _bulk(api, p1, action="cancel", dry_run=True)
    assert r.json()["matched"] == 3  # only its own tenant's, without naming it
    assert await _snapshot(redis_client) == before
    r = await _bulk(api, p1, action="cancel", filter={"tenant": "t1", "handler": "demo"})
    assert r.status_code == 200 and (r.json()["acted"], r.json()["failed"]) == (3, 0)
    await ingest(store)
    for task_id in mine:
        task = await api.client.get(task_id)
        assert task is not None and task.status is Status.CANCELED
    other = await api.client.get(theirs)
    assert other is not None and other.status is Status.PENDING_SUBMIT
    r = await _bulk(api, op, action="cancel", dry_run=True)
    assert r.json()["matched"] == 1
    r = await _bulk(api, op, action="cancel")
    assert (r.json()["matched"], r.json()["acted"]) == (1, 1)


# Per-token request rates.


async def test_a_token_over_its_rate_gets_429_and_writes_nothing(
    api: Api, redis_client: redis.asyncio.Redis
) -> None:
    token, record = mint("producer", "t1", rate=0.01, burst=2)  # 1 per 100 s after 2
    await api.redis.hset(tokens_key("atd"), record.id, msgspec.json.encode(record))
    limited = {"Authorization": f"Bearer {token}"}
    free = await api.token("producer", "t1")
    assert (await api.submit(limited)).status_code == 201
    assert (await api.http.get(f"{API}/tasks", headers=limited)).status_code == 200
    before = await _snapshot(redis_client)
    r = await api.submit(limited)
    assert r.status_code == 429 and error_code(r) == "rate_limited"
    assert 1 <= int(r.headers["Retry-After"]) <= 100
    assert "0.01 requests per second" in r.json()["error"]["message"]
    assert await _snapshot(redis_client) == before
    assert (await api.http.get(f"{API}/tasks", headers=limited)).status_code == 429
    assert (await api.http.get(f"{API}/tasks", headers=free)).status_code == 200  # per token


async def test_a_burst_with_one_token_reads_its_record_once(
    redis_client: redis.asyncio.Redis,
) -> None:
    token, record = mint("viewer", "t1")
    await redis_client.hset(tokens_key("atd"), record.id, msgspec.json.encode(record))
    cache = TokenCache(redis_client, "atd", ttl=60)

    async def hgets() -> int:
        stats = await redis_client.info("commandstats")
        return int(stats.get("cmdstat_hget", {}).get("calls", 0))

    before = await hgets()
    checked = await asyncio.gather(*(cache.check(token) for _ in range(50)))
    assert checked == [record] * 50
    assert await hgets() - before == 1  # one read for the burst, not one per request
    wrong = token[:-1] + ("A" if token[-1] != "A" else "B")
    assert await cache.check(wrong) is None  # the secret is still checked on each use


def test_the_rate_limiter_refills_at_the_rate() -> None:
    from asynctaskd.web.tokens import RateLimiter

    _, record = mint("viewer", "t1", rate=0.5, burst=1)
    limiter = RateLimiter()
    assert limiter.take(record) == 0.0
    assert 0 < limiter.take(record) <= 2.0
    limiter._buckets[record.id] = (0.0, time.monotonic() - 2.0)  # as if 2 s had passed
    assert limiter.take(record) == 0.0
    _, unlimited = mint("viewer", "t1")
    assert all(limiter.take(unlimited) == 0.0 for _ in range(100))
    with pytest.raises(ValueError, match="burst needs a rate"):
        mint("viewer", "t1", burst=3)
