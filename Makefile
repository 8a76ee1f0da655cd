# Two entry points a fresh machine needs: `make run` and `make test`. `make check` is the quick
# edit–test loop (lint, types, unit tests; no end-to-end tests).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The suite's end-to-end tests mostly wait on the daemons they start: six workers keep two cores busy.
TEST_WORKERS ?= 6

.PHONY: run test check lint types unit install install-test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Stamps: reinstall only when pyproject.toml changed (an editable install picks up code edits).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e . >$(VENV)/install.log 2>&1 \
		|| { cat $(VENV)/install.log; exit 1; }
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]' >$(VENV)/install.log 2>&1 \
		|| { cat $(VENV)/install.log; exit 1; }
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(BIN)/agentd run

lint: install-test
	$(BIN)/ruff check agentd tests bench
	$(BIN)/ruff format --check agentd tests bench

types: install-test
	$(BIN)/mypy

unit: install-test
	$(BIN)/python -m pytest -m "not e2e" -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

check: lint types unit

test: lint types
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

bench: install-test
	$(BIN)/python bench/child_figures.py
	$(BIN)/python bench/provider_overhead.py
	$(BIN)/python bench/swap_latency.py
	$(BIN)/python bench/scale.py
	$(BIN)/python bench/tools.py

clean:
	rm -rf $(VENV) .agentd build *.egg-info
