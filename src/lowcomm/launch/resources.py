"""Will a run fit on this machine? Checked before anything starts.

The memory estimate is deliberately a floor, so a run it refuses cannot work
and a run it lets through may still need more (strategy buffers, allocator
slack). Per worker, in bytes, for a model of P parameters (counted from the
model itself, built on the meta device: lowcomm's GPT or a transformers one):

    WORKER_BASE                    a Python process with torch imported (~220 MiB measured)
    + the strategy's model state   its `model_state_bytes` (the planner's figure): e.g. 16 P
                                   for fp32 parameters, gradients and AdamW's two moments
    + 4 L·b·S·(16 d + h·S)         activations autograd keeps per layer (inputs of the
                                   norms, qkv, MLP, GELU; one h·S² attention map)
    + 12 b·S·V                     logits, their softmax and gradient

(b = --micro-batch, S = --seq-len, d = width, h = heads, L = layers, V = 256)
summed over the workers on this machine, against the memory available to
this process (MemAvailable, lowered by a cgroup limit) or, on GPUs, the free
memory of the devices the ranks share.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from ..data import describe
from ..errors import UsageError
from ..metrics.calibration import cpu_cores

WORKER_BASE = 220 * 2**20


def worker_bytes(cfg) -> tuple[int, int]:
    """(bytes one worker needs at least, parameter count) for a validated `cfg`."""
    from ..plan.planner import model_layout
    from ..strategies import registry
    n_layer, n_head, d_model = cfg.model.dims()
    s, b = cfg.model.seq_len, cfg.micro_batch
    params = model_layout(cfg).numel
    state = registry.get(cfg.strategy).cost.model_state_bytes(params, cfg.workers, cfg.strategy_options())
    vocab = describe(cfg.data.source, cfg.data.vocab_size).vocab_size  # the logits' width
    activations = 4 * n_layer * b * s * (16 * d_model + n_head * s) + 12 * b * s * vocab
    return WORKER_BASE + state + activations, params


def available_host_bytes() -> int | None:
    """Memory this process can still use: MemAvailable, or less under a cgroup (v2 or v1) limit."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            cap = Path(limit).read_text().strip()
            if cap != "max" and int(cap) < 2**60:
                found.append(int(cap) - int(Path(usage).read_text().strip()))
                break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def check_fits(cfg, device_type: str) -> None:
    """UsageError when the run cannot fit in memory; a warning when the workers oversubscribe the cores."""
    per_worker, params = worker_bytes(cfg)
    workers = cfg.local_workers
    n_layer, _, d_model = cfg.model.dims()
    what = (f"{workers} worker(s) x {_gib(per_worker)}: model of {params / 1e6:,.1f}M params with "
            f"--n-layer {n_layer} --d-model {d_model}, --micro-batch {cfg.micro_batch}, --seq-len {cfg.model.seq_len}")
    if device_type == "cuda":
        import torch
        devices = torch.cuda.device_count()
        per_device = math.ceil(workers / devices)
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(devices))
        need = per_device * (per_worker - WORKER_BASE)
        if need > free:
            raise UsageError(f"the run needs at least {_gib(need)} of GPU memory per device ({what}, "
                             f"{per_device} per GPU) but {_gib(free)} is free; use a smaller model, "
                             f"--micro-batch or --seq-len, or fewer --workers")
    else:
        avail = available_host_bytes()
        need = workers * per_worker
        if avail is not None and need > avail:
            raise UsageError(f"the run needs at least {_gib(need)} of memory ({what}) but {_gib(avail)} "
                             f"is available; use a smaller model, --micro-batch or --seq-len, or fewer --workers")
    cores = cpu_cores()
    if device_type != "cuda" and workers * cfg.threads > cores:
        _warn_once(f"warning: {workers} worker(s) x {cfg.threads} thread(s) on {cores} CPU core(s): "
                   f"oversubscribed, each worker will run about {workers * cfg.threads / cores:.1f}x slower")


def device_type(cfg) -> str:
    """Where the run's workers compute: "cuda" (nccl, or asked for) or "cpu"."""
    from ..train.worker import pick_backend
    return "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and pick_backend(cfg) == "nccl") else "cpu"


_WARNED: set[str] = set()  # a bench checks each of its runs: one line says it for all of them


def _warn_once(text: str) -> None:
    if text not in _WARNED:
        _WARNED.add(text)
        print(text, file=sys.stderr)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"
