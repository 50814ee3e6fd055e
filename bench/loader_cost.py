"""What reading tokens costs a step: the loader's time (steps.jsonl's loader_s, rank 0's seconds
in Trainer.next_batch: drawing the windows, copying them out of the data, to the device) against
the step's wall time, for the same corpus read as byte text (in memory) and as token files
(memory-mapped), side by side at the tiny model (target: <= 2 % of a step).

The token files hold the byte corpus's own ids (vocabulary 256), so the model, the batches and
the step are the same and only the reading differs: a directory as `lowcomm data prepare` writes
it (uint16) and nanoGPT's train.bin/val.bin; with --llmc also the corpus cut into 4 llm.c shards
read as one stream (uint16; llm.c's GPT-2 vocabulary, 50257, makes that model's head 200 times
larger: its step is another and far slower on a CPU, its ratio is shown for what it is). Runs alternate source by source, --repeats times,
so drifting load falls on all alike; the figure is the median over steps after --skip warm-up
steps of each run, of loader_s / wall_s.

    python bench/loader_cost.py [--steps 40] [--repeats 2] [--workers 2] [--data shakespeare] [--llmc]
"""
from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from lowcomm.data import load_tokens

LLMC_GPT2 = (20240520, 1)


def write_sources(data: str, root: Path, llmc_shards: bool) -> dict[str, str]:
    """The byte corpus `data` and the same ids as token files of each layout."""
    tokens = load_tokens(data, 0.1)
    train, val = np.asarray(tokens.train, dtype=np.uint16), np.asarray(tokens.val, dtype=np.uint16)
    prepared = root / "prepared"
    prepared.mkdir()
    train.tofile(prepared / "train.bin")
    val.tofile(prepared / "val.bin")
    (prepared / "meta.json").write_text(json.dumps({
        "format": "lowcomm-tokens", "version": 1, "dtype": "uint16", "vocab_size": 256, "eot_id": None,
        "special_tokens": {}, "tokens": {"train": len(train), "val": len(val)}, "documents": {"train": 1, "val": 1},
        "source": data, "tokenizer": "bytes", "tokenizer_sha256": "", "val_fraction": 0.1}))
    nanogpt = root / "nanogpt"
    nanogpt.mkdir()
    train.tofile(nanogpt / "train.bin")
    val.tofile(nanogpt / "val.bin")
    (nanogpt / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 256}))  # as its char-level prepare.py
    sources = {"bytes (text)": data, "prepared dir": str(prepared), "nanoGPT .bin": str(nanogpt / "train.bin")}
    if llmc_shards:
        llmc = root / "llmc"
        llmc.mkdir()
        for i, part in enumerate(np.array_split(train, 4)):
            _llmc_shard(llmc / f"corpus_train_{i + 1:06d}.bin", part)
        _llmc_shard(llmc / "corpus_val_000000.bin", val)
        sources["llm.c 4 shards"] = str(llmc)
    return sources


def _llmc_shard(path: Path, ids: np.ndarray) -> None:
    header = np.zeros(256, dtype=np.int32)
    header[:3] = *LLMC_GPT2, len(ids)
    path.write_bytes(header.tobytes() + ids.tobytes())


def run(source: str, args, out: Path) -> list[tuple[float, float]]:
    """(loader_s, wall_s) of each step after the warm-up ones."""
    subprocess.run([sys.executable, "-m", "lowcomm", "train", "--data", source, "--model", args.model,
                    "--workers", str(args.workers), "--steps", str(args.steps), "--eval-every", "0",
                    "--eval-batches", "1", "--quiet", "--out", str(out), "--overwrite"], check=True)
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return [(r["loader_s"], r["wall_s"]) for r in records[args.skip:]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps of each run left out")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default="tiny")
    p.add_argument("--data", default="shakespeare", help="the byte corpus (its ids fill the token files)")
    p.add_argument("--llmc", action="store_true", help="also llm.c shards (at llm.c's vocabulary: a larger model)")
    args = p.parse_args()
    found: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        sources = write_sources(args.data, Path(tmp), args.llmc)
        for repeat in range(args.repeats):
            for name, source in sources.items():
                found.setdefault(name, []).extend(run(source, args, Path(tmp) / f"run-{repeat}"))
    print(f"loader time per step, {args.model} model, W={args.workers}, {args.steps} steps x {args.repeats} "
          f"runs a source (median over steps after the first {args.skip} of each run)")
    print(f"{'source':<16} {'loader ms':>10} {'step ms':>9} {'loader/step':>12}")
    for name, steps in found.items():
        loader, wall = (statistics.median(v) * 1e3 for v in zip(*steps))
        ratio = statistics.median(a / b for a, b in steps)
        print(f"{name:<16} {loader:>10.3f} {wall:>9.2f} {ratio:>11.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
