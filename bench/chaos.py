"""Elastic runs under chaos: a fault every ~30 s, drawn at random, against the same run without.

    python bench/chaos.py                                    # W=4, every strategy, ~5 min fault-free each
    python bench/chaos.py --minutes 2 --strategies diloco    # shorter
    python bench/chaos.py --seeds 0,1 --strategies diloco    # two seeds: the mean, the spread, the noise floor
    python bench/chaos.py --link 100mbit,1ms --minutes 1     # instead: what a join's heal costs on that link

For each strategy, all runs `lowcomm train --elastic --workers W --min-workers 2` on one machine:

1. calibration: a short fault-free run measures the seconds a step takes; the runs below train
   S = minutes * 60 / step_s steps (a multiple of H for the local-SGD family: diloco, sparseloco,
   streaming_diloco, all at --sync-every H), so the fault-free run lasts about --minutes;
2. the fault-free run (validation every ~S/10 steps; acco with --deterministic rounds, so that
   the two runs differ by the faults only, not by the timing its adaptive rounds follow);
3. the same run with faults: every --fault-every s (+-30 %), one drawn at random of
     kill        SIGKILL a random worker (the launcher restarts it as a joiner); while a joined
                 worker has made the run one larger than W, the joined one instead (not
                 restarted: the run keeps W or W+1 workers, not one more for good at every join);
     stop        SIGSTOP a random worker for --stop-s s, then SIGCONT (the others drop it after
                 --member-timeout; continued, it rejoins);
     lighthouse  SIGKILL the lighthouse (the launcher restarts it);
     join        `lowcomm join OUT`, one more worker -- only where this lowcomm has `join`
                 (otherwise this kind is skipped, and the report says so).
Reported side by side, a row a strategy: goodput (tokens committed per second, first quorum to
last commit) and its ratio to the fault-free run's (targets: >= 0.9 for the strategies made for
churning links -- diloco, sparseloco, streaming_diloco, demo -- >= 0.8 for the rest); validation
loss at equal committed tokens (the fault-free run's curve read at the faulted run's final
tokens; target within 2 %); the time a survivor spends not training per fault (the fault to the
quorum that trains on without the member lost: a kill, a stop, the joiner killed); the mean time
from a fault to the next committed step; and from a restart (the launcher's line) to the joiner's
first committed step.

With --link, no faults: per strategy one run on that emulated link and one `lowcomm join` in it;
the row gives the state the joiner's heal moved, its seconds and the plan's price for those bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


LOCAL_SGD = ("diloco", "sparseloco", "streaming_diloco")  # commit at outer syncs: steps a multiple of H
# Flags that make a strategy's run depend on its inputs only, so that the fault-free and the faulted
# run differ by the faults: ACCO's adaptive rounds follow the timing (two fault-free runs of its
# default once parted at a loss spike at step 19, ending 13 % apart at equal tokens). Not the
# registry's reproducible_flags(): those also shorten onebit_adam's warm-up to 2 steps (for runs of
# other lengths to agree), which two runs of one length do not need, and would bench another setting.
SAME_RUN_TWICE = {"acco": ["--deterministic"]}
CHURN = LOCAL_SGD + ("demo",)  # made for churning links: the higher goodput target


def flags(args, strategy: str, steps: int, eval_every: int, seed: int) -> list[str]:
    extra = ["--sync-every", str(args.sync_every)] if strategy in LOCAL_SGD else []
    extra += SAME_RUN_TWICE.get(strategy, [])
    if args.member_timeout:
        extra += ["--member-timeout", str(args.member_timeout)]
    return ["--strategy", strategy, "--workers", str(args.workers), "--elastic", "--min-workers", "2",
            "--max-restarts", "1000", "--steps", str(steps), "--eval-every", str(eval_every),
            "--eval-batches", "2", "--seed", str(seed), "--data", args.data, "--quiet", *extra]


def launch(out: Path, run_flags: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "lowcomm", "train", *run_flags, "--out", str(out)]
    print("  $ lowcomm", " ".join(cmd[3:]), flush=True)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, lines: list) -> None:
    if proc.wait() != 0:
        sys.exit(f"error: {' '.join(proc.args)} failed:\n" + "".join(line for _, line in lines[-30:]))


def run_clean(out: Path, run_flags: list[str]) -> None:
    proc = launch(out, run_flags)
    finish(proc, read_stderr(proc))


def read_stderr(proc: subprocess.Popen) -> list[tuple[float, str]]:
    """The launcher's stderr lines with the time each arrived (a restart's time is its line's)."""
    lines: list[tuple[float, str]] = []
    threading.Thread(target=lambda: [lines.append((time.time(), line)) for line in proc.stderr],
                     daemon=True).start()
    return lines


def children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    tree: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit():
                tree.setdefault(int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(d.name))
        except OSError:  # ended while we looked
            continue
    return tree


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def workers_and_lighthouse(launcher: int) -> tuple[list[int], int | None]:
    """The launcher's workers (children of its fork server) and its lighthouse process."""
    tree = children()
    workers, beacon = [], None
    for child in tree.get(launcher, []):
        line = cmdline(child)
        if b"multiprocessing.forkserver" in line:
            workers += tree.get(child, [])
        elif b"lighthouse_serve.py" in line:
            beacon = child
    return workers, beacon


class Chaos:
    """Faults on a running elastic run, each logged as (time, kind)."""

    def __init__(self, proc: subprocess.Popen, out: Path, args, rng: random.Random, kinds: list[str]):
        self.proc, self.out, self.args, self.rng, self.kinds = proc, out, args, rng, kinds
        self.faults: list[tuple[float, str]] = []
        self.stopped: set[int] = set()
        self.joiners: list[subprocess.Popen] = []

    def run(self) -> None:
        while self.proc.poll() is None:
            deadline = time.monotonic() + self.args.fault_every * self.rng.uniform(0.7, 1.3)
            while time.monotonic() < deadline and self.proc.poll() is None:
                time.sleep(0.2)
            if self.proc.poll() is None:
                self.fault(self.rng.choice(self.kinds))

    def fault(self, kind: str) -> None:
        workers, beacon = workers_and_lighthouse(self.proc.pid)
        running = [w for w in workers if w not in self.stopped]
        joined = [j for j in self.joiners if j.poll() is None]
        if kind in ("kill", "stop") and len(running) <= 2:  # keep --min-workers 2 training
            return
        if kind == "join" and joined:  # one joined worker at a time: the run stays at W or W+1
            kind = "kill"
        t = time.time()
        if kind == "kill" and joined:
            joined[0].kill()
            kind = "kill-joined"
        elif kind == "kill":
            os.kill(self.rng.choice(running), signal.SIGKILL)
        elif kind == "stop":
            pid = self.rng.choice(running)
            os.kill(pid, signal.SIGSTOP)
            self.stopped.add(pid)
            threading.Timer(self.args.stop_s, self._cont, args=(pid,)).start()
        elif kind == "lighthouse" and beacon is not None:
            os.kill(beacon, signal.SIGKILL)
        elif kind == "join":
            self.joiners.append(subprocess.Popen([sys.executable, "-m", "lowcomm", "join", str(self.out)],
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        else:
            return
        self.faults.append((t, kind))
        print(f"    {time.strftime('%H:%M:%S')} {kind}", flush=True)

    def _cont(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        self.stopped.discard(pid)


def measured(out: Path) -> dict:
    """Goodput, the validation curve and commit times of a finished run."""
    records = jsonl(out / "steps.jsonl")
    start = jsonl(out / "membership.jsonl")[0]["time"]
    tokens, curve = 0, []
    for r in records:
        tokens += r["tokens"]
        if r.get("val_loss") is not None:
            curve.append((tokens, r["val_loss"]))
    end = records[-1]["committed_at"]
    return {"tokens": tokens, "seconds": end - start, "goodput": tokens / (end - start), "curve": curve,
            "records": records, "val_loss": curve[-1][1] if curve else float("nan"),
            "quorums": jsonl(out / "membership.jsonl")}


def loss_at(curve: list[tuple[int, float]], tokens: int) -> float:
    """The validation loss of `curve` at `tokens`, read linearly between its points."""
    for (t0, v0), (t1, v1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return v0 + (v1 - v0) * (tokens - t0) / max(1, t1 - t0)
    return curve[-1][1] if tokens > curve[-1][0] else curve[0][1]


def recoveries(m: dict, faults: list[tuple[float, str]], lines: list[tuple[float, str]]) -> dict:
    """Mean seconds from each fault to the next commit, and from each restart to the joiner's first."""
    commits = [(r["committed_at"], r["members"]) for r in m["records"]]
    after = [next((c for c, _ in commits if c > t), None) for t, _ in faults]
    to_commit = [(kind, c - t) for (t, kind), c in zip(faults, after) if c is not None]
    to_join = []
    for t, line in lines:
        if "restarting it" in line and "worker " in line:
            slot = int(line.split("worker ", 1)[1].split()[0])
            first = next((c for c, members in commits if c > t and slot in members), None)
            if first is not None:
                to_join.append(first - t)
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    by_kind = {k: mean([s for kind, s in to_commit if kind == k]) for k in sorted({k for k, _ in to_commit})}
    # A survivor not training: from a fault that loses a member to the quorum without it (the
    # survivors train from there on; membership.jsonl's time is taken once the state is loaded).
    quorums = [q["time"] for q in m["quorums"]]
    idle = [next((q for q in quorums if q > t), t) - t for t, kind in faults if kind in ("kill", "stop", "kill-joined")]
    return {"fault_to_commit_s": mean([s for _, s in to_commit]), "by_kind": by_kind,
            "restart_to_join_s": mean(to_join), "restarts": len(to_join),
            "survivor_idle_s": mean(idle), "survivor_idle_max_s": max(idle, default=float("nan"))}


def calibrated(args, strategy: str, seed: int, calib: Path, extra: tuple = ()) -> tuple[int, int]:
    """(steps, validation every): a short fault-free run (in `calib`, with `extra` flags) measures
    the seconds a step takes; the runs then train about --minutes (a multiple of H: local SGD)."""
    unit = args.sync_every if strategy in LOCAL_SGD else 1
    steps = 3 * (args.sync_every if strategy in LOCAL_SGD else 10)
    run_clean(calib, flags(args, strategy, steps, steps, seed) + list(extra))
    step_s = measured(calib)["seconds"] / steps
    steps = max(unit, round(args.minutes * 60 / step_s / unit) * unit)
    return steps, max(unit, round(steps / 10 / unit) * unit)


def bench(strategy: str, seed: int, args, root: Path, kinds: list[str]) -> dict:
    """The fault-free and the faulted run of `strategy` at `seed` (the training's and the faults')."""
    name = strategy if len(args.seeds) == 1 else f"{strategy}-seed{seed}"
    print(f"{name}:", flush=True)
    steps, every = calibrated(args, strategy, seed, root / f"{name}-calibrate")
    clean_out, chaos_out = root / f"{name}-clean", root / f"{name}-chaos"
    run_clean(clean_out, flags(args, strategy, steps, every, seed))
    proc = launch(chaos_out, flags(args, strategy, steps, every, seed))
    lines = read_stderr(proc)
    chaos = Chaos(proc, chaos_out, args, random.Random(seed), kinds)
    try:
        chaos.run()
    finally:
        for joiner in chaos.joiners:  # a `lowcomm join` ends with the run; one that does not is stopped
            try:
                joiner.wait(30)
            except subprocess.TimeoutExpired:
                joiner.kill()
    finish(proc, lines)
    clean, faulted = measured(clean_out), measured(chaos_out)
    return {"strategy": strategy, "seed": seed, "steps": steps, "clean": clean, "chaos": faulted, "faults": chaos.faults,
            **recoveries(faulted, chaos.faults, lines),
            "val_clean_at_tokens": loss_at(clean["curve"], faulted["tokens"])}


def heal_cost(strategy: str, args, root: Path) -> dict:
    """The --link row: an elastic run on the emulated link, calibrated as bench() is, with one
    `lowcomm join` once it has committed a step; what the joiner's heal moved and took
    (membership.jsonl's `heal`: the lead's seconds in the transfer) against the plan's price for
    moving that state: one latency + bytes / bandwidth, LinkModel.duration of a broadcast, the
    formula the planner prices every collective with."""
    from lowcomm.comm.link import LinkModel, split_link_spec
    print(f"{strategy} on --link {args.link}:", flush=True)
    seed, link = args.seeds[0], ("--link", args.link)
    steps, _ = calibrated(args, strategy, seed, root / f"{strategy}-link-calibrate", link)
    unit = args.sync_every if strategy in LOCAL_SGD else 1
    steps = max(steps, 8 * unit)  # commit points enough for a joiner that takes seconds to start
    out = root / f"{strategy}-link"
    proc = launch(out, flags(args, strategy, steps, steps, seed) + list(link))
    lines, logged = read_stderr(proc), out / "steps.jsonl"
    while proc.poll() is None and not (logged.exists() and logged.stat().st_size):
        time.sleep(0.2)
    joiner = subprocess.Popen([sys.executable, "-m", "lowcomm", "join", str(out)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finish(proc, lines)
    joiner.wait(60)
    summary = json.loads((out / "summary.json").read_text())
    model = LinkModel.parse(*split_link_spec(args.link))
    heals = [dict(q["heal"], world=len(q["slots"])) for q in jsonl(out / "membership.jsonl") if q.get("heal")]
    for h in heals:
        h["plan_s"] = model.duration("broadcast", h["bytes"], h["world"])
    return {"strategy": strategy, "steps": steps, "model_bytes": 4 * summary["params"], "heals": heals}


def report_heals(rows: list[dict], link: str) -> None:
    print(f"\nA heal on --link {link}: the state a joiner receives (pickled, membership.jsonl's heal.bytes), "
          f"the lead's seconds in the transfer, and the plan's price for it (one latency + bytes / bandwidth)")
    print(f"{'':>18} {'state MB':>9} {'x model':>8} {'heal s':>8} {'plan s':>8} {'ratio':>6}")
    for r in rows:
        for h in r["heals"] or [None]:
            if h is None:
                print(f"{r['strategy']:>18} no heal (the joiner came after the last commit point: longer --minutes)")
                continue
            print(f"{r['strategy']:>18} {h['bytes'] / 1e6:>9.2f} {h['bytes'] / r['model_bytes']:>8.2f} "
                  f"{h['seconds']:>8.2f} {h['plan_s']:>8.2f} {h['seconds'] / h['plan_s']:>6.2f}")


def ratio_and_loss(r: dict) -> tuple[float, float]:
    """Goodput faulted / fault-free, and the faulted run's validation loss relative to the
    fault-free run's at the same committed tokens."""
    return r["chaos"]["goodput"] / r["clean"]["goodput"], r["chaos"]["val_loss"] / r["val_clean_at_tokens"] - 1


def report(rows: list[dict], skipped: str) -> None:
    print(f"\n{'':>22} {'steps':>6} {'faults':>30} {'goodput tok/s':>20} {'ratio':>6} {'target':>6} "
          f"{'val loss @ equal tokens':>26} {'idle/fault s':>12} {'fault->commit s':>15} {'restart->join s':>15}")
    seeds = {r["seed"] for r in rows}
    for r in rows:
        kinds = {}
        for _, k in r["faults"]:
            kinds[k] = kinds.get(k, 0) + 1
        ratio, val = ratio_and_loss(r)
        target = 0.9 if r["strategy"] in CHURN else 0.8
        label = r["strategy"] if len(seeds) == 1 else f"{r['strategy']} seed {r['seed']}"
        print(f"{label:>22} {r['steps']:>6} {' '.join(f'{k}:{n}' for k, n in kinds.items()) or '-':>30} "
              f"{r['clean']['goodput']:>9.0f} / {r['chaos']['goodput']:>8.0f} {ratio:>6.3f} {target:>6.2f} "
              f"{r['val_clean_at_tokens']:>8.4f} / {r['chaos']['val_loss']:.4f} ({100 * val:+.1f}%) "
              f"{r['survivor_idle_s']:>6.1f} ({r['survivor_idle_max_s']:.1f}) "
              f"{r['fault_to_commit_s']:>15.1f} {r['restart_to_join_s']:>15.1f}")
    for r in rows:
        print(f"{r['strategy']}{'' if len(seeds) == 1 else ' seed ' + str(r['seed'])}: fault -> next commit by "
              f"kind: " + ", ".join(f"{k} {v:.1f} s" for k, v in r["by_kind"].items()))
    if len(seeds) > 1:
        print("\nover the seeds (mean, min..max); the noise floor of the loss: the fault-free runs of two seeds "
              "at equal tokens, apart by")
        for strategy in dict.fromkeys(r["strategy"] for r in rows):
            mine = [r for r in rows if r["strategy"] == strategy]
            ratios, vals = zip(*map(ratio_and_loss, mine))
            tokens = min(r["clean"]["tokens"] for r in mine)
            clean = [loss_at(r["clean"]["curve"], tokens) for r in mine]
            print(f"{strategy:>22}: goodput ratio {sum(ratios) / len(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f}), "
                  f"loss {100 * sum(vals) / len(vals):+.1f} % ({100 * min(vals):+.1f}..{100 * max(vals):+.1f}); "
                  f"fault-free runs apart by {100 * (max(clean) / min(clean) - 1):.1f} %")
    if skipped:
        print(skipped)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default="all", help="comma-separated, or all: every registered strategy")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--minutes", type=float, default=5.0, help="length of the fault-free run")
    p.add_argument("--fault-every", type=float, default=30.0, help="seconds between faults (+-30 %%)")
    p.add_argument("--stop-s", type=float, default=10.0, help="how long a SIGSTOPped worker stays frozen")
    p.add_argument("--sync-every", type=int, default=16, help="H of the local-SGD family")
    p.add_argument("--member-timeout", type=float, default=0.0,
                   help="lowcomm's --member-timeout (default: lowcomm's, 10 s): what a stop costs")
    # About one pass over shakespeare's 5 MB in a 5-min run: the two runs' losses then compare what
    # they learned; on the 0.47 MB pydoc text (the figures of 2026-12-05) they made ~11 passes, where
    # another data order (a re-formed membership's) moved the loss by +-3 % either way.
    p.add_argument("--data", default="shakespeare")
    p.add_argument("--seeds", default="0", help="comma-separated: each strategy runs at each seed (the "
                   "training's and the faults'), and the report gives the mean and the spread")
    p.add_argument("--keep", help="keep the runs under this directory (default: a temporary one)")
    p.add_argument("--link", help="instead of the faults: what one join's heal costs on this emulated link "
                   "(lowcomm's --link, e.g. 100mbit,1ms), per strategy, against the plan's price")
    args = p.parse_args()
    args.seeds = [int(x) for x in args.seeds.split(",")]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="lowcomm-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    kinds, skipped = ["kill", "stop", "lighthouse"], ""
    has_join = subprocess.run([sys.executable, "-m", "lowcomm", "join", "--help"], capture_output=True).returncode == 0
    if has_join:
        kinds.append("join")
    else:
        skipped = "join: skipped (this lowcomm has no `lowcomm join`)"
    if args.link:
        from lowcomm.strategies import available
        names = available() if args.strategies == "all" else args.strategies.split(",")
        print(f"W={args.workers}, ~{args.minutes:g} min a run; runs in {root}; load {os.getloadavg()[0]:.1f}", flush=True)
        rows = [heal_cost(strategy, args, root) for strategy in names]
        (root / "heals.json").write_text(json.dumps(rows, indent=1))
        report_heals(rows, args.link)
        print(f"load {os.getloadavg()[0]:.1f} at the end")
        return 0
    print(f"W={args.workers}, ~{args.minutes:g} min fault-free, a fault every ~{args.fault_every:g} s of "
          f"{', '.join(kinds)}; runs in {root}; load {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    if args.strategies == "all":
        from lowcomm.strategies import available
        args.strategies = ",".join(available())
    for strategy in args.strategies.split(","):
        for seed in args.seeds:
            rows.append(bench(strategy, seed, args, root, kinds))
        # each strategy's figures on disk as soon as they exist (a later strategy may fail)
        (root / "chaos.json").write_text(json.dumps([{k: v for k, v in r.items() if k not in ("clean", "chaos")}
                                                     | {"goodput": [r["clean"]["goodput"], r["chaos"]["goodput"]],
                                                        "val_loss": r["chaos"]["val_loss"],
                                                        "load": os.getloadavg()[0]} for r in rows], indent=1))
    report(rows, skipped)
    print(f"load {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
