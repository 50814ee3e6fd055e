"""Elastic replica groups under torchrun: how long a kill costs the survivors, and a restart the run.

    python bench/replica_restart.py                  # 3 runs; ~45 s each on 2 loaded cores
    python bench/replica_restart.py --runs 5 --steps 40

Each run: a lighthouse (lowcomm's, torchft's LighthouseServer), two torchrun jobs of 2 processes
(`--elastic --lighthouse HOST:PORT --min-workers 2`, ddp, the tiny GPT), and job b's process 1
SIGKILLed after step 4 (LOWCOMM_TEST_KILL_AT). torchrun stops b's other process and restarts the
job (`--max-restarts 1`); job a goes on alone and, past step 10, waits at a commit point for the
restarted job (LOWCOMM_TEST_HOLD_FOR_REPLICAS). Printed per run, from membership.jsonl and
steps.jsonl (the records are in the --out of the job whose process was rank 0 then):

- kill -> survivors' next commit: the first step committed by job a alone, after the kill;
- kill -> joiner's first commit: the first step committed with job b back (its restart: agent
  rendezvous, two fresh pythons importing torch, the lighthouse's quorum, the state transfer);
- the joiner's state hash equal to the survivor's, position by position (exit 1 if not).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(out: Path, lighthouse: str, steps: int, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts",
           "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port()}", "-m", "lowcomm", "train",
           "--elastic", "--lighthouse", lighthouse, "--min-workers", "2", "--strategy", "ddp", "--steps", str(steps),
           "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--seq-len", "16", "--data", "pydoc",
           "--eval-every", "0", "--quiet", "--out", str(out)]
    with open(f"{out}.log", "w") as log:
        return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, stdout=log,
                                stderr=subprocess.STDOUT)


def records(outs: list[Path], name: str) -> list[dict]:
    return [json.loads(line) for o in outs if (o / name).exists() for line in (o / name).read_text().splitlines()]


def one(root: Path, lighthouse: str, steps: int) -> tuple[float, float]:
    outs, killed = [root / "a", root / "b"], root / "killed"
    jobs = [job(outs[0], lighthouse, steps, {"LOWCOMM_TEST_HOLD_FOR_REPLICAS": "2:10"}),
            job(outs[1], lighthouse, steps, {"LOWCOMM_TEST_KILL_AT": "1:4", "LOWCOMM_TEST_KILL_LOG": str(killed)})]
    if any(j.wait(timeout=600) for j in jobs):
        sys.exit(f"a job failed: see {root}/*.log")
    at = float(killed.read_text())
    after = sorted((r for r in records(outs, "steps.jsonl") if r["committed_at"] > at), key=lambda r: r["step"])
    alone = next(r for r in after if len(r["members"]) == 2)
    back = next(r for r in after if len(r["members"]) == 4)
    rejoined = max(records(outs, "membership.jsonl"), key=lambda q: q["time"])
    h = rejoined["state_sha256"]
    if any(len(set(h[p::2])) > 1 for p in (0, 1)):  # each position alike on both replicas
        sys.exit(f"the joiner's state differs from the survivor's: {h}")
    return alone["committed_at"] - at, back["committed_at"] - at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    from lowcomm.elastic.lighthouse import start
    server = start(1)
    lighthouse = server.address().replace("http://", "")
    got = []
    try:
        for i in range(args.runs):
            with tempfile.TemporaryDirectory() as root:
                load = os.getloadavg()[0]
                got.append(one(Path(root), lighthouse, args.steps))
                print(f"run {i + 1}: kill -> survivors' next commit {got[-1][0]:.2f} s, kill -> joiner's first "
                      f"commit {got[-1][1]:.1f} s (load {load:.1f} before, {os.getloadavg()[0]:.1f} after)", flush=True)
    finally:
        server.shutdown()
    for name, i in (("kill -> survivors' next commit", 0), ("kill -> joiner's first commit", 1)):
        values = [g[i] for g in got]
        print(f"{name}: median {statistics.median(values):.2f} s (range {min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
