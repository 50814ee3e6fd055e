"""Imported by the fork server at its start (supervise.start_method preloads it): the server
dies with the launcher that started it, at once.

Left alone, the server notices a dead launcher only when the pipe it watches reaches EOF, and
then exits like any Python process, running torch's exit handlers (seconds). PR_SET_PDEATHSIG
makes the kernel SIGKILL it as soon as its parent -- the launcher -- is gone. Importing this
module anywhere but in a fork server does nothing.
"""
from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def _is_fork_server() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return b"multiprocessing.forkserver" in f.read()
    except OSError:
        return False


if _is_fork_server():
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the launcher died before the guard was set
        os._exit(1)
