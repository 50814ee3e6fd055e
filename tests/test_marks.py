"""The marks that keep `make test-fast` fast stay true: a test that starts a worker process or a
Python subprocess without one of them fails (even when the code under test catches the refusal,
and when a module's fixture starts it), a marked one runs, and another program (a library's helper
such as matplotlib's fc-list) is no process test."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = '''
import multiprocessing, subprocess, sys
import pytest

def test_python_unmarked():
    subprocess.run([sys.executable, "-c", "pass"])

def test_python_unmarked_refusal_caught():
    try:
        subprocess.run([sys.executable, "-c", "pass"])
    except RuntimeError:
        pass

def test_worker_unmarked():
    p = multiprocessing.get_context("spawn").Process(target=print)
    p.start()
    p.join()

@pytest.fixture(scope="module")
def spawned():
    subprocess.run([sys.executable, "-c", "pass"])

def test_fixture_unmarked(spawned):
    pass

def test_other_program_unmarked():
    assert subprocess.run(["true"]).returncode == 0

@pytest.mark.procs
def test_python_marked():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
'''


@pytest.mark.procs  # the marked test inside starts a Python
def test_an_unmarked_test_that_starts_a_process_fails_naming_the_marks(pytester):
    here = Path(__file__).parent
    pytester.makeconftest((here / "conftest.py").read_text())
    pytester.syspathinsert(here / "helpers")
    pytester.makepyfile(test_guarded=TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-W", "ignore::pytest.PytestUnknownMarkWarning")
    result.assert_outcomes(passed=2, failed=3, errors=1)
    result.stdout.fnmatch_lines(["*test_python_unmarked starts a process*procs, faults, elastic, slow*"])
    outcomes = {r.nodeid.split("::")[-1]: r.outcome for r in result.reprec.getreports("pytest_runtest_logreport")
                if r.when == "call"}
    assert outcomes["test_python_marked"] == outcomes["test_other_program_unmarked"] == "passed"
