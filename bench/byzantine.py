"""Untrusted workers: every emulated attack against every aggregator, the loss it leaves and
what the defences cost an honest run (docs/untrusted.md).

    python bench/byzantine.py                         # W=4, rank 3 attacks: diloco, sparseloco, demo, 2 seeds
    python bench/byzantine.py --quick                 # diloco, one seed, four attacks: a smoke run
    python bench/byzantine.py --workers 8 --attackers 6,7
    python bench/byzantine.py --strategies demo --defences mean,mnc+score --attacks none,copy --seeds 0
    python bench/byzantine.py --cost                  # what the defences cost an honest run, at the default H
    python bench/byzantine.py --cost --size small --cost-steps 320 --rounds 2   # the same on a 3.2M model

Every run trains the bundled Shakespeare corpus with the same small recipe (a 2-block width-64
GPT, 120 steps, an outer sync every 10: 12 rounds) and the same seed, data order and W; only
--attack, --aggregate and --score change (a strategy that takes no --score leaves that column
empty). The defences are the issue's five: mean, median-norm-clip ("mnc"), trimmed:0.25,
centered-clip:1 (τ = 1 in Δ's units: the tiny recipe's Δ norms are of that order), and
median-norm-clip with --score; `--defences` adds `median`. Runs already in --out are read, not rerun
(a run dir is named by strategy, attack, defence, seed and, beyond W=4, the worker count).

Printed, per strategy: the final validation loss of each attack (rows) under each aggregator
(columns), as the mean over the seeds and its change against the attack-free run under `mean`;
with --score, the round at which the attacker was first left out (every attack starts at round
0); and, with no attacker, each defence's tokens/s against `mean`'s (measured on a shared
machine: read it with the load printed beside it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import fields
from pathlib import Path

from _runs import BenchRun, train

from lowcomm.bench.report.untrusted import round_timing, scoring_seconds

RECIPE = ["--n-layer", "2", "--n-head", "2", "--d-model", "64", "--seq-len", "64", "--micro-batch", "8",
          "--lr", "1e-3", "--warmup", "10", "--steps", "120", "--eval-every", "0", "--eval-batches", "8"]
# --cost --size: the matrix's tiny model (RECIPE's), or docs/results.md's 3.2M-parameter one (4 blocks, width 256)
SIZES = {"tiny": [], "small": ["--n-layer", "4", "--n-head", "4", "--d-model", "256", "--seq-len", "128"]}
OUTER = ["--sync-every", "10"]  # the local-SGD family's period (demo has none: it syncs every step)
ATTACKS = ["none", "sign-flip", "scale:100", "scale:-100", "noise:1", "zero", "copy", "stale:2", "alie:1", "wrong-data"]
DEFENCES = {  # column -> flags
    "mean": ["--aggregate", "mean"],
    "mnc": ["--aggregate", "median-norm-clip"],
    "trimmed:0.25": ["--aggregate", "trimmed:0.25"],
    "cclip:1": ["--aggregate", "centered-clip:1"],
    "mnc+score": ["--aggregate", "median-norm-clip", "--score"],
    "median": ["--aggregate", "median"],  # not in the default matrix (--defences adds it)
}
COST_STEPS = 960  # --cost's runs: 30 syncs at diloco's H = 32, 64 at sparseloco's 15
MATRIX = ["mean", "mnc", "trimmed:0.25", "cclip:1", "mnc+score"]
QUICK = dict(strategies=["diloco"], seeds=[0], attacks=["none", "sign-flip", "scale:100", "scale:-100", "copy"],
             defences=["mean", "mnc", "mnc+score"])


def scores(strategy: str) -> bool:
    """Whether `strategy` takes --score (its options have it and do not refuse it)."""
    from lowcomm.errors import UsageError
    from lowcomm.strategies.registry import get
    options = get(strategy).Options
    if "score" not in {f.name for f in fields(options)}:
        return False
    try:
        options(score=True).check()
    except UsageError:
        return False
    return True


def run_name(workers: int, *parts: str) -> str:
    """A run's directory in --out: its parts joined by '-' without ':' ('+' as '_'), and the
    worker count beyond W=4."""
    return "-".join(p.replace(":", "").replace("+", "_") for p in parts) + (f"-w{workers}" if workers != 4 else "")


def run(out: Path, strategy: str, attack: str, defence: str, seed: int, workers: int, attackers: str):
    """One run of the matrix (read from --out where it finished before). A run that fails (an
    attack that makes the loss diverge and the trainer stop) is recorded as failed, not fatal."""
    flags = ["--strategy", strategy, "--workers", str(workers), "--seed", str(seed), *RECIPE,
             *(OUTER if strategy != "demo" else []), *DEFENCES[defence]]
    if attack != "none":
        flags += ["--attack", attack, "--attackers", attackers]
    name = run_name(workers, strategy, attack, defence, f"s{seed}")
    if (out / name / "summary.json").exists():  # finished before: read, not rerun
        return BenchRun(json.loads((out / name / "summary.json").read_text()), [], 0.0)
    if (out / name / "failed.txt").exists():
        return BenchRun({"failed": (out / name / "failed.txt").read_text().strip()}, [], 0.0)
    result = train(out / name, *flags, echo=True, check=False)
    if "failed" in result.summary:
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "failed.txt").write_text(result.summary["failed"] + "\n")
        print(f"    failed: {result.summary['failed']}", flush=True)
    return result


def cost(out: Path, strategies: list[str], workers: int, rounds: int, steps: int, size: str = "tiny") -> None:
    """No attacker, each strategy at its default sync period, `steps` steps (the matrix's 120 are
    3 s at H = 32: four syncs, and a run's noise is larger than the cost): `mean`, median-norm-clip
    and median-norm-clip --score run in turn, `rounds` times (interleaved: a round's three runs meet
    the same load). Printed: each defence's tokens/s against the same round's `mean`, and what a
    sync step costs beyond `mean`'s as a share of `mean`'s round (medians within each run: a
    measure the load's drift between runs moves less), with the share of a scored round its
    scoring took (summary.json, the slowest worker's). `size` small: a 3.2M-parameter model in
    place of the tiny recipe's (a sync's fixed costs against a longer step)."""
    flags = ["--workers", str(workers), "--seed", "0", *RECIPE, *SIZES[size],
             "--steps", str(steps), "--overwrite"]  # a measurement, remade each time (the matrix reads its runs back)
    for strategy in strategies:
        ratios: dict[str, list[float]] = {"mnc": [], "mnc+score": []}
        extra: dict[str, list[float]] = {"mnc": [], "mnc+score": []}
        shares = []
        for k in range(rounds):
            runs = {}
            for d in ("mean", "mnc", "mnc+score"):
                name = run_name(workers, "cost", strategy, d, f"r{k}", f"n{steps}", *([size] if size != "tiny" else []))
                runs[d] = train(out / name, "--strategy", strategy, *flags, *DEFENCES[d], echo=True)
            shares.append(scoring_share(runs["mnc+score"].steps))
            base_sync, base_step, local_per_sync = sync_walls(runs["mean"].steps)
            for d in ratios:
                ratios[d].append(runs[d].summary["tokens_per_s"] / runs["mean"].summary["tokens_per_s"])
                extra[d].append((sync_walls(runs[d].steps)[0] - base_sync) / (local_per_sync * base_step + base_sync))
        percent = {d: [100 * v for v in vs] for d, vs in extra.items()}
        print(f"\n{strategy} (its default H), W={workers}, {size} model, no attacker, {steps} steps, {rounds} "
              f"interleaved rounds; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores:\n"
              f"  tokens/s against mean: {listed(ratios, '{:.2f}')}\n"
              f"  a sync step's extra time, share of mean's round: {listed(percent, '{:+.1f}%')}\n"
              f"  scoring's share of a scored round: {' '.join(f'{100 * s:.1f}%' for s in shares)}")


def listed(values: dict[str, list[float]], form: str) -> str:
    """'mnc 0.96 0.97 0.82 (median 0.96); ...': each defence's values in `form`, and their median."""
    return "; ".join(f"{d} {' '.join(form.format(v) for v in vs)} (median {form.format(statistics.median(vs))})"
                     for d, vs in values.items())


def sync_walls(steps: list[dict]) -> tuple[float, float, float]:
    """(median wall time of a step that synced, of one that did not, local steps per sync) of a run: the
    steps that sent bytes are the syncs (the final one, at the last step, left out: it ends the run)."""
    synced = [s["wall_s"] for s in steps[:-1] if s["wire_bytes"] > 0]
    local = [s["wall_s"] for s in steps[:-1] if s["wire_bytes"] == 0]
    local_per_sync = len(steps) / max(len(synced), 1) - 1
    return statistics.median(synced), statistics.median(local), local_per_sync


def scoring_share(steps: list[dict]) -> float:
    """Scoring's share of its rounds' wall time, as `lowcomm report` says it (the slowest worker's)."""
    seconds = scoring_seconds(round_timing(steps))
    return seconds[0] / seconds[1] if seconds and seconds[1] > 0 else float("nan")


def left_out_at(summary: dict, ranks: list[int]) -> str:
    """The first round at which every attacker was left out, or named in a copy (its content
    counted once: who copied whom the bits cannot tell) ('-': never; '': not scored)."""
    rounds = summary.get("score_rounds")
    if rounds is None:
        return ""
    def caught(entry: dict) -> set[int]:
        return set(entry["left_out"]).union(*map(set, entry.get("copies", [])))
    return next((str(r["round"]) for r in rounds if set(ranks) <= caught(r)), "-")


def final_loss(run) -> float:
    """The run's final validation loss (inf: it diverged, or the trainer stopped on bad steps)."""
    loss = run.summary.get("final_val_loss")
    return float("inf") if loss is None or not math.isfinite(loss) else loss


def cell(runs: list, clean: float, ranks, scored_attack: bool) -> str:
    losses = [final_loss(r) for r in runs]
    if any(math.isinf(x) for x in losses):
        return f"diverged ({sum(math.isinf(x) for x in losses)}/{len(losses)})"
    loss = statistics.mean(losses)
    out = "/".join(left_out_at(r.summary, ranks) for r in runs) if scored_attack else ""
    return f"{loss:7.3f} ({100 * (loss / clean - 1):+6.1f}%)" + (f" [{out}]" if out else "")


def table(results: dict, strategy: str, attacks: list[str], defences: list[str], seeds: list[int], ranks) -> str:
    clean = statistics.mean(final_loss(results[(strategy, "none", "mean", s)]) for s in seeds)
    head = f"{'attack':<12}" + "".join(f"{d:>26}" for d in defences)
    lines = [f"{strategy}: final validation loss, mean of seeds {seeds} (change vs no attack under mean, "
             f"{clean:.3f}); [round each seed first left out every attacker, '-': never]", head]
    for attack in attacks:
        cells = []
        for d in defences:
            runs = [results[(strategy, attack, d, s)] for s in seeds if (strategy, attack, d, s) in results]
            cells.append(cell(runs, clean, ranks, attack != "none" and "--score" in DEFENCES[d]) if runs else "-")
        lines.append(f"{attack:<12}" + "".join(f"{c:>26}" for c in cells))
    speed = {d: statistics.mean(results[(strategy, "none", d, s)].summary.get("tokens_per_s", 0) for s in seeds)
             for d in defences if all((strategy, "none", d, s) in results for s in seeds)}
    if "mean" in speed:
        lines.append("tokens/s with no attacker, against mean (a shared machine: noisy): " +
                     ", ".join(f"{d} {speed[d] / speed['mean']:.2f}" for d in speed))
    lines.append(targets(results, strategy, attacks, seeds, ranks, clean))
    return "\n".join(lines)


def targets(results: dict, strategy: str, attacks: list[str], seeds: list[int], ranks, clean: float) -> str:
    """The issue's targets under median-norm-clip --score: every attack within 2 % of the attack-free
    loss (each seed against its own attack-free run), every attacker left out within 3 rounds
    (by round 2: every attack starts at round 0)."""
    far, late = [], []
    for attack in attacks[1:] if attacks and attacks[0] == "none" else attacks:
        for s in seeds:
            run, base = results.get((strategy, attack, "mnc+score", s)), results.get((strategy, "none", "mean", s))
            if run is None or base is None:
                continue
            change = final_loss(run) / final_loss(base) - 1
            if not change <= 0.02:
                far.append(f"{attack} s{s} {100 * change:+.1f}%")
            at = left_out_at(run.summary, ranks)
            if not at.isdigit() or int(at) > 2:
                late.append(f"{attack} s{s} [{at}]")
    if not any((strategy, a, "mnc+score", s) in results for a in attacks for s in seeds):
        return "targets: no mnc+score run"
    return (f"targets (mnc+score): beyond 2 %: {', '.join(far) or 'none'}; not left out by round 2: "
            f"{', '.join(late) or 'none'}")


COST_FLAGS = ("--rounds", "--cost-steps", "--size")                        # read by --cost only
MATRIX_FLAGS = ("--attackers", "--quick", "--attacks", "--defences", "--seeds")  # read by the matrix only


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/byzantine"))
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--attackers", help="the matrix's attacking ranks, comma-separated (default: 3)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--strategies", help="comma-separated (default: diloco,sparseloco,demo; --quick: diloco)")
    p.add_argument("--attacks", help=f"comma-separated, 'none' first (default: {','.join(ATTACKS)})")
    p.add_argument("--defences", help=f"comma-separated, 'mean' first (default: {','.join(MATRIX)}; also: median)")
    p.add_argument("--seeds", help="comma-separated (default: 0,1)")
    p.add_argument("--cost", action="store_true", help="only what the defences cost an honest run (tokens/s "
                   "against mean, interleaved rounds at each strategy's default H)")
    p.add_argument("--rounds", type=int, help="with --cost: interleaved rounds (default 3)")
    p.add_argument("--cost-steps", type=int, help=f"with --cost: steps of each run (default {COST_STEPS})")
    p.add_argument("--size", choices=list(SIZES),
                   help="with --cost: the matrix's tiny model (default), or a 3.2M-parameter one (4 blocks, width 256)")
    args = p.parse_args()
    # a flag of the other mode would do nothing: refused, not ignored
    unused = [f for f in (MATRIX_FLAGS if args.cost else COST_FLAGS) if getattr(args, f.lstrip("-").replace("-", "_"))]
    if unused:
        sys.exit(f"error: {unused[0]} {'is not read by --cost' if args.cost else 'needs --cost'} "
                 f"(--cost measures an honest run's cost; without it the attack matrix runs)")
    args.rounds = 3 if args.rounds is None else args.rounds
    args.cost_steps = COST_STEPS if args.cost_steps is None else args.cost_steps
    if args.rounds < 1:
        sys.exit(f"error: --rounds {args.rounds}: at least one round")
    if args.cost_steps < 100:
        sys.exit(f"error: --cost-steps {args.cost_steps}: at least 100 (a few syncs at diloco's default H of 32)")
    if args.cost:
        return cost(args.out, (args.strategies or "diloco,sparseloco").split(","), args.workers, args.rounds,
                    args.cost_steps, args.size or "tiny")
    args.attackers = args.attackers or "3"
    plan = dict(QUICK) if args.quick else dict(strategies=["diloco", "sparseloco", "demo"], seeds=[0, 1],
                                               attacks=ATTACKS, defences=MATRIX)
    for key in ("strategies", "attacks", "defences"):
        if getattr(args, key):
            plan[key] = getattr(args, key).split(",")
    if args.seeds:
        plan["seeds"] = [int(s) for s in args.seeds.split(",")]
    unknown = [d for d in plan["defences"] if d not in DEFENCES] + [a for a in plan["attacks"] if a not in ATTACKS]
    if unknown or plan["attacks"][0] != "none" or plan["defences"][0] != "mean":
        sys.exit(f"error: {', '.join(unknown) or 'the matrix'}: attacks are {', '.join(ATTACKS)} ('none' first), "
                 f"defences {', '.join(DEFENCES)} ('mean' first: every change is against the attack-free mean run)")
    ranks = [int(r) for r in args.attackers.split(",")]
    results = {}
    for strategy in plan["strategies"]:
        for seed in plan["seeds"]:
            for attack in plan["attacks"]:
                for defence in plan["defences"]:
                    if "--score" in DEFENCES[defence] and not scores(strategy):
                        continue
                    results[(strategy, attack, defence, seed)] = run(args.out, strategy, attack, defence, seed,
                                                                     args.workers, args.attackers)
    print(f"\nW={args.workers}, attackers {args.attackers}; load average at the end {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    for strategy in plan["strategies"]:
        print("\n" + table(results, strategy, plan["attacks"], plan["defences"], plan["seeds"], ranks))


if __name__ == "__main__":
    main()
