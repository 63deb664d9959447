"""Handler groups: the pure policies, then routing through both clients, then the CLI."""

from __future__ import annotations

import collections
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio

from asynctaskd.client import AsyncClient, Client
from asynctaskd.errors import InvalidTask, UnknownHandler
from asynctaskd.keys import Keys
from asynctaskd.routing import (
    Group,
    Member,
    active_fields,
    choose,
    consistent_hash,
    decode_group,
    encode_group,
    least_active,
    loads,
    make_group,
    round_robin,
    weighted,
)

from .clients import Api

pytestmark = pytest.mark.anyio

BASE: dict[str, Any] = {"tracking_timeout": 60, "strict": False}
ABC = (Member("ocr:a"), Member("ocr:b"), Member("ocr:c", 2))


# The policies, without Redis.


def test_round_robin_is_an_exact_cycle() -> None:
    members = ABC[:3]
    picks = [round_robin(members, n) for n in range(1, 10)]
    assert picks == ["ocr:a", "ocr:b", "ocr:c"] * 3


@pytest.mark.parametrize("weights", [(3, 1), (1, 1), (2, 2, 1), (5, 3, 1, 1), (1,), (7, 11, 13)])
def test_weighted_gives_exact_shares_over_any_window_of_the_total(weights: tuple[int, ...]) -> None:
    members = tuple(Member(f"h{i}", w) for i, w in enumerate(weights))
    total = sum(weights)
    picks = [weighted(members, n) for n in range(1, 5 * total + 1)]
    for start in range(len(picks) - total + 1):  # every run of `total` consecutive submits
        counts = collections.Counter(picks[start : start + total])
        assert counts == {m.handler: m.weight for m in members}


def test_weighted_interleaves_members_instead_of_blocks() -> None:
    members = (Member("a", 3), Member("b", 1))
    assert [weighted(members, n) for n in range(1, 9)] == list("abaaabaa")
    even = (Member("a", 5), Member("b", 5))
    picks = [weighted(even, n) for n in range(1, 11)]
    assert max(len(list(run)) for _, run in itertools.groupby(picks)) <= 2


def test_consistent_hash_is_stable_across_runs() -> None:
    # Pinned: a change of hash or scoring would silently move every business key.
    assert {k: consistent_hash(ABC, k) for k in ("customer-1", "customer-3", "order-7")} == {
        "customer-1": "ocr:a",
        "customer-3": "ocr:b",
        "order-7": "ocr:c",
    }
    assert consistent_hash(ABC, "customer-1") == consistent_hash(tuple(ABC), "customer-1")


def test_consistent_hash_removing_a_member_moves_only_its_keys() -> None:
    keys = [f"customer-{i}" for i in range(2000)]
    before = {k: consistent_hash(ABC, k) for k in keys}
    after = {k: consistent_hash((ABC[0], ABC[2]), k) for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "ocr:b"}
    assert moved  # the removed member did have keys
    # Adding it back restores the original mapping exactly.
    assert {k: consistent_hash(ABC, k) for k in keys} == before


def test_consistent_hash_honours_weights() -> None:
    members = (Member("a", 3), Member("b", 1))
    counts = collections.Counter(consistent_hash(members, f"k{i}") for i in range(8000))
    assert counts["a"] / 8000 == pytest.approx(0.75, abs=0.02)


def test_least_active_picks_the_fewest_first_on_a_tie() -> None:
    assert least_active(ABC, [3, 1, 2]) == "ocr:b"
    assert least_active(ABC, [2, 5, 2]) == "ocr:a"
    fields = active_fields(ABC[:2])
    assert fields[:4] == ["SUBMITTING@ocr:a", "SUBMITTED@ocr:a", "RUNNING@ocr:a",
                          "PENDING_SUBMIT@ocr:a"]  # fmt: skip
    shard0 = [b"1", None, b"2", b"junk", None, None, None, b"1"]
    shard1 = [None, None, None, b"1", b"4", None, None, None]
    assert loads(ABC[:2], [shard0, shard1]) == [4, 5]


def test_choose_dispatches_by_policy() -> None:
    assert choose(Group("round_robin", ABC), counter=2) == "ocr:b"
    assert choose(Group("weighted", ABC), counter=1) == weighted(ABC, 1)
    assert choose(Group("least_active", ABC), active=[1, 1, 0]) == "ocr:c"
    assert choose(Group("consistent_hash", ABC), route_key="order-7") == "ocr:c"
    with pytest.raises(InvalidTask, match="route_key"):
        choose(Group("consistent_hash", ABC))


BAD_GROUPS: list[tuple[Any, Any, Any, str]] = [
    ("has space", "round_robin", ["a"], "group name must be"),
    ("", "round_robin", ["a"], "group name must be"),
    (None, "round_robin", ["a"], "group name must be"),
    ("g", "random", ["a"], "policy must be one of round_robin"),
    ("g", None, ["a"], "policy must be one of"),
    ("g", "weighted", [], "at least one member"),
    ("g", "weighted", "ocr:a", "members must be a list"),
    ("g", "weighted", ["a", "a"], "'a' is listed twice"),
    ("g", "weighted", [("a", 1), "a"], "listed twice"),
    ("g", "weighted", ["a b"], "member's handler key must be"),
    ("g", "weighted", [7], "a member is a handler key or"),
    ("g", "weighted", [("a", 0)], "weight must be an integer from 1"),
    ("g", "weighted", [("a", -2)], "weight must be"),
    ("g", "weighted", [("a", 1.5)], "weight must be"),
    ("g", "weighted", [("a", True)], "weight must be"),
    ("g", "weighted", [("a", 10_001)], "weight must be"),
    ("g", "weighted", [f"h{i}" for i in range(101)], "at most 100 members"),
]


@pytest.mark.parametrize(("name", "policy", "members", "message"), BAD_GROUPS)
def test_make_group_rejects_bad_definitions(
    name: Any, policy: Any, members: Any, message: str
) -> None:
    with pytest.raises(InvalidTask, match=message):
        make_group(name, policy, members)


def test_group_definitions_round_trip_and_corrupt_ones_name_the_group() -> None:
    group = make_group("ocr", "weighted", ["ocr:a", ("ocr:b", 3), Member("ocr:c")])
    assert group.members == (Member("ocr:a"), Member("ocr:b", 3), Member("ocr:c"))
    assert json.loads(encode_group(group)) == {
        "policy": "weighted",
        "members": [{"handler": "ocr:a", "weight": 1}, {"handler": "ocr:b", "weight": 3},
                    {"handler": "ocr:c", "weight": 1}],
    }  # fmt: skip
    assert decode_group("ocr", encode_group(group)) == group
    for raw in (b"{not json", b"[]", b'{"policy": "random", "members": [{"handler": "a"}]}',
                b'{"policy": "weighted", "members": []}',
                b'{"policy": "weighted", "members": [{"handler": "a", "weight": 0}]}'):  # fmt: skip
        with pytest.raises(InvalidTask, match="handler group 'ocr' has a corrupt definition"):
            decode_group("ocr", raw)


# Through Redis, with both clients.


async def live(r: redis.asyncio.Redis, *handlers: str) -> None:
    until = str(int(time.time() * 1000) + 60_000)
    await r.hset("atd:handlers", mapping=dict.fromkeys(handlers, until))


async def routed(api: Api, name: str, n: int, **kwargs: Any) -> list[str]:
    out = []
    for _ in range(n):
        task = await api.submit(name, {}, **{**BASE, **kwargs})
        stored = await api.get(task.id)
        assert stored == task  # the member is stored in the task: workers never re-route
        out.append(task.handler)
    return out


async def test_set_list_and_delete_groups(api: Api, redis_client: redis.asyncio.Redis) -> None:
    assert await api.groups() == {}
    group = await api.set_group("ocr", "weighted", ["ocr:a", ("ocr:b", 3)])
    assert group == Group("weighted", (Member("ocr:a"), Member("ocr:b", 3)))
    await api.set_group("asr", "least_active", ["asr:x"])
    assert await api.groups() == {"asr": Group("least_active", (Member("asr:x"),)), "ocr": group}
    stored = await redis_client.hget("atd:groups", "ocr")
    assert stored is not None
    assert json.loads(stored)["members"][1] == {"handler": "ocr:b", "weight": 3}
    await routed(api, "ocr", 2)
    assert await redis_client.exists(Keys().group_counter("ocr"))
    assert await api.delete_group("ocr") is True
    assert not await redis_client.exists(Keys().group_counter("ocr"))
    assert await api.delete_group("ocr") is False
    assert list(await api.groups()) == ["asr"]
    # Deleted: the name is a plain handler key again.
    assert await routed(api, "ocr", 1) == ["ocr"]


async def test_round_robin_cycles_exactly(api: Api) -> None:
    await api.set_group("ocr", "round_robin", ["ocr:a", "ocr:b", "ocr:c"])
    assert await routed(api, "ocr", 7) == ["ocr:a", "ocr:b", "ocr:c"] * 2 + ["ocr:a"]


async def test_routed_task_is_the_members_own(api: Api) -> None:
    await api.set_group("ocr", "round_robin", ["ocr:a"])
    task = await api.submit("ocr", {"x": 1}, metadata={"m": 1}, **BASE)
    assert (task.handler, task.provider, task.metadata) == ("ocr:a", "ocr:a", {"m": 1})
    pinned = await api.submit("ocr", {}, provider="vendor", **BASE)
    assert (pinned.handler, pinned.provider) == ("ocr:a", "vendor")
    await api.take_in()
    page = await api.list(handler="ocr:a")
    assert {t.id for t in page.tasks} == {task.id, pinned.id}


async def test_weighted_gives_the_exact_ratio_over_a_full_cycle(api: Api) -> None:
    await api.set_group("ocr", "weighted", [("ocr:a", 3), ("ocr:b", 1)])
    picks = await routed(api, "ocr", 12)
    for start in range(0, 12, 4):
        assert collections.Counter(picks[start : start + 4]) == {"ocr:a": 3, "ocr:b": 1}


async def test_counter_is_shared_by_every_client(make_api: Callable[..., Api]) -> None:
    one, two = make_api(), make_api()
    await one.set_group("ocr", "round_robin", ["ocr:a", "ocr:b"])
    picks = [*(await routed(one, "ocr", 1)), *(await routed(two, "ocr", 1)),
             *(await routed(one, "ocr", 1)), *(await routed(two, "ocr", 1))]  # fmt: skip
    assert picks == ["ocr:a", "ocr:b", "ocr:a", "ocr:b"]


async def test_consistent_hash_maps_a_key_to_one_member(
    api: Api, redis_url: str, redis_client: redis.asyncio.Redis
) -> None:
    members = ["ocr:a", "ocr:b", ("ocr:c", 2)]
    await api.set_group("ocr", "consistent_hash", members)
    keys = [f"customer-{i}" for i in range(40)]
    first = {k: (await routed(api, "ocr", 1, route_key=k))[0] for k in keys}
    assert first == {k: consistent_hash(ABC, k) for k in keys}  # the pure function decides
    assert {k: (await routed(api, "ocr", 1, route_key=k))[0] for k in keys} == first
    # The other kind of client agrees.
    other_cls = Client if api.is_async else AsyncClient
    other = Api(other_cls.from_url(redis_url))
    try:
        assert {k: (await routed(other, "ocr", 1, route_key=k))[0] for k in keys} == first
    finally:
        await other.close()
    assert not await redis_client.exists(Keys().group_counter("ocr"))  # no counter needed
    # Remove ocr:b: only its keys move.
    await api.set_group("ocr", "consistent_hash", ["ocr:a", ("ocr:c", 2)])
    after = {k: (await routed(api, "ocr", 1, route_key=k))[0] for k in keys}
    assert {k for k in keys if after[k] != first[k]} == {k for k in keys if first[k] == "ocr:b"}


async def test_consistent_hash_needs_a_route_key(
    api: Api, redis_client: redis.asyncio.Redis
) -> None:
    await api.set_group("ocr", "consistent_hash", ["ocr:a", "ocr:b"])
    before = await redis_client.dbsize()
    with pytest.raises(InvalidTask, match="'ocr' routes by consistent_hash: submit with a"):
        await api.submit("ocr", {}, **BASE)
    assert await redis_client.dbsize() == before
    # Other policies and plain handlers ignore a route_key, so producers can always pass one.
    assert await routed(api, "plain", 1, route_key="customer-1") == ["plain"]


async def test_least_active_picks_the_least_loaded(
    make_api: Callable[..., Api], redis_client: redis.asyncio.Redis
) -> None:
    api = make_api(shards=4)  # the loads are summed over every shard
    for handler, n in (("ocr:a", 3), ("ocr:b", 4), ("ocr:c", 2)):
        await routed(api, handler, n)
    await api.take_in()  # the loads are the daemons' counts: of tasks taken in
    await api.set_group("ocr", "least_active", ["ocr:a", "ocr:b", "ocr:c"])
    assert await routed(api, "ocr", 1) == ["ocr:c"]  # 3, 4, 2: c
    await api.take_in()
    assert await routed(api, "ocr", 1) == ["ocr:a"]  # 3, 4, 3: the first of a and c
    await api.take_in()
    # Finished tasks are not active: cancel three of b's, and b has the fewest.
    page = await api.list(handler="ocr:b")
    for task in page.tasks[:3]:
        assert await api.cancel(task.id)
    await api.take_in()
    assert await routed(api, "ocr", 1) == ["ocr:b"]  # 4, 1, 3


async def test_a_group_defined_elsewhere_is_seen_on_the_next_submit(
    make_api: Callable[..., Api], redis_client: redis.asyncio.Redis
) -> None:
    producer, operator = make_api(), make_api()
    assert await routed(producer, "ocr", 1) == ["ocr"]  # caches "no groups"
    await operator.set_group("ocr", "round_robin", ["ocr:a"])
    assert await routed(producer, "ocr", 1) == ["ocr:a"]  # a miss re-reads
    # A live handler in a fresh cache is trusted without reading the groups again.
    await live(redis_client, "ocr:a")
    await producer.submit("ocr:a", {}, tracking_timeout=60)  # strict: reads the handlers
    before = dict(producer.client._store.round_trips)
    await producer.submit("ocr:a", {}, tracking_timeout=60)
    after = producer.client._store.round_trips
    assert {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} == {
        "create": 1
    }
    before = dict(after)  # a warm round-robin submit: one INCR and the create
    await producer.submit("ocr", {}, tracking_timeout=60)
    after = producer.client._store.round_trips
    assert {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} == {
        "create": 1,
        "read": 1,
    }


async def test_strict_checks_the_chosen_member(api: Api, redis_client: redis.asyncio.Redis) -> None:
    await live(redis_client, "ocr:a")
    await api.set_group("ocr", "round_robin", ["ocr:a", "ocr:b"])
    assert (await api.submit("ocr", {}, tracking_timeout=60)).handler == "ocr:a"
    with pytest.raises(UnknownHandler, match="'ocr:b'"):
        await api.submit("ocr", {}, tracking_timeout=60)
    await api.take_in()
    assert (await api.stats()).by_status["PENDING_SUBMIT"] == 1


async def test_set_group_refusals_write_nothing(
    api: Api, redis_client: redis.asyncio.Redis
) -> None:
    await live(redis_client, "ocr:a")
    await api.set_group("asr", "round_robin", ["asr:x"])
    before = await redis_client.dbsize()
    stored = await redis_client.hgetall("atd:groups")
    refusals: list[tuple[tuple[Any, ...], str]] = [
        (("ocr:a", "round_robin", ["ocr:b"]), "'ocr:a' is the key of a live handler"),
        (("ocr", "round_robin", ["asr"]), "member 'asr' is a group"),
        (("ocr", "round_robin", ["ocr"]), "member 'ocr' is a group"),
        (("asr:x", "round_robin", ["ocr:b"]), "'asr:x' is a member of group 'asr'"),
        *(((n, p, m), msg) for n, p, m, msg in BAD_GROUPS),
    ]
    for args, message in refusals:
        with pytest.raises(InvalidTask, match=message):
            await api.set_group(*args)
    with pytest.raises(InvalidTask, match="group name must be"):
        await api.delete_group("a b")
    assert await redis_client.dbsize() == before
    assert await redis_client.hgetall("atd:groups") == stored


async def test_invalid_submits_to_a_group_write_nothing(
    api: Api, redis_client: redis.asyncio.Redis
) -> None:
    await api.set_group("ocr", "round_robin", ["ocr:a", "ocr:b"])
    before = await redis_client.dbsize()
    bad: list[tuple[dict[str, Any], str]] = [
        ({"params": {"x": b"raw"}}, "params"),
        ({"tracking_timeout": 0}, "tracking_timeout"),
        ({"priority": 500}, "priority"),
        ({"route_key": ""}, "route_key must be a non-empty str"),
        ({"route_key": 42}, "route_key must be"),
        ({"route_key": "x" * 201}, "route_key must be"),
    ]
    for override, message in bad:
        kwargs = {"params": {}, **BASE, **override}
        with pytest.raises(InvalidTask, match=message):
            await api.submit("ocr", **kwargs)
    assert await redis_client.dbsize() == before  # the counter was not even created
    assert await routed(api, "ocr", 1) == ["ocr:a"]  # and was not advanced


@pytest.mark.parametrize(
    "raw",
    [b"{oops", b'{"policy": "weighted", "members": []}', b'{"policy": "x", "members": ["a"]}'],
)
async def test_corrupt_group_json_is_a_clear_error(
    api: Api, redis_client: redis.asyncio.Redis, raw: bytes
) -> None:
    await redis_client.hset("atd:groups", "ocr", raw)
    before = await redis_client.dbsize()
    with pytest.raises(InvalidTask, match="handler group 'ocr' has a corrupt definition"):
        await api.submit("ocr", {}, **BASE)
    with pytest.raises(InvalidTask, match="handler group 'ocr' has a corrupt definition"):
        await api.groups()
    assert await redis_client.dbsize() == before
    # Other groups still route, and the corrupt one can be replaced.
    await api.set_group("asr", "round_robin", ["asr:x"])
    assert await routed(api, "asr", 1) == ["asr:x"]
    await api.set_group("ocr", "round_robin", ["ocr:a"])
    assert await routed(api, "ocr", 1) == ["ocr:a"]


# The CLI.


def cli(*args: str, url: str, check: int | None = 0) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "asynctaskd", *args, "--url", url]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check is not None:
        assert proc.returncode == check, (
            f"{args}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


@pytest.mark.slow
def test_cli_group_set_list_delete(redis_url: str, sync_redis: Any) -> None:
    sync_redis.hset("atd:handlers", "ocr:a", str(int(time.time() * 1000) + 60_000))
    out = cli("group", "set", "ocr", "--policy", "weighted", "--member", "ocr:a=3",
              "--member", "ocr:b", "--json", url=redis_url).stdout  # fmt: skip
    expected = {"policy": "weighted", "members": [{"handler": "ocr:a", "weight": 3},
                                                  {"handler": "ocr:b", "weight": 1}]}  # fmt: skip
    assert json.loads(out) == {"ocr": expected}
    cli("group", "set", "asr", "--policy", "consistent_hash", "--member", "asr:x", url=redis_url)
    listed = json.loads(cli("group", "list", "--json", url=redis_url).stdout)
    assert listed == {"asr": {"policy": "consistent_hash",
                              "members": [{"handler": "asr:x", "weight": 1}]},
                      "ocr": expected}  # fmt: skip
    text = cli("group", "list", url=redis_url).stdout
    assert "ocr:a=3 ocr:b=1" in text and "consistent_hash" in text
    task = json.loads(cli("submit", "ocr", "{}", "--json", url=redis_url).stdout)
    assert task["handler"] == "ocr:a"  # strict: the picked member (3 of 4 slots) is live
    argv = ("submit", "asr", "{}", "--no-strict", "--route-key", "c-1", "--json")
    hashed = json.loads(cli(*argv, url=redis_url).stdout)
    assert hashed["handler"] == "asr:x"
    # Refusals: usage errors exit 2 and write nothing.
    keys_before = sync_redis.dbsize()
    for bad in (["ocr:a", "--policy", "round_robin", "--member", "ocr:b"],
                ["ocr", "--policy", "weighted", "--member", "ocr:a=zero"],
                ["ocr", "--policy", "weighted", "--member", "ocr:a=0"],
                ["ocr", "--policy", "random", "--member", "ocr:a"]):  # fmt: skip
        cli("group", "set", *bad, url=redis_url, check=2)
    cli("submit", "asr", "{}", "--no-strict", url=redis_url, check=2)  # no --route-key
    assert sync_redis.dbsize() == keys_before
    deleted = json.loads(cli("group", "delete", "ocr", "--json", url=redis_url).stdout)
    assert deleted == {"name": "ocr", "deleted": True}
    again = cli("group", "delete", "ocr", url=redis_url, check=3)  # not found
    assert "no group ocr" in again.stdout
    assert list(json.loads(cli("group", "list", "--json", url=redis_url).stdout)) == ["asr"]
