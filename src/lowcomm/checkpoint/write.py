"""Writing a checkpoint, atomically, when the training loop is asked for one.

Every rank writes into `.ckpt-NNNNNN.tmp`; once DCP has finished (its last step writes
`.metadata` after every rank's file is on disk), rank 0 writes the config and
`manifest.json` with the sha256 of every file, fsyncs, and renames the directory to its
final name. A directory named `ckpt-*` is therefore complete, or was damaged after the
fact -- which `verify` detects (missing or extra file, size, checksum). Only the last
`keep` checkpoints are kept.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import torch

from .. import config as C
from ..config.nodes import per_replica
from ..errors import RunError
from ..storage.files import disk_full, first_failure, write_text_atomic
from ..contract.context import tensor_bytes
from .layout import FORMAT, MANIFEST, checksums, config_hash, name_of, prune
from .state import to_dcp

_requested = threading.Event()
_stop_requested = threading.Event()


def request(stop: bool = False) -> None:
    """Ask the training loop for a checkpoint at its next safe point (safe to call from a
    signal handler: it only sets flags). Ranks agree at their next log gather (every
    `--log-every` steps), write one checkpoint there, and with `stop=True` the loop then
    ends as if `--stop-at` had been reached."""
    _requested.set()
    if stop:
        _stop_requested.set()


def take_request() -> tuple[bool, bool]:
    """(checkpoint requested, stop requested) on this rank; clears the checkpoint flag."""
    asked = _requested.is_set()
    _requested.clear()
    return asked, _stop_requested.is_set()


def save(trainer, out_dir: Path, keep: int, wall_s: float = 0.0) -> Path | None:
    """Write the trainer's state (worker.Trainer.state_dict(): the strategy's whole state, data
    position, RNG, step) and the run's wall time so far as checkpoint `ckpt-<step>`. Collective:
    every rank calls it at the same step. Returns the final path on rank 0, None elsewhere.
    A full disk: DiskFull on every rank, and no partial checkpoint left."""
    step, rank = trainer.step, trainer.rank
    _refuse_nonfinite(trainer)
    tmp = out_dir / f".{name_of(step)}.tmp"
    replicated = trainer.run.state_replicated  # every part replicated (ddp): stored once
    state = to_dcp(trainer, wall_s, replicated)
    try:
        return _save(trainer, state, out_dir, tmp, keep, replicated)
    except BaseException as e:
        # Checked before the partial checkpoint is removed: its bytes are part of what filled the disk.
        full = disk_full(e, tmp, need=tensor_bytes(state))
        # DCP raises on every rank once every rank's write is over (it gathers the errors), so
        # rank 0 may remove the partial checkpoint: left there, it would keep a full disk full.
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from e
        if isinstance(e, OSError) or not isinstance(e, (Exception, KeyboardInterrupt, SystemExit)):
            # a file error, or DCP's CheckpointException (a BaseException): say it was the checkpoint
            raise RunError(f"writing checkpoint {out_dir / name_of(step)} failed: {first_failure(e)}") from e
        raise


def _save(trainer, state: dict, out_dir: Path, tmp: Path, keep: int, replicated: bool) -> Path | None:
    import torch.distributed.checkpoint as dcp

    step, rank, comm = trainer.step, trainer.rank, trainer.comm
    t0 = time.perf_counter()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a checkpoint a dead run left half-written
        tmp.mkdir(parents=True)
    comm.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    trainer.write_model_into(tmp if rank == 0 else None)  # tmp/model/: what --init-from and sample read
    comm.barrier()
    if rank != 0:
        return None
    write_text_atomic(tmp / "config.toml", C.to_toml(trainer.cfg))
    _write_manifest(tmp, trainer, replicated, t0)
    final = _publish(tmp, out_dir / name_of(step))
    prune(out_dir, keep)
    return final


def _refuse_nonfinite(trainer) -> None:
    """Agreed across ranks, so that no rank waits in a save the others left."""
    from ..contract.context import all_finite
    bad = torch.tensor([0.0 if all_finite(*(p.detach() for p in trainer.model.parameters())) else 1.0],
                       device=trainer.device)
    if trainer.comm.meta_all_reduce(bad, op="max").item():
        raise RunError(f"refusing to checkpoint step {trainer.step}: the parameters are not finite")


def _write_manifest(tmp: Path, trainer, replicated: bool, t0: float) -> None:
    manifest = {"format": FORMAT, "step": trainer.step, "strategy": trainer.cfg.strategy,
                "world": trainer.world, "per_replica": per_replica(trainer.cfg), "replicated": replicated,
                "config_hash": config_hash(trainer.cfg),
                "torch": torch.__version__, "files": checksums(tmp),
                "write_s": round(time.perf_counter() - t0, 4)}  # DCP + checksums, as rank 0 saw it
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: Path, final: Path) -> Path:
    """Rename the finished directory to its final name: the step that makes it a checkpoint."""
    if final.exists():  # the same step written again (a resumed run's final step): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
