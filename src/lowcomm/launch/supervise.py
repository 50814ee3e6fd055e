"""Start W worker processes, watch them, stop them: the launcher's side of a local run.

torch.multiprocessing starts the processes and records each one's traceback
(`start_processes(join=False)`); its `join()` stops the others only after a
grace period of 30 s and knows nothing of signals sent to the launcher. So
the watching is done here:

- a worker that dies (an exception, a signal such as SIGKILL, a non-zero exit)
  stops the others: they get SETTLE_S to fail by themselves (their peer is gone),
  then SIGTERM, then SIGKILL after STOP_GRACE_S. RunError names the rank that
  caused it and its exit signal or code; every failed rank's traceback is in
  `RunError.details` (the CLI writes it to error.log);
- SIGINT or SIGTERM sent to the launcher alone stops every worker the same way
  and raises Interrupted (exit 130 / 143). With `ask_first`, the workers are
  first asked to write a checkpoint and stop (they get SIGTERM, which such a
  worker turns into a request it honours at the next step boundary) and get
  CHECKPOINT_GRACE_S to do it; a second signal stops them at once.

Workers ignore SIGINT, so a Ctrl-C that reaches the whole process group is
handled once, here, and they die with the launcher even if it is SIGKILLed
(a pidfd watchdog and PR_SET_PDEATHSIG, `die_with`): no orphan is left either way.
"""
from __future__ import annotations

import ctypes
import gc
import multiprocessing.connection
import os
import pickle
import select
import signal
import sys
import threading
import time
from typing import Callable

import torch.multiprocessing as mp

from ..errors import BadSteps, DiskFull, Interrupted, NoQuorum, RunError, StateLost

STOP_GRACE_S = 3.0          # SIGTERM -> SIGKILL: a worker stuck in C++ may not die on SIGTERM
CHECKPOINT_GRACE_S = 60.0   # a signalled run may take this long to write its checkpoint
POLL_S = 0.2                # how often the watcher looks at the signal flag
SETTLE_S = 1.0              # after a failure, how long the other ranks may take to fail too
# How gloo reports a peer that vanished: a consequence of another rank's failure, not a cause.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")
_PR_SET_PDEATHSIG = 1


def run_workers(fn: Callable, args: tuple, nprocs: int, ask_first: bool = False,
                watch: Callable | None = None) -> None:
    """Run fn(rank, *args) on `nprocs` worker processes until all of them return.
    Raises RunError when one fails and Interrupted on SIGINT/SIGTERM; either way
    every worker is gone when this returns or raises. `watch(processes)` is called at
    every turn of the watch loop (at least every POLL_S) while they run."""
    received: list[int] = []
    previous = _catch_signals(received)
    ctx = None
    try:
        ctx = start_workers(fn, args, nprocs)
        _watch(ctx, received, ask_first, watch)
    finally:
        if ctx is not None:
            stop(ctx.processes)
            for path in ctx.error_files:
                _unlink(path)
        _restore_signals(previous)


def start_workers(fn: Callable, args: tuple, nprocs: int):
    """Start fn(rank, *args) on `nprocs` processes (forked from the server, see start_method)
    with this process's environment, directory and import path, dying with it; torch's process
    context (join, error files) is returned unwatched. run_workers watches it; tests' run_dist too."""
    here = (os.getpid(), dict(os.environ), os.getcwd(), list(sys.path))
    return mp.start_processes(_child, args=(*here, fn, args), nprocs=nprocs, start_method=start_method(), join=False)


def start_method() -> str:
    """Workers fork from a server process that imported lowcomm and torch once, instead
    of each spawned worker importing them again (2-3 s of CPU per worker on a small
    machine; the server also serves later runs of the same Python process). It is
    forked before anything touches CUDA, so CUDA works in the workers as under spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    # torch._dynamo: DDP's constructor imports it (seconds), so every worker would.
    # forkserver_guard first: the server dies with the launcher (see die_with).
    mp.set_forkserver_preload(["lowcomm.launch.forkserver_guard", "lowcomm.train.worker", "torch._dynamo"])
    return "forkserver"


def _watch(ctx, received: list[int], ask_first: bool, watch: Callable | None = None) -> None:
    running = {p.sentinel: rank for rank, p in enumerate(ctx.processes)}
    while running:
        if watch is not None:
            watch(ctx.processes)
        if received:
            _interrupt(ctx, received, ask_first)
        ready = multiprocessing.connection.wait(list(running), timeout=POLL_S)
        failed = []
        for sentinel in ready:
            rank = running.pop(sentinel)
            ctx.processes[rank].join()
            if ctx.processes[rank].exitcode != 0:
                failed.append(rank)
        if failed and not received:  # when interrupted, the signal explains the deaths
            # Peers of a failed rank fail too ("connection closed by peer"), and the cause
            # may be the slower to exit: let them settle briefly, then stop the rest.
            deadline = time.monotonic() + SETTLE_S
            for p in ctx.processes:
                p.join(max(0.0, deadline - time.monotonic()))
            settled = [r for r, p in enumerate(ctx.processes) if not p.is_alive() and p.exitcode != 0]
            stop(ctx.processes)
            raise _failure(ctx, settled)


def _interrupt(ctx, received: list[int], ask_first: bool) -> None:
    at = time.perf_counter()  # when the run was interrupted, for a post-mortem of a hung run
    error = interrupted(ctx.processes, received, ask_first)
    error.at = at
    raise error


def interrupted(processes, received: list[int], ask_first: bool) -> Interrupted:
    """Stop every worker after the signal in `received`: with --checkpoint-on-signal (`ask_first`)
    each is asked first (SIGTERM: a checkpoint at its next commit point, then a clean exit) and
    given CHECKPOINT_GRACE_S, unless a second signal comes. The error says which happened."""
    signum = received[0]
    note = ""
    if ask_first:
        for p in processes:
            _send(p, signal.SIGTERM)
        deadline = time.monotonic() + CHECKPOINT_GRACE_S
        while len(received) == 1 and time.monotonic() < deadline and any(p.is_alive() for p in processes):
            time.sleep(POLL_S)
        clean = all(not p.is_alive() and p.exitcode == 0 for p in processes)
        note = ("; the workers wrote a checkpoint first" if clean else
                "; the workers were stopped before they could write a checkpoint")
    stop(processes)
    return Interrupted(signum, f"interrupted by {signal.Signals(signum).name}: every worker stopped{note}")


def stop(processes, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to every live process, SIGKILL to any still alive `grace` s later; reap all."""
    for p in processes:
        _send(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        _send(p, signal.SIGKILL)
        p.join()


def _send(p, signum: int) -> None:
    if p.is_alive():
        try:
            os.kill(p.pid, signum)
        except ProcessLookupError:  # it died between the check and the signal
            pass


def _failure(ctx, failed: list[int]) -> RunError:
    """RunError naming the rank whose failure caused the others': one killed by a signal
    (SIGKILL, the OOM killer), else one whose error is not a lost peer, else the lowest."""
    codes = {r: ctx.processes[r].exitcode for r in failed}
    tbs = {r: _traceback(ctx.error_files[r]) for r in failed}
    rank = min(failed, key=lambda r: (codes[r] >= 0, any(m in tbs[r] for m in PEER_LOST), r))
    details = []
    for r in range(len(ctx.processes)):
        tb = _traceback(ctx.error_files[r])
        if tb:
            details.append(f"--- rank {r} ---\n{tb}")
    code = codes[rank]
    tb = _traceback(ctx.error_files[rank])
    kind = RunError
    if tb:
        what = _last_line(tb)
        if _exception_line(tb).startswith("lowcomm.errors.DiskFull: "):
            kind = DiskFull  # the launcher does not relaunch onto a full disk
    elif code < 0:
        what = f"killed by signal {_signal_name(-code)}"
    else:
        what = f"exited with code {code}"
    error = kind(f"worker rank {rank} failed: {what}", details="\n".join(details))
    error.exit_codes = codes  # the ranks that failed (a post-mortem tells them from the stuck ones)
    return error


def _traceback(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return pickle.load(fh)
    except (OSError, EOFError, pickle.UnpicklingError):
        return ""


def _exception_line(tb: str) -> str:
    lines = [line.strip() for line in tb.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"


def _last_line(tb: str) -> str:
    """The exception line of a traceback; lowcomm's own errors without their class path."""
    last = _exception_line(tb)
    for prefix in ("lowcomm.errors.RunError: ", "lowcomm.errors.UsageError: ", "lowcomm.errors.DiskFull: ",
                   *RUN_FAILED):
        if last.startswith(prefix):
            return last[len(prefix):]
    return last


# A worker's failure that is the run's (errors.RunFailed: --max-bad-steps, no quorum, the run's state lost):
# an elastic launcher ends the run instead of restarting the worker into the same failure.
RUN_FAILED = tuple(f"lowcomm.errors.{cls.__name__}: " for cls in (BadSteps, NoQuorum, StateLost))


def failed_the_run(tb: str) -> bool:
    return _exception_line(tb).startswith(RUN_FAILED)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# -- signals -------------------------------------------------------------------------

def _catch_signals(received: list[int]) -> dict:
    """SIGINT/SIGTERM only note the signal: the watcher acts on it within POLL_S.
    Handlers can be installed from the main thread only (a library caller on
    another thread keeps the default behaviour)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, lambda s, _frame: received.append(s))
    return previous


def _restore_signals(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def _child(rank: int, launcher: int, environ: dict, cwd: str, path: list, fn: Callable, args: tuple) -> None:
    """A worker's first lines: take the launcher's environment, directory and import path (a
    forkserver child starts with the server's, from when it was started: a module the launcher
    can import now, say an optional package found since, would be missing), die with the
    launcher, leave SIGINT to it, then run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # What the fork server imported is never garbage: keep the collector (worker.leave_group
    # runs it) from walking those objects again in every worker.
    gc.freeze()
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    die_with(launcher)
    fn(rank, *args)


def die_with(launcher: int) -> None:
    """This process dies (SIGKILL) within moments of `launcher`, however the launcher dies.

    PR_SET_PDEATHSIG alone is not enough: under the fork server the parent is the server,
    and every forked child inherits the write end of the pipe whose EOF tells the server its
    launcher is gone, so the server -- and with it the children -- outlived a SIGKILLed
    launcher. So the child closes that pipe end (the server then exits with the launcher)
    and a watchdog thread waits on a pidfd of the launcher itself (no polling, no pid reuse)."""
    _release_fork_server()
    try:  # Linux: SIGKILL when the parent dies (the launcher under spawn)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    watched = _watch_launcher(launcher)
    if not _alive(launcher) or (not watched and os.getppid() == 1):  # it died before we watched it
        os._exit(1)


def _release_fork_server() -> None:
    """Close this child's copy of the fork server's liveness pipe (see die_with); a later
    fork-server start in this process would start a server of its own."""
    try:
        from multiprocessing import forkserver
        server = forkserver._forkserver
        fd = getattr(server, "_forkserver_alive_fd", None)
    except (ImportError, AttributeError):
        return
    if fd is None:
        return
    try:
        os.close(fd)
    except OSError:
        pass
    server._forkserver_alive_fd = None
    server._forkserver_pid = None
    server._forkserver_address = None


def _watch_launcher(launcher: int) -> bool:
    """A daemon thread that SIGKILLs this process when `launcher` exits. False where the
    platform has no pidfd (then PR_SET_PDEATHSIG is the only guard)."""
    try:
        fd = os.pidfd_open(launcher)
    except (AttributeError, OSError):
        return False

    def wait() -> None:
        select.select([fd], [], [])  # readable once the launcher has exited
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=wait, name="lowcomm-die-with-launcher", daemon=True).start()
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
