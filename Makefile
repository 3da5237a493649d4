# Two entry points: `make demo` and `make test`. Both create/reuse .venv on their own.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint format venv clean

# torch is pinned to the CPU build that installs from a local file on these machines;
# an unpinned torch would pull a multi-GB CUDA build. `make demo` installs only what the demo
# runs (torch, the package, matplotlib for its plots: about half the processor time of the
# full set); `make test`, `lint` and `format` install the dev extra (plot included) in one
# editable install. pip is upgraded only where it is older than 21.3 (the first with editable installs of a pyproject-only package).
# Packages are installed with --no-compile: pip would byte-compile all 17,000 files of the dev
# set one at a time (about 80 CPU-s, half of the set-up) while the tests import a fraction of
# them. Python writes each module's bytecode the first time it is imported instead; where the
# environment sets PYTHONDONTWRITEBYTECODE (as on these machines) every interpreter the tests
# start (torchrun ranks, CLI runs) would compile the same modules again, so it is not passed on.
unexport PYTHONDONTWRITEBYTECODE
DEMO_STAMP := $(VENV)/.installed-demo
PIP = $(BIN)/python -m pip install -q --no-compile
BASE = test -x $(BIN)/python || $(PY) -m venv $(VENV); \
	$(BIN)/python -m pip install -q 'pip>=21.3' && $(PIP) torch==2.13.0

$(DEMO_STAMP): pyproject.toml
	$(BASE)
	$(PIP) -e '.[plot]'
	touch $(DEMO_STAMP)

# one editable install with the dev extra (which holds the plot one): it also serves the demo
$(STAMP): pyproject.toml
	$(BASE)
	$(PIP) -e '.[dev]'
	touch $(STAMP) $(DEMO_STAMP)

venv: $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/dcparallel demo

# two pytest workers (CI has two cores); a test module stays on one worker, so its
# gloo process pool is started once; modules are handed out in collection order, which
# tests/conftest.py makes longest first (tests/schedule.py), not xdist's most-tests-first
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(BIN)/ruff check dcparallel tests benchmarks examples
	$(BIN)/ruff format --check dcparallel tests benchmarks examples

format: $(STAMP)
	$(BIN)/ruff format dcparallel tests benchmarks examples
	$(BIN)/ruff check --fix dcparallel tests benchmarks examples

clean:
	rm -rf $(VENV) out
