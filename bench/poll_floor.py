"""The floor of a poll: the daemon's workload done by the fewest Python lines we can write.

What any daemon of this design must do per vendor call, built straight from the libraries
the project uses (an asyncio protocol, hiredis, httptools, msgspec) and nothing of its own:
claim tasks from Redis in batches (one EVALSHA returns each task's whole hash), run each call
in an asyncio task of its own (at most 100 at once), make the call over a kept-alive HTTP/1.1
connection, decode the vendor's JSON, and save the outcome with one EVALSHA per task, the
saves of a loop turn written together. The workload is bench/daemon_cost.py's: each task is
submitted once (POST) and polled (GET) until the fake vendor says it succeeded.

Left out, on purpose, is everything the daemon does for its guarantees and its operators:
leases, fences and versions (the save checks nothing), the start mark before a submit, a
deadline and a read timeout per call, retries and error mapping, admission, validation of
what Redis and the vendor send, metrics, logging, draining. So its count is below what
any correct daemon can reach: the gap to the daemon's is what those cost and what the
daemon's own layers cost, the room any further speed-up has to work in. (Its claims also
return params on polls, which the daemon's query claims leave out: a little against it.)

`--parts fetch,codec` swaps the daemon's own parts in, to price each: its HTTP client
(`ctx.fetch`) for the bare connection, its codec (a claimed hash decoded into a Task) for a
dict of the hash.

    python bench/poll_floor.py [--tasks 2000] [--polls 8] [--rounds 3] [--parts fetch,codec]
times the daemon (bench/daemon_cost.py's Worker), the floor and the floor with each part,
each in a child process of its own on a fresh Redis and vendor, in alternating order:
process CPU per call from the first claim to the last save (the tasks are written first,
untimed), medians, and each over the floor. Prints a table, then one JSON line
{"bench": "poll_floor", ...}. bench/daemon_cost.py `--floor [--parts ...]` counts the
same subjects in instructions under callgrind.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import statistics
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import hiredis
import httptools
import msgspec

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import emit, machine, machine_line, run_child, say, table

DUE = "floor:due"
PARTS = frozenset({"fetch", "codec"})
# Take up to ARGV[1] ids off the due list; reply with each task's whole hash.
CLAIM = """
local ids = redis.call('LPOP', KEYS[1], ARGV[1])
if not ids then return {} end
local out = {}
for i = 1, #ids do out[i] = redis.call('HGETALL', 'floor:task:' .. ids[i]) end
return out
"""
# Write the outcome; a task not done goes back on the due list.
SAVE = """
redis.call('HSET', 'floor:task:' .. ARGV[1], 'status', ARGV[2], 'handle', ARGV[3],
  'version', ARGV[4])
if ARGV[2] ~= 'SUCCEEDED' then redis.call('RPUSH', KEYS[1], ARGV[1]) end
return {1, ARGV[4]}
"""


def task_hash(task_id: str) -> dict[str, str]:
    """A stored task's fields, as many and as long as a pending task's in the daemon's store."""
    now = str(int(time.time() * 1000))
    return {
        "id": task_id, "handler": "demo", "status": "PENDING_SUBMIT", "created_ms": now,
        "updated_ms": now, "due_ms": now, "deadline_ms": str(int(now) + 600_000),
        "timeout_ms": "600000", "params": '{"n":1}', "priority": "0", "provider": "demo",
        "version": "1", "submit_attempts": "0", "poll_count": "0", "consecutive_errors": "0",
        "throttles": "0", "fence": "0", "owner": "", "dedup": "", "handle": "",
    }  # fmt: skip


class _Redis(asyncio.Protocol):
    """One connection: replies answer the oldest waiting future (RESP2, hiredis)."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            self.waiting.popleft().set_result(reply)

    def send(self, payload: bytes, futures: list[asyncio.Future[Any]]) -> None:
        assert self.transport is not None
        self.waiting.extend(futures)
        self.transport.write(payload)


class _Saves:
    """Saves of one loop turn go out in one write."""

    def __init__(self, redis: _Redis, loop: asyncio.AbstractEventLoop) -> None:
        self.redis = redis
        self.loop = loop
        self.payloads: list[bytes] = []
        self.futures: list[asyncio.Future[Any]] = []

    def add(self, payload: bytes) -> asyncio.Future[Any]:
        if not self.payloads:
            self.loop.call_soon(self.flush)
        future = self.loop.create_future()
        self.payloads.append(payload)
        self.futures.append(future)
        return future

    def flush(self) -> None:
        payloads, futures, self.payloads, self.futures = self.payloads, self.futures, [], []
        self.redis.send(b"".join(payloads), futures)


class _Http(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection, one exchange at a time, parsed by llhttp."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.parser = httptools.HttpResponseParser(self)
        self.chunks: list[bytes] = []
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        assert self.waiter is not None
        self.waiter.set_result((self.parser.get_status_code(), b"".join(self.chunks)))

    def request(self, payload: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self.chunks = []
        self.waiter = self.loop.create_future()
        self.transport.write(payload)
        return self.waiter


class Floor:
    """The daemon of the fewest lines. `parts` swaps the daemon's own parts in, one at a
    time, to price them: "fetch" makes the vendor calls through `ctx.fetch` (the
    project's HTTP client: `make_http_client` and its Fetcher), "codec" decodes each
    claimed hash into a Task with the project's codec (what a claim's reply goes through)."""

    def __init__(
        self, redis: _Redis, vendor: str, inflight: int = 100, parts: frozenset[str] = frozenset()
    ) -> None:
        unknown = parts - PARTS
        if unknown:
            raise ValueError(f"unknown parts {sorted(unknown)}: choose from {sorted(PARTS)}")
        self.vendor = vendor.rstrip("/")
        self.fetch: Any = None
        if "fetch" in parts:
            from asynctaskd.transport import fetcher_for, make_http_client

            self.fetch = fetcher_for(make_http_client())
        self.decode: Any = None
        if "codec" in parts:
            from asynctaskd.codec import decode_flat_task

            self.decode = decode_flat_task
        self.loop = asyncio.get_running_loop()
        self.redis = redis
        self.saves = _Saves(redis, self.loop)
        url = httptools.parse_url(vendor.encode())
        self.host, self.port = url.host.decode(), url.port
        self.head = b"Host: %s:%d\r\n" % (url.host, url.port)
        self.idle: list[_Http] = []
        self.limit = inflight
        self.inflight = 0
        self.slot = asyncio.Event()
        self.done = 0
        self.claims = 0
        self.claim_sha = self.save_sha = ""

    async def prepare(self) -> None:
        self.claim_sha = (await self._call(b"SCRIPT", b"LOAD", CLAIM)).decode()
        self.save_sha = (await self._call(b"SCRIPT", b"LOAD", SAVE)).decode()

    async def _call(self, *args: Any) -> Any:
        future = self.loop.create_future()
        self.redis.send(hiredis.pack_command(args), [future])
        return await future

    async def run(self, tasks: int) -> None:
        async with asyncio.TaskGroup() as calls:
            while self.done < tasks:
                free = self.limit - self.inflight
                if free > 0:
                    claimed = await self._call(b"EVALSHA", self.claim_sha, 1, DUE, free)
                    self.claims += 1
                    for flat in claimed:
                        self.inflight += 1
                        if self.decode is not None:
                            calls.create_task(self.call_task(self.decode(flat)))
                            continue
                        pairs = iter(flat)
                        calls.create_task(self.call(dict(zip(pairs, pairs, strict=True))))
                    if len(claimed) == free:
                        continue
                self.slot.clear()
                await self.slot.wait()
                await asyncio.sleep(0.001)  # let a round's saves land: claims of many

    async def call(self, task: dict[bytes, bytes]) -> None:
        """One call of a claimed hash, as it came from Redis."""
        stored = task[b"handle"]
        job = msgspec.json.decode(stored)["external_id"] if stored else None
        params = msgspec.json.decode(task[b"params"]) if job is None else None
        await self._vendor_call(task[b"id"].decode(), params, job, int(task[b"version"]))

    async def call_task(self, task: Any) -> None:
        """One call of a claimed hash decoded into a Task (the "codec" part)."""
        handle = task.handle
        job = handle["external_id"] if handle else None
        await self._vendor_call(task.id, task.params, job, task.version)

    async def _vendor_call(self, task_id: str, params: Any, job: str | None, version: int) -> None:
        if job is None:
            body = msgspec.json.encode({"input": params, "ref": task_id})
            status, answer = await self._post(b"/v1/jobs", body)
            self._check(status, answer)
            job = msgspec.json.decode(answer)["id"]
            outcome = b"SUBMITTED"
        else:
            status, answer = await self._get(b"/v1/jobs/%s" % job.encode())
            self._check(status, answer)
            view = msgspec.json.decode(answer)
            outcome = b"SUCCEEDED" if view["status"] == "succeeded" else b"RUNNING"
        handle = msgspec.json.encode({"external_id": job})
        reply = await self.saves.add(
            hiredis.pack_command(
                (b"EVALSHA", self.save_sha, 1, DUE, task_id, outcome, handle, version + 1)
            )
        )
        if reply[0] != 1:
            raise RuntimeError(f"the save failed: {reply!r}")
        if outcome == b"SUCCEEDED":
            self.done += 1
        self.inflight -= 1
        self.slot.set()

    @staticmethod
    def _check(status: int, answer: bytes) -> None:
        if status >= 300:
            raise RuntimeError(f"the vendor answered {status}: {answer[:200]!r}")

    async def _post(self, path: bytes, body: bytes) -> tuple[int, bytes]:
        if self.fetch is not None:
            reply = await self.fetch(
                "POST", self.vendor + path.decode(), content=body,
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            return reply.status, reply.content
        conn = self.idle.pop() if self.idle else await self._connect()
        answer = await conn.request(
            b"POST %s HTTP/1.1\r\n%sContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path, self.head, len(body), body)
        )
        self.idle.append(conn)
        return answer

    async def _get(self, path: bytes) -> tuple[int, bytes]:
        if self.fetch is not None:
            reply = await self.fetch("GET", self.vendor + path.decode())
            return reply.status, reply.content
        conn = self.idle.pop() if self.idle else await self._connect()
        answer = await conn.request(b"GET %s HTTP/1.1\r\n%s\r\n" % (path, self.head))
        self.idle.append(conn)
        return answer

    async def _connect(self) -> _Http:
        _, conn = await self.loop.create_connection(lambda: _Http(self.loop), self.host, self.port)
        return conn


async def prepare_floor(
    redis_url: str, vendor_url: str, tasks: int, parts: frozenset[str] = frozenset()
) -> Floor:
    """The floor, ready to run (the companion of bench/daemon_cost.py's `prepare_worker`):
    connected, the tasks' hashes and the due list written, the garbage collector tuned as
    `asynctaskd run` tunes it. Nothing of this is timed or counted."""
    from asynctaskd.daemon import tune_gc

    url = urllib.parse.urlsplit(redis_url)
    _, redis = await asyncio.get_running_loop().create_connection(_Redis, url.hostname, url.port)
    floor = Floor(redis, vendor_url, parts=parts)
    await floor.prepare()
    for start in range(0, tasks, 500):
        ids = [f"t{i:08d}" for i in range(start, min(tasks, start + 500))]
        batch = [
            hiredis.pack_command((b"HSET", f"floor:task:{i}", *_flat(task_hash(i)))) for i in ids
        ]
        batch.append(hiredis.pack_command((b"RPUSH", DUE, *ids)))
        futures = [floor.loop.create_future() for _ in batch]
        redis.send(b"".join(batch), futures)
        await asyncio.gather(*futures)
    tune_gc()
    return floor


def _flat(fields: dict[str, str]) -> list[str]:
    return [part for pair in fields.items() for part in pair]


async def _timed(subject: str, redis_url: str, vendor_url: str, tasks: int) -> dict[str, Any]:
    """Child side: run one subject ("daemon", "floor" or "floor+PART") over `tasks` tasks
    and return its process CPU from the first claim to the last save."""
    if subject == "daemon":
        from bench.daemon_cost import prepare_worker

        worker, finish = await prepare_worker(redis_url, vendor_url, tasks)
        cpu = time.process_time()
        await worker.run_until_idle()
        cpu = time.process_time() - cpu
        statuses = await finish()
        return {"cpu": cpu, "ok": statuses == {"SUCCEEDED": tasks}}
    floor = await prepare_floor(redis_url, vendor_url, tasks, frozenset(subject.split("+")[1:]))
    cpu = time.process_time()
    await floor.run(tasks)
    cpu = time.process_time() - cpu
    return {"cpu": cpu, "ok": floor.done == tasks, "claims": floor.claims}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["child"]:
        import uvloop

        subject, redis_url, vendor_url, tasks = args[1], args[2], args[3], int(args[4])
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            out = runner.run(_timed(subject, redis_url, vendor_url, tasks))
        print(json.dumps(out), flush=True)  # noqa: T201 - read by the parent
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--polls", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--parts", default="", help=f"comma list of the daemon's parts to price: {sorted(PARTS)}"
    )
    parsed = parser.parse_args(args)
    parts = [p for p in parsed.parts.split(",") if p]
    unknown = set(parts) - PARTS
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}: choose from {sorted(PARTS)}")
    result = run(parsed.tasks, parsed.polls, parsed.rounds, parts)
    emit("poll_floor", result)
    return 0 if result["ok"] else 1


def run(tasks: int, polls: int, rounds: int, parts: list[str]) -> dict[str, Any]:
    """Time the daemon, the floor and the floor with each of `parts`, each in a child of
    its own on a fresh Redis and vendor, in alternating order, `rounds` times."""
    from asynctaskd.devtools.fakevendor import Behaviour, FakeVendorProcess
    from asynctaskd.embedded import ServerProcess, find_binary

    binary = find_binary(os.environ.get("BENCH_REDIS_SERVER", "redis-server"))
    if binary is None:
        raise SystemExit("redis-server not found (set BENCH_REDIS_SERVER)")
    subjects = ["daemon", "floor", *(f"floor+{p}" for p in parts)]
    calls = tasks * (1 + polls)
    per_call: dict[str, list[float]] = {s: [] for s in subjects}
    ok = True
    m: dict[str, Any] = {}
    for r in range(rounds):
        order = subjects if r % 2 == 0 else subjects[::-1]
        for subject in order:
            with (
                ServerProcess(binary) as server,
                FakeVendorProcess.start(Behaviour(polls_to_done=polls)) as vendor,
            ):
                m = machine(server.port)
                argv = [str(Path(__file__).resolve()), "child", subject, server.url, vendor.url]
                child, proc = run_child([*argv, str(tasks)], timeout=600)
                jobs = vendor.jobs()
            good = (
                proc.returncode == 0
                and child is not None
                and child["ok"]
                and len(jobs) == tasks
                and all(job["polls"] == polls for job in jobs)
            )
            if child is None or proc.returncode != 0:
                say(f"  {subject} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
            ok = ok and good
            if child is not None:
                per_call[subject].append(child["cpu"] / calls * 1e6)
                say(f"  round {r + 1} {subject:>16}: {per_call[subject][-1]:5.1f} us of CPU a call")
    medians = {s: statistics.median(v) for s, v in per_call.items() if v}
    floor = medians.get("floor", math.nan)
    rows = [
        (s, f"{medians[s]:.1f}", f"{min(per_call[s]):.1f}-{max(per_call[s]):.1f}",
         f"{medians[s] / floor:.2f}x", f"{medians[s] - floor:+.1f}")
        for s in subjects if s in medians
    ]  # fmt: skip
    say(
        table(
            f"Poll floor: {tasks} tasks, a submit and {polls} polls each, process CPU per call, "
            f"medians of {rounds}",
            ["subject", "us/call", "min-max", "/ floor", "us over floor"],
            rows,
        )
    )
    say(f"  every task SUCCEEDED after one submit and {polls} polls: {ok}")
    say(f"  machine: {machine_line(m)}")
    return {
        "machine": m,
        "tasks": tasks,
        "polls": polls,
        "us_per_call": {s: round(v, 2) for s, v in medians.items()},
        "ok": ok,
    }


if __name__ == "__main__":
    sys.exit(main())
