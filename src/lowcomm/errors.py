"""The two kinds of failure a user can see, and the exit codes they map to."""


class UsageError(Exception):
    """Bad input from the user (flags, config file, data). The CLI prints
    ``error: <message>`` on one line and exits with code 2, before anything
    is written to the output directory."""

    exit_code = 2


class RunError(Exception):
    """A failure while training (a worker died, a collective broke). Exit 1."""

    exit_code = 1
