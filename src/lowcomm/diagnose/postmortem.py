"""After a run failed, timed out or was signalled: every rank's flight ring written to the run
directory, a Perfetto trace of the last events, and the one line that names the stuck rank.

The launcher calls `record_failure` once every worker is stopped, with the rings the ranks
kept in shared memory (comm/flight.py): a rank that was SIGKILLed or is SIGSTOPped cannot
write anything itself, yet its ring says what it did last. A rank under torchrun, which has
no such launcher, writes its own ring when it fails (`write_own`).

How the stuck rank is found (as PyTorch's flight-recorder analysis does): every collective
has a sequence number on its group, equal on every rank. The first collective some rank has
not completed is the one the others wait in; a rank whose last collective is numbered below
it never reached it: that rank is stuck (stopped, in a long compute, dead). If every rank
reached it, the collective itself made no progress (the network). With replica groups a
rank's intra-replica numbers are compared with other replicas' too: the line may then name
a rank of another replica's group; the per-rank files are exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..comm.flight import LEVELS, Event, read_dir
from ..metrics.runlog import write_json_atomic

FLIGHT_DIR = "flight"  # inside the run directory
_CATEGORY = {"micro-batch": "compute", "wait": "wait", "optimizer": "optimizer", "evaluate": "eval",
             "checkpoint": "checkpoint"}


@dataclass
class Stall:
    culprits: list[int]   # ranks that never reached the collective (empty: every rank is in it)
    waiting: list[int]    # ranks in it, waiting
    op: Event             # the collective, as a waiting rank issued it
    silent_s: float       # how long the culprits had recorded nothing when the run failed
    waited_s: float       # how long the first waiting rank had been in it

    def line(self) -> str:
        op = self.op
        what = f"{op.name} #{op.seq} ({'bookkeeping, ' if op.meta else ''}{_size(op.nbytes)}, {op.level})"
        if not self.culprits:
            return (f"{_ranks(self.waiting)} stalled {self.waited_s:.1f} s in {what}: every rank reached it, "
                    f"the collective itself made no progress")
        return f"{_ranks(self.culprits)} stalled {self.silent_s:.1f} s before {what}; " \
               f"{_ranks(self.waiting)} waiting for it"

    def flag(self) -> str:
        """The short form a step record's `flags` carry (diagnose/stalls.py): who held it up, how long."""
        who = _ranks(self.culprits) if self.culprits else "every rank"
        return f"stalled {self.op.name} #{self.op.seq} {who} {self.waited_s:.1f} s"


def failed_at(rings: dict[int, list[Event]]) -> float:
    """When the run failed, as the rings saw it: the latest time any rank recorded (a timed-out
    collective is closed, failed, when its timeout fires)."""
    return max((max(e.t0, e.t1) for events in rings.values() for e in events), default=0.0)


def diagnose(rings: dict[int, list[Event]], world: int, at: float | None = None) -> Stall | None:
    """The stuck rank(s) and the collective the others wait in; None when no collective is
    unfinished (the run failed for another reason: a NaN, an exception on every rank)."""
    at = failed_at(rings) if at is None else at
    best: Stall | None = None
    for level in LEVELS:
        ops = {r: [e for e in rings.get(r, ()) if e.collective and e.level == level] for r in range(world)}
        pending = {r: min((e for e in evs if e.state != "done"), key=lambda e: e.seq, default=None)
                   for r, evs in ops.items()}
        pending = {r: e for r, e in pending.items() if e is not None}
        top = {r: max((e.seq for e in evs), default=0) for r, evs in ops.items()}
        # A collective some rank went past was not what stopped it (that rank's peers took part):
        # one still open on another rank's ring is one it left unrecorded (stopped before its
        # completion callback ran), or the last leg of its own transfer.
        unpassed = [e.seq for e in pending.values()
                    if not any(top[q] > e.seq and (q not in pending or pending[q].seq > e.seq) for q in ops)]
        if not unpassed:
            continue
        seq = min(unpassed)  # the first collective some rank has not completed and none went past
        waiting = sorted(r for r, e in pending.items() if e.seq == seq)
        culprits = [r for r in range(world) if top[r] < seq]
        op = pending[waiting[0]]
        since = min(pending[r].t0 for r in waiting)
        last_seen = [max((max(e.t0, e.t1) for e in rings[r]), default=since) for r in culprits if rings.get(r)]
        stall = Stall(culprits, waiting, op, at - min(last_seen, default=since), at - since)
        if best is None or since < at - best.waited_s:  # the level whose wait began first
            best = stall
    return best


def event_record(e: Event, at: float) -> dict:
    """One event as the flight files show it; times in seconds relative to the failure."""
    rec = {"name": e.name, "step": e.step, "start_s": round(e.t0 - at, 6),
           "duration_s": round(e.t1 - e.t0, 6) if e.t1 else None, "state": e.state,
           "thread": "main" if e.main_thread else "other"}
    if e.collective:
        rec.update(seq=e.seq, level=e.level, bytes=e.nbytes, wire_bytes=e.wire, bookkeeping=e.meta)
    return rec


def lost_in(recorder) -> dict | None:
    """The collective this rank was in when it found a peer gone: its latest one that failed or
    never finished, the strategy's own traffic before bookkeeping (an elastic survivor's record of a
    fault, membership.jsonl); None without a recorder or such a collective."""
    events = recorder.events() if recorder is not None else []
    unfinished = [e for e in events if e.collective and e.state != "done"]
    if not unfinished:
        return None
    e = max(unfinished, key=lambda e: (not e.meta, e.eid))
    return {k: v for k, v in event_record(e, e.t0).items() if k not in ("start_s", "duration_s")}


def rank_record(rank: int, events: list[Event], at: float, written_by: str) -> dict:
    unfinished = [event_record(e, at) for e in events if e.collective and e.state != "done"]
    return {"rank": rank, "written_by": written_by,
            "times": "seconds relative to when the run failed (the latest event any rank recorded)",
            "unfinished_collectives": unfinished, "last_event": event_record(events[-1], at) if events else None,
            "events": [event_record(e, at) for e in events]}


def trace_events(rings: dict[int, list[Event]], at: float) -> list[dict]:
    """The rings as Chrome trace events, laid out as --trace lays out a whole run (diagnose/trace.py);
    what was unfinished ends at the failure, marked unfinished (or failed)."""
    from .trace import Tracer

    origin = min((e.t0 for events in rings.values() for e in events), default=at)
    out: list[dict] = []
    for rank, events in sorted(rings.items()):
        tracer = Tracer(rank)
        tracer.origin = origin
        for e in events:
            lane = "main" if e.main_thread else "other thread"
            if e.collective:
                rec = tracer.open_comm(e.name, e.t0, e.wire, e.nbytes, e.meta, e.t0, e.t0)
                if e.state == "done":
                    tracer.close_comm(rec, e.t1, e.t1)
                elif e.state == "failed":
                    rec["failed"] = True
                    tracer.close_comm(rec, e.t1, e.t1)
            else:
                tracer.span(e.name, _CATEGORY[e.name], e.t0, e.t1 or at, lane=lane)
        out.extend(tracer.events(now=at))
    return out


def record_failure(ring_dir: Path | str, out: Path, world: int, trace: bool = False, at: float | None = None,
                   metadata: dict | None = None) -> tuple[Path | None, Stall | None]:
    """Write OUT/flight/rank-N.json for every rank whose ring is in `ring_dir` (and OUT/trace.json,
    the last events of every rank, with `trace`); returns that directory and the diagnosis.
    `at`: when the run failed (default: the latest event any rank recorded)."""
    rings = read_dir(ring_dir)
    if not rings:
        return None, None
    at = failed_at(rings) if at is None else at
    where = out / FLIGHT_DIR
    where.mkdir(exist_ok=True)
    for rank, events in rings.items():
        write_json_atomic(where / f"rank-{rank}.json", rank_record(rank, events, at, "launcher"))
    if trace:
        from .trace import write_trace
        write_trace(out / "trace.json", trace_events(rings, at),
                    {**(metadata or {}), "partial": "the last events of every rank, written after the run failed"})
    return where, diagnose(rings, world, at)


def write_own(recorder, out: Path) -> None:
    """A rank without lowcomm's launcher (torchrun) writes its own ring when it fails."""
    events = recorder.events()
    where = out / FLIGHT_DIR
    where.mkdir(parents=True, exist_ok=True)
    at = failed_at({recorder.rank: events})
    write_json_atomic(where / f"rank-{recorder.rank}.json", rank_record(recorder.rank, events, at, "rank"))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
