"""Verifying a checkpoint and choosing the newest one a run can continue from.

A directory named `ckpt-*` is complete when written (see write.py), so what can be wrong
with one was done to it afterwards -- a missing or extra file, a truncated or corrupted
one -- or it belongs to another run (strategy, config, world size)."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import config as C
from ..errors import UsageError
from .layout import FORMAT, MANIFEST, config_hashes, listed, sha256


@dataclass
class Found:
    path: Path
    step: int
    world: int
    replicated: bool
    per_replica: int = 1  # processes a replica of the run that wrote it (absent before replica runs checkpointed)


class WorldSizeError(UsageError):
    """The run's world size does not fit its checkpoints (every one of them: no fallback)."""


class FormatError(UsageError):
    """A checkpoint of another format: the run's older ones are too (no fallback, no warning each)."""


def verify(path: Path, cfg: C.RunConfig, world: int) -> Found:
    """The checkpoint at `path` if it is complete, intact and fits this run; else UsageError
    with one line naming the problem."""
    manifest = _manifest(path)
    if manifest.get("format") != FORMAT:
        raise FormatError(f"it is in checkpoint format {manifest.get('format')}, written by an older lowcomm; "
                         f"this version reads format {FORMAT} (restart the run, or resume it with that lowcomm)")
    _check_files(path, manifest.get("files", {}))
    if manifest.get("strategy") != cfg.strategy:
        raise UsageError(f"it was written by strategy '{manifest.get('strategy')}', this run uses "
                         f"'{cfg.strategy}'")
    if manifest.get("config_hash") not in config_hashes(cfg):
        raise UsageError("it was written with an incompatible config (model, data, optimizer or strategy "
                         "options differ)")
    return _found(path, manifest)


def _manifest(path: Path) -> dict:
    try:
        return json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise UsageError(f"{MANIFEST} is missing") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{MANIFEST} is unreadable ({e.__class__.__name__})") from None


def _check_files(path: Path, files: dict) -> None:
    """The directory holds exactly the manifest's files, each of its size and checksum."""
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
        if sha256(f) != want["sha256"]:
            raise UsageError(f"file {fname} fails its sha256 checksum (corrupted)")


def _found(path: Path, manifest: dict) -> Found:
    return Found(Path(path), int(manifest["step"]), int(manifest["world"]), bool(manifest.get("replicated")),
                 int(manifest.get("per_replica", 1)))


def check_world(found: Found, cfg: C.RunConfig, world: int) -> None:
    """A checkpoint of another world size is re-cut for this one (recut.py), unless its state is
    kept by position in replicas of another size."""
    from .recut import refusal
    from ..config.nodes import per_replica
    why = refusal(found, cfg.strategy, world, per_replica(cfg))
    if why:
        raise WorldSizeError(why)


def read(path: Path) -> Found:
    """The manifest of a checkpoint already verified (a worker loading what the launcher chose)."""
    return _found(path, json.loads((Path(path) / MANIFEST).read_text()))


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
            if not cfg.elastic:  # an elastic run continues with the workers it finds (elastic/checkpoints.py)
                check_world(found, cfg, world)  # the run's problem, not this checkpoint's: no fallback
            return found
        except UsageError as e:
            if isinstance(e, WorldSizeError):
                raise
            first_problem = first_problem or f"{path}: {e}"
            if isinstance(e, FormatError):
                break
            warn(f"warning: checkpoint {path} refused: {e}; trying the previous one")
    if candidates:
        raise UsageError(f"no usable checkpoint in {out_dir} (newest: {first_problem})")
    return None
