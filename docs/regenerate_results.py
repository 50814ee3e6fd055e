#!/usr/bin/env python3
"""Regenerates the measured figures of docs/results.md and the README's figure, from runs made now.

    .venv/bin/python docs/regenerate_results.py      # ~7 minutes on 2 quiet cores

1. `lowcomm train` with its defaults: the paragraph it ends with (docs/results.md's first session);
2. `lowcomm bench` with its defaults (what `make bench` runs): docs/results.md's answer and
   table, and docs/bench_loss_vs_time.png (shown in the README);
3. the short recipe (RECIPE): figures that do not depend on timing (bytes, optimizer state,
   the losses of deterministic strategies), which tests/bench/test_results.py recomputes in CI and
   compares with docs/results.md.

Each is written between `<!-- results:NAME -->` and `<!-- /results:NAME -->` with the commit it
was measured at, the machine's load before and after, its CPUs and the date, so a figure is
never older than it says. Run it on a committed tree, on a machine as quiet as you can get,
and commit what it writes. Extra arguments go to the bench (e.g. --workers 4).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
FIGURE = ROOT / "docs" / "bench_loss_vs_time.png"
RUNS = ROOT / "runs"
# Deterministic strategies at the default model and workers, two steps each, no emulated link:
# acco with --deterministic (adaptive acco's micro-batch count depends on timing).
RECIPE = ["bench", "--strategies", "ddp,zero1,acco,diloco,demo", "--steps", "2", "--eval-every", "0",
          "--eval-batches", "1", "--link", "inf,0ms", "--deterministic", "--quiet"]


def lowcomm(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "lowcomm", *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"lowcomm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def tree() -> str:
    """'commit abc1234', and whether the tree differs from it (taken before this script writes)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return f"commit {commit}" + (" with uncommitted changes" if dirty else "")


def provenance(tree: str, load_before: float, started: float) -> str:
    """One line: what was measured where and when."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    return (f"_Measured at {tree} on "
            f"{time.strftime('%Y-%m-%d')}: {os.cpu_count()} CPUs ({cpu}), load average {load_before:.1f} before and "
            f"{os.getloadavg()[0]:.1f} after, {time.time() - started:.0f} s end to end._")


def commit_of(block: str) -> str | None:
    found = re.search(r"Measured at commit (\S+)", block)
    return found.group(1) if found else None


def read_block(path: Path, name: str) -> str:
    text = path.read_text()
    found = re.search(rf"<!-- results:{name} -->\n(.*?)<!-- /results:{name} -->", text, re.S)
    if found is None:
        raise KeyError(f"{path} has no results:{name} block")
    return found.group(1)


def write_block(path: Path, name: str, body: str) -> None:
    text = path.read_text()
    head, tail = f"<!-- results:{name} -->\n", f"<!-- /results:{name} -->"
    start, end = text.index(head) + len(head), text.index(tail)
    path.write_text(text[:start] + body.rstrip("\n") + "\n" + text[end:])


def table_lines(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.startswith("|")]


def recipe_table(bench_dir: Path) -> str:
    """The recipe's figures that do not depend on timing, one row per strategy."""
    import json

    meta = json.loads((bench_dir / "bench.json").read_text())
    lines = ["| strategy | final val loss | tokens trained | MB sent (all ranks) | wire MB/step/rank "
             "| same bytes every step | optimizer state MB/rank |", "|---|---|---|---|---|---|---|"]
    for run in meta["runs"]:
        s = json.loads((bench_dir / run["dir"] / "summary.json").read_text())
        steps = [json.loads(line) for line in (bench_dir / run["dir"] / "steps.jsonl").read_text().splitlines()]
        same = len({r["wire_bytes"] for r in steps}) == 1
        lines.append(f"| {run['label']} | {s['final_val_loss']:.4f} | {s['tokens']:,} | "
                     f"{s['wire_bytes_total'] / 1e6:.3f} | {s['wire_bytes_per_rank_per_step'] / 1e6:.3f} | "
                     f"{'yes' if same else 'no'} | {s['optimizer_state_bytes_per_rank'] / 1e6:.2f} |")
    return "\n".join(lines)


def first_session(stdout: str) -> str:
    """The summary paragraph `lowcomm train` ends with, quoted."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\w+ on \d+ worker", line))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip() or lines[i].startswith("lowcomm:")),
               len(lines))
    return "\n".join("> " + line for line in lines[start:end])


def main(bench_flags: list[str]) -> None:
    RUNS.mkdir(exist_ok=True)
    state = tree()
    load, started = os.getloadavg()[0], time.time()
    out = lowcomm("train", "--out", str(RUNS / "readme-train"), "--overwrite")
    write_block(RESULTS, "first-session", first_session(out) + "\n\n" + provenance(state, load, started)
                + " `lowcomm train`, no flags.")

    load, started = os.getloadavg()[0], time.time()
    bench = RUNS / "readme-bench"
    report = lowcomm("bench", "--out", str(bench), "--overwrite", "--quiet", *bench_flags)
    shutil.copy(bench / "loss_vs_time.png", FIGURE)
    report = report[report.index("# lowcomm bench"):].split("\nbench: report")[0]
    body = report.split("\n", 1)[1].strip()  # the answer, what ran, the table
    write_block(RESULTS, "bench", "`" + " ".join(["lowcomm", "bench", *bench_flags]) + "`\n\n" + body + "\n\n"
                + provenance(state, load, started))

    load, started = os.getloadavg()[0], time.time()
    recipe = RUNS / "readme-recipe"
    lowcomm(*RECIPE, "--out", str(recipe), "--overwrite")
    write_block(RESULTS, "recipe", f"`lowcomm {' '.join(RECIPE)}`\n\n{recipe_table(recipe)}\n\n"
                + provenance(state, load, started))
    print(f"wrote {RESULTS.relative_to(ROOT)} and {FIGURE.relative_to(ROOT)}: commit them")


if __name__ == "__main__":
    main(sys.argv[1:])
