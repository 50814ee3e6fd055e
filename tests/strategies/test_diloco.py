"""DiLoCo: exact reductions, bytes = plan, local inner state, the outer gradient's wire formats
and error feedback, the final sync, --sync-by time with a slow worker, convergence (slow)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from lowcomm.cli.main import main
from lowcomm.engines.outer_wire import OUTER_BLOCK, outer_quantizer

from dist_utils import flat_params, rel_err
from local_sgd import EXACT, adamw, build, check_counted_bytes, count_bytes, diloco_h4, make_model, sgd, train

LOSSLESS = "topk:64,chunk:64,bits:32"  # k = chunk at 32 bits: every value sent as is
BYTE_CASES = [  # (options, steps): run lengths not multiples of H, every precision
    (dict(sync_every=3), 7),
    (dict(sync_every=4, outer_precision="bf16"), 9),
    (dict(sync_every=3, outer_precision="int8"), 8),
    (dict(sync_every=2, outer_precision="int4", sync_by="time"), 5),
    (dict(sync_every=3, outer_compress="topk:0.02,bits:2"), 7),
    (dict(sync_every=3, outer_weights="tokens"), 7),
    (dict(sync_every=3, outer_precision="int8", outer_weights="tokens"), 7),
]


def _h1_and_ddp(rank, world):
    """diloco (inner SGD, H=1, outer lr 1, no momentum) and ddp with the same SGD."""
    m_ddp, ddp = build("ddp", sgd)
    train(ddp, rank, 10)
    m_dl, dl = build("diloco", sgd, total_steps=10, **EXACT)
    train(dl, rank, 10)
    ddp.close(), dl.close()
    return flat_params(m_ddp), flat_params(m_dl)


def _lossless(rank, world):
    """--outer-compress with nothing dropped: the parameters, and the largest residual left."""
    model, run = build("diloco", adamw, total_steps=10, sync_every=4, outer_compress=LOSSLESS)
    train(run, rank, 10)
    left = float(run.strategy.sync.wire.ef.residuals["fragment0"].abs().max())
    run.close()
    return flat_params(model), left


def _error_feedback(rank, world):
    """Each compression of the outer gradient: (Δ, residual before, sent, residual after, decoded)."""
    _, run = build("diloco", adamw, total_steps=6, sync_every=2, outer_compress="topk:0.02,bits:2",
                   outer_ef_decay=0.9)
    wire, seen = run.strategy.sync.wire, []
    real = wire.ef.compress

    def recording(key, x, compressor):
        old = wire.ef.residuals.get(key, torch.zeros_like(x)).clone()
        payload, sent = real(key, x, compressor)
        seen.append((x.clone(), old, sent.clone(), wire.ef.residuals[key].clone(),
                     compressor.decompress(payload)))
        return payload, sent
    wire.ef.compress = recording
    train(run, rank, 6)
    run.close()
    return seen


def _inner_state(rank, world):
    """Around each step that syncs: did the inner AdamW state change, how many bytes went out."""
    _, run = build("diloco", adamw, total_steps=6, sync_every=3)
    s, seen = run.strategy, []
    real = s._end_of_slot

    def watched(ctx):
        before = {k: v.clone() for k, v in s.inner.state[s.params[0]].items()}
        sent, syncs = s.comm.snapshot().wire_bytes, s.sync.syncs
        real(ctx)
        if s.sync.syncs > syncs:
            after = s.inner.state[s.params[0]]
            seen.append((all(torch.equal(before[k], after[k]) for k in before), s.comm.snapshot().wire_bytes - sent))
    s._end_of_slot = watched
    train(run, rank, 6)
    state_numel = sum(v.numel() for st in s.inner.state.values() for v in st.values() if v.dim() > 0)
    run.close()
    return seen, state_numel


def _closed_mid_period(rank, world):
    """H=4, 6 steps: a run closed without knowing its length, and one told total_steps=6."""
    out = []
    for total in (None, 6):
        model, run = build("diloco", adamw, total_steps=total, sync_every=4)
        train(run, rank, 6)
        run.close()
        out.append((flat_params(model), torch.cat([g.detach() for g in run.strategy.sync.globals])))
    return out


def _bytes(rank, world):
    return count_bytes(rank, "diloco", BYTE_CASES)


LOCAL_SGD_RUNS = {"diloco_h1": (_h1_and_ddp, (2,)), "diloco_h4": (diloco_h4, (2,)),
                  "diloco_lossless": (_lossless, (2,)), "diloco_ef": (_error_feedback, (2,)),
                  "diloco_inner_state": (_inner_state, (2,)), "diloco_closed": (_closed_mid_period, (2,)),
                  "diloco_bytes": (_bytes, (2, 3))}


@pytest.mark.procs
def test_h1_with_sgd_equals_ddp(local_sgd_runs):
    ranks = local_sgd_runs(2)
    for r in ranks:
        ddp, dl = r["diloco_h1"]
        assert rel_err(dl, ddp) <= 1e-6, f"diloco H=1 vs ddp: {rel_err(dl, ddp):.2e}"
    assert torch.equal(ranks[0]["diloco_h1"][1], ranks[1]["diloco_h1"][1])


@pytest.mark.procs
@pytest.mark.parametrize("world", [2, 3])
def test_counted_bytes_equal_plan(local_sgd_runs, world):
    check_counted_bytes(local_sgd_runs(world), "diloco", BYTE_CASES, "diloco_bytes")


@pytest.mark.procs
def test_outer_compress_without_loss_equals_the_fp32_all_reduce(local_sgd_runs):
    for r in local_sgd_runs(2):
        params, left = r["diloco_lossless"]
        assert torch.equal(params, r["diloco_h4"]), "k = chunk at 32 bits differs from the fp32 all-reduce"
        assert left == 0.0


@pytest.mark.procs
def test_outer_error_feedback_keeps_what_was_not_sent(local_sgd_runs):
    for r in local_sgd_runs(2):
        assert len(r["diloco_ef"]) == 3  # H=2, 6 steps
        for x, old, sent, new, decoded in r["diloco_ef"]:
            assert torch.equal(sent, decoded)  # what is subtracted is what the peers decode
            assert torch.equal(new, (x + 0.9 * old) - sent)
            assert float(sent.abs().max()) > 0 and float(new.abs().max()) > 0
            kept, sizes = int((sent != 0).sum()), [p.numel() for p in make_model().parameters()]
            assert 0 < kept <= sum(math.ceil(n / 256) for n in sizes) * 5  # top-5 of every 256 of a tensor (0.02)
        assert float(r["diloco_ef"][0][1].abs().max()) == 0.0 and float(r["diloco_ef"][1][1].abs().max()) > 0


@pytest.mark.procs
def test_inner_state_is_local_and_survives_sync(local_sgd_runs):
    params = make_model().num_params()
    for r in local_sgd_runs(2):
        seen, state_numel = r["diloco_inner_state"]
        assert len(seen) == 2  # H=3, 6 steps
        assert all(unchanged for unchanged, _ in seen), "a sync changed the inner optimizer state"
        # one sync sends exactly the fp32 pseudo-gradient's ring all-reduce: 2(W-1)/W * 4P at W=2
        assert all(sent == 4 * params for _, sent in seen), (seen, params)
        assert state_numel == 2 * params  # AdamW's exp_avg and exp_avg_sq: 2P, not sent


@pytest.mark.procs
def test_close_mid_period_ends_on_the_global_parameters(local_sgd_runs):
    """close() without total_steps syncs once more: every rank ends on θ_global, exactly as a
    run that knew its length and synced at its last step."""
    ranks = local_sgd_runs(2)
    for r in ranks:
        (closed, closed_global), (told, told_global) = r["diloco_closed"]
        assert torch.equal(closed, closed_global) and torch.equal(told, told_global)
        assert torch.equal(closed, told)
    assert torch.equal(ranks[0]["diloco_closed"][0][0], ranks[1]["diloco_closed"][0][0])


def test_outer_quantizer_round_trip():
    """The outer gradient goes through lowcomm.compress: bytes as the plan counts them,
    error within half a quantization step."""
    torch.manual_seed(0)
    for bits in (8, 4):
        q = outer_quantizer(bits)
        for n in (1, 63, 64, 65, 1001):
            t = torch.randn(n)
            buf = q.to_bytes(q.compress(t))
            assert buf.numel() == q.nbytes(n) == -(-n * bits // 8) + 4 * -(-n // OUTER_BLOCK)
            back = q.decompress(q.from_bytes(buf, n))
            blocks = -(-n // OUTER_BLOCK)
            padded = torch.zeros(blocks * OUTER_BLOCK)
            padded[:n] = t
            step = padded.view(blocks, OUTER_BLOCK).abs().amax(1) / (2 ** (bits - 1) - 1)
            assert ((back - t).abs() <= step.repeat_interleave(OUTER_BLOCK)[:n] / 2 + 1e-6).all()


# -- --sync-by time with a 4x slower worker (through the CLI; timing, so slow-marked) ----------

# Rank 1 sleeps 3x its own measured compute after each step. On a busy machine the ranks' own compute
# differs too: a rank waking from a long sleep runs at once while the busy one waits for a core
# (2x emulated once measured 1.28x with three pytest workers). At 4x the slow rank's real cost stays
# at least twice the fast one's as long as its own compute is no less than half the other's, so every
# check below is made against the cost ratio measured in the run itself, never against the factor.
SLOWDOWN = 4


def _slow_run(tmp_path, sync_by, text, steps):
    out = tmp_path / sync_by
    rc = main(["train", "--strategy", "diloco", "--workers", "2", "--steps", str(steps), "--sync-every", "16",
               "--sync-by", sync_by, "--slowdown", f"1,{SLOWDOWN}", "--log-every", "16", "--eval-every", "0",
               "--eval-batches", "1", "--model", "tiny", "--micro-batch", "8", "--seq-len", "64",
               "--data", str(text), "--out", str(out), "--quiet"])
    assert rc == 0
    return json.loads((out / "summary.json").read_text())


def _cost_per_step(summary) -> list[float]:
    """Each rank's real seconds per inner step (its compute, the emulated slowdown's sleep included)."""
    return [c / max(n, 1) for c, n in zip(summary["compute_s_per_rank"], summary["micro_batches_per_rank"])]


@pytest.mark.slow
def test_sync_by_time_keeps_the_fast_worker_busy(tmp_path):
    """Against fixed H, with rank 1 emulated 4x slower. Measured on 2 cores, 64 slots against 32
    fixed steps: see docs/development.md. The fixed-H run needs only two periods: it is the
    baseline of the fast rank's wait, measured in the same test."""
    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession "
                    "of a good fortune, must be in want of a wife.\n" * 400)
    fixed = _slow_run(tmp_path, "steps", text, 32)
    timed = _slow_run(tmp_path, "time", text, 64)
    fast, slow = timed["micro_batches_per_rank"]
    cost, fixed_cost = _cost_per_step(timed), _cost_per_step(fixed)
    speed_ratio = cost[1] / cost[0]  # how much slower rank 1 really was per inner step, in this run
    exposed_t, exposed_f = (s["exposed_comm_fraction_per_rank"][0] for s in (timed, fixed))
    figures = (f"time: fast/slow inner steps {fast}/{slow} = {fast / slow:.2f} (real cost ratio "
               f"{speed_ratio:.2f}), fast rank exposed {exposed_t:.1%}; fixed H: cost ratio "
               f"{fixed_cost[1] / fixed_cost[0]:.2f}, fast exposed {exposed_f:.1%}")
    print(figures)
    assert fixed["micro_batches_per_rank"] == [32, 32]
    # The fast rank steps in every slot; the slow one fits as many as its measured speed allows
    # (their ratio measured 0.81 to 1.23 at loads 5 to 20: the slow rank's 7 to 20 steps make it
    # coarse, and it schedules by mean costs of a moving load; one that stepped every slot, or half
    # as often as it could, is off by a factor of 2 or more). A step either way is the count's grain:
    # beside other jobs (load 14) rank 1 measured 30.7x slower, 2.1 steps were its due, it took 3.
    assert fast == 64 and speed_ratio >= 2, figures
    due = fast / speed_ratio
    assert due / 1.5 - 1 <= slow <= due / 0.7 + 1, figures
    # With fixed H the fast rank idles while the slow one finishes each period: 1 - its cost over the
    # slow one's, both measured in that run; sized to the speeds, it waits at most half of that.
    assert abs(exposed_f - (1 - fixed_cost[0] / fixed_cost[1])) <= 0.2, figures
    assert exposed_t < exposed_f / 2, figures


# -- convergence on the bundled corpus (slow) --------------------------------------------------

# The shared corpus recipe of tests/conftest.py: W=2, a 2-layer width-64 GPT, 300 steps, lr 1e-3,
# at the defaults (H=32: nine outer steps). Measured, seeds 0 / 1: 2.838 / 2.663 (ddp: 2.629 /
# 2.618). 3.3 is about the unigram byte model's 3.28: passing needs the model to use context.
CONVERGE_THRESHOLD = 3.3


@pytest.mark.slow
def test_converges_on_the_corpus(corpus_run):
    s, _ = corpus_run("diloco", eval_every=0)
    assert s["final_val_loss"] < CONVERGE_THRESHOLD, (
        f"diloco: validation loss {s['final_val_loss']:.3f} (ln 256 = {math.log(256):.3f})")
