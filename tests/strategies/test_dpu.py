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


# -- convergence on the bundled corpus (slow) ---------------------------------------------

# DPU's peer at equal tokens is ddp itself: the same batch per update and the same number of
# updates, one step late. The corpus recipe (tests/conftest.py) is the smallest that shows the
# unigram plateau (3.28 nats) and ddp's way off it (2.63); the dpu run is the one test_acco.py
# compares with zero1, so this check costs no run of its own. The delay, not the engine, is what
# costs DPU here: --dpu-warmup covering every step gives ddp's losses to the last digit (checked
# to step 100, the tiny model at lr 3e-3), and with --dpu-warmup 120 a run equal to ddp until
# then climbs from 3.08 to 3.44 within 9 delayed steps (ddp: 3.08 to 3.18). With Adam's β1 = 0.9 a one-step-late gradient shrinks the step
# a stiff direction tolerates about 38-fold (linearised, c = η·h·(1−β1)/√v: stable for
# c < 2(1+β1) = 3.8 on time, for c < 1−β1 = 0.1 a step late), so at ddp's learning rates DPU
# oscillates more; the bound holds that cost to what was measured (2.803 against 2.629, seed 0;
# 2.795 against 2.618, seed 1).

@pytest.mark.slow
def test_dpu_is_within_8_percent_of_ddp_at_equal_tokens_past_the_plateau(corpus_run):
    ddp, _ = corpus_run("ddp")
    dpu, _ = corpus_run("dpu", "--accum", "1", "--dpu-warmup", "10", "--warmup", "10", steps=300, eval_every=0)
    losses = f"val loss at {ddp['tokens']:,} tokens: ddp {ddp['final_val_loss']:.4f}  dpu {dpu['final_val_loss']:.4f}"
    print("\n" + losses)
    # equal tokens, and one update fewer: the first delayed step only computes its gradient
    assert dpu["tokens"] == ddp["tokens"] and dpu["optimizer_steps"] == ddp["steps"] - 1
    assert ddp["final_val_loss"] < 3.0, losses
    assert dpu["final_val_loss"] < 3.0, losses  # off the plateau too
    assert dpu["final_val_loss"] <= 1.08 * ddp["final_val_loss"], losses
