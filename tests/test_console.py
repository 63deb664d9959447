"""The console's routes without a browser: login and sessions, CSRF, roles and tenants,
bad input, the audit stream, the browser and find reads, the overview. A real aiohttp
server on a free loopback port, the test Redis behind it, httpx in front (it keeps the
session cookie as a browser would)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
import redis.asyncio
import redis.exceptions
from aiohttp import web

from asynctaskd.client import AsyncClient
from asynctaskd.keys import Keys
from asynctaskd.model import Status
from asynctaskd.store import Code, Store, open_redis
from asynctaskd.web import WebSettings, make_app
from asynctaskd.web.console import browse
from asynctaskd.web.console.audit import audit_key
from asynctaskd.web.tokens import Role, mint, tokens_key
from tests.acl import create_user, user_url
from tests.lua.helpers import claim_one, ingest, submitted

pytestmark = pytest.mark.anyio

API = "/api/v1"
CON = "/console/api"


class Console(msgspec.Struct):
    url: str
    redis: redis.asyncio.Redis
    client: AsyncClient

    async def token(self, role: Role, tenant: str | None = None, note: str = "") -> str:
        token, record = mint(role, tenant, note)
        await self.redis.hset(tokens_key("atd"), record.id, msgspec.json.encode(record))
        return token

    def browser(self) -> httpx.AsyncClient:
        """A client of its own: its own cookie jar, as another browser."""
        return httpx.AsyncClient(base_url=self.url, timeout=10)

    async def login(self, http: httpx.AsyncClient, role: Role, tenant: str | None = None,
                    note: str = "") -> dict[str, Any]:  # fmt: skip
        r = await http.post(f"{CON}/login", json={"token": await self.token(role, tenant, note)})
        assert r.status_code == 200, r.text
        return dict(r.json())


@contextlib.asynccontextmanager
async def served(redis_client: redis.asyncio.Redis, conn: Any = None) -> AsyncIterator[Console]:
    """The web app on a free port, talking to Redis over `conn` (another ACL user's
    connection; closed after) or `redis_client`; the test's own reads and tokens go
    through `redis_client`."""
    own = AsyncClient(redis_client, "atd")
    app_client = own if conn is None else AsyncClient(conn, "atd")
    runner = web.AppRunner(make_app(app_client, WebSettings(token_cache=0.05)), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield Console(f"http://127.0.0.1:{runner.addresses[0][1]}", redis_client, own)
    finally:
        await runner.cleanup()
        if conn is not None:
            await conn.aclose()


@pytest.fixture
async def console(redis_client: redis.asyncio.Redis) -> AsyncIterator[Console]:
    async with served(redis_client) as c:
        yield c


async def submit(client: AsyncClient, n: int = 1, **kw: Any) -> list[str]:
    return [(await client.submit("demo", {"i": i}, tracking_timeout=60, strict=False, **kw)).id
            for i in range(n)]  # fmt: skip


def code(r: httpx.Response) -> str:
    return str(r.json()["error"]["code"])


async def test_the_page_and_its_files_are_served_with_a_strict_policy(console: Console) -> None:
    async with console.browser() as http:
        r = await http.get("/")
        assert r.status_code == 200 and "console.js" in r.text
        assert "default-src 'self'" in r.headers["Content-Security-Policy"]
        assert r.headers["X-Frame-Options"] == "DENY"
        for name in ("console.js", "console.css"):
            assert (await http.get(f"/console/static/{name}")).status_code == 200
        assert (await http.get("/console/static/../app.py")).status_code in (403, 404)


async def test_login_sets_a_strict_httponly_cookie_and_logout_ends_it(console: Console) -> None:
    async with console.browser() as http:
        me = await console.login(http, "operator", note="alice")
        assert me["role"] == "operator" and me["note"] == "alice" and len(me["csrf"]) > 30
        r = await http.get(f"{CON}/session")
        assert r.status_code == 200 and r.json()["csrf"] == me["csrf"]
        cookie = r.request.headers["Cookie"]
        assert cookie.startswith("atd_console=")
        # The cookie's attributes, as the login set them.
        raw = await http.post(f"{CON}/login", json={"token": await console.token("viewer", "t")})
        header = raw.headers["Set-Cookie"].lower()
        assert "httponly" in header and "samesite=strict" in header and "path=/" in header
        assert "secure" not in header.replace("samesite", "")  # plain HTTP: no Secure
        me = raw.json()
        # Redis keeps the session under a hash of its id, never the id itself.
        session_id = http.cookies["atd_console"]
        stored = [k async for k in console.redis.scan_iter("atd:web:session:*")]
        assert len(stored) == 2 and all(session_id.encode() not in k for k in stored)
        r = await http.post(f"{CON}/logout")  # without the CSRF header
        assert r.status_code == 403 and code(r) == "csrf"
        r = await http.post(f"{CON}/logout", headers={"X-CSRF-Token": me["csrf"]})
        assert r.status_code == 204
        assert len([k async for k in console.redis.scan_iter("atd:web:session:*")]) == 1
        http.cookies.set("atd_console", session_id)  # a copy of the ended cookie
        r = await http.get(f"{CON}/session")
        assert r.status_code == 401


async def test_the_cookie_is_secure_behind_a_tls_proxy(console: Console) -> None:
    async with console.browser() as http:
        token = await console.token("operator")
        r = await http.post(f"{CON}/login", json={"token": token},
                            headers={"X-Forwarded-Proto": "https"})  # fmt: skip
        assert "; secure" in r.headers["Set-Cookie"].lower()


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        ({"token": "atd_0000000000000000_" + "x" * 43}, 401, "unauthorized"),
        ({"token": "nonsense"}, 401, "unauthorized"),
        ({"token": 5}, 422, "invalid"),
        ({}, 422, "invalid"),
        ({"token": "x", "extra": 1}, 422, "invalid"),
    ],
)
async def test_login_refuses_bad_tokens(
    console: Console, body: dict[str, Any], status: int, error: str
) -> None:
    async with console.browser() as http:
        r = await http.post(f"{CON}/login", json=body)
        assert r.status_code == status and code(r) == error
        assert "Set-Cookie" not in r.headers


async def test_a_producer_token_cannot_log_in(console: Console) -> None:
    async with console.browser() as http:
        r = await http.post(f"{CON}/login", json={"token": await console.token("producer", "t")})
        assert r.status_code == 403 and "viewer or operator" in r.json()["error"]["message"]
        r = await http.post(f"{CON}/login", content=b'{"token": "x"}')  # not JSON typed
        assert r.status_code == 415


async def test_every_change_through_the_session_needs_the_csrf_header(console: Console) -> None:
    [task_id] = await submit(console.client)
    async with console.browser() as http:
        me = await console.login(http, "operator")
        for path, body in [
            (f"{API}/tasks/{task_id}/cancel", None),
            (f"{API}/pause", {"handler": "demo"}),
            (f"{API}/tasks/bulk", {"action": "cancel", "dry_run": True}),
        ]:
            for headers in ({}, {"X-CSRF-Token": "wrong"}):
                r = await http.post(path, json=body, headers=headers)
                assert r.status_code == 403 and code(r) == "csrf", (path, r.text)
        assert (await console.client.paused()) == {}
        task = await console.client.get(task_id)
        assert task is not None and not task.cancel_requested
        # Reads need no CSRF token; with it, the change goes through.
        assert (await http.get(f"{API}/tasks/{task_id}")).status_code == 200
        r = await http.post(f"{API}/pause", json={"handler": "demo"},
                            headers={"X-CSRF-Token": me["csrf"]})  # fmt: skip
        assert r.status_code == 200 and "handler:demo" in await console.client.paused()


async def test_a_bearer_token_beside_a_cookie_is_what_counts(console: Console) -> None:
    async with console.browser() as http:
        await console.login(http, "operator")
        viewer = await console.token("viewer", "t1")
        r = await http.get(f"{API}/stats", headers={"Authorization": f"Bearer {viewer}"})
        assert r.status_code == 403  # the viewer's token, not the operator's session


async def test_a_revoked_token_ends_its_sessions(console: Console) -> None:
    async with console.browser() as http:
        token = await console.token("operator")
        assert (await http.post(f"{CON}/login", json={"token": token})).status_code == 200
        assert (await http.get(f"{CON}/overview")).status_code == 200
        await console.redis.hdel(tokens_key("atd"), token.split("_")[1])
        r = await http.get(f"{CON}/overview")
        while r.status_code == 200:  # the token cache (50 ms here) still trusts it
            r = await http.get(f"{CON}/overview")
        assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]


async def test_a_viewer_sees_its_tenant_and_acts_on_nothing(console: Console, store: Store) -> None:
    mine = await submit(console.client, 2, tenant="t1")
    [theirs] = await submit(console.client, tenant="t2")
    await ingest(store)  # a daemon's take-in puts them in the status indexes
    async with console.browser() as http:
        me = await console.login(http, "viewer", "t1")
        csrf = {"X-CSRF-Token": me["csrf"]}
        page = (await http.get(f"{CON}/tasks")).json()
        assert sorted(t["id"] for t in page["tasks"]) == sorted(mine)
        r = await http.get(f"{CON}/tasks", params={"tenant": "t2"})
        assert r.status_code == 403
        assert (await http.get(f"{CON}/tasks/{theirs}")).status_code == 404
        r = await http.get(f"{CON}/find", params={"by": "id", "q": theirs})
        assert r.status_code == 200 and r.json()["tasks"] == []
        detail = (await http.get(f"{CON}/tasks/{mine[0]}")).json()
        assert detail["actions"] is None and "fence" not in detail["task"]
        for path in ("/overview", "/audit"):
            assert (await http.get(CON + path)).status_code == 403
        for path, body in [
            (f"{API}/tasks/{mine[0]}/cancel", None),
            (f"{API}/tasks/{mine[0]}/resolve", {"status": "FAILED"}),
            (f"{API}/pause", {"handler": "demo"}),
            (f"{API}/tasks/bulk", {"action": "cancel", "dry_run": True}),
        ]:
            r = await http.post(path, json=body, headers=csrf)
            assert r.status_code == 403 and code(r) == "forbidden", path
        task = await console.client.get(mine[0])
        assert task is not None and not task.cancel_requested


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({"status": "DONE"}, "status must be one of"),
        ({"limit": "0"}, "limit must be"),
        ({"limit": "x"}, "limit must be"),
        ({"since": "yesterday"}, "since must be epoch seconds"),
        ({"since": "20", "until": "10"}, "since must not be after until"),
        ({"cursor": "garbage"}, "cursor"),
        ({"colour": "red"}, "unknown query parameter"),
    ],
)
async def test_the_browser_refuses_bad_filters(
    console: Console, query: dict[str, str], message: str
) -> None:
    async with console.browser() as http:
        await console.login(http, "operator")
        r = await http.get(f"{CON}/tasks", params=query)
        assert r.status_code == 422 and message in r.json()["error"]["message"], r.text


async def test_browse_pages_filters_and_time_ranges(console: Console, store: Store) -> None:
    ids = await submit(console.client, 7, account="acc1")
    others = await submit(console.client, 3, account="acc2")
    await ingest(store)
    async with console.browser() as http:
        await console.login(http, "operator")
        seen: list[str] = []
        params: dict[str, str] = {"status": "PENDING_SUBMIT", "account": "acc1", "limit": "3"}
        while True:
            page = (await http.get(f"{CON}/tasks", params=params)).json()
            seen += [t["id"] for t in page["tasks"]]
            if page["cursor"] is None:
                break
            params["cursor"] = page["cursor"]
        assert sorted(seen) == sorted(ids) and len(seen) == len(set(seen))
        # A cursor is bound to its filters.
        r = await http.get(f"{CON}/tasks", params={**params, "account": "acc2"})
        assert r.status_code == 422
        # Another session cannot use this session's cursor.
        async with console.browser() as other:
            await console.login(other, "operator")
            r = await other.get(f"{CON}/tasks", params=params)
            assert r.status_code == 422
        entered = await console.redis.zrange(Keys().index(0, Status.PENDING_SUBMIT), 0, -1,
                                             withscores=True)  # fmt: skip
        times = sorted({int(s) for _, s in entered})
        r = await http.get(f"{CON}/tasks", params={"since": str((times[-1] + 1) / 1000)})
        assert r.json()["tasks"] == []
        r = await http.get(f"{CON}/tasks", params={"until": str(times[-1] / 1000),
                                                   "since": str(times[0] / 1000)})  # fmt: skip
        assert sorted(t["id"] for t in r.json()["tasks"]) == sorted(ids + others)


async def test_find_by_id_dedup_key_external_id_and_metadata(
    console: Console, store: Store
) -> None:
    [deduped] = [(await console.client.submit("demo", {}, tracking_timeout=60, strict=False,
                                              dedup_key="order-9", tenant="t1")).id]  # fmt: skip
    [tagged] = await submit(console.client, metadata={"order": 42, "who": "ann"})
    await submit(console.client, 5)
    await ingest(store)
    claimed = await claim_one(store)  # the oldest: the dedup one
    await store.start(claimed.lease, False)
    await console.redis.hset(Keys().task(0, claimed.lease.task_id), "external_id", "job-77")
    async with console.browser() as http:
        await console.login(http, "operator")

        async def found(by: str, q: str, **extra: str) -> list[str]:
            r = await http.get(f"{CON}/find", params={"by": by, "q": q, **extra})
            assert r.status_code == 200, r.text
            return [t["id"] for t in r.json()["tasks"]]

        assert await found("id", tagged) == [tagged]
        assert await found("dedup_key", "order-9", tenant="t1") == [deduped]
        assert await found("dedup_key", "order-9") == []  # another tenant's key
        assert await found("external_id", "job-77") == [claimed.lease.task_id]
        assert await found("external_id", "job-78") == []
        assert await found("metadata", "order=42") == [tagged]
        assert await found("metadata", "who=ann") == [tagged]
        assert await found("metadata", "who=bob") == []
        for params in ({"by": "colour", "q": "x"}, {"by": "metadata", "q": "noequals"},
                       {"by": "id", "q": ""}, {"by": "id", "q": "x", "start": "-1"}):  # fmt: skip
            assert (await http.get(f"{CON}/find", params=params)).status_code == 422


async def test_operator_actions_are_audited_with_who_and_how(
    console: Console, store: Store
) -> None:
    [task_id] = await submit(console.client)
    await ingest(store)
    async with console.browser() as http:
        me = await console.login(http, "operator", note="alice")
        csrf = {"X-CSRF-Token": me["csrf"]}
        assert (await http.post(f"{API}/pause", json={"handler": "demo", "note": "vendor down"},
                                headers=csrf)).status_code == 200  # fmt: skip
        assert (await http.post(f"{API}/resume", json={"handler": "demo"},
                                headers=csrf)).status_code == 200  # fmt: skip
    bearer = await console.token("operator", note="cron")
    async with console.browser() as http:
        r = await http.post(f"{API}/tasks/{task_id}/cancel",
                            headers={"Authorization": f"Bearer {bearer}"})  # fmt: skip
        assert r.status_code == 202
        # A refused action writes nothing.
        r = await http.post(f"{API}/tasks/{task_id}/requeue",
                            headers={"Authorization": f"Bearer {bearer}"})  # fmt: skip
        assert r.status_code == 409
    async with console.browser() as http:
        await console.login(http, "operator")
        entries = (await http.get(f"{CON}/audit")).json()["entries"]
    got = [(e["action"], e["target"], e["via"], e["note"]) for e in entries]
    assert got == [
        ("cancel", task_id, "api", "cron"),
        ("resume", "handler:demo", "console", "alice"),
        ("pause", "handler:demo", "console", "alice"),
    ]
    assert entries[2]["detail"] == {"note": "vendor down", "newly": True}
    assert await console.redis.xlen(audit_key("atd")) == 3


async def test_the_task_page_shows_internals_timeline_and_legal_actions(
    console: Console, store: Store
) -> None:
    [task_id] = await submit(console.client)
    await ingest(store)
    async with console.browser() as http:
        await console.login(http, "operator")
        data = (await http.get(f"{CON}/tasks/{task_id}")).json()
        assert data["task"]["status"] == "PENDING_SUBMIT" and "fence" in data["task"]
        assert [e["status"] for e in data["timeline"]] == ["PENDING_SUBMIT"]
        assert data["actions"] == {"cancel": True, "requeue": False, "resolve": []}
        claimed = await claim_one(store)
        await store.start(claimed.lease, False)
        await store.release([claimed.lease])  # a started submit cut off: parked
        data = (await http.get(f"{CON}/tasks/{task_id}")).json()
        assert data["task"]["status"] == "SUBMIT_UNKNOWN" and data["task"]["fence"] == 1
        assert [e["status"] for e in data["timeline"]][-1] == "SUBMIT_UNKNOWN"
        assert data["actions"]["cancel"] is False
        assert set(data["actions"]["resolve"]) == {"SUBMITTED", "PENDING_SUBMIT", "FAILED",
                                                   "CANCELED"}  # fmt: skip
        assert (await http.get(f"{CON}/tasks/01ARZ3NDEKTSV4RRFFQ69G5FAV")).status_code == 404


async def test_the_overview_counts_and_flags_what_needs_a_human(
    console: Console, store: Store
) -> None:
    await submit(console.client, 3)
    await ingest(store)
    claimed = await claim_one(store)
    await store.start(claimed.lease, False)
    await store.release([claimed.lease])
    await console.client.pause(handler="demo", note="maintenance")
    async with console.browser() as http:
        await console.login(http, "operator")
        o = (await http.get(f"{CON}/overview")).json()
    assert o["by_status"]["PENDING_SUBMIT"] == 2 and o["by_status"]["SUBMIT_UNKNOWN"] == 1
    assert o["by_handler"]["demo"]["SUBMIT_UNKNOWN"] == 1
    kinds = {a["kind"] for a in o["attention"]}
    assert {"submit_unknown", "no_daemon"} <= kinds
    assert o["paused"]["handler:demo"]["note"] == "maintenance"
    assert len(o["series"]["succeeded"]) == 60 and sum(o["series"]["failed"]) == 0


async def test_the_console_works_as_the_operators_acl_user(
    redis_client: redis.asyncio.Redis, redis_url: str, store: Store
) -> None:
    """docs/security.md's operator user: sessions, audit, overview, and a find that falls
    back from SORT_RO's GET patterns (refused to a user without every key) to HMGETs."""
    await create_user(redis_client, "asynctaskd-operator", "pw")
    [task_id] = await submit(AsyncClient(redis_client, "atd"))
    await ingest(store)
    await redis_client.hset(Keys().task(0, task_id), "external_id", "job-acl")
    operator = open_redis(user_url(redis_url, "asynctaskd-operator", "pw"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        await operator.execute_command("SORT_RO", Keys().index(0, Status.PENDING_SUBMIT),
                                       "BY", "nosort", "GET", "atd:*")  # fmt: skip
    async with served(redis_client, operator) as console, console.browser() as http:
        me = await console.login(http, "operator")
        r = await http.get(f"{CON}/find", params={"by": "external_id", "q": "job-acl"})
        assert r.status_code == 200 and [t["id"] for t in r.json()["tasks"]] == [task_id]
        r = await http.get(f"{CON}/find", params={"by": "metadata", "q": "x=1"})
        assert r.status_code == 200 and r.json()["tasks"] == []
        assert (await http.get(f"{CON}/overview")).status_code == 200
        r = await http.post(f"{API}/tasks/{task_id}/cancel", headers={"X-CSRF-Token": me["csrf"]})
        assert r.status_code == 202
        entries = (await http.get(f"{CON}/audit")).json()["entries"]
        assert [(e["action"], e["target"]) for e in entries] == [("cancel", task_id)]


async def test_a_producers_redis_user_refuses_sessions_clearly(
    redis_client: redis.asyncio.Redis, redis_url: str
) -> None:
    await create_user(redis_client, "asynctaskd-producer", "pw")
    # docs/api.md: the web process's producer user also reads the tokens
    await redis_client.execute_command("ACL", "SETUSER", "asynctaskd-producer", "%R~atd:web:tokens")
    producer = open_redis(user_url(redis_url, "asynctaskd-producer", "pw"))
    async with served(redis_client, producer) as console, console.browser() as http:
        token = await console.token("viewer", "t1")
        r = await http.post(f"{CON}/login", json={"token": token})
        assert r.status_code == 503 and code(r) == "no_sessions"
        assert "operators' asynctaskd web" in r.json()["error"]["message"]


async def test_the_hourly_series_counts_what_ended_from_the_events(
    console: Console, store: Store
) -> None:
    for outcome in (Status.SUCCEEDED, Status.SUCCEEDED, Status.FAILED):
        await submitted(store)  # a task driven to SUBMITTED, due for a query at once
        claimed = await claim_one(store, "query")
        fields = {"error_code": "x", "error_message": "y"} if outcome is Status.FAILED else None
        assert (await store.save(claimed.lease, outcome, fields=fields)).code is Code.OK
    async with console.browser() as http:
        await console.login(http, "operator")
        series = (await http.get(f"{CON}/overview")).json()["series"]
    assert (sum(series["succeeded"]), sum(series["failed"])) == (2, 1)
    assert (series["succeeded"][-1], series["failed"][-1]) == (2, 1)  # this minute
    assert series["since"] == series["start"]  # the stream holds the whole hour


async def test_a_find_is_bounded_and_goes_on_where_it_stopped(
    console: Console, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(browse, "FIND_SCAN", 3)
    ids = await submit(console.client, 7)
    await ingest(store)
    oldest = ids[0]
    await console.redis.hset(Keys().task(0, oldest), "external_id", "job-old")
    async with console.browser() as http:
        await console.login(http, "operator")
        start, looked, found = "0", 0, []
        while not found:
            r = await http.get(f"{CON}/find", params={"by": "external_id", "q": "job-old",
                                                      "start": start})  # fmt: skip
            body = r.json()
            looked += body["scanned"]
            assert body["scanned"] <= 3, body
            found = [t["id"] for t in body["tasks"]]
            if not found:
                assert body["next"] == looked  # the next call starts after these
                start = str(body["next"])
        assert found == [oldest] and looked == 7  # newest first: the oldest comes last
