"""The run directory: checked before anything starts, created atomically, wiped only when it is a run.

`check` writes nothing; `create` is the first write of a run. A default
directory (runs/<strategy>-w<W>-<time>) is claimed with mkdir, which fails
when another run took the name, so two runs started in the same second get
different directories (the second gets a -2 suffix, and so on). `--overwrite`
removes every file of the old run, but only from a directory that is a
lowcomm run (its config.toml names a strategy): a directory of other files is
never wiped.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ..storage.files import check_writable
from ..errors import UsageError

STALE = ("steps.jsonl", "summary.json", "trace.json", "error.log", "restarts.jsonl")  # outputs a reused directory must not keep


def default_name(strategy: str, workers: int) -> str:
    return f"runs/{strategy}-w{workers}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_readable(path: Path) -> None:
    """UsageError when `path`, or its config.toml, may not be read (permission denied), which
    is_run would report as no run."""
    for target in (path, path / "config.toml"):
        try:
            if target.is_dir():
                os.listdir(target)
            elif target.exists():
                target.open("rb").close()
        except PermissionError as e:
            raise UsageError(f"cannot read '{target}': {e.strerror or 'permission denied'}") from None


def is_run(path: Path) -> bool:
    """Does `path` hold a lowcomm run (a config.toml that names a strategy)?"""
    try:
        return "strategy" in tomllib.loads((path / "config.toml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False


def check(out: Path, overwrite: bool, default: bool = False) -> None:
    """UsageError when the run could not write to `out`; writes nothing. A `default`
    name taken already is no error: `create` claims the next free one."""
    check_writable(out.parent if default else out, "output path")
    if default or not out.exists():
        return
    if (out / "steps.jsonl").exists() and not overwrite:
        raise UsageError(f"output dir '{out}' already holds a run; choose another --out or pass --overwrite")
    if overwrite and any(out.iterdir()) and not is_run(out):
        raise UsageError(f"--overwrite refuses to empty '{out}': it is not a lowcomm run (no config.toml "
                         f"naming a strategy); choose another --out")


def create(out: Path, overwrite: bool, default: bool) -> Path:
    """Make the directory (a fresh one for a default name) and clear what an old run left;
    returns the directory actually used."""
    try:
        if default:
            out = _claim(out)
        else:
            out.mkdir(parents=True, exist_ok=True)
            if overwrite and is_run(out):
                for entry in out.iterdir():
                    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            for name in STALE:
                (out / name).unlink(missing_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create output dir '{out}': {e.strerror or e}") from None
    return out


def _claim(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        candidate = out if n == 1 else out.with_name(f"{out.name}-{n}")
        try:
            candidate.mkdir()  # atomic: exactly one run gets each name
            return candidate
        except FileExistsError:
            continue
    raise UsageError(f"no free output dir name next to '{out}'; pass --out")
