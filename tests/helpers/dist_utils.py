"""Run a function on W real gloo processes and collect what each rank returns.

    from dist_utils import run_dist

    def _worker(rank, world, scale):          # module level, so spawn can pickle it
        t = torch.full((4,), float(rank))
        lowcomm.Comm().all_reduce(t)
        return t * scale                       # anything torch.save can write

    def test_sum():
        out = run_dist(_worker, 2, 10.0)       # [rank 0's value, rank 1's value]
        assert torch.equal(out[0], torch.full((4,), 10.0))

How it works (the same recipe as src/lowcomm/launch/launcher.py): the parent hosts a
TCPStore on a port the OS picks (port 0, so concurrent test runs never race for
a port), starts W processes the way the launcher does (lowcomm.launch.supervise.start_workers:
forked from a server that imported torch and lowcomm once, with the caller's
environment and directory), and each one sets one torch thread, joins the
store, initialises a gloo process group of size W, calls
`fn(rank, world, *args, **kwargs)`, writes the return value with `torch.save` to a
temporary directory and destroys the group. The parent reads the W files back in
rank order.

A worker that raises makes `run_dist` raise `torch.multiprocessing.ProcessRaisedException`
carrying the worker's traceback (pytest shows it); a run that outlives
`timeout` seconds is killed and raises TimeoutError, so a deadlocked
collective fails the test instead of hanging the suite.

Worker functions must be importable by the children: define them at module
level in a test file or a helper here (pytest puts each test file's folder and tests/helpers,
pyproject's `pythonpath`, on sys.path; the workers take the parent's sys.path).
"""
from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from lowcomm.launch.supervise import start_workers

__all__ = ["run_dist", "rel_err", "flat_params"]


def _entry(rank: int, fn: Callable, world: int, port: int, result_dir: str,
           args: tuple, kwargs: dict, threads: int) -> None:
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    # LOWCOMM_TEST_BACKEND=nccl runs the same tests on GPUs (the device check in
    # bench/gpu_check.sh); the suite itself always runs on gloo.
    backend = os.environ.get("LOWCOMM_TEST_BACKEND", "gloo")
    if backend == "nccl" or os.environ.get("LOWCOMM_TEST_DEVICE") == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args, **kwargs)
        # Every rank finishes its collectives before any rank tears the group down.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    tmp = Path(result_dir) / f"rank{rank}.pt.tmp"
    torch.save(result, tmp)
    os.replace(tmp, Path(result_dir) / f"rank{rank}.pt")


def run_dist(fn: Callable, world: int, *args: Any, timeout: float = 600.0, threads: int = 1,
             **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world, *args, **kwargs)` on `world` spawned gloo processes.

    Returns the list of the ranks' return values, indexed by rank. Each process
    uses `threads` torch threads (1 by default: the suite runs on 2 cores).
    `timeout` is a hang guard, not a timing claim: a spawn of a few seconds on quiet cores takes
    20 to 30 times as long at a load of 20 to 38 (120 s was within reach of the larger spawns).
    """
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    old_omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the children
    try:
        with tempfile.TemporaryDirectory(prefix="lowcomm-dist-") as result_dir:
            ctx = start_workers(_entry, (fn, world, store.port, result_dir, args, kwargs, threads), world)
            deadline = time.monotonic() + timeout
            try:
                while not ctx.join(timeout=0.1):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world} ranks "
                                           f"did not finish within {timeout} s")
            finally:
                for p in ctx.processes:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGKILL)
                        p.join()
            return [torch.load(Path(result_dir) / f"rank{r}.pt", weights_only=False)
                    for r in range(world)]
    finally:
        if old_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old_omp
        del store


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """All parameters (tied ones once) as one detached fp32 CPU vector."""
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())
