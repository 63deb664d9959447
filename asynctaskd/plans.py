"""Plans: pure generators that describe Redis work as steps, run by either I/O runner.

A plan yields a step (a script `Call`, a pipeline of `Reads`, or a `Pause`) and receives
its reply, or has the error thrown into it; what it returns is the result. `AsyncClient`
runs plans with asyncio and `Client` with blocking sockets, so the logic of each operation
is written once (see asynctaskd.client and asynctaskd.admission).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, TypeAlias, TypeVar

import anyio

from .store import Call, Read, Store, read_many

__all__ = ["Pause", "Reads", "SimplePlan", "advance", "read", "run_on_store"]

T = TypeVar("T")


class Reads:
    """Read commands for one pipeline; `bound` caps the wait for the reply (seconds).

    Also carries the few plain writes that are not task state: group definitions (HSET,
    HDEL), a group's round-robin counter (INCR, DEL) and, once per namespace, the key
    list() cursors are sealed with (SET NX). Task state is only written by the scripts.
    """

    __slots__ = ("bound", "cmds", "share")

    def __init__(self, *cmds: Read, bound: float | None = None, share: str | None = None) -> None:
        self.cmds = cmds
        self.bound = bound
        # Names a cache refresh (always the same commands): a runner that has one with this
        # name in flight may answer from it instead of sending another. Never for a read
        # that must see the caller's own earlier writes.
        self.share = share


class Pause:
    """Sleep this long before the next step (reconnect backoff)."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


SimplePlan: TypeAlias = Generator[Call[Any] | Reads, Any, T]


def read(name: str, *args: Any, **kwargs: Any) -> Read:
    """One read command: a redis-py method name and its arguments."""
    return (name, args, kwargs)


def advance(
    plan: Generator[Any, Any, Any], reply: Any, error: Exception | None
) -> tuple[bool, Any]:
    """Hand a plan its last reply (or error); (True, next step) or (False, its result)."""
    try:
        return True, (plan.throw(error) if error is not None else plan.send(reply))
    except StopIteration as stop:
        return False, stop.value


async def run_on_store(store: Store, plan: Generator[Call[Any] | Reads | Pause, Any, T]) -> T:
    """Run a plan on a daemon's own store: calls one by one, each `Reads` in one pipeline,
    each `Pause` slept. The daemon's admission work needs nothing more (no producer
    client, no caches shared between callers)."""
    reply: Any = None
    error: Exception | None = None
    while True:
        more, step = advance(plan, reply, error)
        if not more:
            result: T = step
            return result
        try:
            if isinstance(step, Call):
                reply, error = await store.run(step), None
            elif isinstance(step, Pause):
                await anyio.sleep(step.seconds)
                reply, error = None, None
            else:
                reply, error = (await read_many(store, step.cmds) if step.cmds else []), None
        except Exception as exc:  # handed to the plan, which re-raises it
            reply, error = None, exc
