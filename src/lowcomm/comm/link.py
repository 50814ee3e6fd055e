"""LinkModel: an emulated network link per rank, and the `--link` parser.

Each rank owns one NIC. A collective issued at time t starts at
max(t, nic_free) and lasts hops * latency + wire_bytes / bandwidth (plus a
seeded uniform jitter in [-jitter, +jitter], never below zero), with hops and
wire bytes from wire.py -- the same formulas the planner uses, so the two can
never disagree on what a byte costs. Comm makes every op complete no earlier
than its modeled end and no earlier than the real op's end.

The clock is time.perf_counter(), as in Comm. Each rank models its own NIC:
a peer that joins a collective late delays the real op (so the wait is seen),
but the modeled transfer still starts at the local issue time, so a late peer
and a slow link overlap instead of adding up (see the note in Comm).
"""
from __future__ import annotations

import heapq
import math
import random
import re
import threading
import time

from ..errors import UsageError
from .wire import latency_hops, wire_bytes

# Decimal multipliers, as tc and NIC vendors use them (100mbit = 100e6 bit/s).
_BIT_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_BYTE_UNITS = {"b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
               "kib/s": 2**10, "mib/s": 2**20, "gib/s": 2**30}
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*([^\s\d].*?)?\s*$", re.IGNORECASE)
BANDWIDTH_EXAMPLES = "e.g. 100mbit, 1gbit, 12.5MB/s or inf"


def parse_bandwidth(text: str, what: str = "link bandwidth") -> float:
    """'100mbit' -> 12.5e6 bytes/s. 'inf' (or 'unlimited') means no bandwidth limit."""
    raw = str(text).strip()
    if raw.lower() in ("inf", "unlimited"):
        return math.inf
    m = _NUMBER.match(raw)
    if not m:
        raise UsageError(f"{what} '{text}' is not a bandwidth ({BANDWIDTH_EXAMPLES})")
    value, unit = float(m.group(1)), (m.group(2) or "")
    if unit == "":
        raise UsageError(f"{what} '{text}' needs a unit ({BANDWIDTH_EXAMPLES})")
    # 'B' means bytes and 'b' bits; only the bit forms spelled 'kbit' are case-free.
    if unit.lower() in _BIT_UNITS:
        bytes_per_s = value * _BIT_UNITS[unit.lower()] / 8
    elif "B" in unit and unit.lower() in _BYTE_UNITS:
        bytes_per_s = value * _BYTE_UNITS[unit.lower()]
    elif unit.lower().endswith("b/s") and unit.lower()[:-3] + "bit" in _BIT_UNITS:
        bytes_per_s = value * _BIT_UNITS[unit.lower()[:-3] + "bit"] / 8  # '100Mb/s'
    elif unit.lower().endswith("bps"):
        # tc reads 'mbps' as megabytes/s, most people as megabits/s: refuse to guess.
        raise UsageError(f"{what} '{text}' has an ambiguous unit '{unit}': write "
                         f"{m.group(1)}{unit.lower()[:-3]}bit for bits/s or {m.group(1)}{unit[:-3].upper()}B/s for bytes/s")
    else:
        raise UsageError(f"{what} '{text}' has an unknown unit '{unit}' ({BANDWIDTH_EXAMPLES})")
    if not bytes_per_s > 0 or not math.isfinite(bytes_per_s):
        raise UsageError(f"{what} '{text}' must be positive")
    return bytes_per_s


def parse_duration(text: str, what: str = "link latency") -> float:
    """'20ms' -> 0.02 seconds. A bare 0 is allowed; other numbers need a unit."""
    raw = str(text).strip()
    m = _NUMBER.match(raw)
    if not m:
        raise UsageError(f"{what} '{text}' is not a duration (e.g. 20ms, 500us, 0)")
    value, unit = float(m.group(1)), (m.group(2) or "")
    if unit == "":
        if value != 0:
            raise UsageError(f"{what} '{text}' needs a unit (us, ms or s)")
        seconds = 0.0
    elif unit.lower() in _TIME_UNITS or unit in _TIME_UNITS:
        seconds = value * _TIME_UNITS.get(unit, _TIME_UNITS.get(unit.lower(), 0.0))
    else:
        raise UsageError(f"{what} '{text}' has an unknown unit '{unit}' (us, ms or s)")
    if seconds < 0:
        raise UsageError(f"{what} '{text}' must not be negative")
    if not math.isfinite(seconds):
        raise UsageError(f"{what} '{text}' must be finite")
    return seconds


def format_bandwidth(bytes_per_s: float | None) -> str:
    """12.5e6 -> '100mbit': the largest bit unit that writes it exactly ('' for none)."""
    if bytes_per_s is None:
        return ""
    if math.isinf(bytes_per_s):
        return "inf"
    units = {u: _BIT_UNITS[u] / 8 for u in ("tbit", "gbit", "mbit", "kbit")}
    return _in_largest_unit(bytes_per_s, units, parse_bandwidth, f"{bytes_per_s!r}B/s")


def format_duration(seconds: float) -> str:
    """0.02 -> '20ms'; 0 -> '0'."""
    if seconds == 0:
        return "0"
    units = {u: _TIME_UNITS[u] for u in ("s", "ms", "us", "ns")}
    return _in_largest_unit(seconds, units, parse_duration, f"{seconds!r}s")


def _in_largest_unit(value: float, units: dict[str, float], parse, fallback: str) -> str:
    """The first unit (largest first) in which `value` reads >= 1 and parses back exactly."""
    for unit, scale in units.items():
        text = f"{round(value / scale, 6):g}{unit}"
        if value / scale >= 1 and parse(text) == value:
            return text
    return fallback


def split_link_spec(spec: str, what: str = "--link") -> tuple[str, str, str]:
    """'100mbit,20ms[,1ms]' -> its three strings (jitter '0' when absent); units are checked later."""
    parts = [p.strip() for p in str(spec).split(",")]
    if len(parts) not in (2, 3) or not all(parts):
        raise UsageError(f"{what} '{spec}' must be BANDWIDTH,LATENCY[,JITTER] (e.g. 100mbit,20ms)")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else "0"


class LinkModel:
    """One rank's NIC: serialises this rank's collectives and prices each one."""

    def __init__(self, bandwidth_bytes_per_s: float, latency_s: float, jitter_s: float = 0.0,
                 seed: int = 0):
        if not bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
        if latency_s < 0 or jitter_s < 0:
            raise ValueError(f"latency and jitter must not be negative, got {latency_s}, {jitter_s}")
        self.bandwidth = float(bandwidth_bytes_per_s)
        self.latency = float(latency_s)
        self.jitter = float(jitter_s)
        self.nic_free = 0.0  # perf_counter() time the NIC finishes its queued ops
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # DDP's autograd thread and ACCO's comm thread issue too

    @classmethod
    def parse(cls, bandwidth: str, latency: str, jitter: str = "0", seed: int = 0) -> "LinkModel":
        return cls(parse_bandwidth(bandwidth), parse_duration(latency),
                   parse_duration(jitter, "link jitter"), seed)

    def duration(self, op: str, nbytes: int, world: int) -> float:
        """Modeled seconds of one `op` of S = nbytes on `world` ranks, without jitter."""
        if world <= 1:
            return 0.0
        transfer = 0.0 if math.isinf(self.bandwidth) else wire_bytes(op, nbytes, world) / self.bandwidth
        return latency_hops(op, world) * self.latency + transfer

    def schedule(self, op: str, nbytes: int, world: int, now: float) -> tuple[float, float]:
        """Queue an op issued at `now` on this NIC; return its modeled (start, end)."""
        base = self.duration(op, nbytes, world)
        with self._lock:
            if self.jitter > 0 and base > 0:
                base = max(0.0, base + self._rng.uniform(-self.jitter, self.jitter))
            start = max(now, self.nic_free)
            end = start + base
            self.nic_free = end
        return start, end

    def describe(self) -> dict:
        return {"bandwidth_bytes_per_s": self.bandwidth if math.isfinite(self.bandwidth) else None,
                "latency_s": self.latency, "jitter_s": self.jitter}


class Deadlines:
    """Runs callbacks at perf_counter() deadlines on one daemon thread.

    An emulated async op must complete its torch Future at the modeled end,
    and nothing that torch owns may sleep until then: gloo completes futures
    on its own worker threads, and sleeping there would hold up the real
    transport of the ops queued behind (adding real time to modeled time).
    Each due callback runs on a short-lived thread of its own: completing a
    future runs the callbacks chained on it, and one may block on another
    op's future (torch's PowerSGD hook waits inside its callbacks), which only
    this loop can complete -- run inline, that would wait on itself forever.
    """

    def __init__(self):
        self._cv = threading.Condition()
        self._heap: list = []
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._running: list[threading.Thread] = []  # the due callbacks' threads, until joined
        self._closing = False

    def at(self, when: float, fn) -> None:
        with self._cv:
            self._seq += 1
            heapq.heappush(self._heap, (when, self._seq, fn))
            if self._thread is None or not self._thread.is_alive():
                self._closing = False
                self._thread = threading.Thread(target=self._loop, name="lowcomm-link", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    if self._closing:
                        return
                    self._cv.wait()
                when, _, fn = self._heap[0]
                delay = when - time.perf_counter()
                if delay > 0:
                    self._cv.wait(delay)
                    continue
                heapq.heappop(self._heap)
                self._running = [t for t in self._running if t.is_alive()]
                done = threading.Thread(target=fn, name="lowcomm-link-done", daemon=True)
                self._running.append(done)
            done.start()

    def close(self) -> None:
        """Run what is queued, each at its deadline (a closing run's last completions), then
        end the thread and join every callback's: none is left to complete a torch future
        while the interpreter exits. A callback may queue another (a chained future): the
        thread then runs again, until nothing is queued. A later `at` starts it again."""
        while True:
            with self._cv:
                thread, self._closing = self._thread, True
                self._cv.notify()
            if thread is None:
                return
            thread.join()
            with self._cv:
                running, self._running = self._running, []
                if self._thread is thread:
                    self._thread = None
            for done in running:
                done.join()
