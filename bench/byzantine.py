"""Untrusted workers: every emulated attack against every aggregator, the loss it leaves and
what the defences cost an honest run (docs/untrusted.md).

    python bench/byzantine.py                         # W=4, rank 3 attacks: diloco, sparseloco, demo, 2 seeds
    python bench/byzantine.py --quick                 # diloco, one seed, four attacks: a smoke run
    python bench/byzantine.py --workers 8 --attackers 6,7

Every run trains the bundled Shakespeare corpus with the same small recipe (a 2-block width-64
GPT, 120 steps, an outer sync every 10: 12 rounds) and the same seed, data order and W; only
--attack, --aggregate and --score change (demo takes no --score: its column stays empty). Runs
already in --out are read, not rerun.

Printed, per strategy: the final validation loss of each attack (rows) under each aggregator
(columns), as the mean over the seeds and its change against the attack-free run under `mean`;
with --score, the round at which the attacker was first left out (every attack starts at round
0); and, with no attacker, each defence's tokens/s against `mean`'s (measured on a shared
machine: read it with the load printed beside it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from _runs import BenchRun, train

RECIPE = ["--n-layer", "2", "--n-head", "2", "--d-model", "64", "--seq-len", "64", "--micro-batch", "8",
          "--lr", "1e-3", "--warmup", "10", "--steps", "120", "--eval-every", "0", "--eval-batches", "8"]
OUTER = ["--sync-every", "10"]  # the local-SGD family's period (demo has none: it syncs every step)
ATTACKS = ["none", "sign-flip", "scale:100", "scale:-100", "noise:1", "zero", "copy", "stale:2", "alie:1", "wrong-data"]
DEFENCES = {  # column -> flags
    "mean": ["--aggregate", "mean"],
    "median": ["--aggregate", "median"],
    "trimmed:0.25": ["--aggregate", "trimmed:0.25"],
    "mnc": ["--aggregate", "median-norm-clip"],
    "mnc+score": ["--aggregate", "median-norm-clip", "--score"],
}
QUICK = dict(strategies=["diloco"], seeds=[0], attacks=["none", "sign-flip", "scale:100", "scale:-100", "copy"],
             defences=["mean", "mnc", "mnc+score"])


def run(out: Path, strategy: str, attack: str, defence: str, seed: int, workers: int, attackers: str):
    flags = ["--strategy", strategy, "--workers", str(workers), "--seed", str(seed), *RECIPE,
             *(OUTER if strategy != "demo" else []), *DEFENCES[defence]]
    if attack != "none":
        flags += ["--attack", attack, "--attackers", attackers]
    name = f"{strategy}-{attack.replace(':', '')}-{defence.replace(':', '').replace('+', '_')}-s{seed}"
    if (out / name / "summary.json").exists():  # finished before: read, not rerun
        return BenchRun(json.loads((out / name / "summary.json").read_text()), [], 0.0)
    return train(out / name, *flags, echo=True)


def left_out_at(summary: dict, ranks: list[int]) -> str:
    """The first round at which every attacker was left out ('-': never; '': not scored)."""
    rounds = summary.get("score_rounds")
    if rounds is None:
        return ""
    return next((str(r["round"]) for r in rounds if set(ranks) <= set(r["left_out"])), "-")


def table(results: dict, strategy: str, attacks: list[str], defences: list[str], seeds: list[int], ranks) -> str:
    clean = statistics.mean(results[(strategy, "none", "mean", s)].summary["final_val_loss"] for s in seeds)
    head = f"{'attack':<12}" + "".join(f"{d:>24}" for d in defences)
    lines = [f"{strategy}: final validation loss, mean of seeds {seeds} (change vs no attack under mean, "
             f"{clean:.3f}); [round first left out]", head]
    for attack in attacks:
        cells = []
        for d in defences:
            runs = [results[(strategy, attack, d, s)] for s in seeds if (strategy, attack, d, s) in results]
            if not runs:
                cells.append("–")
                continue
            loss = statistics.mean(r.summary["final_val_loss"] for r in runs)
            out = left_out_at(runs[0].summary, ranks) if attack != "none" else ""
            cells.append(f"{loss:8.3f} ({100 * (loss / clean - 1):+6.1f}%)" + (f" [{out}]" if out else "    "))
        lines.append(f"{attack:<12}" + "".join(f"{c:>24}" for c in cells))
    speed = {d: statistics.mean(results[(strategy, "none", d, s)].summary["tokens_per_s"] for s in seeds)
             for d in defences if (strategy, "none", d, seeds[0]) in results}
    lines.append("tokens/s with no attacker, against mean: " +
                 ", ".join(f"{d} {speed[d] / speed['mean']:.2f}" for d in speed))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/byzantine"))
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--attackers", default="3")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--strategies", help="comma-separated (default: diloco,sparseloco,demo; --quick: diloco)")
    args = p.parse_args()
    plan = dict(QUICK) if args.quick else dict(strategies=["diloco", "sparseloco", "demo"], seeds=[0, 1],
                                               attacks=ATTACKS, defences=list(DEFENCES))
    if args.strategies:
        plan["strategies"] = args.strategies.split(",")
    ranks = [int(r) for r in args.attackers.split(",")]
    results = {}
    for strategy in plan["strategies"]:
        for seed in plan["seeds"]:
            for attack in plan["attacks"]:
                for defence in plan["defences"]:
                    if strategy == "demo" and "--score" in DEFENCES[defence]:
                        continue
                    results[(strategy, attack, defence, seed)] = run(args.out, strategy, attack, defence, seed,
                                                                     args.workers, args.attackers)
    print(f"\nW={args.workers}, attackers {args.attackers}; load average at the end {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    for strategy in plan["strategies"]:
        print("\n" + table(results, strategy, plan["attacks"], plan["defences"], plan["seeds"], ranks))


if __name__ == "__main__":
    main()
