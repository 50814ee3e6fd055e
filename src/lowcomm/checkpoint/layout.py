"""What a checkpoint directory is called, what its manifest records, and which config it fits."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from .. import config as C

PREFIX = "ckpt-"
MANIFEST = "manifest.json"
# 2: the strategy's state by its named parts (contract/parts.py); 1 held "model", "optimizers" and
# "extra" by position, and is refused (choose.verify) rather than guessed into parts.
FORMAT = 2
# Config keys a resumed run may change: they do not change what a step computes
# (`steps` extends the run and re-sizes its lr schedule; emulation changes timing only).
SAFE_KEYS = {"steps", "stop_at", "checkpoint_every", "keep", "max_restarts", "lighthouse", "member_timeout", "max_bad_steps",
             "out", "workers", "eval_every", "eval_batches", "log_every", "threads", "trace", "tensorboard", "wandb",
             "link", "slowdown", "stragglers", "min_workers",  # an elastic run resumes on the workers it finds
             "quorum_timeout"}
# Keys a checkpoint's hash held before they were safe: a checkpoint written then is still taken.
FORMERLY_HASHED = ("min_workers",)


def name_of(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def config_hash(cfg: C.RunConfig, keep: tuple[str, ...] = ()) -> str:
    """What a checkpoint's steps depend on: the resolved config without the SAFE_KEYS (but those
    in `keep`). An elastic run's replicas come and go as its workers do (it resumes on those it
    finds); what its state depends on is their size, which the manifest records apart
    (`per_replica`, resume.py checks it)."""
    d = {k: v for k, v in C.to_dict(cfg).items() if k not in SAFE_KEYS or k in keep}
    if cfg.elastic:
        d["replicas"] = 0  # as in a flat run's config, whose checkpoints hash so already
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_hashes(cfg: C.RunConfig) -> set[str]:
    """The hashes a checkpoint of this config may carry: today's, and that of the format before
    FORMERLY_HASHED became safe to change (with the config's own values of them)."""
    return {config_hash(cfg), config_hash(cfg, FORMERLY_HASHED)}


def checksums(path: Path) -> dict:
    """{name: {"bytes", "sha256"}} of every file in `path` but the manifest itself."""
    out = {}
    for f in sorted(path.iterdir()):
        if f.is_file() and f.name != MANIFEST:
            out[f.name] = {"bytes": f.stat().st_size, "sha256": sha256(f)}
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
