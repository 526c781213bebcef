# Two entry points that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo lint test bench clean

setup: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch first, so megatron-core does not pull a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/slimpack demo

# ruff.toml holds the rules; `make test` lints first and stops on a finding.
lint: $(STAMP)
	$(BIN)/ruff check .

# Two pytest workers (pytest-xdist): the real-trainer and gloo tests spend much of their time in
# single-threaded imports and process start-up, so a 2-core machine runs two of them at once.
TEST_WORKERS ?= 2

test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) tests

bench: $(STAMP)
	$(BIN)/python benchmarks/planner.py

clean:
	rm -rf $(VENV) build *.egg-info
