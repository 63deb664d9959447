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
