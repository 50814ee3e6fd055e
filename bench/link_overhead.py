"""What the link emulator costs when the link is unlimited: steps/s of the same
`lowcomm train` run with `--link inf,0` and without `--link`, side by side.

Runs alternate (off, on, on, off, ...) so drifting machine load hits both
equally; the median of the per-pair ratios is the figure (target >= 0.98).
Whole runs on a shared 2-core machine swing by tens of percent, so the
emulator's own cost is also measured directly: the same two processes time
a small all-reduce through a plain Comm and through a Comm with the
unlimited link, interleaved in blocks.

    python bench/link_overhead.py [--pairs 5] [--steps 30] [--strategy ddp]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(strategy: str, steps: int, out: Path, link: bool) -> float:
    cmd = [sys.executable, "-m", "lowcomm", "train", "--strategy", strategy, "--workers", "2",
           "--steps", str(steps), "--eval-every", "0", "--eval-batches", "1", "--quiet",
           "--out", str(out), "--overwrite"]
    if link:
        cmd += ["--link", "inf,0"]
    subprocess.run(cmd, check=True)
    s = json.loads((out / "summary.json").read_text())
    return s["steps"] / s["wall_s"]


def _per_op(rank: int, port: int, iters: int, q) -> None:
    import time

    import torch
    import torch.distributed as dist

    from lowcomm.comm import Comm
    from lowcomm.comm.link import LinkModel

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    plain, emulated = Comm(), Comm(link=LinkModel(float("inf"), 0.0))
    t = torch.ones(1024)
    times = {"plain": [], "emulated": []}
    for block in range(iters // 50):
        for name, comm in (("plain", plain), ("emulated", emulated)):
            for async_op in (False, True):
                t0 = time.perf_counter()
                for _ in range(25):
                    h = comm.all_reduce(t, async_op=async_op)
                    if async_op:
                        h.wait()
                times[name].append((time.perf_counter() - t0) / 25)
    dist.destroy_process_group()
    if rank == 0:
        q.put(times)


def per_op_overhead(iters: int = 2000) -> tuple[float, float]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_per_op, args=(store.port, iters, q), nprocs=2, start_method="spawn")
    times = q.get()
    return statistics.median(times["plain"]), statistics.median(times["emulated"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--strategy", default="ddp")
    a = ap.parse_args()
    plain, emulated = per_op_overhead()
    print(f"4 KiB all_reduce, W=2 gloo, sync and async interleaved: plain Comm {plain * 1e6:.1f} us/op, "
          f"with --link inf,0 {emulated * 1e6:.1f} us/op (emulator adds {(emulated - plain) * 1e6:+.1f} us/op)",
          flush=True)
    off, on = [], []
    with tempfile.TemporaryDirectory(prefix="lowcomm-overhead-") as tmp:
        for i in range(a.pairs):
            # Swap the order every pair: the second run of a pair tends to meet different load.
            for link in ((False, True) if i % 2 == 0 else (True, False)):
                (on if link else off).append(run(a.strategy, a.steps, Path(tmp) / f"{link}{i}", link))
            print(f"pair {i + 1}: no link {off[-1]:.2f} steps/s, --link inf,0 {on[-1]:.2f} steps/s", flush=True)
    ratio = statistics.median(b / a for a, b in zip(off, on))
    print(f"{a.strategy} W=2, {a.steps} steps x {a.pairs} pairs: median steps/s without link "
          f"{statistics.median(off):.2f}, with unlimited emulated link {statistics.median(on):.2f}; "
          f"median per-pair ratio {ratio:.3f} (target >= 0.98)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
