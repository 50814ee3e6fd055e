"""Worker kills under --max-restarts: exact recovery, steps recomputed, time to notice and recover,
and the wall-time cost of checkpointing.

    python bench/faults.py                          # W=2 zero1, 500 steps, kills 0, 1, 3
    python bench/faults.py --steps 200 --kills 0,1  # shrunk
    python bench/faults.py --strategy acco          # any strategy (acco runs --deterministic)

Runs, all with the same model, data, seed and steps (the model is deliberately small, so a
run is about start-up, communication and checkpoints, not compute):

1. fault-free, no checkpoints (the baseline wall time);
2. fault-free with --checkpoint-every N (N = --every, 50): the checkpointing overhead, two
   ways: directly, the mean time one checkpoint takes (manifest.json's write_s: DCP's save and
   the checksums, as rank 0 saw it) times the checkpoints written, over the training loop's
   wall time (target <= 5%); and A/B, its loop wall time (summary.json's wall_s, start-up
   excluded) over the baseline's - 1, which on a shared machine is mostly noise;
3. for each K in --kills: --checkpoint-every N --max-restarts K with K worker kills
   (LOWCOMM_TEST_KILL_AT, the test-only fault injection: a random rank SIGKILLs itself after
   a random step; the i-th kill fires in launch attempt i). Reported: final parameters equal
   to run 2's (bit for bit, from the final checkpoints), steps recomputed (kill step minus
   the step resumed from, summed), time to notice per kill (the launcher noticing the dead
   worker minus the moment it died, from OUT/restarts.jsonl and the kill log), and the
   wall time lost per kill (process wall time minus run 2's, over K: noticing, stopping the
   others, relaunching, loading the checkpoint and recomputing the lost steps).
Exit 1 when a recovered run's parameters differ from the fault-free run's.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

from lowcomm import checkpoint as K
from lowcomm.strategies.registry import reproducible_flags

from _runs import train


def run(out: Path, args, *flags, env: dict | None = None) -> float:
    return train(out, "--strategy", args.strategy, "--workers", str(args.workers), "--steps", str(args.steps),
                 "--n-layer", str(args.n_layer), "--n-head", "2", "--d-model", str(args.d_model),
                 "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--eval-every", "0",
                 "--eval-batches", "1", "--seed", str(args.seed), "--data", args.data,
                 *reproducible_flags(args.strategy), *flags, env=env, echo=True).wall_s


def final_params(out: Path, steps: int, world: int) -> list[dict]:
    found = K.read(out / K.name_of(steps))
    return [K.read_state(found, r)["strategy"]["model"] for r in range(world)]


def same(a: list[dict], b: list[dict]) -> bool:
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="zero1")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--every", type=int, default=50, help="--checkpoint-every")
    p.add_argument("--kills", default="0,1,3")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--data", default="pydoc")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", help="keep the runs under this directory (default: a temporary one)")
    args = p.parse_args()
    kills = [int(k) for k in args.kills.split(",")]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="lowcomm-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"{args.strategy}, W={args.workers}, {args.steps} steps, checkpoint every {args.every}; runs in {root}")

    base_wall = run(root / "plain", args)
    ckpt_wall = run(root / "ckpt", args, "--checkpoint-every", str(args.every))
    base_loop = json.loads((root / "plain" / "summary.json").read_text())["wall_s"]
    ckpt_loop = json.loads((root / "ckpt" / "summary.json").read_text())["wall_s"]
    reference = final_params(root / "ckpt", args.steps, args.workers)

    rows, ok = [], True
    rng = random.Random(args.seed)
    for n in kills:
        if n == 0:  # run 2 is the fault-free run under the same flags
            rows.append({"kills": 0, "at": "", "equal": True, "recomputed": 0, "notice_s": [],
                         "lost_per_kill_s": 0.0, "wall_s": ckpt_wall})
            continue
        out = root / f"kills-{n}"
        steps = sorted(rng.sample(range(args.every + 1, args.steps), n))
        spec = ",".join(f"{rng.randrange(args.workers)}:{s}" for s in steps)
        log = out.parent / f"kills-{n}.log"
        log.unlink(missing_ok=True)
        wall = run(out, args, "--checkpoint-every", str(args.every), "--max-restarts", str(n),
                   env={"LOWCOMM_TEST_KILL_AT": spec, "LOWCOMM_TEST_KILL_LOG": str(log)})
        restarts = [json.loads(line) for line in (out / "restarts.jsonl").read_text().splitlines()]
        died = [float(x) for x in log.read_text().split()]
        equal = same(final_params(out, args.steps, args.workers), reference)
        ok &= equal
        rows.append({"kills": n, "at": spec, "equal": equal,
                     "recomputed": sum(s - r["resume_step"] for s, r in zip(steps, restarts)),
                     "notice_s": [r["noticed_at"] - d for r, d in zip(restarts, died)],
                     "lost_per_kill_s": (wall - ckpt_wall) / n, "wall_s": wall})

    overhead = ckpt_loop / base_loop - 1
    writes = [json.loads((p / K.MANIFEST).read_text()).get("write_s") for _, p in K.listed(root / "ckpt")]
    write_s = sum(writes) / len(writes) if writes and None not in writes else float("nan")
    direct = write_s * (args.steps // args.every) / ckpt_loop
    print(f"\ncheckpoint every {args.every}: training loop {ckpt_loop:.1f} s vs {base_loop:.1f} s without: "
          f"overhead {100 * overhead:+.1f}% (A/B, noisy); one checkpoint takes {write_s:.3f} s, "
          f"{100 * direct:.1f}% of the loop (target <= 5%: {'PASS' if direct <= 0.05 else 'MISS'}); "
          f"process wall {ckpt_wall:.1f} s vs {base_wall:.1f} s")
    print(f"{'kills':>5} {'killed (rank:step)':<24} {'params = fault-free':>20} {'steps recomputed':>17} "
          f"{'notice s (each)':>18} {'lost s per kill':>16} {'wall s':>8}")
    for r in rows:
        notice = ",".join(f"{x:.1f}" for x in r["notice_s"]) or "-"
        print(f"{r['kills']:>5} {r['at'] or '-':<24} {str(r['equal']):>20} {r['recomputed']:>17} "
              f"{notice:>18} {r['lost_per_kill_s']:>16.1f} {r['wall_s']:>8.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
