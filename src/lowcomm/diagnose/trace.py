"""A Chrome/Perfetto trace of every rank: compute, communication, waits, optimizer.

Each rank records spans into a Tracer (thread-safe: DDP's autograd thread and
ACCO's communication thread record too); at the end every rank's spans are
gathered through Comm's bookkeeping collectives and rank 0 writes one JSON
file in the Chrome trace-event format, which ui.perfetto.dev and
chrome://tracing open directly.

Layout: one process per rank ("rank r"); in it a lane per thread that ran
compute or optimizer work ("main" first) and as many "comm" lanes as there
were collectives in flight at once. Each collective is one span in category
"comm" carrying its ring-model `wire_bytes` (bookkeeping ops are category
"meta" with `meta_bytes` instead, as summary.json leaves them out), with two
children: "real" (until the transport finished) and "emulated" (the extra
time the link emulator held it). Time blocked on the network is a "wait"
span on the lane of the thread that blocked.

With replica groups each collective's span names its level in `args.level` ("cross":
across replicas, the slow link; "intra": inside a replica; "world": the run's bookkeeping),
and each level gets lanes of its own ("cross comm 0", "intra comm 0", ..., the slow link's
first), so the two links' traffic reads apart at a glance. A flat run's spans say "cross"
too, on plain "comm N" lanes. Wait spans carry the level of the Comm waited on.

Timestamps are microseconds from a common origin: ranks on one host share
its monotonic clock; a rank on another host lines up to within the skew of
the collective that set the origin (see `align`).
"""
from __future__ import annotations

import json
import socket
import threading
import time
import zlib
from pathlib import Path

import torch
from ..storage.files import write_text_atomic

COMM_TID = 1000  # a level's comm lanes are tids COMM_TID·(i+1) + slot, i its place in LANE_ORDER
LANE_ORDER = {"cross": 0, "intra": 1, "world": 2}  # the slow link's lanes first, bookkeeping last


class Tracer:
    def __init__(self, rank: int):
        self.rank = rank
        self.origin = time.perf_counter()
        self._lock = threading.Lock()
        self._spans: list[tuple] = []  # (name, cat, t0, t1, lane, args)
        self._comm: list[dict] = []
        self._local = threading.local()

    def align(self, comm, device: torch.device | str = "cpu") -> None:
        """Collective: set every rank's time origin. Ranks on rank 0's host share
        its monotonic clock (perf_counter) and take rank 0's reading exactly;
        ranks elsewhere use the moment they leave this collective."""
        host = float(zlib.crc32(socket.gethostname().encode()))
        mine = torch.tensor([time.perf_counter(), host], dtype=torch.float64, device=device)
        every = comm.meta_all_gather(mine).cpu()
        self.origin = float(every[0, 0]) if float(every[0, 1]) == host else time.perf_counter()

    # -- recording ------------------------------------------------------------
    def span(self, name: str, cat: str, t0: float, t1: float, args: dict | None = None,
             lane: str | None = None) -> None:
        lane = lane or _lane_of_current_thread()
        with self._lock:
            self._spans.append((name, cat, t0, t1, lane, args))

    def open_comm(self, op: str, t0: float, wire: int, nbytes: int, meta: bool,
                  modeled_start: float, modeled_end: float, level: str = "cross") -> dict:
        rec = {"op": op, "t0": t0, "wire": wire, "bytes": nbytes, "meta": meta, "level": level,
               "modeled": (modeled_start, modeled_end), "real_end": None, "end": None}
        with self._lock:
            self._comm.append(rec)
        return rec

    def close_comm(self, rec: dict, real_end: float, end: float) -> None:
        with self._lock:
            rec["real_end"], rec["end"] = real_end, end

    def watch_optimizer(self, optimizer: torch.optim.Optimizer, name: str = "optimizer") -> None:
        """Record every optimizer.step() as a span on the thread that ran it."""
        def pre(*_):
            self._local.opt_t0 = time.perf_counter()

        def post(*_):
            t0 = getattr(self._local, "opt_t0", None)
            if t0 is not None:
                self.span(name, "optimizer", t0, time.perf_counter())
        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(post)

    # -- export ------------------------------------------------------------------
    def events(self, now: float | None = None) -> list[dict]:
        """This rank's spans as Chrome trace events (pid = rank); what is unfinished ends at `now`
        (default: now; a post-mortem passes the moment the run failed)."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            spans = list(self._spans)
            comm = [dict(r) for r in self._comm]
        pid = self.rank
        us = lambda t: round((t - self.origin) * 1e6, 3)  # noqa: E731
        lanes: dict[str, int] = {"main": 0}
        for s in spans:
            lanes.setdefault(s[4], len(lanes))
        out: list[dict] = []
        for name, cat, t0, t1, lane, args in spans:
            ev = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": lanes[lane],
                  "ts": us(t0), "dur": round(max(t1 - t0, 0.0) * 1e6, 3)}
            if args:
                ev["args"] = args
            out.append(ev)

        # Collectives overlap each other (DDP buckets, ACCO's count beside its
        # reduce-scatter); give each the first lane of its level that is free by then.
        levels = sorted({r["level"] for r in comm}, key=lambda lv: (LANE_ORDER.get(lv, len(LANE_ORDER)), lv))
        lane_free: dict[str, list[float]] = {lv: [] for lv in levels}
        first_tid = {lv: COMM_TID * (i + 1) for i, lv in enumerate(levels)}
        for rec in sorted(comm, key=lambda r: r["t0"]):
            end = now if rec["end"] is None else rec["end"]
            real_end = now if rec["real_end"] is None else rec["real_end"]
            free_at = lane_free[rec["level"]]
            slot = next((i for i, free in enumerate(free_at) if free <= rec["t0"]), len(free_at))
            if slot == len(free_at):
                free_at.append(end)
            free_at[slot] = end
            out += _collective_events(rec, {"ph": "X", "pid": pid, "tid": first_tid[rec["level"]] + slot},
                                      end, real_end, us)
        names = {tid: name for name, tid in lanes.items()}
        prefix = "" if len(levels) == 1 else "{} "  # one level (a flat run): plain "comm N" lanes
        names.update({first_tid[lv] + i: prefix.format(lv) + f"comm {i}"
                      for lv in levels for i in range(len(lane_free[lv]))})
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        for tid, name in names.items():
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"sort_index": tid}})
        return out

    def gather(self, comm, device: torch.device | str = "cpu") -> list[dict] | None:
        """Collective: every rank calls it; rank 0 gets all ranks' events, others None."""
        blob = json.dumps(self.events(), separators=(",", ":")).encode()
        size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
        sizes = comm.meta_all_gather(size).reshape(-1).tolist()
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        buf[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        every = comm.meta_all_gather(buf.to(device)).cpu()
        if comm.rank != 0:
            return None
        events: list[dict] = []
        for r, n in enumerate(sizes):
            events.extend(json.loads(every[r, :n].numpy().tobytes()))
        return events


def write_trace(path: Path, events: list[dict], metadata: dict | None = None) -> None:
    doc = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata or {}}
    write_text_atomic(path, json.dumps(doc, separators=(",", ":")))


def comm_wire_bytes(doc: dict, level: str | None = None) -> int:
    """Sum of wire_bytes over a trace's communication spans (equals summary.json's wire_bytes_total),
    or over one level's (equals summary.json's levels[level].wire_bytes)."""
    return sum(int(e.get("args", {}).get("wire_bytes", 0)) for e in doc["traceEvents"]
               if e.get("cat") == "comm" and e.get("ph") == "X"
               and (level is None or e["args"].get("level") == level))


def _lane_of_current_thread() -> str:
    t = threading.current_thread()
    return "main" if t is threading.main_thread() else t.name


def nesting_errors(doc: dict, slack_us: float = 0.01) -> list[str]:
    """Spans that break nesting: on one lane (pid, tid) every two spans must be disjoint
    or one must contain the other, or Perfetto draws them wrongly. `slack_us` absorbs
    the rounding of ts and dur to nanoseconds."""
    lanes: dict[tuple, list[dict]] = {}
    for e in doc["traceEvents"]:
        if e.get("ph") == "X":
            lanes.setdefault((e["pid"], e["tid"]), []).append(e)
    errors = []
    for (pid, tid), spans in sorted(lanes.items()):
        open_spans: list[dict] = []  # the spans containing the current one, innermost last
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while open_spans and open_spans[-1]["ts"] + open_spans[-1]["dur"] <= e["ts"] + slack_us:
                open_spans.pop()
            if open_spans and e["ts"] + e["dur"] > open_spans[-1]["ts"] + open_spans[-1]["dur"] + slack_us:
                outer = open_spans[-1]
                errors.append(f"rank {pid} lane {tid}: '{e['name']}' [{e['ts']}, +{e['dur']}] starts inside "
                              f"'{outer['name']}' [{outer['ts']}, +{outer['dur']}] and ends after it")
            open_spans.append(e)
    return errors


def _collective_events(rec: dict, base: dict, end: float, real_end: float, us) -> list[dict]:
    """One collective's spans on its lane: the op (its bytes and level in args), the real
    transfer inside it, and the emulated link's extra time after that."""
    args = {"meta_bytes" if rec["meta"] else "wire_bytes": rec["wire"], "bytes": rec["bytes"], "level": rec["level"]}
    ms, me = rec["modeled"]
    if me > ms:
        args["modeled_start_us"], args["modeled_end_us"] = us(ms), us(me)
    if rec["end"] is None:
        args["unfinished"] = True
    if rec.get("failed"):  # a post-mortem's collective that raised (diagnose/postmortem.py)
        args["failed"] = True
    out = [{**base, "name": rec["op"], "cat": "meta" if rec["meta"] else "comm",
            "ts": us(rec["t0"]), "dur": round((end - rec["t0"]) * 1e6, 3), "args": args},
           {**base, "name": "real", "cat": "comm.real", "ts": us(rec["t0"]),
            "dur": round((real_end - rec["t0"]) * 1e6, 3)}]
    if end - real_end > 1e-6:
        out.append({**base, "name": "emulated", "cat": "comm.emulated", "ts": us(real_end),
                    "dur": round((end - real_end) * 1e6, 3)})
    return out
