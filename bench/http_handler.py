"""Handler call overhead: the declarative HTTP handler versus the hand-written DemoHandler.

Run with ``python bench/http_handler.py`` (``--help`` for the knobs). Both handlers speak to
the same fake vendor (`asynctaskd.devtools.fakevendor`, its own process, jobs that never finish)
through the same shared client (`asynctaskd.transport.make_http_client`) at the same
concurrency, in one process on one event loop (uvloop when installed). The run times
submits, then queries of the jobs they created, in chunks that alternate between the two
handlers (the order flipping each time), so both see the same load on the machine.

A second table takes the network out: the same calls against an in-memory
`httpx.MockTransport` that answers canned vendor JSON, which leaves only what the handler
itself costs per call (templates, JSON encoding and decoding, pointers, status mapping)
plus httpx's request and response objects.

Every phase stops at its call count or ``--phase-seconds`` (8 s), whichever comes first,
so a run stays under a minute (4 phases, plus the vendor's start and a warm-up). Prints
two tables, then one JSON line ``{"bench": "http_handler", ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
import httpx
import msgspec

from asynctaskd.config import HandlerConfig
from asynctaskd.devtools.demo import DemoHandler
from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
from asynctaskd.handlers import HandlerContext
from asynctaskd.http_handler import build
from asynctaskd.transport import make_http_client

HANDLERS = ("demo (python)", "http (declarative)")


def http_options(base_url: str) -> dict[str, Any]:
    """The fake vendor's protocol as a declarative handler: what DemoHandler does by hand."""
    return {
        "base_url": base_url,
        "submit": {"url": "{base_url}/v1/jobs", "id": "/id",
                   "body": {"input": "{params}", "ref": "{task_id}"}},
        "query": {
            "url": "{base_url}/v1/jobs/{external_id}", "status": "/status",
            "running": ["queued", "running"], "succeeded": ["succeeded"],
            "failed": ["failed", "canceled"], "progress": "/progress", "result": "/result",
            "error_code": "/error/code", "error_message": "/error/message",
        },
        "cancel": {"url": "{base_url}/v1/jobs/{external_id}/cancel"},
    }  # fmt: skip


def make_handlers(base_url: str) -> dict[str, Any]:
    hc = HandlerConfig(key="bench", type="http", options=http_options(base_url))
    return {HANDLERS[0]: DemoHandler("bench", base_url), HANDLERS[1]: build(hc)}


def context(http: httpx.AsyncClient, n: int) -> HandlerContext:
    task_id = f"bench-{n}"
    return HandlerContext(
        task_id=task_id, idempotency_key=task_id, handler="bench", tenant="", account="",
        provider="bench", submit_attempt=1, poll_count=0, deadline_at=time.time() + 3600,
        cancel_requested=False, http=http,
        logger=logging.LoggerAdapter(logging.getLogger("bench"), {}),
    )  # fmt: skip


async def timed(
    calls: int, concurrency: int, budget: float, one: Callable[[int], Awaitable[Any]]
) -> tuple[int, float]:
    """Run `one(i)` for i in range(calls), `concurrency` at a time; (done, seconds)."""
    done = 0
    start = time.perf_counter()
    stop_at = start + budget

    async def worker(first: int) -> None:
        nonlocal done
        for i in range(first, calls, concurrency):
            if time.perf_counter() > stop_at:
                return
            await one(i)
            done += 1

    async with anyio.create_task_group() as tg:
        for w in range(min(concurrency, calls)):
            tg.start_soon(worker, w)
    return done, time.perf_counter() - start


async def compare(
    handlers: dict[str, Any], http: httpx.AsyncClient, concurrency: int, args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """Calls per second of each handler's submit, then query, in alternating chunks.

    Chunks of ``--chunk`` calls alternate between the handlers (the order flips each
    time), so both see the same machine load; each phase stops after ``--calls`` calls per
    handler or ``--phase-seconds``, whichever comes first.
    """
    handles: dict[str, list[dict[str, Any]]] = {name: [] for name in handlers}
    totals = {name: {"submit": [0, 0.0], "query": [0, 0.0]} for name in handlers}

    for phase in ("submit", "query"):
        phase_end = time.perf_counter() + args.phase_seconds
        names = list(handlers)
        while time.perf_counter() < phase_end and totals[names[0]][phase][0] < args.calls:
            for name in names:
                handler, kept = handlers[name], handles[name]

                async def one(
                    i: int, handler: Any = handler, kept: list[Any] = kept, phase: str = phase
                ) -> None:
                    ctx = context(http, i)
                    if phase == "submit":
                        out = await handler.submit({"page": i, "lang": "en"}, ctx)
                        kept.append({"external_id": out.external_id, **out.query})
                    else:
                        await handler.query(kept[i % len(kept)], ctx)

                n, seconds = await timed(args.chunk, concurrency, args.phase_seconds, one)
                totals[name][phase][0] += n
                totals[name][phase][1] += seconds
            names.reverse()
    return {
        name: {phase: n / seconds for phase, (n, seconds) in phases.items()}
        for name, phases in totals.items()
    }


async def against_vendor(url: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    http = make_http_client(max_connections=args.concurrency)
    try:
        handlers = make_handlers(url)
        warm = argparse.Namespace(**{**vars(args), "calls": args.concurrency, "phase_seconds": 5})
        await compare(handlers, http, args.concurrency, warm)  # the pool and both code paths
        return await compare(handlers, http, args.concurrency, args)
    finally:
        await http.aclose()


def canned_vendor(request: httpx.Request) -> httpx.Response:
    """Answers like the fake vendor, without a network: created, or running at 40%."""
    if request.method == "POST":
        return httpx.Response(201, json={"id": "job_1", "status": "queued"})
    return httpx.Response(200, json={"id": "job_1", "status": "running", "progress": 0.4})


async def in_memory(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(canned_vendor)) as http:
        return await compare(make_handlers("http://vendor.invalid"), http, 1, args)


def table(title: str, rows: dict[str, dict[str, float]]) -> str:
    lines = [title, f"{'handler':<22}{'submit calls/s':>16}{'query calls/s':>16}"]
    for name, rates in rows.items():
        lines.append(f"{name:<22}{rates['submit']:>16,.0f}{rates['query']:>16,.0f}")
    demo, http = rows[HANDLERS[0]], rows[HANDLERS[1]]
    ratio = "  ".join(f"{p} {http[p] / demo[p]:.2f}x" for p in ("submit", "query"))
    lines.append(f"{'http / demo':<22}{ratio}")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    behaviour = msgspec.convert({"polls_to_done": 1_000_000}, Behaviour)
    with FakeVendorProcess.start(behaviour) as vendor:
        network = await against_vendor(vendor.url, args)
    memory = await in_memory(args)
    return {"fake_vendor": network, "in_memory": memory}


def _run(coro: Coroutine[Any, Any, dict[str, Any]]) -> tuple[dict[str, Any], str]:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro), "asyncio"
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro), "uvloop"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=20_000, help="max calls per handler/phase")
    parser.add_argument("--chunk", type=int, default=400, help="calls per alternating chunk")
    parser.add_argument("--concurrency", type=int, default=100, help="calls in flight (100)")
    parser.add_argument("--phase-seconds", type=float, default=8.0, help="time cap per phase")
    args = parser.parse_args()
    started = time.perf_counter()
    results, loop = _run(main_async(args))
    out = sys.stdout
    out.write(f"one process, {loop}, concurrency {args.concurrency}, chunks of {args.chunk}\n\n")
    out.write(table("against the fake vendor (separate process, loopback)",
                    results["fake_vendor"]) + "\n\n")  # fmt: skip
    out.write(table("in memory (httpx.MockTransport, 1 in flight): the handler's own cost",
                    results["in_memory"]) + "\n")  # fmt: skip
    summary = {
        "bench": "http_handler",
        "python": platform.python_version(),
        "loop": loop,
        "concurrency": args.concurrency,
        "seconds": round(time.perf_counter() - started, 1),
        **{
            kind: {name: {p: round(r) for p, r in rates.items()} for name, rates in rows.items()}
            for kind, rows in results.items()
        },
    }
    out.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
