"""`FakeVendorProcess`: a fake vendor in a child process, started on a free port and
driven from sync code (tests, the demo, benches) through its admin endpoints."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import msgspec

from .server import _JSON, Behaviour, _encode

__all__ = ["FakeVendorProcess"]


class FakeVendorProcess:
    """A fake vendor in a child process, driven from sync code (tests, the demo)."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, workdir: Path) -> None:
        self.process = process
        self.url = url
        self._workdir = workdir
        # Never route admin calls through a proxy from the environment.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @classmethod
    def start(
        cls, behaviour: Behaviour | None = None, *, host: str = "127.0.0.1"
    ) -> FakeVendorProcess:
        """Start `python -m asynctaskd.devtools.fakevendor` on a free port; wait until healthy."""
        workdir = Path(tempfile.mkdtemp(prefix="fakevendor-"))
        port_file = workdir / "port"
        stderr_path = workdir / "stderr"
        argv = [
            sys.executable,
            "-m",
            "asynctaskd.devtools.fakevendor",
            "--host",
            host,
            "--port",
            "0",
        ]
        argv += ["--port-file", str(port_file), *_behaviour_args(behaviour or Behaviour())]
        with stderr_path.open("wb") as stderr:
            process = subprocess.Popen(  # own session: see ServerProcess.start
                argv,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=_child_env(),
                start_new_session=True,
            )
        vendor = cls(process, "", workdir)
        try:
            vendor._wait_until_healthy(port_file, host, deadline=time.monotonic() + 10.0)
        except BaseException:
            vendor.stop()
            raise
        return vendor

    def _wait_until_healthy(self, port_file: Path, host: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"fake vendor exited with status {self.process.returncode}; "
                    f"stderr:\n{self.stderr()}"
                )
            if not self.url and port_file.exists():
                self.url = f"http://{host}:{port_file.read_text()}"
            if self.url:
                with contextlib.suppress(OSError):
                    self._call("GET", "/_health")
                    return
            time.sleep(0.01)
        raise RuntimeError(f"fake vendor not healthy after 10 s; stderr:\n{self.stderr()}")

    def stderr(self) -> str:
        """What the child process has written to stderr so far."""
        with contextlib.suppress(OSError):
            return (self._workdir / "stderr").read_text(errors="replace")
        return ""

    def _call(self, method: str, path: str, body: object = None) -> Any:
        data = None if body is None else _encode(body)
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", _JSON)
        with self._opener.open(request, timeout=5.0) as response:
            return msgspec.json.decode(response.read())

    def configure(self, **changes: Any) -> Behaviour:
        """Change some knobs at runtime; returns the whole new behaviour."""
        try:
            answer = self._call("POST", "/_config", changes)
        except urllib.error.HTTPError as exc:
            raise ValueError(exc.read().decode(errors="replace")) from exc
        return msgspec.convert(answer, Behaviour)

    def submit_log(self) -> list[dict[str, Any]]:
        """Every submit attempt that reached the server, oldest first."""
        log: list[dict[str, Any]] = self._call("GET", "/_log")
        return log

    def jobs(self) -> list[dict[str, Any]]:
        """Every job the server holds, with its poll count and fate."""
        jobs: list[dict[str, Any]] = self._call("GET", "/_jobs")
        return jobs

    def reset(self) -> None:
        """Forget jobs, idempotency keys and the log."""
        self._call("POST", "/_reset")

    def stop(self) -> None:
        """Terminate the process; kill it if it has not exited after 5 s."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _behaviour_args(behaviour: Behaviour) -> list[str]:
    default = Behaviour()
    args: list[str] = []
    for field in msgspec.structs.fields(Behaviour):
        value = getattr(behaviour, field.name)
        if value != getattr(default, field.name):
            args += ["--" + field.name.replace("_", "-"), repr(value)]
    return args


def _child_env() -> dict[str, str]:
    # Let the child import this very package even when the parent found it through
    # sys.path tweaks (pytest rootdir, PYTHONPATH) rather than an install.
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])  # the directory that holds asynctaskd/
    if Path(root).name != "site-packages":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env
