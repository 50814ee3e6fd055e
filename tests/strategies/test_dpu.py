"""DPU against a single-process transcription of its recurrence (W=2, gloo):
    θ_{t+1} = opt(θ_t; g(θ_{t-1})) after `warmup` synchronous steps."""
from __future__ import annotations

import pytest
import torch
from dist_utils import rel_err, run_dist

import lowcomm
from lowcomm.models import lm_loss
from overlap_reference import ACCUM, W, Counter, RefOpt, flat, grad_sum, make_model, make_optimizer, micro_batch

pytestmark = pytest.mark.procs


# -- DPU -----------------------------------------------------------------------

def _dpu_worker(rank, world, steps, warmup):
    model = make_model()
    strat = lowcomm.make_run("dpu", model, lowcomm.Comm(), make_optimizer, accum=ACCUM,
                                  warmup_steps=warmup)
    next_batch = Counter(rank)
    for _ in range(steps):
        strat.step(next_batch, lm_loss)
    return flat(model).cpu()


def dpu_reference(steps: int, warmup: int) -> torch.Tensor:
    model = make_model()
    theta = flat(model)
    ref = RefOpt(theta)
    pending = None
    for t in range(steps):
        batches = [micro_batch(r, t * ACCUM + i) for r in range(W) for i in range(ACCUM)]
        g = grad_sum(model, theta, batches) / (W * ACCUM)   # g(θ_t)
        if t < warmup:
            theta = ref.step(g)
        else:
            if pending is not None:
                theta = ref.step(pending)                    # θ_{t+1} = opt(θ_t; g(θ_{t-1}))
            pending = g
    return theta.cpu()


@pytest.mark.parametrize("warmup", [0, 3])
def test_dpu_matches_its_one_step_delayed_reference(warmup):
    steps = 12
    out = run_dist(_dpu_worker, W, steps, warmup)
    expected = dpu_reference(steps, warmup)
    for rank in range(W):
        err = rel_err(out[rank], expected)
        assert err <= 1e-5, f"rank {rank}: DPU differs from its reference by {err:.2e}"
    # ...and the delay matters: a synchronous run of the same steps ends elsewhere.
    assert rel_err(expected, dpu_reference(steps, steps)) > 1e-4
