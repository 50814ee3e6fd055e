"""Continuing a run: `--resume DIR` from the command line, and a relaunch after a failure."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .. import config as C
from ..errors import UsageError
from ..storage.files import write_text_atomic
from .choose import Found, latest
from ..config.nodes import per_replica, under_torchrun
from .layout import SAFE_KEYS


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
        if key == "replicas" and cfg.elastic:  # its replicas are those it finds, of the size it had
            continue
        if key.split(".")[0] not in SAFE_KEYS and before.get(key) != after.get(key):
            raise UsageError(f"--resume: {C.spelled(cfg, key)} cannot change on a resumed run (it is {before.get(key)!r} in "
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
    if cfg.elastic and per_replica(cfg) != found.per_replica:  # its replicas come and go, their size stays
        raise UsageError(_replica_size_changed(found, cfg))
    if found.world != cfg.workers and not (cfg.elastic and under_torchrun()):  # there: the quorum's replicas
        data = ("the data stream read on from its position there" if cfg.elastic
                else "each worker's data order starts anew")
        print(f"warning: {found.path} was written by {_other_membership(found, cfg)}, {data}",
              file=sys.stderr, flush=True)
    cfg.resume_from = str(found.path)
    if create:  # the checkpoint taken, said once (the lead: a torchrun job's rank 0)
        print(f"lowcomm: resuming from {found.path} (step {found.step} of {cfg.steps})", file=sys.stderr, flush=True)
        write_text_atomic(out / "config.toml", C.to_toml(cfg))
    return out


def _other_membership(found: Found, cfg: C.RunConfig) -> str:
    """How a checkpoint of another number of workers is taken (recut.py; UsageError where it
    cannot be: choose.check_world)."""
    if not cfg.elastic:
        how = ("the replicated state is loaded" if found.replicated else
               "the state is re-cut (a sharded one put together and cut anew; a worker the checkpoint has no "
               "state for takes worker 0's, its own parts fresh)")
        return f"{found.world} workers, resuming on {cfg.workers}: {how}"
    K = per_replica(cfg)
    if K == 1:
        return (f"{found.world} workers, resuming on {cfg.workers}: an elastic run goes on with the workers it finds "
                f"(a worker the checkpoint has no state for takes worker 0's)")
    return (f"{found.world // K} replica(s) of {K} processes, resuming on {cfg.workers // K}: an elastic run goes on "
            f"with the replicas it finds (a replica the checkpoint has no state for takes replica 0's, position by "
            f"position)")


def _replica_size_changed(found: Found, cfg: C.RunConfig) -> str:
    """An elastic run resumes on the replicas it finds, each of as many processes as wrote the
    checkpoint: a process's state is its position's in its replica (its tensors, its FSDP shard)."""
    was, now = found.per_replica, per_replica(cfg)
    fix = (f"start each torchrun job with --nproc-per-node {was}" if under_torchrun() else
           "drop --replicas" if was == 1 else f"pass --replicas {cfg.workers // was}" if cfg.workers % was == 0 else
           f"pass --workers {was}·N --replicas N")
    given = f"--workers {cfg.workers}" + (f" --replicas {cfg.replicas}" if cfg.replicas else "")
    has = f"jobs of {now} process(es) (torchrun's)" if under_torchrun() else f"{given}, replicas of {now}"
    return (f"--resume: {found.path} was written by replicas of {was} process(es), which a resumed elastic run keeps "
            f"(each process holds its position's state); this run has {has}: {fix}")


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
