"""The durability gate: which one to use, what it enforces, and what a crash of Redis can lose.

Before a non-idempotent vendor submit the worker marks the task "call started"; the gate
(WAITAOF or WAIT, sent in the same pipeline) makes that mark durable before the vendor is
called. `choose_gate` picks the gate from `[redis] durability` and the server's settings;
`assess` says what the gate enforces and whether a crash can still lose a mark (the
server's `appendfsync` decides that when there is no gate); `DurabilityWatch` does both
at start and again every `durability_check_interval`, and publishes the verdict to the
metrics and the log (the daemon adds it to `/readyz` and to its heartbeat).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import anyio
import msgspec

from .config import RedisConfig
from .errors import StoreUnavailable
from .metrics import Metrics
from .store import Gate, Persistence, Store

__all__ = ["DurabilityWatch", "Report", "assess", "choose_gate"]

logger = logging.getLogger(__name__)

# What the gate enforces: the mark is fsynced locally (WAITAOF 1 ...), acknowledged by
# replicas only (WAIT n, or WAITAOF 0 n), or nothing.
Mode = Literal["waitaof", "wait", "off"]
# The server's AOF fsync policy; "off": AOF is disabled; "unknown": CONFIG GET refused.
Fsync = Literal["always", "everysec", "no", "off", "unknown"]
# How a "call started" mark is kept through a crash of Redis when the vendor is called.
Marks = Literal["fsynced", "replicated", "at_risk", "unknown"]

# (The metrics export each of these states as a label value: the same tuples, in
# asynctaskd.metrics; a test holds the two together.)
_FSYNC: dict[str, Fsync] = {"always": "always", "everysec": "everysec", "no": "no"}
_MARK = '"call started" mark'
_TWICE = "and a lost mark lets the vendor be called twice"


class Report(msgspec.Struct, frozen=True, kw_only=True):
    """What the gate enforces now, and what a crash of Redis can lose."""

    mode: Mode
    gate: str  # the command sent after each started mark ("WAITAOF 1 0"), "" for none
    fsync: Fsync
    marks: Marks
    held: bool  # the gate cannot pass now: every submit waits (DURABILITY_TIMEOUT)
    detail: str  # one line for people: the log, /readyz, `asynctaskd stats`

    @property
    def at_risk(self) -> bool:
        """A crash of Redis can lose a started mark, or nobody can tell."""
        return self.marks in ("at_risk", "unknown")


def _wait_gate(facts: Persistence, timeout_ms: int, wait_replicas: int) -> Gate:
    return Gate("WAIT", 0, max(1, wait_replicas or facts.replicas), timeout_ms)


def choose_gate(
    mode: str, facts: Persistence, timeout_ms: int, wait_replicas: int
) -> tuple[Gate | None, str]:
    """The gate for `[redis] durability = mode` on this server, and why.

    Raises StoreUnavailable for "waitaof" on a server without WAITAOF.
    """
    if mode == "off":
        return None, 'durability = "off"'
    if mode == "waitaof":
        if not facts.has_waitaof:
            raise StoreUnavailable("durability = 'waitaof' but this server has no WAITAOF")
        local = 1 if facts.aof else 0
        return Gate("WAITAOF", local, wait_replicas, timeout_ms), 'durability = "waitaof"'
    if mode == "wait":
        return _wait_gate(facts, timeout_ms, wait_replicas), 'durability = "wait"'
    # auto: the strongest gate that can pass on this server. With `appendfsync no` Redis
    # never fsyncs by itself, so WAITAOF would never confirm and every submit would wait.
    if not facts.aof:
        lacking = "AOF is off"
    elif not facts.has_waitaof:
        lacking = f"the server ({facts.version}) has no WAITAOF"
    elif facts.appendfsync == "no":
        lacking = "appendfsync is no, so WAITAOF would never confirm"
    else:
        return Gate("WAITAOF", 1, wait_replicas, timeout_ms), "auto: AOF on, with WAITAOF"
    if facts.replicas > 0:
        return _wait_gate(facts, timeout_ms, wait_replicas), (
            f"auto: {lacking}; {facts.replicas} replica(s) connected"
        )
    return None, f"auto: {lacking} and no replica is connected"


def _command(gate: Gate) -> str:
    args = (gate.local, gate.replicas) if gate.kind == "WAITAOF" else (gate.replicas,)
    return " ".join((gate.kind, *map(str, args)))


def assess(gate: Gate | None, why: str, facts: Persistence) -> Report:
    """What `gate` enforces on a server that reports `facts`; `why` says how it was chosen."""
    local = gate is not None and gate.kind == "WAITAOF" and gate.local > 0
    mode: Mode = "waitaof" if local else "wait" if gate and gate.replicas > 0 else "off"
    fsync: Fsync = _FSYNC.get(facts.appendfsync, "unknown") if facts.aof else "off"
    n = gate.replicas if gate else 0
    marks: Marks
    if mode == "waitaof":
        marks = "fsynced"
        outcome = f"each {_MARK} is fsynced" + (f" and on {n} replica(s)" if n else "")
        outcome += " before the vendor is called"
    elif fsync == "always":
        marks = "fsynced"
        outcome = f"Redis fsyncs every write before it replies, each {_MARK} included"
    elif mode == "wait":
        marks = "replicated"
        outcome = f"each {_MARK} reaches {n} replica(s) before the vendor is called"
    elif fsync == "unknown":
        marks = "unknown"
        outcome = (
            f"unless it is always, a crash of the Redis host can lose a {_MARK}, {_TWICE} "
            "(allow CONFIG GET, or check appendfsync by hand)"
        )
    else:
        marks = "at_risk"
        outcome = {
            "everysec": f"a crash of the Redis host can lose the last second's {_MARK}s",
            "no": f"a crash of the Redis host can lose {_MARK}s the kernel has not written",
            "off": f"a restart of Redis loses every {_MARK} since its last snapshot",
        }[fsync] + f", {_TWICE}"

    if gate is None:
        gate_text = "no gate"
    elif mode == "off":
        gate_text = f"gate {_command(gate)}, which waits for nothing"
    else:
        gate_text = f"gate {_command(gate)}"
    if fsync == "off":
        fsync_text = "AOF off"
    elif fsync == "unknown":
        fsync_text = f"appendfsync unknown ({facts.refused or 'not reported'})"
    else:
        fsync_text = f"appendfsync {fsync}"

    held = ""
    if local and not facts.aof:
        held = "AOF is off now, so WAITAOF fails"
    elif local and fsync == "no":
        held = "with appendfsync no WAITAOF never confirms"
    elif gate is not None and gate.replicas > facts.replicas:
        held = f"{facts.replicas} of {gate.replicas} replica(s) are connected"
    detail = f"{gate_text} ({why}); {fsync_text}: {outcome}"
    if held:
        detail += f"; {held}: every submit waits (DURABILITY_TIMEOUT)"
    return Report(
        mode=mode,
        gate="" if gate is None else _command(gate),
        fsync=fsync,
        marks=marks,
        held=bool(held),
        detail=detail,
    )


class DurabilityWatch:
    """The daemon's gate, and what it enforces on the server as it is now.

    `start()` chooses the gate; `check()` reads the server again and republishes the
    report (metrics; the log when it changed). The gate is never weakened after start:
    with `durability = "auto"` a gate that was off is turned on when the server can now
    honour one (AOF switched on, a failover to a newer server), and `on_gate` is called
    with it; a gate that is on stays on, so when it cannot pass any more, submits wait
    rather than go out unprotected (the report says so).
    """

    def __init__(
        self,
        store: Store,
        config: RedisConfig,
        metrics: Metrics,
        on_gate: Callable[[Gate], None] | None = None,
    ) -> None:
        self.store = store
        self.mode = config.durability
        self.timeout_ms = round(float(config.durability_timeout) * 1000)
        self.wait_replicas = config.wait_replicas
        self.interval = float(config.durability_check_interval)
        self.metrics = metrics
        self.on_gate = on_gate
        self.gate: Gate | None = None
        self.why = ""
        self.report: Report | None = None
        self._wake = anyio.Event()

    async def start(self) -> Gate | None:
        """Choose the gate and publish the first report; raises what `choose_gate` raises."""
        facts = await self.store.read_persistence()
        self.gate, self.why = choose_gate(self.mode, facts, self.timeout_ms, self.wait_replicas)
        self._publish(assess(self.gate, self.why, facts))
        return self.gate

    async def check(self) -> Report:
        """Read the server again; raises StoreUnavailable when it cannot be read."""
        facts = await self.store.read_persistence()
        if self.mode == "auto" and self.gate is None:
            gate, self.why = choose_gate(self.mode, facts, self.timeout_ms, self.wait_replicas)
            if gate is not None:
                self.gate = gate
                if self.on_gate is not None:
                    self.on_gate(gate)
        report = assess(self.gate, self.why, facts)
        self._publish(report)
        return report

    def recheck_soon(self) -> None:
        """Check at once rather than at the next interval (after a reconnect)."""
        self._wake.set()

    async def run(self) -> None:
        """Check every `interval`, or sooner when asked; never raises for Redis trouble."""
        while True:
            with anyio.move_on_after(self.interval):
                await self._wake.wait()
            self._wake = anyio.Event()
            try:
                await self.check()
            except Exception as exc:  # a failed re-check keeps the last report
                logger.info("durability re-check failed, keeping the last report: %s", exc)

    def _publish(self, report: Report) -> None:
        self.metrics.observe_durability(report.mode, report.fsync, report.marks)
        if report == self.report:
            return
        self.report = report
        level = logging.WARNING if report.at_risk or report.held else logging.INFO
        logger.log(level, "durability: %s", report.detail)
