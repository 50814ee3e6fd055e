"""The kinds of failure a user can see, and the exit codes they map to."""


class UsageError(Exception):
    """Bad input from the user (flags, config file, data). The CLI prints
    ``error: <message>`` on one line and exits with code 2, before anything
    is written to the output directory."""

    exit_code = 2


class RunError(Exception):
    """A failure while training (a worker died, a collective broke). Exit 1.
    The message is one line; `details` (tracebacks) go to the run's error.log."""

    exit_code = 1

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class RunFailed(RunError):
    """The run failed, not a worker: an elastic run's launcher restarts no worker for it and ends
    the run in its one line (exit 1)."""


class BadSteps(RunFailed):
    """--max-bad-steps consecutive bad steps: every rank saw the same records and stops at the same
    step (a restarted worker would train into the same steps)."""


class StateLost(RunFailed):
    """An elastic run whose every member holding its state is gone: the workers left hold none of
    it, and starting over would overwrite the run's records; it goes on from a checkpoint."""


class NoQuorum(RunFailed):
    """An elastic run whose members holding its state had no quorum for --quorum-timeout (too few
    live workers for good): a restarted worker would wait for the same quorum."""


class Interrupted(Exception):
    """The launcher got SIGINT or SIGTERM and stopped every worker. Exit 128 + signal
    (130 for SIGINT, 143 for SIGTERM), as a shell reports a process killed by it."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.exit_code = 128 + signum


class DiskFull(RunError):
    """A write failed for lack of space (ENOSPC, or a quota: EDQUOT). Exit 1, one line naming
    the path; the partial files are removed (lowcomm/storage/files.py) and the run is not restarted
    (--max-restarts): a relaunch would fill the same disk again."""
