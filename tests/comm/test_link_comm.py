"""The link emulator inside Comm, on 2 real gloo processes (an elastic heal through it too).

Timing on 2 shared cores, whatever the load: a sleep never ends early, so every "at least the
modeled time" bound is strict and holds in every repetition. An upper bound (the emulator did not
wait twice, issuing did not block, a real op took milliseconds) can only be broken by the machine
waking a process late, so the timed cases run REPEATS times in the one spawn and an upper bound must
hold in one of them, with a slack of the larger of SLACK_S = 0.15 s and three times that
repetition's own lateness over the modeled time: the real op without a link plus how late a sleep
of the modeled time woke, measured in the same processes before and after it. An emulator that
waited twice fails every repetition on a quiet machine; one that did not wait fails the lower
bounds at any load. (One repetition with the lateness measured only at its ends failed a few times
at a load of 27 to 30.)
"""
import time

import pytest
import torch

from dist_utils import run_dist
from lowcomm.comm import Comm
from lowcomm.comm.flight import FlightRecorder
from lowcomm.comm.link import LinkModel
from lowcomm.comm.objects import pickled

pytestmark = pytest.mark.procs

SLACK_S = 0.15
REPEATS = 3
N = 2**19                 # fp32 elements: S = 2 MiB
BW = 5e6                  # bytes/s
LAT = 0.005               # per hop


def _modeled(op="all_reduce"):
    return LinkModel(BW, LAT).duration(op, N * 4, 2)


def _sync_and_queue(rank, world):
    comm = Comm(link=LinkModel(BW, LAT))
    times = []
    for _ in range(2):
        t = torch.full((N,), float(rank + 1))
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(t)
        times.append(time.perf_counter() - t0)
        assert torch.all(t == 3.0)
    # Two async ops issued back to back share one NIC: the second ends a
    # modeled duration after the first.
    a, b = torch.ones(N), torch.ones(N)
    comm.barrier()
    t0 = time.perf_counter()
    ha, hb = comm.all_reduce(a, async_op=True), comm.all_reduce(b, async_op=True)
    ha.wait()
    first = time.perf_counter() - t0
    hb.wait()
    both = time.perf_counter() - t0
    assert torch.all(b == 2.0)
    return {"sync": times, "first": first, "both": both, "emulated_s": comm.stats.emulated_s}


def _lateness(rank, world) -> float:
    """This process's delays right now: a real all-reduce of S without a link, plus how late a
    sleep of the modeled time wakes (the slowest of three each)."""
    comm, t = Comm(), torch.ones(N)
    real, late = [], []
    for _ in range(3):
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(t)
        real.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        time.sleep(_modeled())
        late.append(time.perf_counter() - t0 - _modeled())
    return max(real) + max(late)


def _all_cases(rank, world):
    # One spawn for every case: starting 2 processes costs more than the cases.
    timed = {"sync": _sync_and_queue, "overlap": _overlap, "future": _future, "callback": _wait_inside_callback,
             "no_link": _no_link}
    reps, before = [], _lateness(rank, world)
    for _ in range(REPEATS):  # the lateness after one repetition is the next one's before
        rep = {name: case(rank, world) for name, case in timed.items()}
        after = _lateness(rank, world)
        rep["slack"], before = max(SLACK_S, 3 * max(before, after)), after
        reps.append(rep)
    return {"reps": reps, "heal": _heal(rank, world)}


@pytest.fixture(scope="module")
def results():
    return run_dist(_all_cases, 2, timeout=900)


def _each(results, case):
    """(rank, [(that repetition's record of `case`, its slack)]) for each rank."""
    return [(rank, [(rep[case], rep["slack"]) for rep in x["reps"]]) for rank, x in enumerate(results)]


def _holds_once(results, case, upper) -> None:
    """`upper(record, slack)` holds in at least one repetition on each rank (see the docstring)."""
    for rank, reps in _each(results, case):
        assert any(upper(r, slack) for r, slack in reps), (case, rank, reps)


def test_sync_and_queued_ops_take_the_modeled_time(results):
    m = _modeled()
    assert 0.4 < m < 0.5  # 2 MiB all-reduce at 5 MB/s plus 2 hops of 5 ms
    for _, reps in _each(results, "sync"):
        for r, _ in reps:  # never sooner than the model, in every repetition
            assert all(dt >= m for dt in r["sync"]) and r["first"] >= m and r["both"] >= 2 * m, r
            # Most of each op was the emulator's (the real loopback op takes milliseconds).
            assert r["emulated_s"] > 0.8 * 4 * m, r
    _holds_once(results, "sync", lambda r, slack: (all(dt <= m + slack for dt in r["sync"]) and r["first"] <= m + slack
                                                   and r["both"] <= 2 * m + slack))


def _calibrated_compute(seconds):
    """Work of about `seconds`: warmed up first (the first matmuls are slow), then timed over at
    least half of `seconds` (a 0.1 s calibration once came out 6x too short)."""
    a = torch.randn(192, 192)

    def run(iters):
        b = a
        for _ in range(iters):
            b = torch.tanh(b @ b)
        return b
    run(20)
    iters, took = 1, 0.0
    while took < seconds / 2:
        iters *= 2
        t0 = time.perf_counter()
        run(iters)
        took = time.perf_counter() - t0
    iters = max(1, round(iters * seconds / took))
    return lambda: run(iters)


def _overlap(rank, world):
    comm = Comm(link=LinkModel(BW, LAT))
    work = _calibrated_compute(_modeled())
    t0 = time.perf_counter()
    work()
    alone = time.perf_counter() - t0
    t = torch.ones(N)
    comm.barrier()
    before = comm.snapshot()
    t0 = time.perf_counter()
    h = comm.all_reduce(t, async_op=True)
    work()
    computed = time.perf_counter() - t0
    h.wait()
    total = time.perf_counter() - t0
    spent = comm.snapshot() - before
    return {"alone": alone, "computed": computed, "total": total, "exposed": spent.exposed_s}


def test_async_op_overlaps_compute(results):
    m = _modeled()
    for _, reps in _each(results, "overlap"):
        assert all(r["total"] >= m for r, _ in reps), reps
    # Only the blocked part of wait() is exposed: what wait() measured inside, against what the test
    # measured around it (apart only by how late this process ran between the two).
    _holds_once(results, "overlap", lambda r, slack: abs(r["exposed"] - (r["total"] - r["computed"])) < 0.01)

    def overlapped(r, slack):
        # The calibration gave compute of similar length; then max(compute, modeled), not the sum.
        # Measured against the compute as it ran beside the op (`computed`), not alone: gloo's
        # thread and the other rank share two cores, so the compute itself may take longer (0.53 s
        # alone, 0.72 s beside the op, once in CI); that is contention, not a failure to overlap.
        c = r["computed"]
        return (0.5 * m < r["alone"] < 2 * m and r["total"] <= max(c, m) + slack
                and r["total"] < c + m - 0.5 * min(c, m))
    _holds_once(results, "overlap", overlapped)


def _future(rank, world):
    comm = Comm(link=LinkModel(BW, LAT))
    t = torch.ones(N)
    comm.barrier()
    t0 = time.perf_counter()
    h = comm.all_reduce(t, async_op=True)
    # The shape DDP's comm hook returns; its reducer waits on this chain.
    chained = h.future.then(lambda f: f.value()[0] * 2)
    issued = time.perf_counter() - t0
    out = chained.wait()
    done = time.perf_counter() - t0
    return {"issued": issued, "done": done, "ok": bool(torch.all(out == 4.0))}


def _wait_inside_callback(rank, world):
    """torch's PowerSGD hook issues an op inside a future's callback and waits on it
    there: the emulated link must complete the second op although the first one's
    completion is still running that callback (it hung before)."""
    comm = Comm(link=LinkModel(BW, LAT))
    a, b = torch.ones(N // 8), torch.ones(N // 8)
    comm.barrier()
    t0 = time.perf_counter()

    def then_reduce_b(fut):
        return comm.all_reduce(b, async_op=True).future.wait()[0] + fut.value()[0]

    out = comm.all_reduce(a, async_op=True).future.then(then_reduce_b).wait()
    return {"ok": bool(torch.all(out == 4.0)), "done": time.perf_counter() - t0,
            "modeled": 2 * LinkModel(BW, LAT).duration("all_reduce", N // 8 * 4, 2)}


def test_an_op_waited_on_inside_a_callback_completes(results):
    for _, reps in _each(results, "callback"):
        assert all(r["ok"] and r["done"] >= r["modeled"] for r, _ in reps), reps
    _holds_once(results, "callback", lambda r, slack: r["done"] <= r["modeled"] + slack)


def test_future_completes_at_the_modeled_end(results):
    m = _modeled()
    for _, reps in _each(results, "future"):
        assert all(r["ok"] and r["done"] >= m for r, _ in reps), reps
    # issuing does not block (blocking would take m)
    _holds_once(results, "future", lambda r, slack: r["issued"] < 0.5 * m and r["done"] <= m + slack)


def _no_link(rank, world):
    comm = Comm()
    t = torch.ones(N)
    comm.barrier()
    t0 = time.perf_counter()
    comm.all_reduce(t)
    h = comm.all_reduce(t, async_op=True)
    h.wait()
    return {"dt": time.perf_counter() - t0, "emulated": comm.stats.emulated_s}


def test_without_a_link_nothing_is_emulated(results):
    for _, reps in _each(results, "no_link"):
        assert all(r["emulated"] == 0.0 for r, _ in reps), reps
    # two real loopback all-reduces of 2 MiB, not two modeled ones
    _holds_once(results, "no_link", lambda r, slack: r["dt"] < 2 * _modeled())


# -- an elastic heal through the run's Comm (elastic/transfer.py, comm/objects.py) ------------------

def _state(seed: int) -> dict:
    """A committed state as a member's snapshot holds it: 2 MiB of parameters and a few other parts."""
    g = torch.Generator().manual_seed(seed)
    return {"step": seed, "strategy": {"model.w": torch.randn(N, generator=g), "opt.m": torch.randn(999, generator=g).double()},
            "log": {"file": None, "records": [{"step": seed}]}}


def _heal(rank, world):
    # Imported here, not at the top: imported before _overlap (it imports torchft), its compute
    # calibration came out a thousand times too short (0.5 ms of compute where 0.4 s was asked).
    from lowcomm.elastic.membership import View
    from lowcomm.elastic.transfer import heal, state_hash
    comm = Comm(link=LinkModel(BW, LAT))
    comm.flight = FlightRecorder(rank)
    donor_state, got = _state(4), {}
    before = comm.snapshot()
    healed = heal(View("q", rank, 2, (0, 3), (4, -1)), lambda: donor_state, got.update, comm)  # slot 3 joins
    book = comm.books["heal"]
    out = {"healed": list(healed), "record": healed.record, "size": pickled(donor_state).numel(),
           "book": (book.wire_bytes, book.ops, book.busy_s), "steps_untouched": (comm.snapshot() - before).ops == 0,
           "ring": [(e.nbytes, e.meta, e.state) for e in comm.flight.events() if e.name == "heal"]}
    if rank == 1:
        out["equal"] = (state_hash(got["strategy"]) == state_hash(donor_state["strategy"])
                        and all(torch.equal(got["strategy"][k], v) for k, v in donor_state["strategy"].items())
                        and got["log"] == donor_state["log"] and got["step"] == 4)
    # the call train/ made before: a process group, not the run's Comm; the donor here is rank 1
    got_old = {}
    old = heal(View("q2", rank, 2, (0, 3), (2, 6)), lambda: _state(6), got_old.update, None)
    out["old"] = {"healed": list(old), "from": old.record["from"], "bytes": old.record["bytes"],
                  "size": pickled(_state(6)).numel(), "link_s": old.record["link_s"],
                  "equal": rank == 1 or torch.equal(got_old["strategy"]["model.w"], _state(6)["strategy"]["model.w"])}
    return out


def test_a_heal_counts_the_pickled_state_apart_and_takes_the_link_time(results):
    size = results[0]["heal"]["size"]  # the donor's pickle (another process's may differ by a few bytes)
    modeled = LinkModel(BW, LAT).duration("broadcast", size, 2)
    for h in (x["heal"] for x in results):
        assert h["healed"] == [1] and h["steps_untouched"], h
        assert h["record"]["from"] == 0 and h["record"]["bytes"] == size > N * 4, h
        assert h["book"][:2] == (size, 1) and h["ring"] == [(size, False, "done")], h  # counted and recorded once
        # paced as a broadcast of its bytes: never sooner than the link model's time, on both ends
        assert h["record"]["seconds"] >= modeled and h["book"][2] >= modeled, (h, modeled)
        assert h["record"]["link_s"] == pytest.approx(modeled, abs=1e-6), h
    assert results[1]["heal"]["equal"]


def test_a_heal_through_a_process_group_still_heals(results):
    for h in (x["heal"]["old"] for x in results):
        assert h["healed"] == [0] and h["from"] == 3 and h["equal"], h
        assert h["bytes"] == results[1]["heal"]["old"]["size"] and h["link_s"] == 0.0, h  # the donor's pickle, no link
