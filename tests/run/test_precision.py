"""--precision / precision=: the forward under autocast, fp16's loss scaler, and what stays fp32.

Every registered strategy, in one spawn of W=2 gloo ranks (one tiny GPT, a few steps each):
- bf16 (CPU autocast) ends within 3 % of fp32's loss, and sends exactly the bytes fp32 sends;
- fp16's loss scaler, run with fp32 compute (fp16 needs CUDA), ends where fp32 ends: every
  gradient reaches the strategy unscaled (SGD, so a gradient off by the scale would show), and
  the scale grows on schedule;
- an overflow (an inf gradient) on rank 1 alone: the step is skipped and the scale halved on
  both ranks (the local-SGD family's inner steps send nothing: there rank 1 alone skips).
Without a process: fp16 refused on a CPU in one line before anything is written; the scaler's
schedule; its scale in the run's state and through a checkpoint; overflow skips and --max-bad-steps.
"""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

import lowcomm
from lowcomm.cli.main import main
from lowcomm.errors import UsageError
from lowcomm.run.driver import make_run
from lowcomm.run.precision import LossScaler, Precision
from lowcomm.strategies import available, get
from lowcomm.strategies.diloco import DiLoCo
from lowcomm.train.loop import check_steps

from dist_utils import flat_params, rel_err, run_dist
from tiny_runs import TINY

STRATEGIES = available()
STEPS, ACCUM, SEQ, MICRO, VOCAB = 12, 2, 16, 4, 64
OPTIONS = {"dpu": {"warmup_steps": 2}, "diloco": {"sync_every": 4}, "streaming_diloco": {"sync_every": 4},
           "sparseloco": {"sync_every": 4}}  # rounds and syncs within the short run
INIT, GROWTH_EVERY = 2.0**10, 4  # the scaler's runs: doubled at steps 4, 8, 12
OVERFLOW_AT = 3  # 0-based step whose backward gets an inf gradient on rank 1


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return lowcomm.GPT(vocab_size=VOCAB, seq_len=SEQ, n_layer=1, n_head=2, d_model=32)


def batch(step: int, rank: int, micro: int):
    """Counting sequences with a stride of their own: learnable in a few steps (the loss falls)."""
    g = torch.Generator().manual_seed(100_000 * step + 100 * rank + micro)
    start, stride = torch.randint(0, VOCAB, (MICRO, 1), generator=g), torch.randint(1, 4, (MICRO, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def make_sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def make_adam(params):  # 1-bit Adam freezes Adam's second moment; eps large enough that a scaled gradient would show
    return torch.optim.Adam(params, lr=3e-3, eps=1e-3)


def make_slow_sgd(params):  # DeMo steps by the sign of its decoded update: a small lr
    return torch.optim.SGD(params, lr=0.01)


OPTIMIZERS = {"onebit_adam": make_adam, "demo": make_slow_sgd}


def _options(name: str) -> dict:
    return {**get(name).reproducible_options, **OPTIONS.get(name, {})}


def _one_run(rank: int, name: str, precision, overflow: bool = False) -> dict:
    model = make_model()
    run = make_run(name, model, lowcomm.Comm(), OPTIMIZERS.get(name, make_sgd), accum=ACCUM, total_steps=STEPS,
                   precision=precision, **_options(name))
    wire, skipped = 0, []
    for step in range(STEPS):
        hook = None
        if overflow and rank == 1 and step == OVERFLOW_AT:  # one inf in one gradient, once
            hook = next(model.parameters()).register_hook(lambda g: torch.full_like(g, math.inf))
        micro = iter(range(1000))
        result = run.step(lambda: batch(step, rank, next(micro)), lowcomm.lm_loss)
        if hook is not None:
            hook.remove()
        wire += result.wire_bytes
        skipped.append(result.skipped)
    with run.evaluating() as m, run.autocast(), torch.no_grad():
        loss = sum(float(lowcomm.lm_loss(m, batch(10_000 + i, 0, 0))) for i in range(4)) / 4
    run.close()
    scaler = run.precision.scaler
    return {"loss": loss, "wire": wire, "skipped": skipped, "params": flat_params(model),
            "dtypes": {str(p.dtype) for p in model.parameters()},
            "scale": scaler.scale if scaler is not None else None}


def _scaled() -> Precision:
    return Precision("fp32", scaler=LossScaler(init_scale=INIT, growth_interval=GROWTH_EVERY))


def _every_strategy(rank: int, world: int) -> dict:
    return {name: {"fp32": _one_run(rank, name, "fp32"), "bf16": _one_run(rank, name, "bf16"),
                   "scaled": _one_run(rank, name, _scaled()),
                   "overflow": _one_run(rank, name, _scaled(), overflow=True)} for name in STRATEGIES}


@pytest.fixture(scope="module")
def runs():
    return run_dist(_every_strategy, 2, timeout=600)


@pytest.mark.procs
@pytest.mark.parametrize("name", STRATEGIES)
def test_bf16_trains_as_fp32_does_and_sends_the_same_bytes(name, runs):
    for rank in range(2):
        fp32, bf16 = runs[rank][name]["fp32"], runs[rank][name]["bf16"]
        assert bf16["wire"] == fp32["wire"] > 0, (bf16["wire"], fp32["wire"])
        assert abs(bf16["loss"] - fp32["loss"]) <= 0.03 * fp32["loss"], (bf16["loss"], fp32["loss"])
        assert bf16["dtypes"] == {"torch.float32"}  # the parameters stay fp32
        assert not any(bf16["skipped"])
    assert runs[0][name]["fp32"]["loss"] < math.log(VOCAB) - 0.3  # it learned: the comparison means something


@pytest.mark.procs
@pytest.mark.parametrize("name", STRATEGIES)
def test_the_loss_scaler_hands_every_strategy_unscaled_gradients(name, runs):
    for rank in range(2):
        fp32, scaled = runs[rank][name]["fp32"], runs[rank][name]["scaled"]
        assert scaled["wire"] == fp32["wire"]
        # bit-identical: the scale is a power of two, so scaling and unscaling round nothing
        assert torch.equal(scaled["params"], fp32["params"]), rel_err(scaled["params"], fp32["params"])
        assert scaled["scale"] == INIT * 2 ** (STEPS // GROWTH_EVERY)  # grown on schedule, never halved


@pytest.mark.procs
@pytest.mark.parametrize("name", STRATEGIES)
def test_an_overflow_on_one_rank_is_skipped_and_halves_the_scale_where_it_is_skipped(name, runs):
    out = [runs[rank][name]["overflow"] for rank in range(2)]
    for rank in range(2):  # the scale followed each step's skip: halved at each, grown between
        replay = LossScaler(init_scale=INIT, growth_interval=GROWTH_EVERY)
        for skipped in out[rank]["skipped"]:
            replay.update(skipped)
        assert out[rank]["scale"] == replay.scale, (rank, out[rank]["skipped"], out[rank]["scale"])
        assert not any(out[rank]["skipped"][:OVERFLOW_AT])
    if issubclass(get(name), DiLoCo):  # inner steps send nothing: the rank that overflowed skips alone
        assert [sum(o["skipped"]) for o in out] == [0, 1]
        return
    # every rank skips the update the overflow reached (acco: its estimate and its real round; dpu: a step late)
    assert out[0]["skipped"] == out[1]["skipped"] and any(out[0]["skipped"][OVERFLOW_AT:OVERFLOW_AT + 2]), out
    assert out[0]["scale"] == out[1]["scale"] < INIT * 2 ** (STEPS // GROWTH_EVERY)


@pytest.mark.procs
def test_lowcomm_train_precision_bf16_computes_in_bf16_and_sends_what_fp32_sends(tmp_path, data_file):
    summaries = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        assert main(["train", *TINY, "--steps", "4", "--eval-every", "2", "--data", str(data_file),
                     "--out", str(out), "--precision", precision]) == 0
        summaries[precision] = json.loads((out / "summary.json").read_text())
    fp32, bf16 = summaries["fp32"], summaries["bf16"]
    assert (fp32["precision"], bf16["precision"]) == ("fp32", "bf16")
    assert bf16["wire_bytes_total"] == fp32["wire_bytes_total"] == fp32["planned_wire_bytes_total"]
    for key in ("final_train_loss", "final_val_loss"):  # the workers ran under autocast: close, not equal
        assert bf16[key] != fp32[key] and abs(bf16[key] - fp32[key]) <= 0.03 * fp32[key], (key, bf16, fp32)


# -- without a process ----------------------------------------------------------------------

def test_fp16_is_refused_on_a_cpu_in_one_line_before_anything_is_written(tmp_path, capsys, data_file):
    out = tmp_path / "run"
    code = main(["train", "--precision", "fp16", "--device", "cpu", "--data", str(data_file), "--out", str(out),
                 "--steps", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: --precision fp16 needs CUDA") and "--precision bf16" in err[0], err
    assert not out.exists()
    with pytest.raises(UsageError, match="precision fp16 needs CUDA .*use bf16"):
        make_run("ddp", make_model(), lowcomm.Comm(), make_sgd, precision="fp16")
    with pytest.raises(UsageError, match="unknown precision 'fp8'"):
        make_run("ddp", make_model(), lowcomm.Comm(), make_sgd, precision="fp8")


def test_training_and_evaluation_forwards_run_under_the_runs_autocast():
    from types import SimpleNamespace
    from lowcomm.train.loop import evaluate_run

    model = make_model()
    seen = []
    model.blocks[0].mlp[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    run = make_run("ddp", model, lowcomm.Comm(), make_sgd, precision="bf16")
    run.step(lambda: batch(0, 0, 0), lowcomm.lm_loss)
    assert seen == [torch.bfloat16] and {p.dtype for p in model.parameters()} == {torch.float32}
    t = SimpleNamespace(run=run, flight=None, val=[batch(1, 0, 0)], comm=run.comm, device=torch.device("cpu"))
    assert math.isfinite(evaluate_run(t)) and seen == [torch.bfloat16] * 2
    with run.autocast():  # a loop of its own
        run.backward(lowcomm.lm_loss(run.model, batch(2, 0, 0)))
    assert seen == [torch.bfloat16] * 3
    run.close()


def test_the_scaler_halves_on_an_overflow_and_doubles_after_its_interval():
    s = LossScaler()
    assert (s.scale, s.growth_interval) == (2.0**16, 2000)  # torch's GradScaler's defaults
    s = LossScaler(init_scale=8.0, growth_interval=2)
    for skipped, want in [(False, 8), (False, 16), (True, 8), (False, 8), (True, 4), (False, 4), (False, 8)]:
        s.update(skipped)
        assert s.scale == want
    assert s.overflows == 2
    restored = LossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict() == {"scale": 8.0, "good_steps": 0, "overflows": 2}


def _single(precision):
    return make_run("ddp", make_model(), lowcomm.Comm(), make_sgd, accum=ACCUM, precision=precision)


def _pull(run, steps: int) -> None:
    for _ in range(steps):
        step, micro = run.steps_done, iter(range(1000))
        run.step(lambda: batch(step, 0, next(micro)), lowcomm.lm_loss)


def test_the_scale_is_in_the_run_state_and_a_resumed_run_continues_with_it():
    a = _single(Precision("fp32", scaler=LossScaler(init_scale=INIT, growth_interval=3)))
    _pull(a, 4)
    state = a.state_dict()
    assert state["precision"]["scaler"] == {"scale": INIT * 2, "good_steps": 1, "overflows": 0}
    b = _single(Precision("fp32", scaler=LossScaler(init_scale=INIT, growth_interval=3)))
    b.load_state_dict(state)
    assert b.precision.scaler.state_dict() == a.precision.scaler.state_dict()
    _pull(a, 2), _pull(b, 2)
    assert b.precision.scaler.scale == a.precision.scaler.scale == INIT * 4
    assert torch.equal(flat_params(a.strategy.model), flat_params(b.strategy.model))
    a.close(), b.close()


def test_the_scale_survives_a_checkpoint(tmp_path):
    """The checkpoint stores the run's state as DCP entries plus a pickled skeleton: the scaler's too."""
    import torch.distributed.checkpoint as dcp
    from lowcomm.checkpoint.choose import Found
    from lowcomm.checkpoint.state import read_state, to_dcp

    run = _single(Precision("fp32", scaler=LossScaler(init_scale=INIT, growth_interval=2)))
    _pull(run, 3)

    class Trainer:  # what to_dcp reads of worker.Trainer
        rank = 0

        def state_dict(self):
            return {"step": 3, "strategy": run.state_dict()}

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore")
        dcp.save(to_dcp(Trainer(), 1.0, replicated=False), checkpoint_id=str(tmp_path), no_dist=True)
    back = read_state(Found(tmp_path, 3, 1, False), 0)["strategy"]["precision"]
    assert back == {"name": "fp32", "scaler": {"scale": INIT * 2, "good_steps": 1, "overflows": 0}}
    run.close()


def _record(step: int, loss: float, skipped: list[int]) -> dict:
    return {"step": step, "loss": loss, "skipped_ranks": skipped}


def test_fp16_overflow_skips_do_not_count_toward_max_bad_steps(capsys):
    class Log:
        def write(self, record):
            pass

    overflows = [_record(s, 2.0, [0, 1]) for s in range(1, 8)]
    assert check_steps(overflows, 0, 3, True, Log(), scaled=True) == 0  # seven in a row: the scaler's
    assert "gradient overflowed in fp16" in capsys.readouterr().err
    bad = [_record(1, math.nan, []), *overflows[:2], _record(4, math.inf, [0, 1])]
    assert check_steps(bad, 0, 5, False, Log(), scaled=True) == 2  # non-finite losses still count, in a row
    with pytest.raises(lowcomm.errors.BadSteps):
        check_steps(overflows, 0, 3, False, Log())  # without the scaler a skip is a bad step
