"""Writing the run's files whole, when the disk may be full.

A full disk (ENOSPC, or a quota: EDQUOT) must end a run with one line that says so and names
the path, leave no partial file that keeps the disk full, and never leave a directory that
looks like a run (rundir.is_run: a config.toml naming a strategy). So: small files are
written to a temporary name and renamed (a half-written config.toml never exists under its
name), a failed write removes its temporary file, and `disk_full` finds the ENOSPC inside
whatever the failure was wrapped in (DCP gathers every rank's error into a
CheckpointException, which is a BaseException) and turns it into DiskFull.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import DiskFull, UsageError

FULL = (errno.ENOSPC, errno.EDQUOT)
PARTIAL_DIRS = ".ckpt-*.tmp"   # checkpoint.write's directories before their rename
PARTIAL_FILES = "*.tmp"        # write_text_atomic's and runlog's temporary files


def write_text_atomic(path: Path, text: str) -> None:
    """`path` holds `text` entirely, or keeps what it held before; DiskFull when out of space."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        full = disk_full(e, path)
        if full is not None:
            raise full from e
        raise


def full_error(exc: BaseException) -> OSError | None:
    """The OSError of a full disk inside `exc` (its causes, contexts, DCP's per-rank failures)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL:
            return e
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return None


def disk_full(exc: BaseException, path: Path | str | None = None, need: int = 0) -> DiskFull | None:
    """DiskFull naming the file that could not be written (else `path`), or None when `exc`
    is not a full disk. Where the error lost its errno (torch.save reports a short write as
    "unexpected pos ..."), a failed write into `path` whose filesystem has less than `need`
    bytes (at least MIN_FREE) left is taken as a full disk too."""
    if isinstance(exc, DiskFull):
        return exc
    found = full_error(exc)
    if found is not None:
        what = "no space left on device" if found.errno == errno.ENOSPC else "disk quota exceeded"
        where = found.filename or path
    elif path is not None and free_bytes(path) < max(need, MIN_FREE):
        what, where = f"{free_bytes(path):,} bytes left", path
    else:
        return None
    return DiskFull(f"the disk is full ({what}) writing {where}; free space there or choose another --out")


MIN_FREE = 1 << 20


def free_bytes(path: Path | str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `path` (or of the
    nearest existing directory above it); a large number when it cannot be told."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return 1 << 62
    if st.f_files and not st.f_favail:  # out of inodes: nothing new can be created
        return 0
    return st.f_bavail * st.f_frsize


def remove_partial(out: Path) -> None:
    """Remove what an interrupted write left in run directory `out`: checkpoint directories
    not yet renamed and temporary files (they would keep a full disk full)."""
    out = Path(out)
    try:
        for p in out.glob(PARTIAL_DIRS):
            shutil.rmtree(p, ignore_errors=True)
        for p in out.glob(PARTIAL_FILES):
            if p.is_file():
                p.unlink(missing_ok=True)
    except OSError:
        pass


def first_failure(e: BaseException) -> str:
    """The first rank's error inside DCP's CheckpointException (else the exception), in one line."""
    failures = getattr(e, "failures", None) or {}
    for rank, failure in sorted(failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(inner).__name__}: {' '.join(str(inner).split())}"
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def check_writable(path: Path, name: str) -> None:
    """UsageError, one line naming `path` (introduced as `name`: "output path", "--tensorboard"),
    unless it is a directory this process can write into or one it can create; leaves nothing."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{name} '{path}' exists and is not a directory")
    existing = path
    while not existing.exists():  # the directory mkdir will create it in
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{name} '{path}' cannot be created: '{existing}' is not a directory")
    if not _writable(existing):
        where = "" if existing == path else f" ('{existing}' is not writable)"
        raise UsageError(f"{name} '{path}' cannot be written{where}")


def _writable(path: Path) -> bool:
    """Can this process make entries in the directory `path`? Modes and a read-only mount say
    no at once; otherwise an empty directory is made and removed, as root passes every mode
    check yet cannot create anything in /proc or /sys."""
    if not os.access(path, os.W_OK | os.X_OK):
        return False
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return False
    except OSError:
        pass
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lowcomm-probe-", dir=path))
    except OSError:
        return False
    return True


def replace_directory(tmp: Path, directory: Path) -> None:
    """`tmp` (written beside `directory`, on the same file system) renamed to `directory`, so that a
    reader sees the old directory or the new one, never half of either; an older `directory` (a run
    or a prepared data set written over) moved aside first and removed after."""
    old = None
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
        os.replace(directory, old)
    os.replace(tmp, directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
