"""The local-SGD family's token-weighted outer merge (--outer-weights tokens, Decoupled DiLoCo):
θ_global after a sync is Σ_r (t_r / Σ t) θ_r for workers that trained unequal tokens, a worker
whose inner steps were all skipped counts for nothing, too few contributors (the quorum) leave
θ_global as it was, and equal tokens give bit for bit the equal-weight run."""
from __future__ import annotations

import math

import pytest
import torch

import lowcomm

from dist_utils import flat_params, rel_err
from local_sgd import EXACT, SEQ, adamw, batch, build, diloco_h4, sgd, train

pytestmark = pytest.mark.procs

CASES = {  # name -> (min contributors, sequence length of rank r, does rank r's loss go NaN)
    "unequal": (1, lambda r: SEQ - 4 * r, lambda r: False),
    "quorum_met": (2, lambda r: SEQ, lambda r: r == 2),
    "quorum_missed": (3, lambda r: SEQ, lambda r: r == 2),
}


def _nan_loss(logits, targets):
    return lowcomm.lm_loss(logits, targets) * math.nan


def _token_weighted(rank, world):
    """Each case: (θ0, this rank's θ_r before the final sync, θ after it, the sync's contribution)."""
    out = {}
    for name, (quorum, seq_of, nan_on) in CASES.items():
        model, run = build("diloco", sgd, outer_weights="tokens", **{**EXACT, "sync_every": 100})
        run.strategy.min_contributors = quorum
        start, seq = flat_params(model), seq_of(rank)
        for _ in range(2):
            step, micro = run.steps_done, iter(range(1000))
            run.step(lambda: tuple(t[:, :seq] for t in batch(step, rank, next(micro))),
                     _nan_loss if nan_on(rank) else lowcomm.lm_loss)
        local = flat_params(model)
        run.close()  # the final sync: θ_global ← θ_global − Σ w_r Δ_r (outer lr 1, no momentum)
        out[name] = (start, local, flat_params(model), run.strategy.elastic.contribution(run.strategy))
    return out


def _equal_tokens(rank, world):
    """diloco_h4's run with token weights: every rank trains the same tokens."""
    model, run = build("diloco", adamw, total_steps=10, sync_every=4, outer_weights="tokens")
    train(run, rank, 10)
    run.close()
    return flat_params(model)


LOCAL_SGD_RUNS = {"token_weighted": (_token_weighted, (3,)), "token_equal": (_equal_tokens, (2,)),
                  "diloco_h4": (diloco_h4, (2,))}


def test_outer_merge_weights_each_worker_by_the_tokens_it_trained(local_sgd_runs):
    ranks = [r["token_weighted"]["unequal"] for r in local_sgd_runs(3)]
    info = ranks[0][3]
    per = [2 * 2 * 2 * (SEQ - 4 * r) for r in range(3)]  # steps x accum x micro-batch x its sequence length
    assert info == {"contributors": 3, "tokens": sum(per), "tokens_per_member": per}
    want = sum(t / sum(per) * local.double() for t, (_, local, _, _) in zip(per, ranks))
    for _, _, final, _ in ranks:
        assert rel_err(final.double(), want) <= 1e-6, rel_err(final.double(), want)
    equal = sum(local.double() for _, local, _, _ in ranks) / 3  # what equal weights would give: far off
    assert rel_err(equal, want) > 1e-3


def test_a_worker_that_trained_nothing_counts_for_nothing_and_the_quorum_holds(local_sgd_runs):
    met = [r["token_weighted"]["quorum_met"] for r in local_sgd_runs(3)]
    assert met[0][3]["contributors"] == 2 and met[0][3]["tokens_per_member"][2] == 0
    assert torch.equal(met[2][1], met[2][0])  # its inner steps were all skipped
    want = (met[0][1].double() + met[1][1].double()) / 2
    assert all(rel_err(final.double(), want) <= 1e-6 for _, _, final, _ in met)
    for start, _, final, info in (r["token_weighted"]["quorum_missed"] for r in local_sgd_runs(3)):
        assert info["contributors"] == 2  # below the quorum of 3: no outer step, all back on θ_global = θ0
        assert torch.equal(final, start)


def test_equal_tokens_give_the_equal_weight_merge_bit_for_bit(local_sgd_runs):
    for r in local_sgd_runs(2):
        assert torch.equal(r["token_equal"], r["diloco_h4"])
