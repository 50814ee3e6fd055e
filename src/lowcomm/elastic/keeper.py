"""The launcher's lighthouse, kept alive: run in its own process, restarted on the same port when
it dies, so that it is not a single point of failure for the run.

The workers ride out the gap: their heartbeats fail quietly until it is back, and a quorum request
is repeated while the lighthouse is unreachable (membership.py). The restarted lighthouse knows
nothing of the old one's state; it learns the live workers from their next heartbeats (every
0.1 s), and the quorum ids it gives out are told apart from the old ones by their creation time.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from ..errors import RunError

SERVE = Path(__file__).with_name("lighthouse_serve.py")
RESTART_DELAY_S = 0.5   # between a death and the restart (and between failed restarts)
START_TIMEOUT_S = 60.0  # a start that prints no address within this long failed


class KeptLighthouse:
    """torchft's lighthouse in a child process, restarted by a thread of the launcher when it dies."""

    def __init__(self, min_replicas: int, join_timeout_ms: int, quorum_tick_ms: int, heartbeat_timeout_ms: int):
        self._options = [str(min_replicas), str(join_timeout_ms), str(quorum_tick_ms), str(heartbeat_timeout_ms)]
        self._stopping = threading.Event()
        self.restarts = 0
        self._proc, self._address = self._spawn(0)
        self._port = int(self._address.rsplit(":", 1)[1])
        threading.Thread(target=self._keep, name="lowcomm-lighthouse", daemon=True).start()

    def address(self) -> str:
        return self._address

    def pid(self) -> int:
        return self._proc.pid

    def _spawn(self, port: int) -> tuple[subprocess.Popen, str]:
        with tempfile.TemporaryFile("w+") as err:
            # Its own session: a Ctrl-C in the terminal (SIGINT to the foreground process group)
            # is the launcher's to handle; the lighthouse ends with the launcher (lighthouse_serve.py).
            proc = subprocess.Popen([sys.executable, str(SERVE), str(port), *self._options],
                                    stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
            address = _first_line(proc, START_TIMEOUT_S)
            if not address:
                proc.kill()
                proc.wait()
                err.seek(0)
                lines = err.read().strip().splitlines()
                raise RunError(f"the lighthouse did not start on port {port}: {lines[-1] if lines else 'no output'}")
        return proc, address

    def _keep(self) -> None:
        while True:
            code = self._proc.wait()
            if self._stopping.is_set():
                return
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            while not self._stopping.wait(RESTART_DELAY_S):
                try:
                    self._proc, _ = self._spawn(self._port)
                    break
                except RunError:  # the port not free yet: try again
                    continue
            else:
                return
            self.restarts += 1
            print(f"lowcomm: the lighthouse {how}; restarted it on port {self._port} (pid {self._proc.pid})",
                  file=sys.stderr, flush=True)

    def shutdown(self) -> None:
        self._stopping.set()
        self._proc.kill()
        self._proc.wait()


def _first_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The first line the child prints ('' when it exits or stays silent for timeout_s)."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline().strip()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return line[0] if line else ""
