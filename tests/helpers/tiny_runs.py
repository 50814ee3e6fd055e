"""The tiny CLI run that the launcher, diagnosis and metrics tests start (its flags and its text),
how to find the worker processes a launcher started, the one `error:` line a failed run prints, and
one rank's plain run inside a test's own process group (`trained`).
The `data_file` fixture that writes TEXT is in tests/conftest.py."""
from __future__ import annotations

import os
from pathlib import Path

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife.\n") * 60
TINY = ["--workers", "2", "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
        "--micro-batch", "2", "--eval-every", "0", "--eval-batches", "1", "--log-every", "1", "--quiet"]

# A model whose step is tens of ms of CPU, for a test that compares the ranks' compute (flags after
# TINY's replace them): on a busy machine both ranks are then preempted alike (rank 0's median compute
# 0.69 to 1.17 times rank 1's own at load 22), where TINY's ~2 ms are the scheduler's: a rank waking
# from a long sleep runs its few ms at once while the other waits for a core (0.5 to 4 at load 22-37).
EVEN_WORK = ["--n-layer", "2", "--d-model", "128", "--seq-len", "64", "--micro-batch", "8"]


def workers_of(pid: int) -> set[int]:
    """The worker processes launcher `pid` started: the children of its fork server
    (or, where the platform has none, its spawned children)."""
    kids = children(pid)
    servers = {k for k in kids if b"multiprocessing.forkserver" in _read(f"/proc/{k}/cmdline")}
    spawned = {k for k in kids if b"spawn_main" in _read(f"/proc/{k}/cmdline")}
    return spawned | {w for s in servers for w in children(s)}


def children(pid: int) -> set[int]:
    kids: set[int] = set()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return kids
    for task in tasks:
        try:
            kids |= {int(k) for k in (task / "children").read_text().split()}
        except OSError:
            pass
    return kids


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has exited; only its exit status is left)."""
    stat = _read(f"/proc/{pid}/stat")
    return bool(stat) and stat.rsplit(b")", 1)[1].split()[0] != b"Z"


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def error_line(err: str) -> str:
    """The one `error:` line, with no traceback on the terminal."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def unwritable_dir(tmp: Path) -> Path:
    """A directory this process cannot write into."""
    if os.geteuid() == 0:  # root writes through file modes, not into /proc/1
        return Path("/proc/1")
    locked = tmp / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    return locked


def trained(cfg, rank: int, world: int):
    """One rank's plain run of `cfg` in a process group the caller made (a resumed run when
    cfg.resume_from is set): the Trainer it ended with, its strategy closed."""
    from lowcomm import checkpoint
    from lowcomm.train.worker import build, run_plain
    t = build(cfg, rank, world, local_rank=0)
    try:
        if cfg.resume_from:
            checkpoint.load(t, checkpoint.read(Path(cfg.resume_from)))
        run_plain(t, Path(cfg.out) if rank == 0 else None, quiet=True)
    finally:
        t.run.close()
    return t
