"""Script headers vs bodies vs Store vs docs/protocol.md, without Redis."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from asynctaskd.model import LEGAL_TRANSITIONS, Status
from asynctaskd.scripts import LIBRARIES, SCRIPT_NAMES, load_scripts
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
    # a script that hands its whole ARGV to its library (offset 0) reads ARGV[k] there as
    # A[o + k]
    if "ARGV, 0, #ARGV)" in code:
        for lib in LIBRARIES[name]:
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

    prelude = (ROOT / "lua" / "_prelude.lua").read_text()
    (span,) = re.findall(r"^local PRIO_SPAN = (\d+)", prelude, re.M)
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
