"""The mutation catalog stays applicable as the code moves (running it is `make mutants`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.mutation.catalog import MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[1]


def test_names_are_unique_and_the_catalog_is_not_thin() -> None:
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    assert len(MUTANTS) >= 30


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_applies_once_and_names_tests_that_exist(mutant: Mutant) -> None:
    text = (ROOT / mutant.path).read_text(encoding="utf-8")
    assert text.count(mutant.old) == 1, f"{mutant.path} no longer holds the line once"
    assert mutant.new != mutant.old
    assert mutant.tests
    for node in mutant.tests:
        file, _, name = node.partition("::")
        source = ROOT / file
        assert source.is_file(), node
        if name:
            tree = ast.parse(source.read_text(encoding="utf-8"))
            functions = (ast.FunctionDef, ast.AsyncFunctionDef)
            defined = {f.name for f in ast.walk(tree) if isinstance(f, functions)}
            assert name in defined, f"{node}: no such test"
