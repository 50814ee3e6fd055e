"""The flight recorder: every rank's last events in a fixed ring (metrics/flight.py), and what the
launcher makes of the rings after a run failed (metrics/postmortem.py).

- the ring keeps the last CAPACITY events, in order, from several threads, and is read back from
  its shared file as another process (the launcher) reads it;
- the diagnosis names the rank that never reached the collective the others wait in;
- end to end: a worker SIGSTOPped past --timeout fails the run with one line naming that rank and
  the collective rank 0 waits in, and every rank's flight record is in the run directory;
- a worker SIGKILLed in a run with --trace still leaves a trace.json of every rank's last steps.
"""
from __future__ import annotations

import json
import re
import threading

from test_faults import TINY, data_file, error_line  # noqa: F401 (data_file: a fixture)

from lowcomm.cli import main
from lowcomm.metrics.flight import CODE, FlightRecorder, read_dir, ring_name
from lowcomm.metrics.postmortem import diagnose
from lowcomm.metrics.trace import nesting_errors


def test_the_ring_keeps_the_last_events_in_order(tmp_path):
    rec = FlightRecorder(3, capacity=16, path=tmp_path / ring_name(3))
    first = rec.open(CODE["all_reduce"], 1.0, seq=1, nbytes=400, wire=400)
    rec.close(first, 1.5, failed=True)
    for i in range(40):
        rec.step = i
        rec.close(rec.open(CODE["all_gather"], 2.0 + i, seq=2 + i, nbytes=8, meta=True), 2.5 + i)
    rec.close(first, 9.0)  # wrapped over since: ignored, it must not touch the slot's new event
    events = read_dir(tmp_path)[3]  # as the launcher reads it: from the file
    assert [e.seq for e in events] == list(range(26, 42))
    assert all(e.state == "done" and e.meta and e.t1 == e.t0 + 0.5 for e in events)
    assert events[-1].step == 39


def test_the_ring_is_thread_safe():
    rec = FlightRecorder(0, capacity=4096)

    def record():
        for _ in range(1000):
            rec.close(rec.open(CODE["wait"], 1.0), 2.0)
    threads = [threading.Thread(target=record) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    events = rec.events()
    assert len(events) == 4000 and {e.state for e in events} == {"done"}
    assert {e.main_thread for e in events} == {False}


def _ring(seqs_done, open_seq=None, last_t=10.0):
    rec = FlightRecorder(0, capacity=64)
    for seq in seqs_done:
        rec.close(rec.open(CODE["all_reduce"], last_t - 1, seq=seq, nbytes=4_200_000), last_t - 0.5)
    rec.span(CODE["micro-batch"], last_t - 0.4, last_t)
    if open_seq is not None:
        eid = rec.open(CODE["all_reduce"], last_t, seq=open_seq, nbytes=4_200_000)
        rec.close(eid, last_t + 12.0, failed=True)
    return rec.events()


def test_the_rank_that_never_reached_the_collective_is_named():
    rings = {0: _ring([1, 2, 3], open_seq=4), 1: _ring([1, 2, 3]), 2: _ring([1, 2, 3], open_seq=4),
             3: _ring([1, 2, 3], open_seq=4)}
    stall = diagnose(rings, 4)
    assert stall.line() == "rank 1 stalled 12.0 s before all_reduce #4 (4.2 MB, cross); ranks 0,2,3 waiting for it"
    # every rank in it: no rank to blame, the collective itself is stuck
    stall = diagnose({0: _ring([1], open_seq=2), 1: _ring([1], open_seq=2)}, 2)
    assert stall.culprits == [] and "every rank reached it" in stall.line()
    # nothing unfinished: the run failed for another reason
    assert diagnose({0: _ring([1, 2]), 1: _ring([1, 2])}, 2) is None


def test_a_stopped_worker_is_named_with_the_collective_the_others_wait_in(tmp_path, data_file, monkeypatch,
                                                                         capfd):
    monkeypatch.setenv("LOWCOMM_TEST_STOP_AT", "1:4")  # rank 1 SIGSTOPs itself before step 4
    out = tmp_path / "run"
    code = main(["train", *TINY, "--steps", "100000", "--timeout", "2", "--data", str(data_file),
                 "--out", str(out)])
    assert code == 1
    line = error_line(capfd.readouterr().err)
    m = re.match(r"error: rank 1 stalled (\d+\.\d) s before (\w+) #(\d+) \([\d.]+ \w?B, cross\); "
                 r"rank 0 waiting for it \(.*timed out after 2 s \(--timeout\).*flight records in (\S+)\)", line)
    assert m, line
    assert 2.0 <= float(m[1]) < 10.0, line
    records = {r: json.loads((out / "flight" / f"rank-{r}.json").read_text()) for r in (0, 1)}
    waiting = records[0]["unfinished_collectives"]
    assert [(w["name"], w["seq"], w["state"]) for w in waiting] == [(m[2], int(m[3]), "failed")]
    assert records[0]["events"][-1]["step"] == 4
    # the stopped rank's own ring, read by the launcher: its last collective is the one before
    seqs = [e["seq"] for e in records[1]["events"] if "seq" in e]
    assert max(seqs) == int(m[3]) - 1 and not records[1]["unfinished_collectives"]


def test_a_killed_worker_leaves_a_trace_of_every_ranks_last_steps(tmp_path, data_file, monkeypatch, capfd):
    monkeypatch.setenv("LOWCOMM_TEST_KILL_AT", "1:3")  # rank 1 SIGKILLs itself after step 3
    out = tmp_path / "run"
    code = main(["train", *TINY, "--steps", "100000", "--trace", "--data", str(data_file), "--out", str(out)])
    assert code == 1
    line = error_line(capfd.readouterr().err)
    assert "worker rank 1 failed: killed by signal SIGKILL" in line and "flight records in" in line, line
    doc = json.loads((out / "trace.json").read_text())
    assert "partial" in doc["otherData"] and not nesting_errors(doc)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        cats = {e["cat"] for e in spans if e["pid"] == rank}
        assert {"compute", "comm", "wait", "optimizer"} <= cats, (rank, cats)
        computed = sum(1 for e in spans if e["pid"] == rank and e["cat"] == "compute")
        assert computed >= 3  # steps 1 to 3, one micro-batch each
    assert all(e["dur"] >= 0 for e in spans)


def test_a_run_stopped_early_writes_its_trace(tmp_path, data_file):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "10", "--stop-at", "2", "--trace", "--data", str(data_file),
                 "--out", str(out)]) == 0
    doc = json.loads((out / "trace.json").read_text())
    assert doc["otherData"]["stopped_after_step"] == 2 and not nesting_errors(doc)
    assert {e["pid"] for e in doc["traceEvents"] if e.get("cat") == "comm"} == {0, 1}
    assert not (out / "flight").exists()  # nothing failed: the rings stay in memory


def test_a_slowed_rank_is_flagged_as_a_straggler_during_the_run(tmp_path, data_file):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "8", "--slowdown", "1,4", "--data", str(data_file),
                 "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    flagged = [r for r in records if r.get("flags")]
    assert flagged and records[-1] in flagged  # from the window's first full step on
    for r in flagged:
        (flag,) = r["flags"]
        ratio = float(re.fullmatch(r"straggler rank 1 x(\d+\.\d)", flag)[1])
        # 4 emulated; a tiny model's few ms of compute make it noisy (both ways on a busy machine)
        assert ratio >= 2.0, flag
