"""SparseLoCo: the paper's defaults on DiLoCo's code, bytes = plan, resuming with its
error-feedback residuals, learning on a sliver of ddp's bytes (slow)."""
from __future__ import annotations

import copy

import pytest
import torch

from lowcomm.models.layout import ModelLayout
from lowcomm.strategies import get

from dist_utils import flat_params
from local_sgd import adamw, build, check_counted_bytes, count_bytes, train

BYTE_CASES = [(dict(sync_every=3), 5)]  # (options, steps)


def _resume(rank, world):
    """Saved after step 3 (a sync at step 2): the residuals then, after 8 steps straight, and
    after 8 steps resumed; whether the parameters agree."""
    m1, s1 = build("sparseloco", adamw, total_steps=8, sync_every=2)
    train(s1, rank, 3)
    state = copy.deepcopy(s1.state_dict())
    m2, s2 = build("sparseloco", adamw, total_steps=8, sync_every=2)
    s2.load_state_dict(state)
    train(s1, rank, 5), train(s2, rank, 5)
    out = (state["parts"]["outer_residuals"], s1.state_dict()["parts"]["outer_residuals"],
           s2.state_dict()["parts"]["outer_residuals"], torch.equal(flat_params(m1), flat_params(m2)))
    s1.close(), s2.close()
    return out


def _bytes(rank, world):
    return count_bytes(rank, "sparseloco", BYTE_CASES)


LOCAL_SGD_RUNS = {"sparseloco_resume": (_resume, (2,)), "sparseloco_bytes": (_bytes, (2, 3))}


def test_the_papers_defaults_on_diloco():
    o = get("sparseloco").Options().validate("sparseloco")
    assert (o.sync_every, o.outer_lr, o.outer_momentum, o.outer_ef_decay) == (15, 1.0, 0.0, 0.95)
    c = o.wire().compressor()
    assert (c.chunk, c.k, c.values.bits, c.values.scheme) == (4096, 64, 2, "stat")
    # per 4096 values: 64 int16 indices, 64 2-bit codes; one mean + 4-entry table per fragment
    assert c.nbytes(3 * 4096) == 3 * (64 * 2 + 16) + 5 * 4
    plan = get("sparseloco").comm_plan(ModelLayout(((3 * 4096,),)), 4, o)
    assert [(op.collective, op.nbytes, op.every) for op in plan] == [("all_gather", 4 * (3 * 144 + 20 + 16), 15)]


@pytest.mark.procs
@pytest.mark.parametrize("world", [2, 3])
def test_counted_bytes_equal_plan(local_sgd_runs, world):
    check_counted_bytes(local_sgd_runs(world), "sparseloco", BYTE_CASES, "sparseloco_bytes")


@pytest.mark.procs
def test_resumes_with_its_residuals(local_sgd_runs):
    for r in local_sgd_runs(2):
        saved, straight, resumed, same_params = r["sparseloco_resume"]
        assert set(saved) == {"fragment0"} and float(saved["fragment0"].abs().max()) > 0
        assert torch.equal(straight["fragment0"], resumed["fragment0"])
        assert same_params


@pytest.mark.slow
def test_learns_on_a_sliver_of_ddps_bytes(corpus_run):
    """Measured (the shared recipe, 300 steps, lr 1e-3), seed 0: sparseloco 2.784 against ddp's
    2.629, 1188x fewer bytes (each tensor compressed alone; 2.913 at 1645x when chunks and
    statistics spanned the whole flattened outer gradient). The bench target is >= 500x fewer
    bytes within 5 % of ddp's loss at W=4 (bench/compress.py, 300 steps: 594x at -0.3 % with
    lr 2e-3, +4.3 % with lr 1e-3); here the check is that it
    learns (below the unigram level, 3.3) on >= 500x fewer bytes."""
    ddp, _ = corpus_run("ddp")
    s, _ = corpus_run("sparseloco")
    ratio = ddp["wire_bytes_total"] / s["wire_bytes_total"]
    figures = f"sparseloco {s['final_val_loss']:.3f} vs ddp {ddp['final_val_loss']:.3f}; {ratio:.0f}x fewer bytes"
    print(figures)
    assert s["final_val_loss"] < 3.3, figures
    assert ratio >= 500, figures


@pytest.mark.slow
def test_its_summary_says_how_far_an_outer_step_moved_the_model(corpus_run):
    """Validation is of the global model right after an outer step, the train loss of the
    workers' own: summary.json keeps the train loss across the outer step that raised it most
    and across the last one, as the step records show them (an outer step: a step that sent)."""
    s, records = corpus_run("sparseloco")
    across = [(a["step"], a["loss"], b["loss"]) for a, b in zip(records, records[1:]) if a["wire_bytes"] > 0]
    step, before, after = max(across, key=lambda x: x[2] - x[1])
    assert s["rise_after_outer_step"] == {"step": step, "loss_before": before, "loss_after": after}
    assert s["last_after_outer_step"]["step"] == across[-1][0] == s["steps"] - s["sync_every"]
    assert after > before  # at the paper's defaults the first outer steps raise the loss (docs/strategies.md)
