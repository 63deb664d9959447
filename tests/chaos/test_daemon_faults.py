"""SIGKILLed daemons and a restarted Redis: nothing submitted twice, nothing lost."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.embedded import ServerProcess
from asynctaskd.model import Status
from tests.chaos.harness import (
    Daemons,
    check_history,
    counts,
    create_tasks,
    daemon_config,
    ever_parked,
    settled,
)
from tests.conftest import wait_until_sync

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


@pytest.fixture
def slow_vendor() -> Iterator[FakeVendorProcess]:
    # Submits take long enough that kills land inside them.
    behaviour = Behaviour(
        submit_latency=0.05, query_latency=0.02, latency_jitter=0.05, polls_to_done=3, seed=7
    )
    with FakeVendorProcess.start(behaviour) as vendor:
        yield vendor


def vendor_calls(vendor: FakeVendorProcess) -> int:
    """Submits and polls that reached the vendor so far."""
    return len(vendor.submit_log()) + sum(job["polls"] for job in vendor.jobs())


def _kill_through_the_traffic(
    daemons: Daemons, vendor: FakeVendorProcess, url: str, ids: list[str], done: Any
) -> None:
    """SIGKILL a random daemon at each sixteenth of the vendor traffic (a submit and 3 polls
    per task), then wait for `done`: kills land among submits and among polls however fast
    the host is. The marks are fixed: a harness slower than the daemons (a loaded host)
    kills at the next check instead of letting the traffic run on without kills."""
    rng = random.Random(11)
    step = len(ids) * 4 // 16
    for mark in range(step, len(ids) * 4, step):
        wait_until_sync(
            lambda m=mark: vendor_calls(vendor) >= m or done(),
            "more vendor traffic",
            timeout=60,
        )
        if done():
            break
        daemons.kill_random_and_restart(rng)
    wait_until_sync(done, "every task settled", timeout=90)


def test_sigkill_daemons_mid_submit_and_mid_poll(
    tmp_path: Path, aof_server: ServerProcess, slow_vendor: FakeVendorProcess
) -> None:
    ids = create_tasks(aof_server.url, 2000)
    daemons = Daemons(daemon_config(tmp_path, aof_server.url, slow_vendor.url), 3)
    daemons.start_all()
    try:
        _kill_through_the_traffic(
            daemons, slow_vendor, aof_server.url, ids, lambda: settled(aof_server.url, ids)
        )
    finally:
        codes = daemons.stop_all()
    assert codes == [0, 0, 0], daemons.logs()
    statuses = check_history(aof_server.url, ids, slow_vendor.submit_log())
    assert daemons.kills >= 5
    assert statuses[Status.SUCCEEDED] + statuses[Status.SUBMIT_UNKNOWN] == 2000, statuses
    parked = len(ever_parked(aof_server.url))
    left = statuses[Status.SUBMIT_UNKNOWN]
    print(f"parked: {parked} ever, {left} at the end (no find: for an operator)")  # noqa: T201


def test_sigkill_daemons_mid_submit_with_find_leaves_nothing_parked(
    tmp_path: Path, aof_server: ServerProcess, slow_vendor: FakeVendorProcess
) -> None:
    """The crash run with a handler that can look its vendor job up: tasks the
    kills park are settled by lookups, every task succeeds, still one vendor job per task.
    The handler's listing lags 0.3 s behind the vendor's creates (within its 2 s
    find_visible_after): a lookup that finds nothing too early asks again, never resubmits."""
    lookups_log = tmp_path / "lookups.log"
    handler = {
        "key": "demo",
        "type": "python",
        "factory": "tests.fakes.findable:make_handler",
        "options": {"base_url": slow_vendor.url, "lag": 0.3, "visible_after": 2.0,
                    "log": str(lookups_log)},
    }  # fmt: skip
    ids = create_tasks(aof_server.url, 2000)
    config = daemon_config(tmp_path, aof_server.url, slow_vendor.url, handler=handler)
    daemons = Daemons(config, 3)
    daemons.start_all()
    terminal = [s.value for s in Status if s.is_terminal]

    def done() -> bool:
        c = counts(aof_server.url)
        return sum(c.get(s, 0) for s in terminal) >= len(ids)

    try:
        _kill_through_the_traffic(daemons, slow_vendor, aof_server.url, ids, done)
    finally:
        codes = daemons.stop_all()
    assert codes == [0, 0, 0], daemons.logs()
    statuses = check_history(aof_server.url, ids, slow_vendor.submit_log())
    assert daemons.kills >= 5
    assert statuses == {Status.SUCCEEDED: 2000}, statuses  # none left SUBMIT_UNKNOWN
    parked = ever_parked(aof_server.url)
    lines = lookups_log.read_text().splitlines() if lookups_log.exists() else []
    found = sum(1 for line in lines if not line.endswith(" -"))
    print(f"parked: {len(parked)} ever, 0 at the end; lookups: {len(lines)} "  # noqa: T201
          f"({found} found a job, {len(lines) - found} found none)")  # fmt: skip
    assert parked, "no kill parked a task: the run did not test the lookups"
    assert len(lines) >= len(parked)


def test_redis_restarted_twice_loses_nothing(
    tmp_path: Path, aof_server: ServerProcess, slow_vendor: FakeVendorProcess
) -> None:
    ids = create_tasks(aof_server.url, 1500)
    daemons = Daemons(daemon_config(tmp_path, aof_server.url, slow_vendor.url), 2)
    daemons.start_all()
    try:
        for _ in range(2):
            # restart in the middle of the traffic: once 150 more submits reached the vendor
            seen = len(slow_vendor.submit_log())
            wait_until_sync(lambda n=seen: len(slow_vendor.submit_log()) >= n + 150,
                            "vendor traffic", 30)  # fmt: skip
            aof_server.restart()
        wait_until_sync(lambda: settled(aof_server.url, ids), "every task settled", timeout=120)
    finally:
        codes = daemons.stop_all()
    assert codes == [0, 0], daemons.logs()
    statuses = check_history(aof_server.url, ids, slow_vendor.submit_log())
    assert statuses[Status.SUCCEEDED] + statuses[Status.SUBMIT_UNKNOWN] == 1500, statuses


def test_ambiguous_submits_of_a_non_idempotent_handler_park_in_submit_unknown(
    tmp_path: Path, aof_server: ServerProcess
) -> None:
    # Never resent blindly: a submit whose answer was lost may have made a job, so the task
    # waits in SUBMIT_UNKNOWN (check_history proves no task was submitted twice).
    behaviour = Behaviour(ambiguous_rate=0.2, ambiguous_delay=3.0, polls_to_done=2, seed=3)
    with FakeVendorProcess.start(behaviour) as vendor:
        ids = create_tasks(aof_server.url, 200)
        daemons = Daemons(daemon_config(tmp_path, aof_server.url, vendor.url), 1)
        daemons.start_all()
        try:
            wait_until_sync(lambda: settled(aof_server.url, ids), "settled", timeout=60)
        finally:
            daemons.stop_all()
        statuses = check_history(aof_server.url, ids, vendor.submit_log())
        ambiguous = sum(1 for e in vendor.submit_log() if e["outcome"] == "ambiguous")
        assert ambiguous > 0 and statuses[Status.SUBMIT_UNKNOWN] >= 1


def test_ambiguous_submits_with_an_idempotent_handler_all_succeed_once(
    tmp_path: Path, aof_server: ServerProcess
) -> None:
    # The vendor honours Idempotency-Key: an ambiguous submit is resent with the same key
    # and the vendor answers with the job it already made.
    behaviour = Behaviour(ambiguous_rate=0.2, ambiguous_delay=3.0, polls_to_done=2, seed=5)
    with FakeVendorProcess.start(behaviour) as vendor:
        ids = create_tasks(aof_server.url, 200)
        daemons = Daemons(daemon_config(tmp_path, aof_server.url, vendor.url, idempotent=True), 1)
        daemons.start_all()
        try:
            wait_until_sync(lambda: settled(aof_server.url, ids), "settled", timeout=90)
        finally:
            daemons.stop_all()
        log = vendor.submit_log()
        statuses = check_history(aof_server.url, ids, log, idempotent=True)
        assert statuses == {Status.SUCCEEDED: 200}, statuses
        assert any(e["outcome"] == "ambiguous" for e in log)
        assert any(e["outcome"] == "deduped" for e in log)
        jobs = {e["ref"]: set() for e in log}
        for e in log:
            if e["outcome"] in ("created", "ambiguous", "deduped"):
                jobs[e["ref"]].add(e["job_id"])
        assert all(len(j) == 1 for j in jobs.values()), "one vendor job per task"
