"""Each aggregator of the outer step against its formula written out by hand on small inputs,
and what one scale:100 attacker does to each."""
from __future__ import annotations

import pytest
import torch

from lowcomm.errors import UsageError
from lowcomm.robust import parse_aggregator
from lowcomm.robust.aggregators import centered_clip, median_norm_clip


def agg(spec, x, sizes=None, support=None):
    return parse_aggregator(spec)(torch.tensor(x, dtype=torch.float32), sizes,
                                  None if support is None else torch.tensor(support, dtype=torch.float32))


def test_median_of_an_odd_and_an_even_count():
    assert agg("median", [[1, 5], [3, 2], [2, 9]]).tolist() == [2, 5]
    assert agg("median", [[1], [4], [2], [10]]).tolist() == [3]  # the mean of the middle two, 2 and 4
    assert agg("median", [[1, -3], [7, 5]]).tolist() == [4, 1]   # W = 2: the mean


def test_trimmed_drops_beta_w_on_each_side():
    assert agg("trimmed:0.25", [[1], [100], [3], [-50]]).tolist() == [2]  # W=4: one each side, mean of 1, 3
    col = [[v] for v in (8, -7, 1, 2, 3, 4, 90, -40)]                      # W=8: two each side
    assert agg("trimmed:0.25", col).tolist() == [(1 + 2 + 3 + 4) / 4]
    assert agg("trimmed:0.3", col).tolist() == [(1 + 2 + 3 + 4) / 4]       # ⌊0.3·8⌋ = 2 too


def test_a_coordinate_only_some_sent_is_aggregated_over_its_senders():
    x = [[2, 6, 0], [4, 0, 0], [9, 0, 0]]
    sent = [[1, 1, 0], [1, 0, 0], [1, 0, 0]]
    assert agg("mean", x, support=sent).tolist() == [5, 6, 0]
    assert agg("median", x, support=sent).tolist() == [4, 6, 0]


def test_centered_clip_reaches_its_fixed_point():
    torch.manual_seed(0)
    x = torch.cat([torch.randn(5, 4) * 0.1, torch.full((1, 4), 50.0)])
    tau = 0.3
    v = centered_clip(x, tau, iters=200)
    diff = x - v
    clipped = diff * (tau / diff.norm(dim=1)).clamp(max=1).unsqueeze(1)
    assert clipped.sum(dim=0).abs().max() < 1e-5          # Σ_r clip_τ(x_r − v) = 0
    assert (v - x[:5].mean(dim=0)).norm() < 0.5          # the outlier moved it by at most τ/W-ish steps
    # one iteration from 0 with a radius nothing reaches: the mean
    assert torch.allclose(centered_clip(x, 1e9, iters=1, start=torch.zeros(4)), x.mean(dim=0))


def test_median_norm_clip_clips_each_tensor_to_its_median_norm():
    x = torch.tensor([[3.0, 4.0, 1.0], [0.6, 0.8, 2.0], [30.0, 40.0, 3.0]])  # tensor A: 2 values, B: 1
    out = median_norm_clip(x, sizes=[2, 1])
    # A's norms 5, 1, 50: median 5, so the third row is scaled by 5/50; B's 1, 2, 3: median 2
    want_a = (x[0, :2] + x[1, :2] + x[2, :2] * 5 / 50) / 3
    want_b = (1.0 + 2.0 + 3.0 * 2 / 3) / 3
    assert torch.allclose(out, torch.cat([want_a, torch.tensor([want_b])]), atol=1e-6)
    # an even count takes the lower middle norm, as Covenant's torch.median does: norms 1, 2, 3, 4 -> 2
    even = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    assert torch.allclose(median_norm_clip(even), torch.tensor([(1 + 2 + 2 + 2) / 4]), atol=1e-6)


@pytest.mark.parametrize("spec", ["median", "trimmed:0.25", "centered-clip:0.5", "median-norm-clip"])
def test_a_robust_aggregator_bounds_one_scale_100_attacker_where_mean_does_not(spec):
    g = torch.Generator().manual_seed(3)
    truth = torch.randn(64, generator=g)
    honest = truth + 0.1 * torch.randn(3, 64, generator=g)
    x = torch.cat([honest, 100 * honest[:1]])               # W = 4, rank 3 sends 100·Δ
    mean_err = (parse_aggregator("mean")(x) - honest.mean(dim=0)).norm() / truth.norm()
    err = (parse_aggregator(spec)(x) - honest.mean(dim=0)).norm() / truth.norm()
    assert mean_err > 20  # the mean follows the attacker: 25 times the update
    assert err < 0.6, f"{spec}: {err:.3f} of the update's norm away from the honest mean"


@pytest.mark.parametrize("spec, says", [("trim:1", "'trim:1' is not one of"), ("trimmed:0.5", "got '0.5'"),
                                        ("trimmed:x", "got 'x'"), ("centered-clip:-1", "got '-1'"),
                                        ("median:2", "'median:2' is not one of")])
def test_a_bad_aggregator_is_named(spec, says):
    with pytest.raises(UsageError, match=says):
        parse_aggregator(spec)


def test_a_trimmed_mean_that_trims_nobody_is_refused():
    with pytest.raises(UsageError, match=r"trims ⌊0.2·4⌋ = 0 of 4 workers"):
        parse_aggregator("trimmed:0.2").check_world(4)
    parse_aggregator("trimmed:0.25").check_world(4)
