# Two entry points that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo lint test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch first, so megatron-core does not pull a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

# The other supported megatron-core releases, for the real-trainer tests (tests/test_megatron_releases.py):
# each wheel in its own folder, put first on the trainer's PYTHONPATH (the venv keeps 0.16.1). Their
# metadata says Python >= 3.12; the wheels are pure Python and run on 3.11 (a typing.override shim in
# tests/real_megatron/site), and their dependencies are the venv's.
MEGATRON_RELEASES := 0.17.1 0.18.2 0.19.2
RELEASE_DIRS := $(addprefix $(VENV)/megatron-core/,$(MEGATRON_RELEASES))

$(VENV)/megatron-core/%: $(STAMP)
	rm -rf $@.partial
	$(BIN)/pip install --quiet --no-deps --ignore-requires-python --target $@.partial megatron-core==$*
	mv $@.partial $@

demo: $(STAMP)
	$(BIN)/slimpack demo

# pyproject.toml holds the rules; `make test` lints first and stops on a finding. ruff: style,
# imports, likely bugs; mypy: the package's types.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# Two pytest workers (pytest-xdist): the real-trainer and gloo tests spend much of their time in
# single-threaded imports and process start-up, so a 2-core machine runs two of them at once.
TEST_WORKERS ?= 2

# --dist loadgroup: tests of one release's trainer share a workspace, kept in one worker.
test: lint $(RELEASE_DIRS)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

bench: $(STAMP)
	$(BIN)/python benchmarks/planner.py

clean:
	rm -rf $(VENV) build *.egg-info
