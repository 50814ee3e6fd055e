"""What the local-SGD family's tests (DiLoCo, Streaming DiLoCo, SparseLoCo) share: a tiny GPT,
deterministic batches, runs built through the driver, and the plan's bytes.

Spawning processes is the expensive part, so each test file lists its multi-process
scenarios in `LOCAL_SGD_RUNS` ({name: (fn(rank, world) -> result, world sizes)}) and the
`local_sgd_runs` fixture (conftest.py) runs every listed scenario of the collected files in
one process group per world size; `run_scenarios` is what each rank runs.
"""
from __future__ import annotations

import copy

import torch

import lowcomm
from lowcomm.models.layout import layout_of
from lowcomm.run.driver import make_run
from lowcomm.strategies import get

from dist_utils import flat_params

SEQ, MICRO, ACCUM = 16, 2, 2
EXACT = dict(sync_every=1, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False)


def make_model() -> torch.nn.Module:
    return lowcomm.GPT(vocab_size=256, seq_len=SEQ, n_layer=3, n_head=2, d_model=16)


def batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(100_000 * step + 100 * rank + micro)
    seq = torch.randint(0, 256, (MICRO, SEQ + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def reference_workers(world: int):
    """A transcription's start: (θ_0's model, `world` workers built from it, an AdamW each), every
    worker from the seed the runs build theirs with."""
    torch.manual_seed(1234)
    first = make_model()
    workers = [copy.deepcopy(first) for _ in range(world)]
    return first, workers, [adamw(m.parameters()) for m in workers]


def inner_step(workers, inner, t: int) -> None:
    """Trainer step t (from 1) in a transcription: one inner step of every worker on its own batches."""
    for r, (m, opt) in enumerate(zip(workers, inner)):
        for micro in range(ACCUM):
            (lowcomm.lm_loss(m, batch(t - 1, r, micro)) / ACCUM).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def outer_sgd(param, lr: float, momentum: float, nesterov: bool):
    """(step(grad), the parameter): DiLoCo's outer SGD on one flat parameter."""
    opt = torch.optim.SGD([param], lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)

    def step(grad):
        param.grad = grad
        opt.step()
        param.grad = None
    return step


def build(name, make_optimizer, total_steps=None, **options):
    """(model, run) of strategy `name` on the tiny GPT, every rank from the same seed."""
    torch.manual_seed(1234)
    model = make_model()
    return model, make_run(name, model, lowcomm.Comm(), make_optimizer, accum=ACCUM, total_steps=total_steps,
                           **options)


def train(run, rank, steps):
    for _ in range(steps):
        step, micro = run.steps_done, iter(range(1000))
        run.step(lambda: batch(step, rank, next(micro)), lowcomm.lm_loss)


def diloco_h4(rank, world):
    """The reference several files compare with: diloco, AdamW inside, H=4, default outer
    step, a run of 10 steps that ends mid-period."""
    model, run = build("diloco", adamw, total_steps=10, sync_every=4)
    train(run, rank, 10)
    run.close()
    return flat_params(model)


def count_bytes(rank, name, cases) -> list[int]:
    """The bytes Comm counts in each (options, steps) run of strategy `name`."""
    counted = []
    for options, steps in cases:
        _, run = build(name, adamw, total_steps=steps, **options)
        train(run, rank, steps)
        counted.append(run.comm.snapshot().wire_bytes)
        run.close()
    return counted


def check_counted_bytes(ranks, name, cases, counted_key) -> None:
    """Every rank counted, in each case, what strategy `name`'s plan says it sends."""
    world = len(ranks)
    for k, (options, steps) in enumerate(cases):
        want = plan_bytes(name, world, steps, options)
        assert want > 0
        for r in range(world):
            got = ranks[r][counted_key][k]
            assert got == want, f"{name} {options} {steps} steps, W={world} rank {r}: counted {got}, plan {want}"


def plan_bytes(name: str, world: int, steps: int, options: dict) -> int:
    """What strategy `name`'s plan says one rank sends in a run of `steps` steps."""
    cls = get(name)
    opts = cls.Options(**options).validate(name)
    return sum(op.wire_bytes(world) * cls.cost.plan_occurrences(op, steps, opts)
               for op in cls.comm_plan(layout_of(make_model()), world, opts))


def run_scenarios(rank, world, scenarios):
    """Each rank runs every scenario in the same order: {name: its result}."""
    return {name: fn(rank, world) for name, fn in scenarios}
