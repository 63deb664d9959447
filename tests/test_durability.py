"""The durability gate you can see: what it enforces, the server's appendfsync, re-checks.

Pure cases for `choose_gate` and `assess`; the rest against private servers of their own
(CONFIG SET changes them): redis-server 7.0 has no WAITAOF, the valkey-server wheel has.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import get_args

import anyio
import msgspec
import pytest
from redis import Redis as SyncRedis

from asynctaskd.config import RedisConfig, decode_hook
from asynctaskd.durability import DurabilityWatch, Fsync, Marks, Mode, assess, choose_gate
from asynctaskd.embedded import ServerProcess, find_binary
from asynctaskd.errors import StoreUnavailable
from asynctaskd.keys import Keys
from asynctaskd.metrics import DURABILITY_FSYNC, DURABILITY_MARKS, DURABILITY_MODES, Metrics
from asynctaskd.store import Gate, Persistence, Store, open_redis
from tests.conftest import wait_until


def facts(
    version: str = "7.2.4", *, aof: bool = True, fsync: str = "everysec", replicas: int = 0
) -> Persistence:
    refused = "" if fsync else "CONFIG GET appendfsync refused: NOPERM"
    return Persistence(
        version=version, aof=aof, appendfsync=fsync, replicas=replicas, refused=refused
    )


# --- which gate, and what it enforces (pure) ---------------------------------------------


def test_the_metric_states_are_the_report_states() -> None:
    assert get_args(Mode) == DURABILITY_MODES
    assert get_args(Fsync) == DURABILITY_FSYNC
    assert get_args(Marks) == DURABILITY_MARKS


@pytest.mark.parametrize(
    ("server", "gate", "why"),
    [
        (facts(), Gate("WAITAOF", 1, 0, 1000), "auto: AOF on, with WAITAOF"),
        (facts("7.0.15"), None, "auto: the server (7.0.15) has no WAITAOF and no replica"),
        (facts("7.0.15", replicas=2), Gate("WAIT", 0, 2, 1000), "2 replica(s) connected"),
        (facts(aof=False), None, "auto: AOF is off and no replica is connected"),
        # WAITAOF never confirms a local fsync under appendfsync no: every submit would wait
        (facts(fsync="no"), None, "auto: appendfsync is no, so WAITAOF would never confirm"),
        (facts(fsync="no", replicas=1), Gate("WAIT", 0, 1, 1000), "1 replica(s) connected"),
        # appendfsync unknown: WAITAOF is tried (if it cannot confirm, submits wait: safe)
        (facts(fsync=""), Gate("WAITAOF", 1, 0, 1000), "auto: AOF on, with WAITAOF"),
    ],
)
def test_auto_picks_the_strongest_gate_that_can_pass(
    server: Persistence, gate: Gate | None, why: str
) -> None:
    chosen, reason = choose_gate("auto", server, 1000, 0)
    assert chosen == gate
    assert why in reason


def test_explicit_modes_keep_their_behaviour() -> None:
    assert choose_gate("off", facts(), 1000, 0) == (None, 'durability = "off"')
    assert choose_gate("waitaof", facts(fsync="no"), 500, 1)[0] == Gate("WAITAOF", 1, 1, 500)
    assert choose_gate("wait", facts(), 500, 0)[0] == Gate("WAIT", 0, 1, 500)
    with pytest.raises(StoreUnavailable, match="no WAITAOF"):
        choose_gate("waitaof", facts("7.0.15"), 500, 0)


@pytest.mark.parametrize(
    ("gate", "server", "mode", "fsync", "marks", "said"),
    [
        # The finding: Redis 7.0, AOF everysec, no replicas. The gate is off and a crash
        # of the host can lose a started mark: reported, not only logged once.
        (None, facts("7.0.15"), "off", "everysec", "at_risk", "last second's"),
        (None, facts("7.0.15", fsync="no"), "off", "no", "at_risk", "kernel has not written"),
        (None, facts(aof=False), "off", "off", "at_risk", "AOF off: a restart of Redis loses"),
        (None, facts("7.0.15", fsync=""), "off", "unknown", "unknown", "allow CONFIG GET"),
        (None, facts("7.0.15", fsync="always"), "off", "always", "fsynced", "fsyncs every write"),
        (Gate("WAITAOF", 1, 0, 1000), facts(), "waitaof", "everysec", "fsynced", "is fsynced"),
        (Gate("WAIT", 0, 1, 1000), facts(replicas=1), "wait", "everysec", "replicated", "1 rep"),
        (
            Gate("WAITAOF", 0, 1, 1000),
            facts(aof=False, replicas=1),
            "wait",
            "off",
            "replicated",
            "reaches 1 replica(s)",
        ),
        # durability = "waitaof" on a server with AOF off and wait_replicas = 0
        (
            Gate("WAITAOF", 0, 0, 1000),
            facts(aof=False),
            "off",
            "off",
            "at_risk",
            "WAITAOF 0 0, which waits for nothing",
        ),
    ],
)
def test_assess_says_what_the_gate_enforces_and_what_a_crash_can_lose(
    gate: Gate | None, server: Persistence, mode: str, fsync: str, marks: str, said: str
) -> None:
    report = assess(gate, "why", server)
    assert (report.mode, report.fsync, report.marks) == (mode, fsync, marks)
    assert said in report.detail
    assert report.at_risk is (marks in ("at_risk", "unknown"))
    assert not report.held
    if marks == "at_risk":
        assert "vendor be called twice" in report.detail


@pytest.mark.parametrize(
    ("gate", "server", "said"),
    [
        (Gate("WAITAOF", 1, 0, 1000), facts(aof=False), "AOF is off now, so WAITAOF fails"),
        (Gate("WAITAOF", 1, 0, 1000), facts(fsync="no"), "WAITAOF never confirms"),
        (Gate("WAIT", 0, 2, 1000), facts(replicas=1), "1 of 2 replica(s) are connected"),
    ],
)
def test_a_gate_that_cannot_pass_is_reported_as_holding_every_submit(
    gate: Gate, server: Persistence, said: str
) -> None:
    report = assess(gate, "why", server)
    assert report.held
    assert report.marks in ("fsynced", "replicated")  # nothing goes out unprotected
    assert said in report.detail
    assert "every submit waits (DURABILITY_TIMEOUT)" in report.detail


def test_the_report_names_the_gate_and_why() -> None:
    report = assess(Gate("WAITAOF", 1, 0, 1000), "auto: AOF on, with WAITAOF", facts())
    assert report.gate == "WAITAOF 1 0"
    assert report.detail.startswith("gate WAITAOF 1 0 (auto: AOF on, with WAITAOF); ")
    assert assess(None, "x", facts()).detail.startswith("no gate (x); appendfsync everysec: ")


# --- the server's settings, read for real -------------------------------------------------


@contextmanager
def private_server(name: str, *args: str, aof: bool = True) -> Iterator[ServerProcess]:
    """A server of this test's own: CONFIG SET on it touches nobody else."""
    binary = find_binary(name)
    if binary is None:
        pytest.skip(f"{name} is not installed")
    with ServerProcess(binary, aof=aof, extra_args=args) as server:
        yield server


@asynccontextmanager
async def store_on(url: str) -> AsyncIterator[Store]:
    redis = open_redis(url)
    try:
        yield Store(redis, Keys("atd", 1))
    finally:
        await redis.aclose()


def watch(store: Store, metrics: Metrics, **redis: object) -> DurabilityWatch:
    config = msgspec.convert({"durability_timeout": 1, **redis}, RedisConfig, dec_hook=decode_hook)
    return DurabilityWatch(store, config, metrics)


async def switch_aof_on(sync: SyncRedis) -> None:
    sync.config_set("appendonly", "yes")

    async def on() -> bool:
        return bool(sync.info("persistence")["aof_enabled"] == 1)

    await wait_until(on, "AOF on", timeout=10)


def logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "asynctaskd.durability"]


STATE_SETS = (
    ("asynctaskd_durability_gate", "mode", DURABILITY_MODES),
    ("asynctaskd_durability_aof", "fsync", DURABILITY_FSYNC),
    ("asynctaskd_durability_marks", "state", DURABILITY_MARKS),
)


def current(metrics: Metrics) -> tuple[str, ...]:
    """(mode, fsync, marks): the one state set to 1 in each state set; the others are 0."""
    out = []
    for name, label, all_states in STATE_SETS:
        values = {s: metrics.registry.get_sample_value(name, {label: s}) for s in all_states}
        ones = [s for s, v in values.items() if v == 1.0]
        assert len(ones) == 1, values
        assert all(v == 0.0 for s, v in values.items() if s != ones[0]), values
        out.append(ones[0])
    return tuple(out)


@pytest.mark.parametrize("name", ["redis-server", "valkey-server"])
async def test_read_persistence_reports_aof_appendfsync_and_replicas(name: str) -> None:
    with private_server(name) as server:
        sync = SyncRedis.from_url(server.url)
        async with store_on(server.url) as store:
            for policy in ("always", "everysec", "no"):
                sync.config_set("appendfsync", policy)
                got = await store.read_persistence()
                assert (got.aof, got.appendfsync, got.replicas, got.refused) == (
                    True,
                    policy,
                    0,
                    "",
                )
            assert got.version == sync.info("server")["redis_version"]
            assert got.has_waitaof is (name == "valkey-server")
        sync.close()
    with private_server(name, aof=False) as server:
        async with store_on(server.url) as store:
            assert not (await store.read_persistence()).aof


@pytest.mark.parametrize("name", ["redis-server", "valkey-server"])
async def test_config_get_refused_by_an_acl_is_unknown_and_never_a_crash(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with private_server(name, "--appendfsync", "everysec") as server:
        admin = SyncRedis.from_url(server.url)
        admin.acl_setuser(
            "noconfig", enabled=True, passwords=["+pw"], keys=["*"],
            commands=["+@all", "-config"],
        )  # fmt: skip
        admin.close()
        url = server.url.replace("redis://", "redis://noconfig:pw@")
        async with store_on(url) as store:
            got = await store.read_persistence()
            assert got.appendfsync == ""
            assert "CONFIG GET appendfsync refused" in got.refused
            assert "config|get" in got.refused
            metrics = Metrics()
            w = watch(store, metrics)
            with caplog.at_level(logging.INFO, logger="asynctaskd.durability"):
                gate = await w.start()
            assert w.report is not None
            if name == "redis-server":  # no WAITAOF: the gate is off, and nobody can tell
                assert gate is None
                assert current(metrics) == ("off", "unknown", "unknown")
                assert w.report.at_risk
                assert "appendfsync unknown (CONFIG GET appendfsync refused" in w.report.detail
                assert [r.levelname for r in logged(caplog)] == ["WARNING"]
            else:  # WAITAOF confirms the fsync whatever the policy
                assert gate == Gate("WAITAOF", 1, 0, 1000)
                assert current(metrics) == ("waitaof", "unknown", "fsynced")
                assert not w.report.at_risk


async def test_redis_7_0_without_a_gate_is_reported_at_risk_until_appendfsync_always(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The finding itself: Redis 7.0, AOF, everysec, no replicas, durability = "auto"."""
    with private_server("redis-server", "--appendfsync", "everysec") as server:
        sync = SyncRedis.from_url(server.url)
        async with store_on(server.url) as store:
            metrics = Metrics()
            w = watch(store, metrics)
            with caplog.at_level(logging.INFO, logger="asynctaskd.durability"):
                assert await w.start() is None
                assert current(metrics) == ("off", "everysec", "at_risk")
                assert w.report is not None
                assert "crash of the Redis host can lose" in w.report.detail

                await w.check()  # nothing changed: nothing logged again
                assert len(logged(caplog)) == 1
                assert logged(caplog)[0].levelname == "WARNING"
                assert "appendfsync everysec" in logged(caplog)[0].getMessage()

                sync.config_set("appendfsync", "always")
                report = await w.check()
                assert current(metrics) == ("off", "always", "fsynced")
                assert not report.at_risk
                assert logged(caplog)[-1].levelname == "INFO"

                sync.config_set("appendfsync", "no")
                assert (await w.check()).fsync == "no"
                assert current(metrics) == ("off", "no", "at_risk")
                assert logged(caplog)[-1].levelname == "WARNING"
                assert "kernel has not written" in logged(caplog)[-1].getMessage()

                sync.config_set("appendonly", "no")
                assert (await w.check()).fsync == "off"
                assert current(metrics) == ("off", "off", "at_risk")
                assert "AOF off" in logged(caplog)[-1].getMessage()
        sync.close()


async def test_auto_turns_the_gate_on_when_the_server_can_honour_it() -> None:
    """AOF switched on at runtime on a server with WAITAOF: the next check gates submits."""
    with private_server("valkey-server", aof=False) as server:
        sync = SyncRedis.from_url(server.url)
        async with store_on(server.url) as store:
            metrics = Metrics()
            turned_on: list[Gate] = []
            w = watch(store, metrics)
            w.on_gate = turned_on.append
            assert await w.start() is None
            assert current(metrics) == ("off", "off", "at_risk")

            await switch_aof_on(sync)
            report = await w.check()
            assert turned_on == [Gate("WAITAOF", 1, 0, 1000)]
            assert w.gate == turned_on[0]
            assert (report.mode, report.marks) == ("waitaof", "fsynced")
            assert current(metrics)[0] == "waitaof"

            # The gate is never weakened: AOF off again holds every submit instead.
            sync.config_set("appendonly", "no")
            report = await w.check()
            assert turned_on == [Gate("WAITAOF", 1, 0, 1000)]
            assert (report.mode, report.held) == ("waitaof", True)
            assert "every submit waits" in report.detail
        sync.close()


async def test_an_explicit_mode_is_never_changed_by_a_check() -> None:
    with private_server("valkey-server", aof=False) as server:
        sync = SyncRedis.from_url(server.url)
        async with store_on(server.url) as store:
            w = watch(store, Metrics(), durability="off")
            w.on_gate = lambda gate: pytest.fail(f"gate turned on: {gate}")
            assert await w.start() is None
            await switch_aof_on(sync)
            report = await w.check()
            assert w.gate is None
            assert report.mode == "off"
            assert report.detail.startswith('no gate (durability = "off"); appendfsync everysec')
        sync.close()


async def test_run_rechecks_when_asked_without_waiting_for_the_interval() -> None:
    with private_server("redis-server", "--appendfsync", "everysec") as server:
        sync = SyncRedis.from_url(server.url)
        async with store_on(server.url) as store:
            metrics = Metrics()
            w = watch(store, metrics, durability_check_interval="1h")
            await w.start()
            async with anyio.create_task_group() as tg:
                tg.start_soon(w.run)
                sync.config_set("appendfsync", "always")
                w.recheck_soon()  # what the heartbeat does after a reconnect

                async def fsynced() -> bool:
                    return current(metrics)[2] == "fsynced"

                await wait_until(fsynced, "the re-check to report fsynced")
                tg.cancel_scope.cancel()
        sync.close()


async def test_a_failed_recheck_keeps_the_last_report_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with private_server("redis-server", "--appendfsync", "everysec") as server:
        async with store_on(server.url) as store:
            metrics = Metrics()
            w = watch(store, metrics, durability_check_interval="1h")
            await w.start()
            before = w.report
            server.kill()
            with pytest.raises(StoreUnavailable):
                await w.check()
            assert w.report == before
            assert current(metrics) == ("off", "everysec", "at_risk")
            with caplog.at_level(logging.INFO, logger="asynctaskd.durability"):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(w.run)
                    for _ in range(2):  # the loop outlives a failed check
                        failures = len(logged(caplog))
                        w.recheck_soon()

                        async def failed(n: int = failures) -> bool:
                            return len(logged(caplog)) > n

                        await wait_until(failed, "a failed re-check to be logged")
                    tg.cancel_scope.cancel()
            assert "durability re-check failed" in logged(caplog)[-1].getMessage()
            assert w.report == before
