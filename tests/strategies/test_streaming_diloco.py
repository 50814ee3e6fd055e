"""Streaming DiLoCo: DiLoCo as its special case, bytes = plan, fragments strided over the
model's blocks, resuming and replacing the group with a fragment's sync in flight,
convergence (slow)."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import lowcomm
from lowcomm.models.layout import layout_of
from lowcomm.strategies.streaming_diloco import StreamingDiLoCo

from dist_utils import flat_params, rel_err
from local_sgd import adamw, build, check_counted_bytes, count_bytes, diloco_h4, train

BYTE_CASES = [  # (options, steps): run lengths not multiples of H, every precision
    (dict(sync_every=6, fragments=3, fragment_delay=2), 13),
    (dict(sync_every=4, fragments=2, fragment_delay=1, outer_precision="int4"), 11),
    (dict(sync_every=4, fragments=4, fragment_delay=0, outer_precision="int8", sync_by="time"), 7),
    (dict(sync_every=4, fragments=3, outer_precision="bf16", sync_by="time"), 6),
    (dict(sync_every=4, fragments=2, fragment_delay=1, outer_compress="topk:8,chunk:64,bits:4",
          sync_by="time"), 7),
]
IN_FLIGHT = dict(sync_every=4, fragments=2, fragment_delay=2, outer_precision="int8")


def _as_diloco(rank, world):
    """F=1, τ=0, α=0 with DiLoCo's run of local_sgd.diloco_h4."""
    model, run = build("streaming_diloco", adamw, total_steps=10, sync_every=4, fragments=1, fragment_delay=0,
                       merge_alpha=0.0)
    train(run, rank, 10)
    run.close()
    return flat_params(model)


def _in_flight(rank, world):
    """9 steps straight; the same resumed from the state after step 5 (fragment 0 synced at step
    4, merges at step 6); the same with the group replaced (use_comm) after step 5."""
    m1, s1 = build("streaming_diloco", adamw, total_steps=9, **IN_FLIGHT)
    train(s1, rank, 5)
    in_flight = bool(s1.strategy.sync.in_flight)
    state = copy.deepcopy(s1.state_dict())  # optimizer state_dicts hold live tensors
    m2, s2 = build("streaming_diloco", adamw, total_steps=9, **IN_FLIGHT)
    s2.load_state_dict(state)
    m3, s3 = build("streaming_diloco", adamw, total_steps=9, **IN_FLIGHT)
    train(s3, rank, 5)
    replaced_in_flight = bool(s3.strategy.sync.in_flight)
    s3.use_comm(lowcomm.Comm())
    for run in (s1, s2, s3):
        train(run, rank, 4)
    out = {"in_flight": (in_flight, replaced_in_flight), "params": [flat_params(m) for m in (m1, m2, m3)],
           "globals": [run.strategy.sync.globals[0].detach().clone() for run in (s1, s2, s3)]}
    for run in (s1, s2, s3):
        run.close()
    return out


def _bytes(rank, world):
    return count_bytes(rank, "streaming_diloco", BYTE_CASES)


LOCAL_SGD_RUNS = {"diloco_h4": (diloco_h4, (2,)), "streaming_as_diloco": (_as_diloco, (2,)),
                  "streaming_in_flight": (_in_flight, (2,)), "streaming_bytes": (_bytes, (2, 3))}


@pytest.mark.procs
def test_one_fragment_without_delay_or_mixing_equals_diloco(local_sgd_runs):
    for r in local_sgd_runs(2):
        err = rel_err(r["streaming_as_diloco"], r["diloco_h4"])
        assert err <= 1e-6, f"streaming F=1 vs diloco: {err:.2e}"


@pytest.mark.procs
@pytest.mark.parametrize("world", [2, 3])
def test_counted_bytes_equal_plan(local_sgd_runs, world):
    check_counted_bytes(local_sgd_runs(world), "streaming_diloco", BYTE_CASES, "streaming_bytes")


@pytest.mark.procs
def test_resumes_bit_identically_with_a_sync_in_flight(local_sgd_runs):
    for r in local_sgd_runs(2):
        got = r["streaming_in_flight"]
        assert got["in_flight"][0]
        assert torch.equal(got["params"][0], got["params"][1]) and torch.equal(got["globals"][0], got["globals"][1])


@pytest.mark.procs
def test_a_group_replaced_with_a_sync_in_flight_continues_bit_identically(local_sgd_runs):
    """use_comm lands what is in flight on the old group; the next syncs use the new one."""
    for r in local_sgd_runs(2):
        got = r["streaming_in_flight"]
        assert got["in_flight"][1]
        assert torch.equal(got["params"][0], got["params"][2]) and torch.equal(got["globals"][0], got["globals"][2])


def test_gpt_fragments_are_strided_over_blocks():
    model = lowcomm.GPT(256, 16, n_layer=6, n_head=2, d_model=16)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    sizes = layout_of(model).fragment_numels(3)
    assert sizes[1] == sizes[2] == 2 * block                 # blocks 1,4 and 2,5
    assert sizes[0] == model.num_params() - 4 * block        # blocks 0,3 + embeddings + final norm
    plain = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    assert layout_of(plain).fragment_numels(2) == [144, 144]    # contiguous, nearly equal
    # the plan prices the fragments the strategy syncs
    opts = StreamingDiLoCo.Options(fragments=3).validate("streaming_diloco")
    plan = StreamingDiLoCo.comm_plan(layout_of(model), 2, opts)
    assert [op.nbytes for op in plan] == [4 * n for n in sizes]


# The shared corpus recipe of tests/conftest.py (W=2, a 2-layer width-64 GPT, 300 steps, lr 1e-3),
# F=4, τ=2 at int4. Measured, seeds 0 / 1: 2.597 / 2.642 (ddp: 2.629 / 2.618). 3.3 is about the
# unigram byte model's 3.28: passing needs the model to use context.
CONVERGE_THRESHOLD = 3.3


@pytest.mark.slow
def test_converges_on_the_corpus_at_int4(corpus_run):
    s, _ = corpus_run("streaming_diloco", "--outer-precision", "int4", eval_every=0)
    assert s["final_val_loss"] < CONVERGE_THRESHOLD, (
        f"streaming_diloco --outer-precision int4: validation loss {s['final_val_loss']:.3f} "
        f"(ln 256 = {math.log(256):.3f})")


def test_fragments_beyond_the_blocks_are_said_in_one_warning(capsys):
    """With fewer transformer blocks than fragments some fragments hold nothing and never sync:
    the run goes on (the paper's schedule kept) and says so in one line."""
    from lowcomm.models.layout import layout_of
    from lowcomm.strategies import get
    opts = get("streaming_diloco").Options(fragments=4).validate("streaming_diloco")
    opts.check_model(layout_of(lowcomm.GPT(256, 16, n_layer=4, n_head=2, d_model=16)))
    assert capsys.readouterr().err == ""
    opts.check_model(layout_of(lowcomm.GPT(256, 16, n_layer=2, n_head=2, d_model=16)))
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: --fragments 4: 2 of them hold no parameter of this model (fewer transformer "
                   "blocks than fragments) and never sync"]
