"""Start a run: validate everything first, then spawn W local workers or join torchrun's world.

Nothing touches the output directory until the config and the data have been
checked, so bad input never leaves a half-written run behind.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import config as C
from .data import check_sizes, load_bytes
from .errors import RunError, UsageError
from .strategies import available
from .worker import check_model, pick_backend, run_rank, spawned_entry


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def default_out(cfg: C.RunConfig) -> str:
    return f"runs/{cfg.strategy}-w{cfg.workers}-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare(cfg: C.RunConfig, create: bool = True, overwrite: bool = False) -> Path:
    """Validate config and data; create the output dir and write config.toml.
    Raises UsageError (before writing anything) on bad input."""
    if under_torchrun():
        cfg.workers = int(os.environ["WORLD_SIZE"])
    C.validate(cfg, available())
    backend = pick_backend(cfg)
    if (backend == "nccl" or cfg.device == "cuda") and not torch.cuda.is_available():
        raise UsageError(f"backend '{backend}' on device '{cfg.device}' needs CUDA, and no GPU is visible")
    check_model(cfg)
    tokens, label = load_bytes(cfg.data.source, quiet=True)
    check_sizes(tokens, cfg.data.val_fraction, cfg.model.seq_len, cfg.workers, label)
    if not cfg.out:
        cfg.out = default_out(cfg)
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"output path '{cfg.out}' exists and is not a directory")
    if (out / "steps.jsonl").exists() and not overwrite:
        raise UsageError(f"output dir '{cfg.out}' already holds a run; choose another --out or pass --overwrite")
    if create:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot create output dir '{cfg.out}': {e.strerror or e}") from None
        (out / "config.toml").write_text(C.to_toml(cfg))
        for stale in ("steps.jsonl", "summary.json"):
            (out / stale).unlink(missing_ok=True)
    return out


def launch(cfg: C.RunConfig, out: Path | None, quiet: bool = False) -> None:
    """Run training on cfg.workers local processes, or as one rank of torchrun's world."""
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        run_rank(cfg, rank, world, local_rank, out if rank == 0 else None, quiet)
        return

    # The parent hosts the rendezvous store on a free port the OS picks: no port races.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.threads))
    try:
        mp.start_processes(spawned_entry, args=(cfg.workers, cfg, store.port, str(out) if out else None, quiet),
                           nprocs=cfg.workers, start_method="spawn", join=True)
    except mp.ProcessRaisedException as e:
        raise RunError(f"a worker failed:\n{e}") from None
    except mp.ProcessExitedException as e:
        raise RunError(f"a worker exited abnormally: {e}") from None
    finally:
        del store
