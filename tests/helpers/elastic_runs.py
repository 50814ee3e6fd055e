"""The tiny --elastic run the elastic tests start (three workers, at least two), and what they
check of a finished one: each step logged once, every live worker on the same parameters."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

TINY = ["--workers", "3", "--elastic", "--min-workers", "2", "--n-layer", "2", "--n-head", "2",
        "--d-model", "16", "--seq-len", "16", "--data", "pydoc", "--eval-every", "0", "--quiet"]


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
    models = [read_state(found, r)["strategy"]["model"] for r in range(found.world)]
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
