"""The Chrome/Perfetto trace: merged across ranks, thread-safe, bytes that add up.
(The end-to-end check against summary.json's wire_bytes_total is in tests/comm/test_link_train.py.)"""
import json
import threading
import time

import pytest
import torch

from dist_utils import run_dist
from lowcomm.comm import Comm
from lowcomm.comm.link import LinkModel
from lowcomm.diagnose.trace import Tracer, comm_wire_bytes, write_trace

N = 2**16  # fp32 elements: 256 KiB
BW = 10e6  # 26 ms per all-reduce of 256 KiB on W=2: long enough to be seen, short enough to be quick


def _traced(rank, world, path):
    comm = Comm(link=LinkModel(BW, 0.001))
    tracer = Tracer(rank)
    tracer.align(comm)
    comm.tracer = tracer
    t = torch.ones(N)
    # A background thread issues and waits like ACCO's communication thread
    # while this one computes (collectives stay in one order on every rank).
    def comm_thread():
        with comm.overlapped():
            for _ in range(3):
                comm.all_gather(torch.empty(2 * N), torch.ones(N))
    th = threading.Thread(target=comm_thread, name="comm-thread")
    th.start()
    while th.is_alive():
        t0 = time.perf_counter()
        _ = torch.randn(64, 64) @ torch.randn(64, 64)
        tracer.span("micro-batch", "compute", t0, time.perf_counter())
        time.sleep(0.005)
    th.join()
    for _ in range(3):
        t0 = time.perf_counter()
        h = comm.all_reduce(t, async_op=True)
        _ = torch.randn(64, 64) @ torch.randn(64, 64)
        tracer.span("micro-batch", "compute", t0, time.perf_counter())
        h.wait()
    comm.reduce_scatter(torch.empty(N // 2), t)
    comm.meta_all_reduce(torch.ones(4))  # bookkeeping: traced as meta, not as wire bytes
    events = tracer.gather(comm)
    if rank == 0:
        write_trace(path, events, {"test": True})
    return {"wire": comm.stats.wire_bytes, "emulated": comm.stats.emulated_s}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    results = run_dist(_traced, 2, path, timeout=60)
    return json.loads(path.read_text()), results


@pytest.mark.procs
def test_trace_parses_and_holds_every_rank(traced):
    doc, _ = traced
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for rank in (0, 1):
        cats = {e["cat"] for e in spans if e["pid"] == rank}
        assert {"compute", "comm", "comm.real", "comm.emulated", "wait", "meta"} <= cats
        names = {e["args"]["name"] for e in doc["traceEvents"]
                 if e["ph"] == "M" and e["pid"] == rank and e["name"] == "thread_name"}
        assert "main" in names and "comm 0" in names
    assert all(e["dur"] >= 0 and e["ts"] >= -1e6 for e in spans)


@pytest.mark.procs
def test_comm_span_bytes_add_up_to_the_counted_bytes(traced):
    doc, results = traced
    # 3 all-reduces + 3 all-gathers + 1 reduce-scatter per rank, by the ring formulas:
    per_rank = 3 * (N * 4) + 3 * (2 * N * 4) // 2 + (N * 4) // 2
    assert [r["wire"] for r in results] == [per_rank, per_rank]
    assert comm_wire_bytes(doc) == sum(r["wire"] for r in results)
    meta = [e for e in doc["traceEvents"] if e.get("cat") == "meta"]
    assert meta and all("wire_bytes" not in e["args"] for e in meta)


@pytest.mark.procs
def test_emulated_parts_match_the_model_and_lanes_do_not_overlap(traced):
    doc, results = traced
    link = LinkModel(BW, 0.001)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for e in (e for e in spans if e["cat"] == "comm"):
        # Each op lasts at least its modeled time (the NIC queue can only add).
        assert e["dur"] / 1e6 >= link.duration(e["name"], e["args"]["bytes"], 2) - 1e-6
    for rank in (0, 1):
        em = sum(e["dur"] for e in spans if e["pid"] == rank and e["cat"] == "comm.emulated") / 1e6
        assert em == pytest.approx(results[rank]["emulated"], rel=0.02, abs=1e-3)
        # Top-level comm spans on one lane never overlap: Perfetto draws each lane as a stack.
        for tid in {e["tid"] for e in spans if e["pid"] == rank and e["cat"] in ("comm", "meta")}:
            lane = sorted((e for e in spans if e["pid"] == rank and e["tid"] == tid
                           and e["cat"] in ("comm", "meta")), key=lambda e: e["ts"])
            for a, b in zip(lane, lane[1:]):
                assert a["ts"] + a["dur"] <= b["ts"] + 1.0  # 1 us of rounding
    # The overlapped thread's waits are not exposed time, so they are not "wait" spans.
    assert not any(e["cat"] == "wait" and e["tid"] != 0 for e in spans)


def test_tracer_is_thread_safe():
    tracer = Tracer(0)

    def record(k):
        for i in range(2000):
            tracer.span(f"s{k}", "compute", i * 1e-6, i * 1e-6 + 1e-7)
            tracer.close_comm(tracer.open_comm("all_reduce", i * 1e-6, 8, 8, False, 0, 0), i * 1e-6, i * 1e-6)
    threads = [threading.Thread(target=record, args=(k,), name=f"t{k}") for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    events = tracer.events()
    assert sum(1 for e in events if e.get("cat") == "compute") == 8000
    assert sum(e["args"]["wire_bytes"] for e in events if e.get("cat") == "comm") == 8 * 8000
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"t0", "t1", "t2", "t3"} <= lanes
