"""A tenant's overview in the console: what its viewers see of their own tenant (counts,
parked and stalled tasks, the hour's finished tasks), computed by a bounded walk of the
status indexes, and reported as a lower bound with the time it covers when the walk's
budget ran out."""

from __future__ import annotations

import pytest

from asynctaskd.keys import READY_BAND, Keys, ready_due_ms
from asynctaskd.model import Status
from asynctaskd.store import Code, Store
from asynctaskd.web.console import tenant as tenant_module
from tests.lua.helpers import claim_one, create, submitted
from tests.test_console import CON, Console, code, console

pytestmark = pytest.mark.anyio
__all__ = ["console"]  # the fixture, shared with test_console


async def test_a_viewer_sees_the_counts_and_troubles_of_its_own_tenant_only(
    console: Console, store: Store
) -> None:
    for outcome in (Status.SUCCEEDED, Status.FAILED):  # t1: one of each ended this minute
        lease = await submitted(store, tenant="t1")
        claimed = await claim_one(store, "query")
        assert claimed.lease.task_id == lease.task_id
        fields = {"error_code": "x", "error_message": "y"} if outcome is Status.FAILED else None
        assert (await store.save(claimed.lease, outcome, fields=fields)).code is Code.OK
    await create(store, tenant="t1")  # becomes SUBMIT_UNKNOWN: claimed, started, released
    claimed = await claim_one(store)
    await store.start(claimed.lease, False)
    await store.release([claimed.lease])
    for _ in range(2):
        await create(store, tenant="t1")
    for _ in range(3):
        await create(store, tenant="t2")
    async with console.browser() as http:
        await console.login(http, "viewer", "t1")
        r = await http.get(f"{CON}/tenant")
        assert r.status_code == 200, r.text
        o = r.json()
        r = await http.get(f"{CON}/tenant", params={"tenant": "t2"})
        assert r.status_code == 403 and code(r) == "forbidden"
    assert o["tenant"] == "t1"
    assert {s: n for s, n in o["by_status"].items() if n} == {
        "PENDING_SUBMIT": 2, "SUBMIT_UNKNOWN": 1, "SUCCEEDED": 1, "FAILED": 1,
    }  # fmt: skip
    assert set(o["whole_since"].values()) == {None}  # every index read to its end
    assert (o["parked_for_operator"], o["parked_for_lookup"]) == (1, 0)
    assert [a["kind"] for a in o["attention"]] == ["submit_unknown"]
    series = o["series"]
    assert (series["succeeded"][-1], series["failed"][-1]) == (1, 1)
    assert (sum(series["succeeded"]), sum(series["failed"])) == (1, 1)
    assert series["since"] == series["start"]
    async with console.browser() as http:
        await console.login(http, "operator")
        assert (await http.get(f"{CON}/tenant")).status_code == 422  # name one
        assert (await http.get(f"{CON}/tenant", params={"tenant": "a b"})).status_code == 422
        o = (await http.get(f"{CON}/tenant", params={"tenant": "t2"})).json()
    assert {s: n for s, n in o["by_status"].items() if n} == {"PENDING_SUBMIT": 3}
    assert o["attention"] == [] and sum(o["series"]["succeeded"]) == 0


async def test_a_spent_budget_gives_a_lower_bound_and_the_time_it_covers(
    console: Console, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tenant_module, "WALK", 6)
    ids = [(await create(store, tenant="t1" if i % 2 else "t2")).task_id for i in range(8)]
    index = Keys().index(0, Status.PENDING_SUBMIT)
    base = 1_700_000_000_000  # task i entered PENDING_SUBMIT at base + i seconds
    await console.redis.zadd(index, {t: base + 1000 * i for i, t in enumerate(ids)})
    # Three t1 tasks in SUCCEEDED, to be found however much budget PENDING_SUBMIT had
    await console.redis.zadd(Keys().index(0, Status.SUCCEEDED), dict.fromkeys(ids[1:6:2], base))
    async with console.browser() as http:
        await console.login(http, "viewer", "t1")
        o = (await http.get(f"{CON}/tenant")).json()
    async with console.browser() as http:
        await console.login(http, "operator")
        seen = (await http.get(f"{CON}/tenant", params={"tenant": "t1"})).json()
    assert seen["by_status"] == o["by_status"] and seen["scanned"] == 6
    assert o["scanned"] is None  # how many tasks all tenants have is not a viewer's
    # Two statuses share the 6 entries: 3 of PENDING_SUBMIT, newest first: tasks 7, 6, 5,
    # of which t1's are 7 and 5; every task that entered the status after task 4 (the
    # newest not read, another tenant's) is counted, said as from the next whole minute.
    assert o["by_status"]["PENDING_SUBMIT"] == 2
    minute = 60_000
    assert o["whole_since"]["PENDING_SUBMIT"] == -(-(base + 4000 + 1) // minute) * minute / 1000
    assert o["by_status"]["SUCCEEDED"] == 3 and o["whole_since"]["SUCCEEDED"] is None
    assert o["whole_since"]["FAILED"] is None  # an empty index: nothing to read


async def test_a_viewer_sees_its_own_stalled_tasks(console: Console, store: Store) -> None:
    late = (await create(store, tenant="t1")).task_id
    await create(store, tenant="t2")
    ready = Keys().ready(0, "submit")
    score = await console.redis.zscore(ready, late)
    assert score is not None and ready_due_ms(score) < READY_BAND
    await console.redis.zadd(ready, {late: score - 120_000})  # due two minutes ago
    async with console.browser() as http:
        await console.login(http, "viewer", "t1")
        mine = (await http.get(f"{CON}/tenant")).json()
    async with console.browser() as http:
        await console.login(http, "viewer", "t2")
        theirs = (await http.get(f"{CON}/tenant")).json()
    assert mine["stalls"]["count"] == 1 and mine["stalls"]["waited"] >= 120
    assert [a["kind"] for a in mine["attention"]] == ["stall"]
    assert theirs["stalls"]["count"] == 0 and theirs["attention"] == []
