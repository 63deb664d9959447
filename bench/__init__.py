"""Benchmarks for asynctaskd; `python -m bench [--full]` runs them all (docs/performance.md).

This module holds what the W2-W5 scripts share: the machine line, the Redis ceiling
(`redis-benchmark` EVALSHA of the claim-shaped script of bench/claim_save.py), a daemon
started as `python -m asynctaskd run --config FILE` with its CPU read from /proc, INFO
commandstats deltas, percentiles, and the table + JSON line every bench prints.
Nothing here is imported by the package itself.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from asynctaskd.embedded import ServerProcess, find_binary, free_port  # noqa: E402

# The claim-shaped script of bench/claim_save.py (ZRANGEBYSCORE + HGET + ZADD), kept
# textually identical so both benches measure the same ceiling.
CLAIM_SHAPED = (
    "local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 1) "
    "if #ids > 0 then redis.call('HGET', KEYS[2], 'status') end "
    "redis.call('ZADD', KEYS[1], ARGV[1], 'x') return #ids"
)

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# --- machine -----------------------------------------------------------------------------


def loadavg() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (math.nan, math.nan, math.nan)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def redis_version(port: int) -> str:
    from redis import Redis

    r = Redis(port=port)
    try:
        info = r.info("server")
        name = "valkey" if "valkey_version" in info else "redis"
        return f"{name} {info.get('valkey_version', info['redis_version'])}"
    finally:
        r.close()


def py_loop_ns() -> float:
    """ns per iteration of a plain Python loop (best of 3): a CPU-speed probe, so figures
    from machines of different speed (or load) can be compared."""
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        s = 0
        for i in range(300_000):
            s += i
        best = min(best, time.perf_counter() - t0)
    return round(best / 300_000 * 1e9, 1)


def machine(port: int | None = None) -> dict[str, Any]:
    """The machine line: cores, CPU model, Redis version, Python, load average now."""
    out: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "loadavg": [round(x, 2) for x in loadavg()],
        "py_loop_ns": py_loop_ns(),
    }
    if port is not None:
        out["redis"] = redis_version(port)
    return out


def machine_line(m: dict[str, Any]) -> str:
    la = " ".join(f"{x:.2f}" for x in m["loadavg"])
    redis = f", {m['redis']}" if "redis" in m else ""
    probe = f", py loop {m['py_loop_ns']} ns/iter" if "py_loop_ns" in m else ""
    return f"nproc {m['nproc']}, {m['cpu']}{redis}, Python {m['python']}{probe}, load {la}"


# --- Redis -------------------------------------------------------------------------------


def redis_server() -> ServerProcess:
    """A private redis-server on loopback (no AOF, no RDB), as bench/lifecycle.py uses."""
    binary = find_binary(os.environ.get("BENCH_REDIS_SERVER", "redis-server"))
    if binary is None:
        raise SystemExit("redis-server not found (set BENCH_REDIS_SERVER)")
    return ServerProcess(binary)


def redis_ceiling(port: int, requests: int = 100_000) -> dict[str, float | None]:
    """redis-benchmark EVALSHA/s of the claim-shaped script, 50 clients, plain and -P 16."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {"evalsha_per_s": None, "evalsha_pipelined_per_s": None}
    from redis import Redis

    r = Redis(port=port)
    sha = r.script_load(CLAIM_SHAPED)
    out: dict[str, float | None] = {}
    for name, pipeline, n in (
        ("evalsha_per_s", 1, requests),
        ("evalsha_pipelined_per_s", 16, requests * 2),
    ):
        proc = subprocess.run(
            [
                exe,
                "-p",
                str(port),
                "-n",
                str(n),
                "-c",
                "50",
                "-P",
                str(pipeline),
                "-q",
                "EVALSHA",
                sha,
                "2",
                "bench:z",
                "bench:h",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        m = re.search(r"([\d.]+) requests per second", proc.stdout)
        out[name] = float(m[1]) if m else None
    r.delete("bench:z", "bench:h")
    r.close()
    return out


def commandstats(sync: Any) -> dict[str, int]:
    """Calls per command (INFO commandstats), without INFO itself (the harness's own)."""
    info = sync.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items() if k != "info"}


def commands_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    keys = set(before) | set(after)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    return {k: v for k, v in sorted(delta.items(), key=lambda kv: -kv[1]) if v}


class Monitor:
    """Counts commands with MONITOR on a raw socket: top-level ones (sent by clients, by
    command name) apart from those run inside Lua scripts. MONITOR costs Redis CPU, so
    the benches use it only in a separate accounting pass, never in a timed one."""

    def __init__(self, port: int) -> None:
        import socket
        import threading

        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(b"MONITOR\r\n")
        self.top: dict[str, int] = {}
        self.in_lua: dict[str, int] = {}
        self.lua = 0
        self._stop = False
        self._buf = b""
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        self._ready.wait(5)

    def _read(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                return
            if not chunk:
                return
            data = self._buf + chunk
            lines = data.split(b"\r\n")
            self._buf = lines.pop()
            for line in lines:
                if line == b"+OK":
                    self._ready.set()
                    continue
                i = line.find(b'] "')
                if i < 0:
                    continue
                j = line.find(b'"', i + 3)
                name = line[i + 3 : j].decode(errors="replace").lower()
                if b" lua] " in line:
                    self.lua += 1
                    self.in_lua[name] = self.in_lua.get(name, 0) + 1
                else:
                    self.top[name] = self.top.get(name, 0) + 1

    def stop(self) -> dict[str, Any]:
        time.sleep(0.2)
        self._stop = True
        self.thread.join(5)
        self.sock.close()
        return {
            "top_level": dict(sorted(self.top.items(), key=lambda kv: -kv[1])),
            "in_lua": self.lua,
            "in_lua_by_command": dict(sorted(self.in_lua.items(), key=lambda kv: -kv[1])),
        }


def redis_cpu(sync: Any) -> float:
    info = sync.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


# --- processes ---------------------------------------------------------------------------


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a live process (and its waited-for children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # after the ")" field 3 (state) is index 0: utime=14, stime=15, cutime=16, cstime=17
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / CLK_TCK


def proc_rss_mb(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":", 1)
            out["rss_mb" if key == "VmRSS" else "peak_rss_mb"] = int(value.split()[0]) / 1024
    return out


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_child(
    args: Sequence[str], timeout: float, prefix: Sequence[str] = ()
) -> tuple[dict[str, Any] | None, subprocess.CompletedProcess[str]]:
    """Run `python <args>` (this Python, the project on its path, from its root) after
    `prefix` (valgrind, say): the last JSON line it printed, or None, and the process."""
    proc = subprocess.run(
        [*prefix, sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        cwd=str(ROOT),
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    return (json.loads(lines[-1]) if lines else None), proc


def daemon_config(
    path: Path,
    redis_url: str,
    vendor_url: str,
    *,
    poll_interval: str,
    max_inflight: int,
    metrics_port: int | None = None,
    lease: str = "30s",
) -> Path:
    # How the demo handler calls the vendor: "fetch" (ctx.fetch) or "http" (ctx.http).
    demo_client = os.environ.get("BENCH_DEMO_CLIENT", "fetch")
    metrics = (
        f'enabled = true\nlisten = "127.0.0.1:{metrics_port}"'
        if metrics_port
        else "enabled = false"
    )
    path.write_text(f"""
[redis]
url = "{redis_url}"
durability = "auto"
[worker]
max_inflight = {max_inflight}
lease = "{lease}"
shutdown_grace = "2s"
[retry]
poll_interval = "{poll_interval}"
[metrics]
{metrics}
[log]
level = "warning"
format = "json"
[[handlers]]
key = "demo"
type = "python"
factory = "asynctaskd.devtools.demo:make_handler"
options = {{ base_url = "{vendor_url}", key = "demo", client = "{demo_client}" }}
""")
    return path


class Daemon:
    """`python -m asynctaskd run --config FILE` as a child process, stopped by its PID."""

    def __init__(self, config: Path, redis_url: str) -> None:
        self.config = config
        self.redis_url = redis_url
        self.log = config.with_suffix(".log")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout: float = 20.0) -> Daemon:
        from redis import Redis

        sync = Redis.from_url(self.redis_url)
        sync.delete("atd:handlers")
        with self.log.open("wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "asynctaskd", "run", "--config", str(self.config)],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=child_env(),
                cwd=str(ROOT),
            )
        deadline = time.monotonic() + timeout
        try:
            # Ready once it published its handler keys (heartbeat runs after start-up).
            while not sync.hexists("atd:handlers", "demo"):
                if self.process.poll() is not None:
                    raise RuntimeError(f"daemon exited: {self.log.read_text()[-2000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"daemon not ready in {timeout}s: {self.log.read_text()}")
                time.sleep(0.02)
        finally:
            sync.close()
        return self

    def cpu(self) -> float:
        return proc_cpu(self.pid)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.process = None

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def create_tasks(
    store: Any,
    ids: Sequence[str],
    handler: str,
    params: bytes = b"{}",
    timeout_ms: int = 600_000,
) -> None:
    """Create one task per id through `store` (an asynctaskd Store), 1,000 calls a round
    trip: the setup of the benches that start from tasks already waiting."""
    calls = [store.ops.create(i, handler, params, timeout_ms=timeout_ms) for i in ids]
    for start in range(0, len(calls), 1000):
        await store.run_many(calls[start : start + 1000])


@contextmanager
def workdir(prefix: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        yield Path(d)


def metrics_port() -> int:
    return free_port()


# --- figures -----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of unsorted values; NaN if empty."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def spread(values: Sequence[float]) -> dict[str, float]:
    """min / median / max of a few runs."""
    vs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vs:
        return {"min": math.nan, "median": math.nan, "max": math.nan}
    mid = len(vs) // 2
    median = vs[mid] if len(vs) % 2 else (vs[mid - 1] + vs[mid]) / 2
    return {"min": vs[0], "median": median, "max": vs[-1]}


def fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        a = abs(v)
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 10:
            return f"{v:.1f}"
        if a >= 0.01 or a == 0:
            return f"{v:.3f}"
        return f"{v:.2e}"
    return str(v)


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in header]] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title]
    for n, r in enumerate(cells):
        lines.append(
            "  "
            + "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
        if n == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def emit(name: str, result: dict[str, Any]) -> None:
    """The one JSON line each bench ends with (NaN becomes null)."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and math.isnan(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    print(json.dumps({"bench": name, **clean(result)}), flush=True)  # noqa: T201


def say(text: str) -> None:
    print(text, flush=True)  # noqa: T201


def arun(coro: Any) -> Any:
    """Run a coroutine on uvloop when installed (as the daemon does)."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


class Profiler:
    """py-spy attached to a running PID (non-blocking sampling), raw collapsed output."""

    def __init__(self, pid: int, out: Path, rate: int = 250) -> None:
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not Path(exe).exists():
            raise SystemExit(
                "--profile needs py-spy, a profiler that is not a project dependency: "
                f"{sys.executable} -m pip install py-spy"
            )
        self.out = out
        self.process = subprocess.Popen(
            [
                exe,
                "record",
                "--pid",
                str(pid),
                "--format",
                "raw",
                "--rate",
                str(rate),
                "--nonblocking",
                "-o",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)  # let it attach

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _frame_name(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)"
    m = re.match(r"(.*) \((.*?):\d+\)$", frame.strip())
    if not m:
        return frame.strip()
    return f"{m[1]} ({Path(m[2]).name})"


def profile_summary(path: Path, top: int = 15) -> dict[str, Any]:
    """Self and inclusive sample shares per function from py-spy's raw (collapsed) output."""
    selfs: dict[str, int] = {}
    incl: dict[str, int] = {}
    packages: dict[str, int] = {}
    total = 0
    if not path.exists():
        return {"samples": 0, "self": [], "inclusive": []}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        raw = [f for f in stack.split(";")[1:] if f.strip()]
        frames = [_frame_name(f) for f in raw]
        if not frames:
            continue
        pkg = _package(raw[-1])
        packages[pkg] = packages.get(pkg, 0) + count
        selfs[frames[-1]] = selfs.get(frames[-1], 0) + count
        for name in set(frames):
            incl[name] = incl.get(name, 0) + count

    def ranked(d: dict[str, int]) -> list[tuple[str, float]]:
        return [
            (k, round(100 * v / total, 1))
            for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]
        ]

    return {
        "samples": total,
        "self": ranked(selfs),
        "inclusive": ranked(incl),
        "self_by_package": ranked(packages),
    }


def _package(frame: str) -> str:
    """Top-level package of a frame's file: httpx, aiohttp, asynctaskd, asyncio, ..."""
    m = re.search(r"\((.*?):\d+\)$", frame.strip())
    path = m[1] if m else frame
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    elif "/lib/python3" in path:
        path = path.split("/lib/python3", 1)[1].split("/", 1)[-1]
    return path.split("/", 1)[0].removesuffix(".py")


def peer_python() -> Path | None:
    """The bench-only venv's interpreter (bench/peers/setup.sh), if it exists."""
    venv = Path(os.environ.get("BENCH_VENV", ROOT / ".bench-venv"))
    exe = venv / "bin" / "python"
    return exe if exe.exists() else None
