"""Reads lua/*.lua, parses their headers, and prepares them for EVALSHA."""

from __future__ import annotations

import hashlib
import json
import re
from functools import cache
from importlib.resources import files
from typing import Final

import msgspec

from .model import LEGAL_TRANSITIONS

__all__ = [
    "CORE",
    "SCRIPT_NAMES",
    "Script",
    "export_files",
    "includes",
    "legal_table_lua",
    "load_scripts",
]

SCRIPT_NAMES: Final = (
    "create",
    "claim",
    "start",
    "save",
    "create_many",
    "start_many",
    "save_many",
    "renew",
    "release",
    "withdraw",
    "cancel",
    "reap",
    "time_out",
    "resolve",
    "lookup",
    "reconcile",
    "purge",
    "expire",
    "quarantine",
    "pause",
    "resume",
    "take",
    "quota",
    "limits",
    "stage_limits",
    "sync_limits",
)

# The include every script starts with, before the ones it declares.
CORE: Final = "_core"
_INCLUDE_LINE: Final = re.compile(r"^--- @include (_[a-z_]+)$", re.M)

_KEY_LINE: Final = re.compile(r"^-- KEYS\[(\d+)\] (\w+)")
_ARGV_LINE: Final = re.compile(r"^-- ARGV\[(\d+)(\.\.)?\]")


class Script(msgspec.Struct, frozen=True):
    """One atomic operation: its name, header contract and the full source sent to Redis."""

    name: str
    summary: str
    keys: tuple[str, ...]
    argv_count: int  # fixed ARGV slots named in the header
    variadic: bool  # the header names a trailing ARGV[n..] run
    body: str  # the file as written
    includes: tuple[str, ...]  # after _core, in the order they are put in the source
    source: str  # legal table + _core + its includes + body: what Redis runs
    sha: str


def legal_table_lua() -> str:
    """The transition table of model.py as one Lua string constant.

    Each legal (source, target, actor) is a token " SOURCE>TARGET#A "; `legal()` in the
    _guards does a plain string.find. A constant string costs nothing per script call,
    unlike a nested table that Lua would build on every EVALSHA.
    """
    tokens = [
        f"{t.source.value}>{t.target.value}#{actor}"
        for t in LEGAL_TRANSITIONS
        if t.source is not None
        for actor in t.actors
    ]
    return "local LEGAL = ' " + " ".join(sorted(tokens)) + " '\n"


def _read(name: str) -> str:
    return (files("asynctaskd") / "lua" / f"{name}.lua").read_text(encoding="utf-8")


def parse_header(name: str, body: str) -> tuple[str, tuple[str, ...], int, bool]:
    """Return (summary, key names, fixed ARGV count, variadic) from a script header."""
    lines = body.splitlines()
    first = lines[0]
    if not first.startswith(f"-- {name}: "):
        raise ValueError(f"lua/{name}.lua: line 1 must start with '-- {name}: '")
    keys: list[str] = []
    argv = 0
    variadic = False
    for line in lines:
        if not line.startswith("--"):
            break
        if m := _KEY_LINE.match(line):
            if int(m[1]) != len(keys) + 1:
                raise ValueError(f"lua/{name}.lua: KEYS are not numbered 1..n")
            keys.append(m[2])
        elif m := _ARGV_LINE.match(line):
            if m[2]:
                variadic = True
            else:
                if int(m[1]) != argv + 1:
                    raise ValueError(f"lua/{name}.lua: ARGV are not numbered 1..n")
                argv += 1
    return first[len(f"-- {name}: ") :], tuple(keys), argv, variadic


def declared_includes(text: str) -> list[str]:
    """The `--- @include <name>` lines of a script or an include, in order."""
    return _INCLUDE_LINE.findall(text)


def includes(name: str) -> tuple[str, ...]:
    """What lua/<name>.lua needs after _core: its includes and theirs, each once, every
    include after the ones it declares itself (Lua binds a helper's upvalues to the locals
    defined before it)."""
    order: list[str] = []

    def visit(inc: str, path: tuple[str, ...]) -> None:
        if inc in path:
            raise ValueError(f"lua/{inc}.lua: include cycle {' -> '.join((*path, inc))}")
        if inc in order:
            return
        for dep in declared_includes(_read(inc)):
            visit(dep, (*path, inc))
        order.append(inc)

    for dep in declared_includes(_read(name)):
        visit(dep, (name,))
    return tuple(order)


@cache
def load_scripts() -> dict[str, Script]:
    """Every script, parsed once per process."""
    head = legal_table_lua() + _read(CORE)
    out = {}
    for name in SCRIPT_NAMES:
        body = _read(name)
        summary, keys, argv, variadic = parse_header(name, body)
        needs = includes(name)
        parts = "".join(f"\n-- include: {inc}\n{_read(inc)}" for inc in needs)
        source = f"{head}{parts}\n-- script: {name}\n{body}"
        sha = hashlib.sha1(source.encode()).hexdigest()
        out[name] = Script(name, summary, keys, argv, variadic, body, needs, source, sha)
    return out


def export_files(protocol: int) -> dict[str, bytes]:
    """What a producer in another language loads the scripts from, file name -> bytes:
    `<name>.lua` (the exact source Redis runs: its SHA-1 is the script's SHA),
    `manifest.json` ({"protocol", "scripts": {name: {"sha1", "keys", "argv", "variadic"}}})
    and `SHA1SUMS` (as `sha1sum -c` reads it). `asynctaskd scripts export` writes them; the
    copy in protocol/scripts/ is these files, checked by a test (docs/protocol.md, 7)."""
    scripts = sorted(load_scripts().items())
    out = {f"{name}.lua": script.source.encode() for name, script in scripts}
    manifest = {
        "protocol": protocol,
        "scripts": {
            name: {
                "sha1": script.sha,
                "keys": list(script.keys),
                "argv": script.argv_count,
                "variadic": script.variadic,
            }
            for name, script in scripts
        },
    }
    out["manifest.json"] = (json.dumps(manifest, indent=2) + "\n").encode()
    out["SHA1SUMS"] = "".join(f"{s.sha}  {name}.lua\n" for name, s in scripts).encode()
    return out
