"""Python objects through a Comm (comm/objects.py), on 2 real gloo processes, one spawn:

- all_gather_object returns what torch's all_gather_object returns, counted as bookkeeping
  (comm.meta, the ring model's all-gather bytes of the lengths and the padded pickles), recorded
  in the flight ring with the bookkeeping flag, the steps' counters untouched;
- an elastic heal (elastic/transfer.py) through the run's Comm: the receiver's state equals the
  donor's (hash and tensors), its counted bytes are the pickled state's size, it is recorded in
  the flight ring as "heal", and on an emulated slow link it takes at least bytes / bandwidth
  (a lower bound: a sleep never ends early); the old call with a process group still heals.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_dist
from lowcomm.comm import Comm
from lowcomm.comm.flight import FlightRecorder
from lowcomm.comm.link import LinkModel
from lowcomm.comm.objects import all_gather_object, pickled
from lowcomm.elastic.membership import View
from lowcomm.elastic.transfer import heal, state_hash

pytestmark = pytest.mark.procs

BW = 1e6  # bytes/s: the state below (~200 kB) takes ~0.2 s on the emulated link


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"step": seed, "strategy": {"model.w": torch.randn(40_000, generator=g),
                                       "opt.m": torch.randn(10_000, generator=g).double()},
            "log": {"file": None, "records": [{"step": seed}]}}


def _gathers(rank: int, comm: Comm) -> dict:
    mine = ("hash" * (rank + 1), rank, None if rank else {"in": "all_reduce"})  # unequal pickles
    theirs = [None] * comm.world
    dist.all_gather_object(theirs, mine)
    before, meta_before, events_before = comm.snapshot(), comm.meta.copy(), len(comm.flight.events())
    got = all_gather_object(comm, mine)
    events = comm.flight.events()[events_before:]
    longest = max(pickled(o).numel() for o in theirs)
    W = comm.world
    return {"same": got == theirs, "steps_untouched": (comm.snapshot() - before).wire_bytes == 0,
            "meta_wire": (comm.meta - meta_before).wire_bytes,
            "expected_wire": (W - 1) * 8 + (W - 1) * longest,  # ring all-gather: (W-1)/W of W lengths, W pickles
            "events": [(e.name, e.meta, e.state) for e in events]}


def _heal(rank: int, comm: Comm) -> dict:
    view = View("q", rank, 2, (0, 3), (4, -1))  # rank 0 holds step 4; rank 1 (slot 3) is a joiner
    donor_state = _state(4)
    got = {}
    before, events_before = comm.snapshot(), len(comm.flight.events())
    healed = heal(view, lambda: donor_state, got.update, comm)
    heal_events = [e for e in comm.flight.events()[events_before:] if e.name == "heal"]
    book = comm.books["heal"]
    out = {"healed": list(healed), "record": healed.record, "size": pickled(donor_state).numel(),
           "book_wire": book.wire_bytes, "book_ops": book.ops, "book_busy_s": book.busy_s,
           "steps_untouched": (comm.snapshot() - before).wire_bytes == 0,
           "ring": [(e.nbytes, e.meta, e.state, e.level) for e in heal_events]}
    if rank == 1:
        out["equal"] = (state_hash({k: v for k, v in got["strategy"].items()})
                        == state_hash(donor_state["strategy"])
                        and all(torch.equal(got["strategy"][k], v) for k, v in donor_state["strategy"].items())
                        and got["log"] == donor_state["log"] and got["step"] == 4)
    # the call as train/ makes it today: a process group, not a Comm; the donor here is rank 1
    view = View("q2", rank, 2, (0, 3), (2, 6))
    got_old = {}
    old = heal(view, lambda: _state(6), got_old.update, None)
    out["old"] = {"healed": list(old), "from": old.record["from"], "bytes": old.record["bytes"],
                  "size": pickled(_state(6)).numel(),  # the donor's (a pickle's size is this process's)
                  "equal": rank == 1 or torch.equal(got_old["strategy"]["model.w"], _state(6)["strategy"]["model.w"])}
    return out


def _both(rank: int, world: int) -> dict:
    comm = Comm(link=LinkModel(BW, 0.0))
    comm.flight = FlightRecorder(rank)
    return {"gathers": _gathers(rank, comm), "heal": _heal(rank, comm)}


@pytest.fixture(scope="module")
def results():
    return run_dist(_both, 2)


def test_gathered_objects_equal_torchs_and_are_counted_as_bookkeeping(results):
    for r in results:
        g = r["gathers"]
        assert g["same"] and g["steps_untouched"], g
        assert g["meta_wire"] == g["expected_wire"] > 0, g
        assert g["events"] == [("all_gather", True, "done")] * 2, g  # the lengths, then the pickles


def test_heal_counts_the_pickled_state_and_takes_the_link_time(results):
    size = results[0]["heal"]["size"]  # the donor's pickle (its size may differ by a few bytes in another process)
    for r in results:
        h = r["heal"]
        assert h["healed"] == [1] and h["steps_untouched"], h
        assert h["record"]["from"] == 0 and h["record"]["bytes"] == size == h["book_wire"] > 200_000, h
        assert h["book_ops"] == 1 and h["ring"] == [(size, False, "done", "cross")], h
        # paced by the emulated link: at least the bytes at its bandwidth, on both ends
        assert h["record"]["seconds"] >= size / BW and h["book_busy_s"] >= size / BW, h
        assert h["record"]["link_s"] == pytest.approx(size / BW, rel=1e-6), h
    assert results[1]["heal"]["equal"]


def test_heal_through_a_process_group_still_heals(results):
    for rank, r in enumerate(results):
        old = r["heal"]["old"]
        assert old["healed"] == [0] and old["from"] == 3 and old["equal"], old
        assert old["bytes"] == results[1]["heal"]["old"]["size"], old  # the donor's pickle
