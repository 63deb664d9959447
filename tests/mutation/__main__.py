"""Run the mutation catalog: `python -m tests.mutation [--only a,b] [-j 2] [--all-servers]`.

Each mutant is applied to a private copy of the repository (the files git knows of, plus
untracked ones not ignored), the tests it names run there with the copy first on
PYTHONPATH (so daemons the tests start import the mutated code too), and the file is put
back. pytest exiting 1 (a test failed) kills the mutant; exiting 0 means it survived; any
other exit (no such test, a collection error, a timeout) is an error of the catalog. First
the named tests run once on the unmutated copy and must pass: a mutant "killed" by a test
that fails anyway proves nothing.

Exit status: 0 when every mutant was killed and the baseline passed, else 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.mutation.catalog import MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[2]


def say(text: str) -> None:
    print(text)  # noqa: T201 - a command-line report


@dataclass
class Outcome:
    mutant: Mutant
    verdict: str  # killed | survived | error
    seconds: float
    detail: str = ""


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked-not-ignored files)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        rel = raw.decode()
        src, dst = ROOT / rel, dest / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree, not yet in the index
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)


def pytest_command(tests: tuple[str, ...], all_servers: bool) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", *tests, "-x", "-q", "--no-header", "-p", "no:randomly"]
    cmd += ["-p", "no:cacheprovider", "--run-slow", "--run-chaos", "--tb=line"]
    if not all_servers:
        cmd += ["-k", "not valkey"]
    return cmd


def run_tests(
    copy: Path, tests: tuple[str, ...], all_servers: bool, timeout: float
) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_ADDOPTS", None)
    try:
        proc = subprocess.run(
            pytest_command(tests, all_servers),
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout:.0f} s"
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
    return proc.returncode, tail


def check_copy(copy: Path) -> None:
    """The copy's package is the one imported there, not the installed one."""
    env = dict(os.environ, PYTHONPATH=str(copy))
    out = subprocess.run(
        [sys.executable, "-c", "import asynctaskd; print(asynctaskd.__file__)"],
        cwd=copy,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not Path(out).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"mutation: the copy imports asynctaskd from {out}, not from {copy}")


def try_mutant(copy: Path, m: Mutant, all_servers: bool, timeout: float) -> Outcome:
    path = copy / m.path
    original = path.read_text(encoding="utf-8")
    if original.count(m.old) != 1:
        found = original.count(m.old)
        return Outcome(m, "error", 0.0, f"{m.path}: the line to mutate occurs {found} times")
    path.write_text(original.replace(m.old, m.new), encoding="utf-8")
    started = time.monotonic()
    try:
        rc, tail = run_tests(copy, m.tests, all_servers or m.all_servers, timeout)
    finally:
        path.write_text(original, encoding="utf-8")
    seconds = time.monotonic() - started
    if rc == 1:
        return Outcome(m, "killed", seconds)
    if rc == 0:
        return Outcome(m, "survived", seconds, "every named test passed with the mutant in place")
    return Outcome(m, "error", seconds, f"pytest exited {rc}: {tail}")


def main(argv: list[str] | None = None) -> int:
    doc = (__doc__ or "").splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m tests.mutation", description=doc)
    parser.add_argument("--only", help="comma list of mutant names")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="mutants at once")
    parser.add_argument("--all-servers", action="store_true", help="valkey-server too")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("--list", action="store_true", help="print the catalog and exit")
    args = parser.parse_args(argv)

    mutants = list(MUTANTS)
    if args.only:
        wanted = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = wanted - {m.name for m in mutants}
        if unknown:
            parser.error(f"no mutant named {', '.join(sorted(unknown))} (see --list)")
        mutants = [m for m in mutants if m.name in wanted]
    if args.list:
        for m in mutants:
            say(f"{m.name:36} {m.path:28} {m.rule}")
        return 0

    jobs = max(1, min(args.jobs, len(mutants)))
    with tempfile.TemporaryDirectory(prefix="asynctaskd-mutants-") as tmp:
        copies = [Path(tmp) / f"copy{i}" for i in range(jobs)]
        for c in copies:
            copy_tree(c)
        check_copy(copies[0])
        started = time.monotonic()
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
            both = tuple(dict.fromkeys(t for m in mutants if m.all_servers for t in m.tests))
            for names, on_both in ((tests, args.all_servers), (both, True)):
                if not names or (on_both and names is both and args.all_servers):
                    continue
                rc, tail = run_tests(copies[0], names, on_both, args.timeout * 2)
                if rc != 0:
                    say(f"baseline: the named tests fail without any mutant (exit {rc}):\n{tail}")
                    return 1
            took = time.monotonic() - started
            say(f"baseline: {len(tests)} named tests pass unmutated ({took:.0f} s)")

        free = list(copies)
        outcomes: list[Outcome] = []
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            pending: dict[concurrent.futures.Future[Outcome], Path] = {}
            queue = list(mutants)
            while queue or pending:
                while queue and free:
                    copy = free.pop()
                    m = queue.pop(0)
                    fut = pool.submit(try_mutant, copy, m, args.all_servers, args.timeout)
                    pending[fut] = copy
                done, _ = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
                for fut in done:
                    free.append(pending.pop(fut))
                    o = fut.result()
                    outcomes.append(o)
                    line = f"{o.verdict:8} {o.seconds:6.1f} s  {o.mutant.name}"
                    say(line if o.verdict == "killed" else f"{line}\n         {o.detail}")

    bad = [o for o in outcomes if o.verdict != "killed"]
    total = time.monotonic() - started
    say(f"\n{len(outcomes) - len(bad)}/{len(outcomes)} mutants killed in {total:.0f} s")
    for o in bad:
        say(f"  {o.verdict}: {o.mutant.name} ({o.mutant.path}): {o.mutant.rule}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
