# fedps developer commands. `make demo` and `make check` are the README's two commands.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo check test lint typecheck protos protos-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[all,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fedps demo --json demo-summary.json

check: lint typecheck protos-check test

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy fedps crypto clients server tests

protos: $(STAMP)
	PATH=$(BIN):$$PATH bash fedps/proto/generate.sh

protos-check: $(STAMP)
	PATH=$(BIN):$$PATH bash fedps/proto/generate.sh --check

# Four workers share the two cores, each taking one test at a time (slow tests first:
# tests/conftest.py), so that no worker is left alone with a queue of long tests. Four, not
# two: most of a long test is waiting on the processes it started (with two workers the
# suite kept the two cores about 60% busy, every process it started counted), and the other
# workers fill that wait.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 4 --maxschedchunk 1 --durations=20

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
