"""The scale ladder: each strategy's validation-loss gap to ddp at three model sizes.

    python bench/ladder.py                   # CPU: 3 sizes x 9 variants x 2 seeds, W=2 (about 2 h on 2 cores)
    python bench/ladder.py --quick           # the smallest size, one seed, ddp and diloco: a smoke run
    python bench/ladder.py --gpu             # 124M (gpt2) and 350M on one GPU, bf16 (prepared, see below)
    python bench/ladder.py --write-docs      # also rewrite docs/results.md's ladder section and the plot

Every run trains the same tokens of the same BPE corpus (made once by `lowcomm data prepare` from
the bundled Shakespeare, cached in --data) with the same seed, data order and W; a variant is a
strategy at its defaults (acco with --deterministic, so that it trains the tokens asked; delayed
diloco with --outer-delay 1 --eager --outer-momentum 0, as the README runs it). Two seeds: the step where a small run leaves its plateau
moves with the data order, so a gap is read against the seeds' spread. Runs already finished in
--out are read, not rerun: an interrupted ladder continues where it stopped.

The sizes are chosen by their parameters, embeddings included (tied), at --vocab: on CPU
0.11M, 0.44M and 1.99M at bpe:1024 (18x), 600,000 tokens a run (293 steps of 2 x 8 x 128
tokens): what 17 runs a size fit in about two hours on 2 cores. What was cut to fit: larger
models and longer runs (every size is still early in its training: read the gaps as gaps at
this budget), and zero1, whose updates equal ddp's by construction (tests/strategies), is
kept but costs a run a size. On a GPU, GPT-2 small (124M, 12x768) and medium (350M, 24x1024)
at seq 1024, bf16. One GPU holds both ranks: NCCL takes one GPU a rank, so `--gpu` runs the
two ranks over gloo on the one GPU (with two GPUs or more it is NCCL). Expected time on one
H100: about 2 h for the 36 runs at 10M tokens each, an estimate (about 100k tokens/s at 124M,
a third of it at 350M), not a measurement: no GPU was lent when this was written.

Printed: a table per size (each seed's final validation loss, the gap to ddp's of the same
seed, bytes sent by all ranks), then per strategy whether its gap shrinks or grows with size:
a change is named only when it exceeds the spread of its two seeds. --plot writes gap against
size.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from _runs import train

ROOT = Path(__file__).resolve().parents[1]
# variant -> lowcomm train flags; ddp is the baseline every gap is measured against
VARIANTS = {
    "ddp": ("--strategy", "ddp"),
    "zero1": ("--strategy", "zero1"),
    "acco": ("--strategy", "acco", "--deterministic"),
    "diloco": ("--strategy", "diloco"),
    # as the README runs it: a delayed mean lands on a model that moved on, and Nesterov's outer
    # momentum on top of that diverged at these sizes (S, 97 steps: validation 12.3 and 11.6)
    "diloco-delayed-eager": ("--strategy", "diloco", "--outer-delay", "1", "--eager", "--outer-momentum", "0"),
    "streaming_diloco": ("--strategy", "streaming_diloco"),
    "sparseloco": ("--strategy", "sparseloco"),
    "demo": ("--strategy", "demo"),
    "quantized": ("--strategy", "quantized"),
}


@dataclass(frozen=True)
class Size:
    name: str
    n_layer: int
    n_head: int
    d_model: int

    def flags(self) -> tuple[str, ...]:
        return ("--n-layer", str(self.n_layer), "--n-head", str(self.n_head), "--d-model", str(self.d_model))


CPU_SIZES = (Size("S", 2, 2, 48), Size("M", 3, 4, 96), Size("L", 4, 4, 192))
GPU_SIZES = (Size("124M", 12, 12, 768), Size("350M", 24, 16, 1024))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "ladder", help="where the runs go (default: runs/ladder)")
    p.add_argument("--data", type=Path, default=None, help="a prepared token directory (default: made in OUT/data)")
    p.add_argument("--vocab", default="bpe:1024", help="tokenizer for the corpus made (default: bpe:1024)")
    p.add_argument("--tokens", type=int, default=0, help="tokens per run (default: 600,000; --gpu: 10M)")
    p.add_argument("--seeds", default="0,1", help="seeds (default: 0,1)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="variants (default: all nine)")
    p.add_argument("--sizes", default="", help="size names to run (default: all of the mode's)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=0, help="(default: 128; --gpu: 1024)")
    p.add_argument("--quick", action="store_true", help="smallest size, seed 0, ddp and diloco, 60k tokens")
    p.add_argument("--gpu", action="store_true", help="the GPU ladder: 124M and 350M, bf16, on cuda")
    p.add_argument("--plot", type=Path, default=None, help="write gap-vs-size here (PNG)")
    p.add_argument("--write-docs", action="store_true", help="rewrite docs/results.md's ladder section and "
                   "docs/ladder_gap.png")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.variants, args.sizes, args.tokens = "0", "ddp,diloco", "S", args.tokens or 60_000
    args.tokens = args.tokens or (10_000_000 if args.gpu else 600_000)
    args.seq_len = args.seq_len or (1024 if args.gpu else 128)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variant(s) {', '.join(sorted(unknown))} (choose from {', '.join(VARIANTS)})")
    return args


def prepared_data(args) -> Path:
    """The BPE corpus: --data, else made once in OUT/data by `lowcomm data prepare`."""
    if args.data is not None:
        return args.data
    data = args.out / f"data-{args.vocab.replace(':', '')}"
    if not (data / "meta.json").is_file():
        cmd = [sys.executable, "-m", "lowcomm", "data", "prepare", "shakespeare", "--tokenizer", args.vocab,
               "--out", str(data), "--quiet"]
        print("  $ lowcomm", " ".join(cmd[3:]), flush=True)
        subprocess.run(cmd, check=True)
    return data


def run_one(args, data: Path, size: Size, variant: str, seed: int) -> dict:
    """One run's summary.json: read when the run finished before, else trained now."""
    # the directory names what decides the result, so a ladder of other settings never reads it
    out = (args.out / f"{size.name}-{size.n_layer}x{size.d_model}-{data.name}" /
           f"{variant}-seed{seed}-{args.tokens // 1000}k-w{args.workers}-mb{args.micro_batch}-seq{args.seq_len}")
    if (out / "summary.json").is_file():
        return json.loads((out / "summary.json").read_text())
    steps = max(1, args.tokens // (args.workers * args.micro_batch * args.seq_len))
    flags = [*VARIANTS[variant], *size.flags(), "--data", str(data), "--workers", str(args.workers),
             "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--steps", str(steps),
             "--seed", str(seed), "--eval-every", "0", "--overwrite"]
    if args.gpu:
        flags += ["--device", "cuda", "--precision", "bf16"]
    return train(out, *flags, echo=True).summary


def gaps(results: dict, size: str, variant: str, seeds: list[int]) -> list[float]:
    """The variant's validation-loss gap to ddp, in %, seed by seed."""
    return [100 * (results[size, variant, s]["final_val_loss"] / results[size, "ddp", s]["final_val_loss"] - 1)
            for s in seeds]


def table(results: dict, sizes, variants, seeds) -> str:
    lines = []
    for size in sizes:
        params = results[size.name, "ddp", seeds[0]]["params"]
        lines += [f"\n{size.name}: {params / 1e6:.2f}M parameters ({size.n_layer} layers, width {size.d_model})",
                  "| variant | val loss (" + ", ".join(f"seed {s}" for s in seeds) + ") | gap to ddp % | MB sent |",
                  "|---|---|---|---|"]
        for v in variants:
            runs = [results[size.name, v, s] for s in seeds]
            g = gaps(results, size.name, v, seeds)
            losses = " / ".join(f"{r['final_val_loss']:.4f}" for r in runs)
            lines.append(f"| {v} | {losses} | "
                         f"{' / '.join(f'{x:+.1f}' for x in g)} | {runs[0]['wire_bytes_total'] / 1e6:,.1f} |")
    return "\n".join(lines)


def trends(results: dict, sizes, variants, seeds) -> str:
    """Per variant: does its gap move from the smallest to the largest size by more than the seeds' spread?"""
    small, large = sizes[0].name, sizes[-1].name
    lines = []
    for v in (v for v in variants if v != "ddp"):
        a, b = gaps(results, small, v, seeds), gaps(results, large, v, seeds)
        spread = max(max(a) - min(a), max(b) - min(b))
        change = statistics.mean(b) - statistics.mean(a)
        word = ("no change beyond the seeds' spread" if abs(change) <= spread
                else "shrinks" if abs(statistics.mean(b)) < abs(statistics.mean(a)) else "grows")
        lines.append(f"- {v}: gap {statistics.mean(a):+.1f} % at {small}, {statistics.mean(b):+.1f} % at {large} "
                     f"({word}; seed spread {spread:.1f} points)")
    return "\n".join(lines)


def plot(results: dict, sizes, variants, seeds, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [results[s.name, "ddp", seeds[0]]["params"] / 1e6 for s in sizes]
    for v in (v for v in variants if v != "ddp"):
        per = [gaps(results, s.name, v, seeds) for s in sizes]
        mean = [statistics.mean(g) for g in per]
        err = [[m - min(g) for m, g in zip(mean, per)], [max(g) - m for m, g in zip(mean, per)]]
        ax.errorbar(xs, mean, yerr=err, marker="o", capsize=3, label=v)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters (M)")
    ax.set_ylabel("validation loss gap to ddp (%)")
    ax.set_title(f"Gap to ddp at equal tokens, W={results[sizes[0].name, 'ddp', seeds[0]]['workers']}, "
                 f"seeds {','.join(map(str, seeds))} (bars: seed range)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = [s for s in (GPU_SIZES if args.gpu else CPU_SIZES) if not args.sizes or s.name in args.sizes.split(",")]
    variants = ["ddp", *(v for v in args.variants.split(",") if v != "ddp")]
    seeds = [int(s) for s in args.seeds.split(",")]
    data = prepared_data(args)
    results = {(s.name, v, seed): run_one(args, data, s, v, seed) for s in sizes for v in variants for seed in seeds}
    text = table(results, sizes, variants, seeds)
    if len(sizes) > 1:
        text += "\n\n" + trends(results, sizes, variants, seeds)
    print(text)
    (args.out / "ladder.json").write_text(json.dumps({"|".join(map(str, k)): v for k, v in results.items()}))
    if args.plot or args.write_docs:
        plot(results, sizes, variants, seeds, args.plot or ROOT / "docs" / "ladder_gap.png")
    if args.write_docs:
        write_docs(text, args)
    return 0


def write_docs(text: str, args) -> None:
    """Replace the text between docs/results.md's ladder markers with this ladder's."""
    import os
    import time
    doc = ROOT / "docs" / "results.md"
    start, end = "<!-- results:ladder -->", "<!-- /results:ladder -->"
    body = doc.read_text()
    if start not in body:
        body += f"\n## The scale ladder\n\n{start}\n{end}\n"
    head, _, rest = body.partition(start)
    _, _, tail = rest.partition(end)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    # Losses and bytes are the same at any load (only wall time moves, which the table does not use):
    # the runs, cached under --out and rerun only when missing, may come from several sittings.
    stamp = (f"_Written on {time.strftime('%Y-%m-%d')} at {commit or 'an unknown commit'}, {os.cpu_count()} CPUs; "
             f"{args.tokens:,} tokens a run, W={args.workers}, micro-batch {args.micro_batch}, "
             f"sequence {args.seq_len}, {args.vocab}; validation loss and bytes do not depend on the "
             f"machine's load (the runs are cached and may come from several sittings)._ `python bench/ladder.py`")
    doc.write_text(f"{head}{start}\n![gap to ddp against size](ladder_gap.png)\n{text}\n\n{stamp}\n{end}{tail}")


if __name__ == "__main__":
    sys.exit(main())
