"""What the compressed strategies' test files (quantized, onebit_adam, demo, powersgd) share: a
tiny GPT and its batches, the bytes-versus-plan and state round-trip checks, and one spawn per
world size for all of them.

Spawning gloo processes is the costly part of these tests, so each file registers its per-rank
checks with `@in_shared_spawn`, and the first test that asks for a world size's results runs
the checks of every file collected in one `run_dist` (one file run alone spawns for itself).
"""
from __future__ import annotations

import copy

import importlib
import io
from typing import Callable

import torch

import lowcomm
from lowcomm.models.layout import ModelLayout
from lowcomm.run.driver import make_run
from lowcomm.strategies import get

from dist_utils import flat_params, run_dist

SEQ, MICRO, ACCUM = 16, 2, 2
DIMS = dict(n_layer=1, n_head=2, d_model=32)


def make_model(seed=1234):
    torch.manual_seed(seed)
    return lowcomm.GPT(vocab_size=256, seq_len=SEQ, **DIMS)


def batch(step, rank, micro):
    g = torch.Generator().manual_seed(100_000 * step + 100 * rank + micro)
    seq = torch.randint(0, 256, (MICRO, SEQ + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def schedule(step):
    return 1e-2 * min(1.0, (step + 1) / 3)


def decaying(step):
    """An lr that differs from make_optimizer's at every step, so that a resumed strategy
    stepping with a stale lr (not the schedule's) shows."""
    return 1e-2 / (step + 2)


def build(name, seed=1234, lr_schedule=schedule, optimizer=make_optimizer, **options):
    model = make_model(seed)
    return model, make_run(name, model, lowcomm.Comm(), optimizer, accum=ACCUM, schedule=lr_schedule, **options)


def steps(strategy, rank, n):
    for _ in range(n):
        step, micro = strategy.steps_done, iter(range(1000))
        strategy.step(lambda: batch(step, rank, next(micro)), lowcomm.lm_loss)


# -- bytes counted = the plan ------------------------------------------------------------------

def counted_bytes(rank, cases):
    """Per (strategy, options, steps) case: (wire bytes, ops, parameter shapes) of its run."""
    out = []
    for name, options, n in cases:
        model, strategy = build(name, **options)
        before = strategy.comm.snapshot()
        steps(strategy, rank, n)
        spent = strategy.comm.snapshot() - before
        out.append((spent.wire_bytes, spent.ops, [tuple(p.shape) for p in model.parameters()]))
        strategy.close()
    return out


def planned(name, options, n, world, shapes):
    cls = get(name)
    opts = cls.Options(**options).validate(name)
    plan = cls.comm_plan(ModelLayout(tuple(shapes)), world, opts)
    return sum(op.wire_bytes(world) * cls.cost.plan_occurrences(op, n, opts) for op in plan)


def assert_bytes_equal_plans(results, cases, world, slack_per_op=False):
    """Every rank counted the same bytes, equal to the plan (`slack_per_op`: each op's ring
    count may round down on its own, as DDP's buckets do)."""
    assert len(results[0]) == len(cases)
    for k, ((name, options, n), (counted, ops, shapes)) in enumerate(zip(cases, results[0])):
        want = planned(name, options, n, world, shapes)
        assert want > 0
        for r in range(world):
            assert results[r][k][0] == counted
        if slack_per_op:
            assert 0 <= want - counted <= ops, (name, options, counted, want)
        else:
            assert counted == want, (name, options, counted, want)


# -- state_dict -> load_state_dict: the same continuation ----------------------------------------

def round_trip(rank, name, options, lr_schedule=schedule):
    """3 steps, state saved, 2 more; a fresh strategy (other parameters) loads it and takes the
    same 2: (straight parameters, resumed parameters, saved state parts, loaded state parts)."""
    model, strategy = build(name, lr_schedule=lr_schedule, **options)
    steps(strategy, rank, 3)
    buf = io.BytesIO()
    torch.save(strategy.state_dict(), buf)
    steps(strategy, rank, 2)
    model2, resumed = build(name, seed=99, lr_schedule=lr_schedule, **options)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    loaded = copy.deepcopy(resumed.state_dict()["parts"])  # an optimizer's state_dict() holds its live tensors
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)["parts"]
    steps(resumed, rank, 2)
    strategy.close()
    resumed.close()
    return flat_params(model), flat_params(model2), saved, loaded


def assert_round_trip(results):
    for straight, resumed, saved, loaded in results:
        nested_equal(saved, loaded)
        assert torch.equal(straight, resumed), "resumed run differs"


def nested_equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            nested_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            nested_equal(x, y, f"{where}/{i}")


# -- one spawn per world size for every collected file's checks -----------------------------------

_CHECKS: dict[str, Callable] = {}
_RESULTS: dict[int, list[dict]] = {}


def in_shared_spawn(fn):
    """Register fn(rank, world, path) -> a per-rank result (module level, so the ranks import it)."""
    _CHECKS[f"{fn.__module__}:{fn.__qualname__}"] = fn
    return fn


def shared_results(fn, world, tmp_path_factory) -> list:
    """fn's result on each rank of the shared spawn of `world` processes (run once per session)."""
    if world not in _RESULTS:
        path = tmp_path_factory.mktemp(f"compressed-w{world}")
        _RESULTS[world] = run_dist(_run_checks, world, sorted(_CHECKS), str(path), timeout=600)
    return [r[f"{fn.__module__}:{fn.__qualname__}"] for r in _RESULTS[world]]


def _run_checks(rank, world, names, path):
    out = {}
    for name in names:
        module, _, qualname = name.partition(":")
        out[name] = getattr(importlib.import_module(module), qualname)(rank, world, path)
    return out
