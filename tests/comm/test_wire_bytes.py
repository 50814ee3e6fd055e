"""Comm counts the ring-model wire bytes of ALGORITHMS.md for every collective.

On W in {2, 3} real gloo ranks, each collective is run sync and async and the
per-rank counters (total and per op) are compared with the table, written out
here by hand from ALGORITHMS.md (S = bytes of the full logical tensor):

    all_reduce      2(W-1)/W * S        reduce_scatter  (W-1)/W * S (S = input)
    all_gather      (W-1)/W * S (S = gathered output) = (W-1) * s
    broadcast       S                   all_to_all      (W-1)/W * S (S = send buffer)

Python objects gathered through a Comm (an elastic run's agreements) are counted as bookkeeping.
The collectives' values are checked too, and one ddp and one zero1 step's
StepResult.wire_bytes equal 2(W-1)/W * P * 4 (zero1: P padded to a multiple of W).
"""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import lowcomm
from lowcomm.comm import latency_hops, wire_bytes
from lowcomm.comm.flight import FlightRecorder
from lowcomm.comm.objects import all_gather_object, pickled

from dist_utils import run_dist

K = 5  # elements per rank chunk; sizes are multiples of W so every op has equal splits


def expected_wire(op: str, S: int, W: int) -> Fraction:
    """ALGORITHMS.md's table, as exact fractions."""
    return {
        "all_reduce": Fraction(2 * (W - 1), W) * S,
        "reduce_scatter": Fraction(W - 1, W) * S,
        "all_gather": Fraction(W - 1, W) * S,
        "broadcast": Fraction(S),
        "all_to_all": Fraction(W - 1, W) * S,
    }[op]


# -- rank worker ---------------------------------------------------------------------

def _collectives(rank: int, world: int) -> dict:
    """Run every collective sync and async; record counter deltas, logical sizes and values."""
    comm = lowcomm.Comm()
    W, r = world, rank
    rec: dict = {"cases": [], "values_ok": {}, "meta_untouched": None}

    def measure(name, op, S, fn, check):
        for async_op in (False, True):
            before, op_before = comm.snapshot(), comm.by_op.get(op, lowcomm.CommStats()).copy()
            result = fn(async_op)
            if async_op:
                handle = result
                assert handle is not None, f"{name}: async op returned no handle"
                waited = handle.wait()
                fut_value = handle.future.wait()[0]
                ok = check(waited) and check(fut_value)
            else:
                assert result is None or isinstance(result, torch.Tensor)
                ok = check(None)
            after = comm.snapshot()
            d, dop = after - before, comm.by_op[op] - op_before
            rec["cases"].append({"name": name, "op": op, "S": S, "async": async_op,
                                 "wire": d.wire_bytes, "ops": d.ops, "op_wire": dop.wire_bytes,
                                 "op_ops": dop.ops})
            rec["values_ok"][(name, async_op)] = bool(ok)

    # all_reduce sum, fp32, a size that W does not divide
    n = 7 * W + 1
    def ar(async_op, store={}):
        store["t"] = torch.arange(n, dtype=torch.float32) + 100 * r
        return comm.all_reduce(store["t"], op="sum", async_op=async_op)
    ar_expect = W * torch.arange(n, dtype=torch.float32) + 100 * sum(range(W))
    measure("all_reduce_sum_f32", "all_reduce", n * 4, ar,
            lambda res, s=ar.__defaults__[0]: torch.equal(s["t"], ar_expect)
            and (res is None or res is s["t"]))

    # all_reduce avg and max, fp64 (8 bytes per element)
    def ar_avg(async_op, store={}):
        store["t"] = torch.full((W * K,), float(r + 1), dtype=torch.float64)
        return comm.all_reduce(store["t"], op="avg", async_op=async_op)
    measure("all_reduce_avg_f64", "all_reduce", W * K * 8, ar_avg,
            lambda res, s=ar_avg.__defaults__[0]: torch.allclose(
                s["t"], torch.full((W * K,), (W + 1) / 2, dtype=torch.float64)))

    def ar_max(async_op, store={}):
        store["t"] = torch.tensor([r, -r, 3], dtype=torch.int64)
        return comm.all_reduce(store["t"], op="max", async_op=async_op)
    measure("all_reduce_max_i64", "all_reduce", 3 * 8, ar_max,
            lambda res, s=ar_max.__defaults__[0]: s["t"].tolist() == [W - 1, 0, 3])

    # reduce_scatter: input S = W*K fp32, rank r keeps the sum of everyone's chunk r
    def rs(async_op, store={}):
        inp = torch.arange(W * K, dtype=torch.float32) * (r + 1)
        store["out"] = torch.empty(K, dtype=torch.float32)
        return comm.reduce_scatter(store["out"], inp, op="sum", async_op=async_op)
    tri = W * (W + 1) // 2
    rs_expect = torch.arange(r * K, (r + 1) * K, dtype=torch.float32) * tri
    measure("reduce_scatter_sum", "reduce_scatter", W * K * 4, rs,
            lambda res, s=rs.__defaults__[0]: torch.equal(s["out"], rs_expect))

    def rs_avg(async_op, store={}):
        inp = torch.arange(W * K, dtype=torch.float32) * (r + 1)
        store["out"] = torch.empty(K, dtype=torch.float32)
        return comm.reduce_scatter(store["out"], inp, op="avg", async_op=async_op)
    measure("reduce_scatter_avg", "reduce_scatter", W * K * 4, rs_avg,
            lambda res, s=rs_avg.__defaults__[0]: torch.allclose(s["out"], rs_expect / W))

    # all_gather: each rank sends s = K fp32, output S = W*K
    def ag(async_op, store={}):
        store["out"] = torch.empty(W * K, dtype=torch.float32)
        return comm.all_gather(store["out"], torch.full((K,), float(r) + 0.5), async_op=async_op)
    ag_expect = torch.cat([torch.full((K,), q + 0.5) for q in range(W)])
    measure("all_gather", "all_gather", W * K * 4, ag,
            lambda res, s=ag.__defaults__[0]: torch.equal(s["out"], ag_expect))

    # broadcast from the last rank (not only rank 0)
    src = W - 1
    def bc(async_op, store={}):
        store["t"] = torch.full((2 * K,), float(r * 10))
        return comm.broadcast(store["t"], src=src, async_op=async_op)
    measure("broadcast", "broadcast", 2 * K * 4, bc,
            lambda res, s=bc.__defaults__[0]: torch.equal(s["t"], torch.full((2 * K,), float(src * 10))))

    # all_to_all: send chunk j (K elements) to rank j; receive rank j's chunk r
    def a2a(async_op, store={}):
        inp = torch.cat([torch.full((K,), float(100 * r + j)) for j in range(W)])
        store["out"] = torch.empty(W * K)
        return comm.all_to_all(store["out"], inp, async_op=async_op)
    a2a_expect = torch.cat([torch.full((K,), float(100 * j + r)) for j in range(W)])
    measure("all_to_all", "all_to_all", W * K * 4, a2a,
            lambda res, s=a2a.__defaults__[0]: torch.equal(s["out"], a2a_expect))

    # bookkeeping traffic is counted apart from the strategy's bytes
    before, meta_before = comm.snapshot(), comm.meta.copy()
    t = torch.ones(4)
    comm.meta_all_reduce(t)
    g = comm.meta_all_gather(torch.tensor([float(r)]))
    rec["meta_untouched"] = (comm.snapshot() - before).wire_bytes == 0
    rec["meta_counted"] = (comm.meta - meta_before).wire_bytes
    rec["meta_values_ok"] = torch.equal(t, torch.full((4,), float(W))) and \
        g.reshape(-1).tolist() == [float(q) for q in range(W)]
    return rec


# -- strategy steps ----------------------------------------------------------------------

class OddMLP(nn.Module):
    """P = 5*7+7 + 7*3+3 + 1 = 67 parameters: prime, so W=2 and W=3 both need padding."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * self.gain


def _mlp_loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _strategy_steps(rank: int, world: int) -> dict:
    out = {}
    torch.manual_seed(0)
    for strategy in ("ddp", "zero1"):
        for model_kind in ("gpt", "mlp"):
            for accum, opts in ((1, {}), (2, {})) + (((1, {"bucket_mb": 0.01}),) if strategy == "ddp" else ()):
                torch.manual_seed(0)
                if model_kind == "gpt":
                    model = lowcomm.GPT(256, 16, n_layer=2, n_head=2, d_model=32)

                    def next_batch():
                        x = torch.randint(0, 256, (2, 17))
                        return x[:, :-1], x[:, 1:]
                    loss_fn = lowcomm.lm_loss
                else:
                    model = OddMLP()

                    def next_batch():
                        return torch.randn(4, 5), torch.randn(4, 3)
                    loss_fn = _mlp_loss
                P = sum(p.numel() for p in model.parameters())
                comm = lowcomm.Comm()
                strat = lowcomm.make_run(strategy, model, comm,
                                              lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                              accum=accum, **opts)
                wire, ops = [], []
                for _ in range(2):
                    before = comm.stats.ops
                    wire.append(strat.step(next_batch, loss_fn).wire_bytes)
                    ops.append(comm.stats.ops - before)
                out[(strategy, model_kind, accum, tuple(opts.items()))] = {
                    "P": P, "wire": wire, "ops": ops,
                    "by_op": {k: v.wire_bytes for k, v in comm.by_op.items()},
                }
    return out


def _object_gathers(rank: int, world: int) -> dict:
    """An elastic run's agreements (comm/objects.py): unequal pickles on the ranks, gathered as
    torch gathers them, counted and recorded as bookkeeping."""
    comm = lowcomm.Comm()
    comm.flight = FlightRecorder(rank)
    mine = ("hash" * (rank + 1), rank, None if rank else {"in": "all_reduce"})
    theirs = [None] * world
    dist.all_gather_object(theirs, mine)
    before, meta_before = comm.snapshot(), comm.meta.copy()
    got = all_gather_object(comm, mine)
    return {"same": got == theirs, "steps_untouched": (comm.snapshot() - before).wire_bytes == 0,
            "meta_wire": (comm.meta - meta_before).wire_bytes, "longest": max(pickled(o).numel() for o in theirs),
            "events": [(e.name, e.meta, e.state) for e in comm.flight.events()]}


def _run_all(rank: int, world: int) -> dict:
    return {"collectives": _collectives(rank, world), "steps": _strategy_steps(rank, world),
            "objects": _object_gathers(rank, world)}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"W{w}")
def world_runs(request):
    W = request.param
    return W, run_dist(_run_all, W)


# -- tests --------------------------------------------------------------------------------

@pytest.mark.procs
def test_collective_wire_bytes_match_the_table(world_runs):
    W, runs = world_runs
    names = set()
    for r, run in enumerate(runs):
        cases = run["collectives"]["cases"]
        assert len(cases) == 2 * 8
        for c in cases:
            names.add(c["op"])
            want = expected_wire(c["op"], c["S"], W)
            # integer counters: the exact value, rounded down when it is not whole
            assert c["wire"] == int(want), (r, c, want)
            assert c["op_wire"] == c["wire"] and c["ops"] == 1 and c["op_ops"] == 1, (r, c)
    assert names == {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"}
    if W == 3:  # 2(W-1)/W * S is not whole for the odd-sized all_reduce: rounding is exercised
        odd = [c for c in runs[0]["collectives"]["cases"] if c["name"] == "all_reduce_sum_f32"]
        assert odd and all(expected_wire(c["op"], c["S"], W).denominator != 1 for c in odd)


@pytest.mark.procs
def test_collective_values_are_correct(world_runs):
    W, runs = world_runs
    for r, run in enumerate(runs):
        bad = [k for k, ok in run["collectives"]["values_ok"].items() if not ok]
        assert not bad, f"rank {r}: wrong values from {bad}"
        assert len(run["collectives"]["values_ok"]) == 16


@pytest.mark.procs
def test_objects_are_gathered_as_torch_gathers_them_and_counted_as_bookkeeping(world_runs):
    W, runs = world_runs
    for run in runs:
        g = run["objects"]
        assert g["same"] and g["steps_untouched"], g
        # two ring all-gathers: the W lengths (int64), then the W pickles padded to the longest
        assert g["meta_wire"] == (W - 1) * 8 + (W - 1) * g["longest"], g
        assert g["events"] == [("all_gather", True, "done")] * 2, g


@pytest.mark.procs
def test_meta_traffic_is_counted_apart(world_runs):
    W, runs = world_runs
    for run in runs:
        c = run["collectives"]
        assert c["meta_untouched"], "meta_* ops leaked into the strategy's byte counter"
        assert c["meta_values_ok"]
        # meta_all_reduce of 4 fp32 + meta_all_gather of 1 fp32 per rank
        assert c["meta_counted"] == int(Fraction(2 * (W - 1), W) * 16) + int(Fraction(W - 1, W) * 4 * W)


@pytest.mark.procs
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_step_wire_bytes(world_runs, strategy):
    W, runs = world_runs
    seen = 0
    for run in runs:
        for (name, kind, accum, opts), rec in run["steps"].items():
            if name != strategy:
                continue
            seen += 1
            P = rec["P"]
            if strategy == "zero1":
                P = -(-P // W) * W  # padded to a multiple of W
                assert rec["by_op"].keys() == {"reduce_scatter", "all_gather"}
            else:
                assert rec["by_op"].keys() == {"all_reduce"}
            want = Fraction(2 * (W - 1), W) * P * 4
            if strategy == "ddp" and opts:
                # several buckets: each bucket's count is rounded down on its own
                for w, nb in zip(rec["wire"], rec["ops"]):
                    assert want - nb < w <= want, (kind, accum, opts, rec, want)
                if kind == "gpt":
                    # DDP rebuilds its buckets after the first step (which uses one 1 MiB bucket)
                    assert max(rec["ops"]) > 1, "bucket_mb=0.01 should split the GPT into several buckets"
                if W == 2:
                    assert rec["wire"] == [int(want)] * 2
            else:
                assert rec["wire"] == [int(want)] * 2, (kind, accum, opts, rec, want)
                # accumulation does not add communication: one round per optimizer step
                assert rec["ops"] == [1 if strategy == "ddp" else 2] * 2, rec
    assert seen == W * (6 if strategy == "ddp" else 4)


# -- the pure functions -------------------------------------------------------------------

# (op, S, W) -> bytes, worked out by hand from the table
HAND = [
    ("all_reduce", 1000, 2, 1000), ("all_reduce", 1200, 3, 1600), ("all_reduce", 1000, 4, 1500),
    ("all_reduce", 800, 8, 1400), ("all_reduce", 1000, 1, 0),
    ("reduce_scatter", 1000, 2, 500), ("reduce_scatter", 1200, 3, 800), ("reduce_scatter", 1000, 4, 750),
    ("all_gather", 1000, 2, 500), ("all_gather", 1200, 3, 800), ("all_gather", 4096, 8, 3584),
    ("broadcast", 1000, 2, 1000), ("broadcast", 1000, 7, 1000), ("broadcast", 1000, 1, 0),
    ("all_to_all", 1000, 2, 500), ("all_to_all", 1200, 3, 800), ("all_to_all", 1000, 1, 0),
]


@pytest.mark.parametrize("op,S,W,want", HAND)
def test_wire_bytes_hand_values(op, S, W, want):
    assert wire_bytes(op, S, W) == want


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"])
def test_wire_bytes_formula_sweep(op):
    for W in range(2, 17):
        for S in (0, 1, 3, 4, 1023, 4096, 10**9 + 7):
            want = expected_wire(op, S, W)
            got = wire_bytes(op, S, W)
            assert isinstance(got, int)
            assert got == int(want), (op, S, W, got, want)  # whole bytes, rounded down
        assert wire_bytes(op, 1000, 1) == 0


# Hops by hand: all_reduce 2(W-1), reduce_scatter and all_gather W-1, broadcast and all_to_all 1.
HOPS = [("all_reduce", 2, 2), ("all_reduce", 3, 4), ("all_reduce", 8, 14),
        ("reduce_scatter", 2, 1), ("reduce_scatter", 8, 7), ("all_gather", 3, 2), ("all_gather", 16, 15),
        ("broadcast", 2, 1), ("broadcast", 64, 1), ("all_to_all", 3, 1), ("all_to_all", 64, 1)]


@pytest.mark.parametrize("op,W,want", HOPS)
def test_latency_hops(op, W, want):
    assert latency_hops(op, W) == want
    assert latency_hops(op, 1) == 0


def test_unknown_collective_is_rejected():
    with pytest.raises(ValueError, match="gossip"):
        wire_bytes("gossip", 10, 2)
    with pytest.raises(ValueError, match="gossip"):
        latency_hops("gossip", 2)
