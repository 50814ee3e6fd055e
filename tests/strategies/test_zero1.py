"""ZeRO-1 against one process on the global batch and against torch's own
DistributedDataParallel + ZeroRedundancyOptimizer; its flat views and 1/W optimizer state."""
from __future__ import annotations

import pytest
import torch

from dist_utils import rel_err
from exact_reference import TOL, W, check_gpt_matches_single_process, check_gradient_scale_under_sgd, \
    check_non_gpt_module_with_custom_loss

pytestmark = pytest.mark.procs


def test_gpt_trains_as_one_process_on_the_global_batch(gpt_runs):
    check_gpt_matches_single_process("zero1", gpt_runs)


def test_any_module_with_a_custom_loss_trains_as_one_process(mlp_runs):
    check_non_gpt_module_with_custom_loss("zero1", mlp_runs)


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_gradients_are_averaged_not_summed(kind, gpt_runs, mlp_runs):
    check_gradient_scale_under_sgd("zero1", kind, gpt_runs, mlp_runs)


def test_zero1_matches_torch_zero_redundancy_optimizer(gpt_runs):
    runs, _ = gpt_runs
    ours = runs[0]["zero1"]["params"]
    peer = runs[0]["torch_zero"]["params"]
    assert torch.equal(peer, runs[1]["torch_zero"]["params"])
    err = rel_err(ours, peer)
    assert err <= TOL, f"zero1 vs ZeroRedundancyOptimizer+DDP: relative error {err:.3e} > {TOL}"


def test_zero1_keeps_flat_views_and_shards_optimizer_state(mlp_runs):
    runs, _ = mlp_runs
    P = 133
    shard = -(-P // W)
    for r in range(W):
        v = runs[r]["zero1"]["views"]
        assert v["params_view"], "a parameter no longer views the flat parameter buffer"
        assert v["grads_view"], "a .grad no longer views the flat gradient buffer"
        assert v["values_match"]
        assert (v["numel"], v["padded"], v["shard"]) == (P, shard * W, shard)
        z, d = runs[r]["zero1"]["opt_bytes"], runs[r]["ddp"]["opt_bytes"]
        # AdamW keeps exp_avg and exp_avg_sq (fp32) per element, plus a small step counter per tensor
        assert 2 * P * 4 <= d <= 2 * P * 4 + 8 * 5   # 5 parameter tensors
        assert 2 * shard * 4 <= z <= 2 * shard * 4 + 8
        assert z * W / d == pytest.approx(1.0, rel=0.1)
