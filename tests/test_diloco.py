"""DiLoCo and Streaming DiLoCo (issue 8): exact reductions, bytes = plan, local inner state,
--sync-by time with a slow worker, convergence on the bundled corpus (slow).

Spawning is the expensive part, so each process group runs several checks."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import lowcomm
from lowcomm.models.layout import ModelLayout, layout_of
from lowcomm.cli import main
from lowcomm.run import make_run
from lowcomm.strategies import get
from lowcomm.strategies.diloco import OUTER_BLOCK, outer_compressor, outer_quantizer
from lowcomm.strategies.streaming_diloco import StreamingDiLoCo

from dist_utils import flat_params, rel_err, run_dist

SEQ, MICRO, ACCUM = 16, 2, 2


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


def build(name, make_optimizer, total_steps=None, **options):
    torch.manual_seed(1234)
    model = make_model()
    strategy = make_run(name, model, lowcomm.Comm(), make_optimizer, accum=ACCUM, **options)
    strategy.total_steps = total_steps
    return model, strategy


def train(strategy, rank, steps):
    for _ in range(steps):
        step, micro = strategy.steps_done, iter(range(1000))
        strategy.step(lambda: batch(step, rank, next(micro)), lowcomm.lm_loss)


def plan_bytes(name: str, params: int, world: int, steps: int, options: dict) -> int:
    cls = get(name)
    opts = cls.Options(**options).validate(name)
    layout = layout_of(make_model())
    assert layout.numel == params
    return sum(op.wire_bytes(world) * cls.plan_occurrences(op, steps, opts)
               for op in cls.comm_plan(layout, world, opts))


EXACT = dict(sync_every=1, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False)
STREAM_AS_DILOCO = dict(fragments=1, fragment_delay=0, merge_alpha=0.0)
BYTE_CASES = [  # (strategy, options, steps): run lengths not multiples of H, every precision
    ("diloco", dict(sync_every=3), 7),
    ("diloco", dict(sync_every=4, outer_precision="bf16"), 9),
    ("diloco", dict(sync_every=3, outer_precision="int8"), 8),
    ("diloco", dict(sync_every=2, outer_precision="int4", sync_by="time"), 5),
    ("streaming_diloco", dict(sync_every=6, fragments=3, fragment_delay=2), 13),
    ("streaming_diloco", dict(sync_every=4, fragments=2, fragment_delay=1, outer_precision="int4"), 11),
    ("streaming_diloco", dict(sync_every=4, fragments=4, fragment_delay=0, outer_precision="int8",
                              sync_by="time"), 7),
    ("streaming_diloco", dict(sync_every=4, fragments=3, outer_precision="bf16", sync_by="time"), 6),
    ("diloco", dict(sync_every=3, outer_compress="topk:0.02,bits:2"), 7),  # issue 9's composition
    ("sparseloco", dict(sync_every=3), 5),
    ("streaming_diloco", dict(sync_every=4, fragments=2, fragment_delay=1, outer_compress="topk:8,chunk:64,bits:4",
                              sync_by="time"), 7),
]
LOSSLESS = "topk:64,chunk:64,bits:32"  # k = chunk at 32 bits: every value sent as is


def _checks(rank, world):
    out = {}
    if world == 2:
        # diloco (inner SGD, H=1, outer lr 1, no momentum) vs ddp with the same SGD
        m_ddp, ddp = build("ddp", sgd)
        train(ddp, rank, 10)
        m_dl, dl = build("diloco", sgd, total_steps=10, **EXACT)
        train(dl, rank, 10)
        out["ddp"], out["diloco_h1"] = flat_params(m_ddp), flat_params(m_dl)
        ddp.close(), dl.close()
        # streaming F=1, τ=0, α=0 vs diloco (AdamW inside, H=4, default outer, ends mid-period)
        m_a, a = build("diloco", adamw, total_steps=10, sync_every=4)
        train(a, rank, 10)
        m_b, b = build("streaming_diloco", adamw, total_steps=10, sync_every=4, **STREAM_AS_DILOCO)
        train(b, rank, 10)
        out["diloco_h4"], out["stream_f1"] = flat_params(m_a), flat_params(m_b)
        a.close(), b.close()
        # the same through --outer-compress with nothing dropped: every bit as plain diloco
        m_c, c = build("diloco", adamw, total_steps=10, sync_every=4, outer_compress=LOSSLESS)
        train(c, rank, 10)
        out["lossless"] = (flat_params(m_c), float(c.ef.residuals["fragment0"].abs().max()))
        c.close()
        # error feedback on the outer gradient: residual' = (Δ + β·residual) − sent, sent decoded
        model, s = build("diloco", adamw, total_steps=6, sync_every=2, outer_compress="topk:0.02,bits:2",
                         outer_ef_decay=0.9)
        seen, real = [], s.ef.compress

        def recording(key, x):
            old = s.ef.residuals.get(key, torch.zeros_like(x)).clone()
            payload, sent = real(key, x)
            seen.append((x.clone(), old, sent.clone(), s.ef.residuals[key].clone(),
                         s.compressor.decompress(payload)))
            return payload, sent
        s.ef.compress = recording
        train(s, rank, 6)
        out["ef"] = seen
        s.close()
        # sparseloco resumed after a sync: residuals and parameters bit-identical
        m1, s1 = build("sparseloco", adamw, total_steps=8, sync_every=2)
        train(s1, rank, 3)
        state = copy.deepcopy(s1.state_dict())
        m2, s2 = build("sparseloco", adamw, total_steps=8, sync_every=2)
        s2.load_state_dict(state)
        train(s1, rank, 5), train(s2, rank, 5)
        out["sparseloco_resume"] = (state["extra"]["outer_residuals"], s1.state_dict()["extra"]["outer_residuals"],
                                    s2.state_dict()["extra"]["outer_residuals"],
                                    torch.equal(flat_params(m1), flat_params(m2)))
        s1.close(), s2.close()
        # inner AdamW state: unchanged by a sync, never on the wire
        model, s = build("diloco", adamw, total_steps=6, sync_every=3)
        seen = []
        real_job = s._sync_job

        def watched(i, delta, tau, c):
            before = {k: v.clone() for k, v in s.inner.state[s.params[0]].items()}
            sent = s.comm.snapshot().wire_bytes
            infos = real_job(i, delta, tau, c)
            after = s.inner.state[s.params[0]]
            seen.append((all(torch.equal(before[k], after[k]) for k in before),
                         s.comm.snapshot().wire_bytes - sent))
            return infos
        s._sync_job = watched
        train(s, rank, 6)
        out["inner_state"] = {"seen": seen, "state_numel": sum(v.numel() for st in s.inner.state.values()
                                                              for v in st.values() if v.dim() > 0)}
        s.close()
        # resume while a fragment's all-reduce is in flight (τ=2): bit-identical continuation
        opts = dict(sync_every=4, fragments=2, fragment_delay=2, outer_precision="int8")
        m1, s1 = build("streaming_diloco", adamw, total_steps=9, **opts)
        train(s1, rank, 5)  # fragment 0 synced at step 4, merges at step 6
        in_flight = bool(s1.in_flight)
        state = copy.deepcopy(s1.state_dict())  # optimizer state_dicts hold live tensors
        m2, s2 = build("streaming_diloco", adamw, total_steps=9, **opts)
        s2.load_state_dict(state)
        train(s1, rank, 4), train(s2, rank, 4)
        out["resume"] = (in_flight, torch.equal(flat_params(m1), flat_params(m2)),
                         torch.equal(s1.globals[0].detach(), s2.globals[0].detach()))
        s1.close(), s2.close()
    # bytes counted = plan, every case
    counted = []
    for name, options, steps in BYTE_CASES:
        model, s = build(name, adamw, total_steps=steps, **options)
        train(s, rank, steps)
        counted.append(s.comm.snapshot().wire_bytes)
        s.close()
    out["counted"] = counted
    return out


@pytest.fixture(scope="module")
def lives():
    return {2: run_dist(_checks, 2, timeout=300), 3: run_dist(_checks, 3, timeout=300)}


def test_diloco_h1_sgd_equals_ddp(lives):
    for r in lives[2]:
        err = rel_err(r["diloco_h1"], r["ddp"])
        assert err <= 1e-6, f"diloco H=1 vs ddp: {err:.2e}"
    assert torch.equal(lives[2][0]["diloco_h1"], lives[2][1]["diloco_h1"])


def test_streaming_f1_tau0_alpha0_equals_diloco(lives):
    for r in lives[2]:
        err = rel_err(r["stream_f1"], r["diloco_h4"])
        assert err <= 1e-6, f"streaming F=1 vs diloco: {err:.2e}"


@pytest.mark.parametrize("world", [2, 3])
def test_counted_bytes_equal_plan(lives, world):
    params = make_model().num_params()
    for k, (name, options, steps) in enumerate(BYTE_CASES):
        want = plan_bytes(name, params, world, steps, options)
        for r in range(world):
            got = lives[world][r]["counted"][k]
            assert got == want, f"{name} {options} {steps} steps, W={world} rank {r}: counted {got}, plan {want}"
        assert want > 0


def test_outer_compress_without_loss_equals_plain_diloco(lives):
    for r in lives[2]:
        params, left = r["lossless"]
        assert torch.equal(params, r["diloco_h4"]), "k = chunk at 32 bits differs from the fp32 all-reduce"
        assert left == 0.0


def test_outer_error_feedback_identity(lives):
    for r in lives[2]:
        assert len(r["ef"]) == 3  # H=2, 6 steps
        for x, old, sent, new, decoded in r["ef"]:
            assert torch.equal(sent, decoded)  # what is subtracted is what the peers decode
            assert torch.equal(new, (x + 0.9 * old) - sent)
            assert float(sent.abs().max()) > 0 and float(new.abs().max()) > 0
            kept = int((sent != 0).sum())
            assert 0 < kept <= math.ceil(x.numel() / 256) * 5  # top-5 of every 256 (0.02)
        assert float(r["ef"][0][1].abs().max()) == 0.0 and float(r["ef"][1][1].abs().max()) > 0


def test_sparseloco_resumes_with_its_residuals(lives):
    for r in lives[2]:
        saved, straight, resumed, same_params = r["sparseloco_resume"]
        assert set(saved) == {"fragment0"} and float(saved["fragment0"].abs().max()) > 0
        assert torch.equal(straight["fragment0"], resumed["fragment0"])
        assert same_params


def test_sparseloco_is_diloco_with_the_papers_defaults():
    o = get("sparseloco").Options().validate("sparseloco")
    assert (o.sync_every, o.outer_lr, o.outer_momentum, o.outer_ef_decay) == (15, 1.0, 0.0, 0.95)
    c = outer_compressor(o)
    assert (c.chunk, c.k, c.values.bits, c.values.scheme) == (4096, 64, 2, "stat")
    # per 4096 values: 64 int16 indices, 64 2-bit codes; one mean + 4-entry table per fragment
    assert c.nbytes(3 * 4096) == 3 * (64 * 2 + 16) + 5 * 4
    plan = get("sparseloco").comm_plan(ModelLayout(((3 * 4096,),)), 4, o)
    assert [(op.collective, op.nbytes, op.every) for op in plan] == [("all_gather", 4 * (3 * 144 + 20 + 16), 15)]


def test_inner_state_is_local_and_survives_sync(lives):
    params = make_model().num_params()
    for r in lives[2]:
        seen = r["inner_state"]["seen"]
        assert len(seen) == 2  # H=3, 6 steps
        assert all(unchanged for unchanged, _ in seen), "a sync changed the inner optimizer state"
        # one sync sends exactly the fp32 pseudo-gradient's ring all-reduce: 2(W-1)/W * 4P at W=2
        assert all(sent == 4 * params for _, sent in seen), (seen, params)
        assert r["inner_state"]["state_numel"] == 2 * params  # AdamW's exp_avg and exp_avg_sq: 2P, not sent


def test_streaming_resumes_bit_identically_with_a_sync_in_flight(lives):
    for r in lives[2]:
        assert r["resume"] == (True, True, True), r["resume"]


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


# -- --sync-by time with a 2x slower worker (through the CLI; timing, so slow-marked) ----------

def _slow_run(tmp_path, sync_by, text):
    out = tmp_path / sync_by
    rc = main(["train", "--strategy", "diloco", "--workers", "2", "--steps", "64", "--sync-every", "16",
               "--sync-by", sync_by, "--slowdown", "1,2", "--log-every", "16", "--eval-every", "0",
               "--eval-batches", "1", "--model", "tiny", "--micro-batch", "8", "--seq-len", "64",
               "--data", str(text), "--out", str(out), "--quiet"])
    assert rc == 0
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_sync_by_time_keeps_the_fast_worker_busy(tmp_path):
    """Measured on the shared 2-core machine at load 7-10: fast/slow inner steps 64/18 and 64/15
    (the slow rank's real cost per inner step was 3.3x and 4.0x the fast one's there, not 2x:
    with both ranks busy the slow one's compute, which the slowdown doubles, is itself inflated
    by contention); fast rank exposed 5.0 % and 8.0 % of the wall time; with fixed H 46-57 %.
    So the test checks fast/slow against the measured cost ratio (and >= 1.6), not against 2."""
    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession "
                    "of a good fortune, must be in want of a wife.\n" * 400)
    fixed = _slow_run(tmp_path, "steps", text)
    timed = _slow_run(tmp_path, "time", text)
    fast, slow = timed["micro_batches_per_rank"]
    cost = [c / max(n, 1) for c, n in zip(timed["compute_s_per_rank"], timed["micro_batches_per_rank"])]
    speed_ratio = cost[1] / cost[0]  # how much slower rank 1 really was per inner step
    exposed_t, exposed_f = (s["exposed_comm_fraction_per_rank"][0] for s in (timed, fixed))
    figures = (f"time: fast/slow inner steps {fast}/{slow} = {fast / slow:.2f} (real cost ratio "
               f"{speed_ratio:.2f}), fast rank exposed {exposed_t:.1%}, idle "
               f"{1 - timed['compute_s_per_rank'][0] / timed['wall_s']:.1%}; fixed H: fast exposed "
               f"{exposed_f:.1%}, idle {1 - fixed['compute_s_per_rank'][0] / fixed['wall_s']:.1%}")
    print(figures)
    assert fast == 64 and fast / slow >= 1.6, figures
    assert 0.7 <= (fast / slow) / speed_ratio <= 1.4, figures
    assert exposed_t < 0.10, figures
    assert 0.3 <= exposed_f <= 0.7, figures
    assert fixed["micro_batches_per_rank"] == [64, 64]


# -- convergence on the bundled corpus (slow) --------------------------------------------------

# The shared corpus recipe of tests/conftest.py: W=2, a 2-layer width-64 GPT, 300 steps, lr 1e-3,
# each strategy at its defaults (H=32: nine outer steps). Measured, seeds 0 / 1: diloco fp32
# 2.838 / 2.663, streaming_diloco F=4 tau=2 int4 2.597 / 2.642 (ddp: 2.629 / 2.618).
# 3.3 is about the unigram byte model's 3.28: passing needs the model to use context.
CONVERGE_THRESHOLD = 3.3


@pytest.mark.slow
@pytest.mark.parametrize("name, flags", [("diloco", ()), ("streaming_diloco", ("--outer-precision", "int4"))])
def test_diloco_converges_on_the_corpus(corpus_run, name, flags):
    s, _ = corpus_run(name, *flags, eval_every=0)
    assert s["final_val_loss"] < CONVERGE_THRESHOLD, (
        f"{name} {' '.join(flags)}: validation loss {s['final_val_loss']:.3f} (ln 256 = {math.log(256):.3f})")


@pytest.mark.slow
def test_sparseloco_learns_on_a_sliver_of_ddps_bytes(corpus_run):
    """Measured (the shared recipe, 300 steps, lr 1e-3), seeds 0 / 1: sparseloco 2.913 / 2.922
    against ddp's 2.629 / 2.618, sending 174,240 bytes against ddp's 286,617,600 (1645x fewer).
    The issue's bench target is >= 500x fewer bytes within 5 % of ddp's loss at W=4
    (bench/compress.py, 300 steps: 822x at +0.4 % with lr 2e-3, +8.4 % with lr 1e-3); here
    the check is that it learns (below the unigram level) on >= 500x fewer bytes."""
    ddp, _ = corpus_run("ddp")
    s, _ = corpus_run("sparseloco")
    ratio = ddp["wire_bytes_total"] / s["wire_bytes_total"]
    figures = f"sparseloco {s['final_val_loss']:.3f} vs ddp {ddp['final_val_loss']:.3f}; {ratio:.0f}x fewer bytes"
    print(figures)
    assert s["final_val_loss"] < CONVERGE_THRESHOLD, figures
    assert ratio >= 500, figures
