"""Checkpoints: written with torch.distributed.checkpoint (DCP), made atomic, verified before use.

A checkpoint is a directory `ckpt-NNNNNN` (the trainer step it was taken after) in the
run's output directory:

    ckpt-000400/
      __0_0.distcp, __1_0.distcp, ...   DCP's data files, one per rank
      .metadata                          DCP's index of every entry
      config.toml                        the resolved config of the run
      manifest.json                      step, strategy, world size, config hash, sha256 of every file

What DCP stores. DCP keeps one copy of an entry that several ranks save under the same
key (it treats it as replicated and de-duplicates it), so per-rank state -- data position,
RNG, ZeRO-1/ACCO shards, DPU's pending gradient, error-feedback residuals, DiLoCo's local
θ -- goes under a per-rank key `rank<r>`, and only state that is identical on every rank
(a strategy that declares `checkpoint_replicated`, e.g. ddp's parameters and optimizer)
goes under the shared key `shared`, written once. DCP flattens nested dicts into dotted
keys, which turns integer keys (an optimizer's `state[0]`) into strings and drops empty
containers; so each namespace is stored as its tensors (`tensors.<i>`, real DCP tensor
entries) plus a `skeleton`: the nested structure with each tensor replaced by its index,
which DCP pickles as one bytes entry. Loading is rank-local (`no_dist`): a rank reads its
own namespace and the shared one, with a template built from DCP's metadata.

Atomicity. Every rank writes into `.ckpt-NNNNNN.tmp`; once DCP has finished (its last
step writes `.metadata` after every rank's file is on disk), rank 0 writes the config and
`manifest.json` with the sha256 of every file, fsyncs, and renames the directory to its
final name. A directory named `ckpt-*` is therefore complete, or was damaged after the
fact -- which `verify` detects (missing or extra file, size, checksum). Only the last
`keep` checkpoints are kept.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import config as C
from .errors import RunError, UsageError

PREFIX = "ckpt-"
MANIFEST = "manifest.json"
FORMAT = 1
# Config keys a resumed run may change: they do not change what a step computes
# (`steps` extends the run and re-sizes its lr schedule; emulation changes timing only).
SAFE_KEYS = {"steps", "stop_at", "checkpoint_every", "keep", "max_restarts", "max_bad_steps",
             "out", "workers", "eval_every", "eval_batches", "log_every", "threads", "trace",
             "link", "slowdown", "stragglers"}


def name_of(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def config_hash(cfg: C.RunConfig) -> str:
    """What a checkpoint's steps depend on: the resolved config without the SAFE_KEYS."""
    d = {k: v for k, v in C.to_dict(cfg).items() if k not in SAFE_KEYS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


# -- the state, split so that DCP stores it faithfully -------------------------------------

class _Ref:
    """Where a tensor sat in a skeleton: its index in the namespace's tensor list."""

    def __init__(self, i: int):
        self.i = i

    def __reduce__(self):
        return (_Ref, (self.i,))


def _split(obj: Any, tensors: list) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().cpu() if obj.device.type != "cpu" else obj.detach())
        return _Ref(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_split(v, tensors) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _join(obj: Any, tensors: dict) -> Any:
    if isinstance(obj, _Ref):
        return tensors[str(obj.i)]
    if isinstance(obj, dict):
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_join(v, tensors) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _namespace(state: Any) -> dict:
    tensors: list = []
    skeleton = _split(state, tensors)
    # Pickled here, so DCP stores the skeleton as one opaque bytes entry instead of flattening it.
    return {"tensors": {str(i): t for i, t in enumerate(tensors)}, "skeleton": pickle.dumps(skeleton)}


# -- writing ----------------------------------------------------------------------------------

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
    every rank calls it at the same step. Returns the final path on rank 0, None elsewhere."""
    import torch.distributed.checkpoint as dcp

    step, rank, comm = trainer.step, trainer.rank, trainer.comm
    t0 = time.perf_counter()
    from .strategies.context import all_finite
    bad = torch.tensor([0.0 if all_finite(*(p.detach() for p in trainer.model.parameters())) else 1.0],
                       device=trainer.device)
    if comm.meta_all_reduce(bad, op="max").item():  # agreed: no rank waits in a save the others left
        raise RunError(f"refusing to checkpoint step {step}: the parameters are not finite")
    final = out_dir / name_of(step)
    tmp = out_dir / f".{name_of(step)}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a checkpoint a dead run left half-written
        tmp.mkdir(parents=True)
    comm.barrier()
    state = {**trainer.state_dict(), "run": {"wall_s": wall_s}}
    strategy_state = state.pop("strategy")
    replicated = getattr(trainer.run, "checkpoint_replicated", False)
    sd = {f"rank{rank}": _namespace(state)}
    if replicated:
        sd["shared"] = _namespace({"strategy": strategy_state})  # identical on every rank: stored once
    else:
        sd[f"rank{rank}"] = _namespace({**state, "strategy": strategy_state})
    dcp.save(sd, checkpoint_id=str(tmp))
    comm.barrier()
    if rank != 0:
        return None
    (tmp / "config.toml").write_text(C.to_toml(trainer.cfg))
    manifest = {"format": FORMAT, "step": step, "strategy": trainer.cfg.strategy, "world": trainer.world,
                "replicated": replicated, "config_hash": config_hash(trainer.cfg),
                "torch": torch.__version__, "files": _checksums(tmp),
                "write_s": round(time.perf_counter() - t0, 4)}  # DCP + checksums, as rank 0 saw it
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # the same step written again (a resumed run's final step): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(out_dir)
    prune(out_dir, keep)
    return final


def _checksums(path: Path) -> dict:
    out = {}
    for f in sorted(path.iterdir()):
        if f.is_file() and f.name != MANIFEST:
            out[f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def listed(out_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `ckpt-*` directory, newest first."""
    found = []
    for p in Path(out_dir).glob(f"{PREFIX}*"):
        tail = p.name[len(PREFIX):]
        if p.is_dir() and tail.isdigit():
            found.append((int(tail), p))
    return sorted(found, reverse=True)


def prune(out_dir: Path, keep: int) -> None:
    for _, path in listed(out_dir)[keep:]:
        shutil.rmtree(path, ignore_errors=True)


# -- choosing and verifying -------------------------------------------------------------------

@dataclass
class Found:
    path: Path
    step: int
    world: int
    replicated: bool


def verify(path: Path, cfg: C.RunConfig, world: int) -> Found:
    """The checkpoint at `path` if it is complete, intact and fits this run; else UsageError
    with one line naming the problem."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise UsageError(f"{MANIFEST} is missing") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{MANIFEST} is unreadable ({e.__class__.__name__})") from None
    files = manifest.get("files", {})
    present = {f.name for f in path.iterdir() if f.is_file() and f.name != MANIFEST}
    for fname in sorted(files):
        if fname not in present:
            raise UsageError(f"file {fname} is missing")
    for fname in sorted(present - set(files)):
        raise UsageError(f"file {fname} is not in its manifest")
    for fname, want in sorted(files.items()):
        f = path / fname
        if f.stat().st_size != want["bytes"]:
            raise UsageError(f"file {fname} has {f.stat().st_size} bytes, its manifest says {want['bytes']} "
                             f"(truncated?)")
        if _sha256(f) != want["sha256"]:
            raise UsageError(f"file {fname} fails its sha256 checksum (corrupted)")
    if manifest.get("strategy") != cfg.strategy:
        raise UsageError(f"it was written by strategy '{manifest.get('strategy')}', this run uses "
                         f"'{cfg.strategy}'")
    if manifest.get("config_hash") != config_hash(cfg):
        raise UsageError("it was written with an incompatible config (model, data, optimizer or strategy "
                         "options differ)")
    return Found(path, int(manifest["step"]), int(manifest["world"]), bool(manifest.get("replicated")))


class WorldSizeError(UsageError):
    """The run's world size does not fit its checkpoints (every one of them: no fallback)."""


def check_world(found: Found, strategy: str, world: int) -> None:
    """A checkpoint of another world size loads only where its strategy state is replicated."""
    if found.world != world and not found.replicated:
        raise WorldSizeError(f"checkpoint {found.path} was written by {found.world} workers and strategy "
                         f"'{strategy}' keeps per-rank (sharded) state that cannot be resharded to {world} "
                         f"workers; resume with --workers {found.world}")


def read(path: Path) -> Found:
    """The manifest of a checkpoint already verified (a worker loading what the launcher chose)."""
    m = json.loads((Path(path) / MANIFEST).read_text())
    return Found(Path(path), int(m["step"]), int(m["world"]), bool(m.get("replicated")))


def latest(out_dir: Path, cfg: C.RunConfig, world: int, warn=None) -> Found | None:
    """The newest checkpoint in out_dir that verifies; each refused one is reported in one
    line through `warn` (default: stderr). None when there is none at all; UsageError when
    there are some and none is usable (naming the newest one's problem)."""
    warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
    candidates = listed(out_dir)
    first_problem = None
    for step, path in candidates:
        try:
            found = verify(path, cfg, world)
            check_world(found, cfg.strategy, world)  # the run's problem, not this checkpoint's: no fallback
            return found
        except UsageError as e:
            if isinstance(e, WorldSizeError):
                raise
            first_problem = first_problem or f"{path}: {e}"
            warn(f"warning: checkpoint {path} refused: {e}; trying the previous one")
    if candidates:
        raise UsageError(f"no usable checkpoint in {out_dir} (newest: {first_problem})")
    return None


def load(trainer, found: Found) -> dict:
    """Load checkpoint `found` into the trainer: rank-local reads of its own namespace (or, for
    replicated state written by another world size, the shared one and fresh data/RNG).
    Returns the run's bookkeeping saved with it ({"wall_s": ...})."""
    same_world = found.world == trainer.world
    state = read_state(found, trainer.rank if same_world else None)
    if not same_world:  # replicated strategy state on a new world size: the data order starts anew
        trainer.run.load_state_dict(state["strategy"])
        trainer.step = found.step
        return {}
    trainer.load_state_dict(state)
    if trainer.step != found.step:
        raise RunError(f"checkpoint {found.path} holds step {trainer.step}, its name says {found.step}")
    return state.get("run", {})


def read_state(found: Found, rank: int | None) -> dict:
    """What rank `rank` saved (None: only the shared part), as worker.Trainer.state_dict() laid
    it out plus "run"; read on this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(found.path)).read_metadata().state_dict_metadata
    wanted = ["shared"] if found.replicated else []
    if rank is not None:
        wanted.append(f"rank{rank}")
    template: dict = {}
    for key, md in meta.items():
        ns = key.split(".", 1)[0]
        if ns not in wanted:
            continue
        parts = key.split(".")
        node = template
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = (torch.empty(md.size, dtype=md.properties.dtype)
                           if isinstance(md, TensorStorageMetadata) else None)
    if any(ns not in template for ns in wanted):
        raise RunError(f"checkpoint {found.path} holds no state for rank {rank}")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(template, checkpoint_id=str(found.path), no_dist=True)
    state: dict = {}
    for ns in wanted:
        part = template[ns]
        state.update(_join(pickle.loads(part["skeleton"]), part.get("tensors", {})))
    return state


# -- resuming from the command line -------------------------------------------------------------

def resume_config(args, apply_flags) -> C.RunConfig:
    """`--resume DIR`: the config is DIR/config.toml; flags given with it may change only what
    does not change a step's result (SAFE_KEYS, e.g. --steps to extend, --stop-at)."""
    run = Path(args.resume)
    if args.config:
        raise UsageError(f"--resume takes its config from {run / 'config.toml'}; drop --config")
    if getattr(args, "out", None) and Path(args.out) != run:
        raise UsageError(f"--out ({args.out}) must be the --resume directory ({run}) or left out")
    if not (run / "config.toml").is_file():
        raise UsageError(f"--resume {run}: no config.toml there (not a lowcomm run directory)")
    cfg = C.load_toml(run / "config.toml")
    cfg.stop_at = 0  # the stop that ended the previous part is not this part's
    C.validate(cfg)
    before = _flat(C.to_dict(cfg))
    apply_flags(cfg)
    C.validate(cfg)
    after = _flat(C.to_dict(cfg))
    for key in sorted(before.keys() | after.keys()):
        if key.split(".")[0] not in SAFE_KEYS and before.get(key) != after.get(key):
            raise UsageError(f"--resume: {key} cannot change on a resumed run (it is {before.get(key)!r} in "
                             f"{run / 'config.toml'}, given {after.get(key)!r}); only --steps, --stop-at, "
                             f"checkpointing, logging, evaluation and emulation settings may")
    cfg.out = str(run)
    return cfg


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def prepare_resume(cfg: C.RunConfig, create: bool) -> Path | None:
    """Choose the checkpoint the run continues from (cfg.resume_from) and rewrite config.toml.
    None for a torchrun restart that finds no checkpoint (the run then starts over)."""
    required = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0  # --resume, not a restart
    out = Path(cfg.out) if cfg.out else None
    if out is None or not out.is_dir():
        if required:
            raise UsageError(f"--resume {cfg.out}: no such run directory")
        return None
    found = latest(out, cfg, cfg.workers)
    if found is None:
        if required:
            raise UsageError(f"--resume {out}: no checkpoint there (write them with --checkpoint-every N or --stop-at S)")
        return None
    if cfg.steps < found.step:
        raise UsageError(f"--steps {cfg.steps} is below the checkpoint's step {found.step} ({found.path})")
    if found.world != cfg.workers:
        print(f"warning: {found.path} was written by {found.world} workers, resuming on {cfg.workers}: the "
              f"replicated state is loaded, each worker's data order starts anew", file=sys.stderr, flush=True)
    cfg.resume_from = str(found.path)
    if create:
        (out / "config.toml").write_text(C.to_toml(cfg))
    return out


def restart_from(cfg: C.RunConfig, out: Path, error: Exception, attempt: int) -> None:
    """After a failed launch attempt (--max-restarts): point cfg.resume_from at the last good
    checkpoint (none: the run starts over), say so in one line, and log the restart in
    OUT/restarts.jsonl (when the failure was noticed and the relaunch began)."""
    noticed = time.time()
    try:
        found = latest(out, cfg, cfg.workers)
    except UsageError as e:  # checkpoints there, none usable: start over rather than give up
        print(f"warning: {e}", file=sys.stderr, flush=True)
        found = None
    cfg.resume_from = str(found.path) if found else ""
    where = f"{found.path.name} (step {found.step})" if found else "the start (no checkpoint yet)"
    print(f"lowcomm: {error}; restart {attempt} of {cfg.max_restarts} from {where}", file=sys.stderr, flush=True)
    with open(out / "restarts.jsonl", "a") as f:
        f.write(json.dumps({"attempt": attempt, "error": str(error), "noticed_at": noticed,
                            "resume_step": found.step if found else 0, "relaunched_at": time.time()}) + "\n")
