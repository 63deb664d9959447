"""Script headers vs bodies vs Store vs docs/protocol.md, without Redis."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from asynctaskd.model import LEGAL_TRANSITIONS, Status
from asynctaskd.scripts import CORE, SCRIPT_NAMES, declared_includes, load_scripts
from asynctaskd.store import Code, Ops

ROOT = Path(__file__).resolve().parents[2]


def test_every_lua_file_is_a_known_script() -> None:
    on_disk = {p.stem for p in (ROOT / "lua").glob("*.lua") if not p.stem.startswith("_")}
    assert on_disk == set(SCRIPT_NAMES)


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_header_matches_body(name: str) -> None:
    script = load_scripts()[name]
    body = script.body
    assert body.startswith(f"-- {name}: ")
    used_keys = {int(m) for m in re.findall(r"KEYS\[(\d+)\]", _code(body))}
    assert used_keys <= set(range(1, len(script.keys) + 1)), f"{name} uses undeclared KEYS"
    assert script.keys[0] == "prefix", "every script takes the shard prefix first"
    code = _code(body)
    # a script that hands its whole ARGV to an include (offset 0) reads ARGV[k] there as
    # A[o + k]
    if "ARGV, 0, #ARGV)" in code:
        for lib in script.includes:
            lib_code = _code((ROOT / "lua" / f"{lib}.lua").read_text())
            code += re.sub(r"\bA\[o \+ (\d+)\]", r"ARGV[\1]", lib_code)
    used_argv = {int(m) for m in re.findall(r"ARGV\[(\d+)\]", code)}
    if not script.variadic:
        assert used_argv == set(range(1, script.argv_count + 1)), f"{name}: ARGV header/body"
    else:
        assert {a for a in used_argv if a <= script.argv_count} == set(
            range(1, script.argv_count + 1)
        )
    assert "-- Returns" in body, f"{name}: header has no Returns section"


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_return_codes_are_in_the_python_enum(name: str) -> None:
    body = load_scripts()[name].body
    header = body.split("\n\n", 1)[0] if "\n\n" in body else body
    for code in re.findall(r"\{(-\d+)[,}]", header):
        Code(int(code))
    for m in re.finditer(r"\{(-\d+)\} ?([A-Z_]+)", header):
        assert Code(int(m[1])).name == m[2], f"{name}: {m[0]} disagrees with Code"


def test_scripts_and_ops_match_one_to_one() -> None:
    methods = {n for n in dir(Ops) if not n.startswith("_")}
    assert set(SCRIPT_NAMES) <= methods


def test_every_script_is_documented_in_protocol() -> None:
    doc = (ROOT / "docs" / "protocol.md").read_text()
    for name in SCRIPT_NAMES:
        assert f"`{name}`" in doc, f"docs/protocol.md does not describe {name}"
    for code in Code:
        assert f"`{code.value}`" in doc and code.name in doc, f"protocol.md lacks code {code}"
    for status in Status:
        assert status.value in doc


def test_no_unbounded_commands() -> None:
    for name in SCRIPT_NAMES:
        code = _code(load_scripts()[name].body)
        assert "'KEYS'" not in code and "'SCAN'" not in code
        for m in re.finditer(r"'ZRANGEBYSCORE'[^\n]*", code):
            assert "LIMIT" in m[0], f"{name}: unbounded ZRANGEBYSCORE"


def test_legal_table_has_no_duplicates_and_terminal_sources_only_requeue() -> None:
    seen = set()
    for t in LEGAL_TRANSITIONS:
        assert (t.source, t.target) not in seen
        seen.add((t.source, t.target))
        if t.source is not None and t.source.is_terminal:
            assert t.target is Status.PENDING_SUBMIT and t.actors == "O"


def _code(body: str) -> str:
    return "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("--"))


def test_the_ready_score_band_is_the_same_in_python_and_lua() -> None:
    from asynctaskd.keys import READY_BAND

    schedule = (ROOT / "lua" / "_schedule.lua").read_text()
    (span,) = re.findall(r"^local PRIO_SPAN = (\d+)", schedule, re.M)
    assert int(span) == READY_BAND == 2**42


def test_the_transition_table_in_protocol_md_is_the_model() -> None:
    doc = (ROOT / "docs" / "protocol.md").read_text()
    start = doc.index("| source | target | actors | why | script(s) |")
    rows = doc[start : doc.index("\n\n", start)].splitlines()[2:]
    documented = set()
    for row in rows:
        source, target, actors, why, _ = (c.strip() for c in row.strip("|").split("|"))
        documented.add((None if source == "(none)" else source, target, actors, why))
    model = {
        (t.source.value if t.source else None, t.target.value, t.actors, t.why)
        for t in LEGAL_TRANSITIONS
    }
    assert documented == model, (documented - model, model - documented)
    assert len(rows) == len(LEGAL_TRANSITIONS)


def test_every_task_field_the_code_reads_or_writes_is_in_protocol_md() -> None:
    doc = (ROOT / "docs" / "protocol.md").read_text()
    section = doc[doc.index("## 4. Task hash fields") : doc.index("## 5. Statuses")]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", section, re.M))
    codec = (ROOT / "asynctaskd" / "codec.py").read_text()
    read_by_codec = set(re.findall(r'get\(b"([a-z_]+)"\)', codec))
    save = (ROOT / "lua" / "_save.lua").read_text()
    writable = re.search(r"local WRITABLE = \{(.*?)\}", save, re.S)
    assert writable is not None
    written_by_save = set(re.findall(r"([a-z_]+) = true", writable.group(1)))
    assert read_by_codec and written_by_save
    assert read_by_codec - documented == set()
    assert written_by_save - documented == set()


# Includes (lua/_*.lua): a script declares what it uses with `--- @include <name>` lines;
# the loader puts _core first, then each include after its own. A helper that a script
# calls without including it would be a global at run time (an error, on the path that
# calls it); one included but unused costs every call a closure.


def _lua_code(text: str) -> str:
    """Code without comments and with string literals emptied: what names a file uses."""
    lines = [line.split("--")[0] for line in text.splitlines()]
    return re.sub(r"'[^'\n]*'", "''", "\n".join(lines))


def _defined(text: str) -> set[str]:
    code = _lua_code(text)
    names = set(re.findall(r"^local function (\w+)", code, re.M))
    for group in re.findall(r"^local ([\w ,]+?)\s*(?:=|$)", code, re.M):
        names |= {n.strip() for n in group.split(",")}
    return names


def _includes_on_disk() -> dict[str, str]:
    return {p.stem: p.read_text() for p in (ROOT / "lua").glob("_*.lua")}


def _owners() -> dict[str, str]:
    owner: dict[str, str] = {}
    for inc, text in _includes_on_disk().items():
        for name in _defined(text):
            assert name not in owner, f"{name} is defined in {owner.get(name)} and {inc}"
            owner[name] = inc
    return owner


def _uses(text: str, owner: dict[str, str], own: set[str]) -> set[str]:
    """The includes whose top-level names `text` uses (its own names aside)."""
    words = set(re.findall(r"\b\w+\b", _lua_code(text)))
    return {owner[w] for w in words if w in owner and w not in own}


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_a_script_carries_every_include_it_uses_each_before_its_users(name: str) -> None:
    owner = _owners()
    on_disk = _includes_on_disk()
    units = [CORE, *load_scripts()[name].includes]
    for i, unit in enumerate([*units, name]):
        text = on_disk[unit] if unit.startswith("_") else load_scripts()[name].body
        own = _defined(text) if unit.startswith("_") else set()
        needed = _uses(text, owner, own) - {unit}
        missing = needed - set(units[:i])
        assert not missing, f"{name}: {unit} uses {sorted(missing)} without including it"


@pytest.mark.parametrize("unit", [*SCRIPT_NAMES, *sorted(set(_includes_on_disk()) - {CORE})])
def test_every_declared_include_is_used_by_the_file_that_declares_it(unit: str) -> None:
    owner = _owners()
    text = (ROOT / "lua" / f"{unit}.lua").read_text()
    own = _defined(text) if unit.startswith("_") else set()
    declared = declared_includes(text)
    assert len(declared) == len(set(declared)), f"{unit} declares an include twice"
    assert CORE not in declared, "_core comes first in every script without being declared"
    used = _uses(text, owner, own)
    assert set(declared) == used - {CORE}, (
        f"lua/{unit}.lua: declare exactly what it uses: "
        f"unused {sorted(set(declared) - used)}, undeclared {sorted(used - {CORE} - set(declared))}"
    )


def test_every_include_is_used_by_some_script() -> None:
    used = {inc for s in load_scripts().values() for inc in s.includes}
    assert set(_includes_on_disk()) - {CORE} == used


def test_a_script_source_is_legal_core_includes_body_in_that_order() -> None:
    on_disk = _includes_on_disk()
    for name, script in load_scripts().items():
        expected = "".join(
            [
                script.source.split("\n", 1)[0] + "\n",  # the LEGAL line
                on_disk[CORE],
                *(f"\n-- include: {inc}\n{on_disk[inc]}" for inc in script.includes),
                f"\n-- script: {name}\n{script.body}",
            ]
        )
        assert script.source == expected


# The doc against the scripts, both ways: a reply code, a task field or a status
# move that exists in one and not the other fails one of the tests below.

_TASK_KEY = re.compile(r"^(tk|KEYS\[2\]|P \.\. 'task:' \.\. \w+|task_key\(\w+\))$")
_LITERAL = re.compile(r"^'([a-z_]+)'$")


def _call_args(code: str, command: str) -> list[tuple[str, list[str]]]:
    """(command, top-level arguments) of every `redis.call('<command>...', ...)` in `code`."""
    out = []
    for m in re.finditer(rf"redis\.call\('({command})', ", code):
        depth, args, arg, i = 0, [], "", m.end()
        while depth or code[i] != ")":
            ch = code[i]
            depth += (ch in "({[") - (ch in ")}]")
            if ch == "," and not depth:
                args.append(arg.strip())
                arg = ""
            else:
                arg += ch
            i += 1
        out.append((m[1], [*args, arg.strip()]))
    return out


def _task_fields_in_lua() -> set[str]:
    """Every task hash field a script reads or writes by name."""
    fields: set[str] = set()
    for path in (ROOT / "lua").glob("*.lua"):
        code = _code(path.read_text())
        for command, args in _call_args(code, "H[A-Z]+"):
            if not _TASK_KEY.match(args[0]):
                continue
            named = args[1::2] if command == "HSET" else args[1:]
            fields |= {m[1] for a in named if (m := _LITERAL.match(a))}
        # _save builds its HSET and HDEL as tables, from its own names and WRITABLE
        fields |= set(re.findall(r"(?:sets|dels)\[#(?:sets|dels) \+ 1\] = '([a-z_]+)'", code))
        for table in re.findall(r"local (?:WRITABLE|REQUEST_FIELDS) = \{(.*?)\}", code, re.S):
            fields |= set(re.findall(r"([a-z_]+) = (?:true|false)", table))
    return fields


def test_the_task_fields_of_protocol_md_are_those_the_scripts_use() -> None:
    doc = (ROOT / "docs" / "protocol.md").read_text()
    section = doc[doc.index("## 4. Task hash fields") : doc.index("## 5. Statuses")]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", section, re.M))
    in_lua = _task_fields_in_lua()
    assert {"status", "version", "fence", "started_fence", "find", "quarantined"} <= in_lua
    assert in_lua - documented == set(), "fields the scripts use that section 4 lacks"
    assert documented - in_lua == set(), "fields section 4 names that no script uses"


def _documented_codes() -> tuple[dict[int, str], dict[str, set[int]], set[str]]:
    """Section 6: value -> name, script -> the codes it is said to return, and the scripts
    said to reply with data."""
    doc = (ROOT / "docs" / "protocol.md").read_text()
    section = doc[doc.index("## 6. Reply codes") : doc.index("**Errors come before any write.**")]
    names: dict[int, str] = {}
    returned_by: dict[str, set[int]] = {}
    for value, name, scripts in re.findall(
        r"^\| `(-?\d+)` \| ([A-Z_]+) \|.*\| ([^|]*) \|$", section, re.M
    ):
        names[int(value)] = name
        for script in re.findall(r"`(\w+)`", scripts):
            returned_by.setdefault(script, set()).add(int(value))
    data = section[section.rindex("| `-") :].split("reply with data")[0]
    return names, returned_by, set(re.findall(r"`(\w+)`", data.split("\n", 1)[1]))


# Codes a script's includes can return but the script never does, and why.
_UNREACHABLE: dict[str, dict[int, str]] = {
    "withdraw": {Code.WRONG_VERSION: "it saves at the version it has just read"},
}


def _codes_in_lua(name: str) -> set[int]:
    script = load_scripts()[name]
    units = [script.body, *((ROOT / "lua" / f"{i}.lua").read_text() for i in script.includes)]
    code = "\n".join(_code(u) for u in units)
    found = re.findall(r"return \{(-?\d+)[,}]", code)
    found += re.findall(r"out\[#out \+ 1\] = (-?\d+)", code)
    found += [c for pair in re.findall(r" and (-?\d+) or (-?\d+)\}", code) for c in pair]
    return {int(c) for c in found} - set(_UNREACHABLE.get(name, {}))


def test_the_reply_codes_of_protocol_md_are_those_the_scripts_return() -> None:
    names, returned_by, data = _documented_codes()
    assert names == {c.value: c.name for c in Code}, "section 6's table is not store.Code"
    assert data & set(returned_by) == set(), "a script both replies with data and with codes"
    for name in SCRIPT_NAMES:
        if name in data:
            continue
        documented = returned_by.get(name.removesuffix("_many"), set())
        assert documented, f"section 6 says nothing of what {name} replies"
        assert _codes_in_lua(name) == documented, f"{name}: section 6 vs lua/"


# Moves an include makes that a script including it never reaches, and why.
_NOT_MADE: dict[tuple[str, str], str] = {
    ("time_out", "SUBMITTING"): "the intake claims fresh tasks only for a submit claim",
}

_MOVE = re.compile(r"\b(move_status|finish)\(tk, id, (nil|'[A-Z_]+'|\w+(?:\[\d+\])?), '([A-Z_]+)'")


def test_every_move_a_script_makes_by_name_is_in_the_model_and_the_doc_names_the_script() -> None:
    """The moves written with literal statuses (the others go through `legal()` at run
    time): each must be a transition of the model, and section 5 must name the script."""
    doc = (ROOT / "docs" / "protocol.md").read_text()
    start = doc.index("| source | target | actors | why | script(s) |")
    rows = {}
    for row in doc[start : doc.index("\n\n", start)].splitlines()[2:]:
        source, target, _, _, scripts = (c.strip() for c in row.strip("|").split("|"))
        rows[(None if source == "(none)" else source, target)] = set(
            re.findall(r"`(\w+)`", scripts)
        )
    model = {(t.source.value if t.source else None, t.target.value) for t in LEGAL_TRANSITIONS}
    checked = 0
    for name in SCRIPT_NAMES:
        script = load_scripts()[name]
        units = [script.body, *((ROOT / "lua" / f"{i}.lua").read_text() for i in script.includes)]
        for _, source, target in _MOVE.findall("\n".join(_code(u) for u in units)):
            if (name, target) in _NOT_MADE:
                continue
            if source == "nil" and target == "SUBMITTING":
                # taken in and claimed at once: the create, then the claim (section 7)
                moves = [(None, "PENDING_SUBMIT"), ("PENDING_SUBMIT", "SUBMITTING")]
            elif source == "nil" or source.startswith("'"):
                moves = [(None if source == "nil" else source.strip("'"), target)]
            else:  # a source read from the hash: some move into `target` names the script
                into = [s for (_, t), s in rows.items() if t == target]
                assert any(name.removesuffix("_many") in s for s in into), (name, target)
                continue
            for move in moves:
                checked += 1
                assert move in model, f"{name} makes {move}, which the model lacks"
                assert name.removesuffix("_many") in rows[move], f"section 5: {move} by {name}?"
    assert checked


def test_every_error_code_a_script_writes_is_named_in_protocol_md() -> None:
    doc = (ROOT / "docs" / "protocol.md").read_text()
    (row,) = [line for line in doc.splitlines() if line.startswith("| `error_code` |")]
    named = set(re.findall(r"`([A-Z_]+)(?:<STATUS>)?`", row))
    written = set()
    for path in (ROOT / "lua").glob("*.lua"):
        written |= set(re.findall(r"'error_code', '([A-Z_]+)'", _code(path.read_text())))
    assert "INTERRUPTED_IN_SUBMIT" in written
    assert written - named == set(), "error codes the scripts write that section 4 lacks"
