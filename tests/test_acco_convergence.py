"""ACCO converges like ZeRO-1 at equal tokens on the bundled corpus (W=2, the
shared corpus recipe of tests/conftest.py: a 2-layer width-64 GPT).

ACCO's optimizer step uses the micro-batches of two rounds (estimate + real), so
at equal tokens its peer is ZeRO-1 with twice the accumulation: the same batch
per update, the same number of updates, the same lr curve over tokens. Measured
(300 rounds, micro-batch 8, seq 64, lr 1e-3; 307,200 tokens), seeds 0 / 1: zero1
(accum 2) 2.837 / 2.833, acco 2.838 / 2.852, dpu (accum 1, 290 delayed updates)
2.803 / 2.795. With --slowdown 1,3 the fast rank computes 3x the micro-batches of
the slow one.
"""
from __future__ import annotations

import pytest

ROUNDS, WARMUP = 300, 10


@pytest.mark.slow
def test_acco_is_no_worse_than_zero1_at_equal_tokens(corpus_run):
    """The claim is that ACCO's delayed, compensated update does not cost
    convergence: one-sided, ACCO within 2% above ZeRO-1 (or below it)."""
    zero1, _ = corpus_run("zero1", "--accum", "2", "--warmup", str(WARMUP // 2), steps=ROUNDS // 2, eval_every=0)
    acco, _ = corpus_run("acco", "--accum", "1", "--deterministic", "--warmup", str(WARMUP),
                         steps=ROUNDS, eval_every=0)
    dpu, _ = corpus_run("dpu", "--accum", "1", "--dpu-warmup", "10", "--warmup", str(WARMUP),
                        steps=ROUNDS, eval_every=0)
    losses = (f"val loss at {zero1['tokens']:,} tokens: zero1 {zero1['final_val_loss']:.4f}  "
              f"acco {acco['final_val_loss']:.4f}  dpu {dpu['final_val_loss']:.4f}")
    print("\n" + losses)
    start_up = 2 * 8 * 64  # ACCO's one extra micro-batch per rank at θ_0
    assert acco["tokens"] == zero1["tokens"] + start_up and dpu["tokens"] == zero1["tokens"]
    assert acco["optimizer_steps"] == ROUNDS // 2
    assert zero1["final_val_loss"] < 3.5, losses  # well below ln(256) = 5.55: it learned
    assert acco["final_val_loss"] <= 1.02 * zero1["final_val_loss"], losses
    assert dpu["final_val_loss"] <= 1.05 * zero1["final_val_loss"], losses


@pytest.mark.slow
def test_acco_with_a_three_times_slower_worker_still_converges(corpus_run):
    """--slowdown 1,3: the fast rank keeps accumulating while each round waits for
    the slow one, so it computes about 3x the micro-batches, and the run still
    learns. That each micro-batch weighs 1/N of the true total is checked exactly
    in test_acco.py against the recurrence."""
    # 60 rounds at lr 3e-3 (1e-3 is too slow to learn in 60): only "it learned" is checked,
    # and the unigram plateau (~3.3-3.4) lies below 4.0 whichever seed (measured 3.711).
    run, _ = corpus_run("acco", "--accum", "1", "--slowdown", "1,3", "--lr", "3e-3", steps=60, eval_every=0)
    fast, slow = run["micro_batches_per_rank"]
    assert 2.3 <= fast / slow <= 3.8, f"fast/slow micro-batches {fast}/{slow}"
    assert run["tokens"] == (fast + slow) * 8 * 64
    assert run["final_val_loss"] < 4.0, run["final_val_loss"]
