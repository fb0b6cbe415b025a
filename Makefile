# Two commands do all the set-up on a fresh machine with Python 3.11 and pip:
#   make plan   creates .venv, installs soapjax, runs the main job on the embedded default
#   make test   creates .venv, installs soapjax with its test extra, runs the suite
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: plan test test-all install clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	@touch $(STAMP)

install: $(STAMP)

plan: $(STAMP)
	$(BIN)/soapjax plan

# Lint first (ruff: pyflakes, pycodestyle, import order; pyproject's [tool.ruff]), then
# the suite without the `heavy` zoo checks (big models' train steps and default-size summaries;
# every tiny model's train step still runs in tests/test_apply.py), the `timing` ones (this
# machine's own timings, skewed by the other worker) and the `long` ones (tests/long_tests.py:
# the longest checks, each with the faster test that keeps its property in make test).
# make test-all runs them all: run it after changing apply, the simulator or the search.
# Both run the docstring examples of soapjax/ as doctests (pyproject: --doctest-modules).
# The suite runs on two workers (pytest-xdist), a test file per worker at a time (its cached
# traces and compiled steps stay in one process): on the 2-core machines this project is
# built on, 407 s where one process took 641 s (when the suite was a third of its size).
# PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

test: $(STAMP)
	$(BIN)/ruff check soapjax soapjax_zoo soapjax_eval scripts tests
	$(PYTEST) -m "not heavy and not timing and not long" --durations=25 tests soapjax

test-all: $(STAMP)
	$(BIN)/ruff check soapjax soapjax_zoo soapjax_eval scripts tests
	$(PYTEST) tests soapjax

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
