"""The tiny --elastic run the elastic tests start (three workers, at least two), the strategies
that run elastically with options under which they commit within a few steps, and what the tests
check of a finished run: each step logged once, every live worker on the same parameters."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from lowcomm.contract.options import cli_flag
from lowcomm.strategies import available, get

TINY = ["--workers", "3", "--elastic", "--min-workers", "2", "--n-layer", "2", "--n-head", "2",
        "--d-model", "16", "--seq-len", "16", "--data", "pydoc", "--eval-every", "0", "--quiet"]


# Options under which commits come within a few steps: the local-SGD family syncs every 2 (streaming
# diloco: 2 fragments of a period of 4, each merged a step after its sync: commits at 3, 5, 7, ...);
# the compressors past their warm-ups, so their residuals are live at the commits checked.
SHORT = {"diloco": {"sync_every": 2}, "sparseloco": {"sync_every": 2},
         "streaming_diloco": {"sync_every": 4, "fragments": 2, "fragment_delay": 1},
         "powersgd": {"start": 2}, "onebit_adam": {"freeze_variance_after": 2}, "dpu": {"warmup_steps": 2}}
ELASTIC = [n for n in available()
           if get(n).elastic.refusal(get(n).Options(**SHORT.get(n, {})).validate(n), False) is None]


# Variants, by name: "<strategy> <variant>" runs the strategy with these options besides its SHORT ones.
VARIANTS = {"delayed": {"outer_delay": 1}, "eager": {"outer_delay": 1, "eager": True}}


def options(case: str) -> dict:
    """The options of a strategy, or of "<strategy> <variant>", in these tests: reproducible,
    SHORT, the variant's, merges weighted by tokens."""
    name, _, variant = case.partition(" ")
    values = {**get(name).reproducible_options, **SHORT.get(name, {}), **VARIANTS.get(variant, {})}
    if "outer_weights" in {f for f in get(name).Options.__dataclass_fields__}:
        values["outer_weights"] = "tokens"  # as --elastic runs the local-SGD family
    return values


def cli_flags(case: str) -> list[str]:
    """`--strategy NAME` and the flags of options(case)."""
    name = case.partition(" ")[0]
    out = ["--strategy", name]
    for key, value in options(case).items():
        flag = cli_flag(get(name).Options.__dataclass_fields__[key])
        out += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return out


# A hang guard, not a timing claim: how long a test waits for what its run will do (a quorum, a
# record) before it fails instead of hanging. Generous: at load 10-19 a quorum took over 60 s.
HANG_GUARD_S = 300.0


def wait_for(ready, what: str, within: float = HANG_GUARD_S):
    deadline = time.monotonic() + within
    while not (value := ready()):
        assert time.monotonic() < deadline, f"no {what} within {within:.0f} s"
        time.sleep(0.05)
    return value


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_finished(out: Path, steps: int) -> tuple[list[dict], dict]:
    records = jsonl(out / "steps.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # each step once: none applied twice
    summary = json.loads((out / "summary.json").read_text())
    hashes = summary["elastic"]["final_params_sha256"]
    assert len(set(hashes)) == 1, hashes  # every live worker ends with the same parameters
    return records, summary


def checkpoint_params_hashes(checkpoint: Path) -> list[str]:
    """Each rank's model in a checkpoint, hashed as summary.json's `final_params_sha256` (with FSDP
    inside a replica: its shards)."""
    from lowcomm.checkpoint import read, read_state
    from lowcomm.elastic.transfer import state_hash
    found = read(checkpoint)
    models = [read_state(found, r)["strategy"]["parts"]["model"] for r in range(found.world)]
    return [state_hash({f"model.{k}": v for k, v in model.items()}) for model in models]


def join_once(run: Path, ready) -> tuple[threading.Thread, list[subprocess.Popen]]:
    """`lowcomm join RUN` from another process, as from a user's other terminal, once `ready()`:
    the thread that starts it, and the list that then holds it."""
    joiner: list[subprocess.Popen] = []

    def start() -> None:
        wait_for(ready, f"{run} to join")
        joiner.append(subprocess.Popen([sys.executable, "-m", "lowcomm", "join", str(run)], text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread, joiner
