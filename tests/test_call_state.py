"""A call's state (asynctaskd.worker.call): the legal moves, and what each state owes its
lease, and its cut (asyncio.timeout's rules). A call is entered in a task; the renewal
test at the end renews real leases."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest

from asynctaskd.metrics import Metrics
from asynctaskd.store import Code, Lease, Store
from asynctaskd.worker.call import (
    LOSABLE,
    MOVES,
    Call,
    CallState,
    Cut,
    IllegalMove,
    InFlight,
)
from asynctaskd.worker.leases import Leases
from tests.conftest import wait_until
from tests.lua.helpers import claim_one, create

pytestmark = pytest.mark.anyio

S = CallState


@contextlib.asynccontextmanager
async def running(*path: str) -> AsyncIterator[Call]:
    """A submit call inside its cut, as Worker._run_call runs it, taken along `path`."""
    c = Call(Lease("t1", 1, 1), "submit", "h")
    async with c.cut:  # a lost call's cut is rescheduled: the body must not wait
        walk(c, *path)
        yield c


def state_of(c: Call) -> CallState:  # what mypy does not narrow across moves
    return c.state


def walk(c: Call, *path: str) -> None:
    """Take `c` along `path` (method names; "lose"/"lose_nl" for lose())."""
    for step in path:
        if step == "lose":
            c.lose(no_lease=False)
        elif step == "lose_nl":
            c.lose(no_lease=True)
        elif step == "mark":
            c.mark("tok")
        elif step == "save_ends":
            c.save_ends(landed=False)
        else:
            getattr(c, step)()


@pytest.mark.parametrize(
    ("path", "state", "gives_back"),
    [
        # (moves, state after them, what end() says: None, or withdraw the mark or not)
        (("begin",), S.CALLING, False),
        (("begin", "mark"), S.MARKED, True),  # the vendor was not called: withdraw
        (("begin", "mark", "start"), S.STARTED, False),  # release: the script parks it
        (("begin", "mark", "refused"), S.DONE, None),
        (("begin", "lose"), S.LOST, None),
        (("lose", "begin"), S.LOST, None),  # lost before it began: cut at once
        (("begin", "lose", "mark", "start"), S.LOST, None),  # lost absorbs progress
        (("begin", "mark", "start", "lose_nl"), S.LATE, None),  # may still land late
        (("begin", "mark", "start", "lose"), S.LOST, None),  # a newer fence: pointless
        (("begin", "mark", "lose_nl"), S.LOST, None),  # not started: NO_LEASE cuts it
    ],
)
async def test_paths(path: tuple[str, ...], state: CallState, gives_back: bool | None) -> None:
    async with running(*path) as c:
        assert c.state is state
        assert c.end() == gives_back
        assert c.state is (S.RELEASING if gives_back is not None else state)


@pytest.mark.parametrize(
    "path", [("begin",), ("begin", "mark"), ("begin", "mark", "start"), ("begin", "lose")]
)
@pytest.mark.parametrize("landing", [False, True])
async def test_a_save_that_gives_up_returns_to_where_it_began(
    path: tuple[str, ...], landing: bool
) -> None:
    async with running(*path) as c:
        before = c.state
        if landing and before is S.CALLING:
            with pytest.raises(IllegalMove):  # only a submit's outcome lands
                c.save_begins(landing=True)
            return
        c.save_begins(landing=landing)
        assert c.state is (S.LANDING if landing else S.SAVING)
        assert c.state not in LOSABLE  # a NO_LEASE now may be this very save
        assert c.end() is None  # no release while a save (a landing one) holds the lease
        c.save_ends(landed=False)
        assert c.state is before
        c.save_begins(landing=landing)
        c.save_ends(landed=True)
        assert state_of(c) is S.DONE and c.end() is None


async def test_a_landing_save_whose_call_ended_settles_in_done() -> None:
    async with running("begin", "mark", "start") as c:
        c.save_begins(landing=True)
        assert c.end() is None
    c.save_ends(landed=False, call_over=True)
    assert state_of(c) is S.DONE


async def test_illegal_moves_raise() -> None:
    for path in [
        ("start",),  # CLAIMED -> STARTED
        ("begin", "start"),  # a vendor call without a start mark
        ("begin", "mark", "refused", "begin"),
        ("begin", "mark", "refused", "save_begins"),  # DONE is final
        ("begin", "save_begins", "lose"),  # renewal never finds a saving call lost
        ("begin", "save_ends"),  # no save to end
    ]:
        with pytest.raises(IllegalMove):
            async with running(*path):
                pass


def test_every_state_has_its_moves_and_done_is_final() -> None:
    assert set(MOVES) == set(CallState)
    assert MOVES[S.DONE] == frozenset()
    assert {S.CLAIMED, S.CALLING, S.MARKED, S.STARTED, S.RELEASING} == LOSABLE


async def test_renewal_asks_only_for_leases_a_renewal_can_keep(store: Store) -> None:
    """A call found LOST or LATE holds no lease any more: renewing it again each pass would
    only cost Redis; a call that still holds its lease keeps being renewed."""
    held, lost, late = [], [], []
    for calls in (held, lost, late):
        await create(store)
        calls.append(Call((await claim_one(store, lease_ms=60_000)).lease, "submit", "h"))
    inflight = InFlight(10)
    for c in (*held, *lost, *late):
        inflight.active[c.lease.task_id] = c
    held[0].begin()
    lost[0].lose(no_lease=False)  # found lost before it began (a cut call would be cut)
    late[0].begin()
    late[0].mark("t")
    late[0].start()
    late[0].lose(no_lease=True)
    assert (state_of(lost[0]), state_of(late[0])) == (S.LOST, S.LATE)
    asked: list[list[str]] = []
    renew = store.renew

    async def spy(lease_ms: int, leases: list[Lease]) -> dict[str, Code]:
        asked.append([lease.task_id for lease in leases])
        return await renew(lease_ms, leases)

    store.renew = spy  # type: ignore[method-assign]  # the real renew, watched
    leases = Leases(store, Metrics(), inflight, lease_ms=300)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(leases.renew_loop)
            await wait_until(lambda: _async(len(asked) >= 2), "two renewal passes")
            tg.cancel_scope.cancel()
    assert asked[:2] == [[held[0].lease.task_id]] * 2
    assert state_of(held[0]) is S.CALLING  # renewed: not found lost


async def _async(value: bool) -> bool:
    return value


# --- the cut: asyncio.timeout's rules (a Cut is a slimmed copy of it) -----------------


async def _cut_at(cut: Cut, when: float, wait: float) -> None:
    """Enter `cut`, set it to fire at loop time `when`, then wait `wait` seconds."""
    async with cut:
        cut.reschedule(when)
        await asyncio.sleep(wait)


async def test_a_cut_that_fires_leaves_its_block_as_timeout_error() -> None:
    cut = Cut()
    assert cut.when() is None and not cut.expired()
    with pytest.raises(TimeoutError):
        await _cut_at(cut, asyncio.get_running_loop().time() + 0.01, 10)
    assert cut.expired()
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # its cancellation was taken back


async def test_a_cut_rescheduled_to_none_does_not_fire() -> None:
    cut = Cut()
    async with cut:
        cut.reschedule(asyncio.get_running_loop().time() + 0.01)
        cut.reschedule(None)
        assert cut.when() is None
        await asyncio.sleep(0.05)
    assert not cut.expired()


async def test_a_cut_in_the_past_fires_on_the_next_pass() -> None:
    with pytest.raises(TimeoutError):
        await _cut_at(Cut(), 0.0, 0)  # one pass of the loop: the cut fired in it


async def test_a_cut_leaves_a_cancellation_from_elsewhere_as_it_is() -> None:
    """Cut and cancelled by someone else at once: the cancellation is not the cut's to
    turn into a timeout (asyncio.timeout's rule), so the task stays cancelled."""

    async def body(cut: Cut) -> None:
        async with cut:
            cut.reschedule(0.0)
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # another cancellation besides the cut's
            await asyncio.sleep(10)

    cut = Cut()
    task = asyncio.ensure_future(body(cut))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cut.expired()


async def test_a_cut_is_entered_once_and_rescheduled_only_while_entered() -> None:
    cut = Cut()
    with pytest.raises(RuntimeError):
        cut.reschedule(None)
    async with cut:
        pass
    with pytest.raises(RuntimeError):
        cut.reschedule(None)
    with pytest.raises(RuntimeError):
        async with cut:
            pass


async def test_a_deadline_later_than_arm_by_is_noted_a_sooner_one_armed_none_disarms() -> None:
    loop = asyncio.get_running_loop()
    async with running("begin") as c:
        now = loop.time()
        c.set_deadline(now + 100, now + 30)  # past the lease: only noted
        assert (c.deadline, c.cut.when()) == (now + 100, None)
        c.set_deadline(now + 10, now + 30)  # sooner: armed
        assert (c.deadline, c.cut.when()) == (now + 10, now + 10)
        c.set_deadline(None)  # lifted: disarmed
        assert (c.deadline, c.cut.when()) == (None, None)
        c.set_deadline(now + 100, now + 30)
        c.arm_near(now + 200)  # the noted one comes near: armed
        assert c.cut.when() == now + 100
        c.set_deadline(None)
        assert c.cut.when() is None
    async with running("begin", "lose") as c:  # lost: cut now, a deadline changes nothing
        armed = c.cut.when()
        c.set_deadline(now + 10, now + 30)
        c.set_deadline(None)
        assert c.deadline is None and c.cut.when() == armed
    cut_short: list[Call] = []

    async def past_deadline() -> None:
        async with running("begin") as c:
            cut_short.append(c)
            c.set_deadline(loop.time() - 1, loop.time())  # past: fires on the next pass
            await asyncio.sleep(0.1)

    with pytest.raises(TimeoutError):
        await past_deadline()
    c = cut_short[0]
    assert c.cut.expired()
    c.set_deadline(None)  # expired: left as it is
    assert c.cut.when() is not None


async def test_a_cut_told_its_loop_finds_its_task_and_cuts_it_as_one_that_asks() -> None:
    loop = asyncio.get_running_loop()

    async def cut_short(cut: Cut) -> None:
        async with cut:
            cut.reschedule(loop.time() + 0.01)
            await asyncio.sleep(1)

    for cut in (Cut(), Cut(loop)):
        with pytest.raises(TimeoutError):
            await cut_short(cut)
        assert cut.expired()
    call = Call(Lease("t1", 1, 1), "query", "h", loop)
    assert call.loop is loop
    async with call.cut:
        call.begin()
    assert Call(Lease("t1", 1, 1), "query", "h").loop is None
