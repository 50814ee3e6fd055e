"""The exact strategies' reference (ddp, zero1): W=2 gloo processes must end where one
process with the same global batch ends.

Every micro-batch is a deterministic function of (step, rank, micro), so the
single-process reference can concatenate exactly the global batch the W ranks
saw together: W * ACCUM micro-batches of equal size, whose mean loss is the
mean of the per-rank, per-micro-batch mean losses that the strategies average.
AdamW, accumulation over 2 micro-batches and a warmup + cosine schedule are all
exercised; parameters are compared after 20 optimizer steps in fp32 by the
relative error ||a - b|| / ||b|| of the flattened parameter vector.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lowcomm
from lowcomm.config import OptimConfig
from lowcomm.train.optim import lr_schedule

from dist_utils import flat_params, rel_err

W = 2
STEPS = 20
ACCUM = 2
MICRO = 4      # sequences (or rows) per micro-batch per rank
SEQ = 16
TOL = 1e-5
OPT = OptimConfig(lr=3e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                  warmup_steps=5, schedule="cosine", min_lr_ratio=0.1)


# -- models, batches and losses (module level: the spawned ranks import them) --------

def make_gpt() -> nn.Module:
    torch.manual_seed(1234)
    return lowcomm.GPT(vocab_size=256, seq_len=SEQ, n_layer=2, n_head=2, d_model=32)


def gpt_batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(100_000 * step + 100 * rank + micro)
    seq = torch.randint(0, 256, (MICRO, SEQ + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class TinyMLP(nn.Module):
    """Not a GPT: a regression MLP with a learnable scalar, so P = 7*13+13 + 13*2+2 + 1 = 133
    is odd and zero1 has to pad its flat buffer."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 2)
        self.log_scale = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.log_scale.exp()


def make_mlp() -> nn.Module:
    torch.manual_seed(4321)
    return TinyMLP()


def mlp_batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(7_000_000 + 100_000 * step + 100 * rank + micro)
    x = torch.randn(MICRO, 7, generator=g)
    y = torch.stack([x[:, :3].sum(1), (x[:, 3:] ** 2).mean(1)], dim=1)
    return x, y


def mlp_loss(model, batch):
    """A custom loss: Huber on the two targets plus a small penalty on the outputs.
    (It only calls the model: under ddp, `model` is torch's DDP wrapper.)"""
    x, y = batch
    pred = model(x)
    return F.smooth_l1_loss(pred, y) + 0.01 * pred.pow(2).mean()


MODELS = {
    "gpt": (make_gpt, gpt_batch, lowcomm.lm_loss),
    "mlp": (make_mlp, mlp_batch, mlp_loss),
}


def make_adamw(params):
    return torch.optim.AdamW(params, lr=OPT.lr, betas=(OPT.beta1, OPT.beta2), eps=OPT.eps,
                             weight_decay=OPT.weight_decay)


# Adam's update barely depends on the gradient's scale, so a strategy that summed where it
# should average would still match under AdamW. SGD with momentum is scale-sensitive:
# the same runs under SGD catch a wrong reduction or accumulation scale.
SGD_OPT = OptimConfig(lr=0.5, warmup_steps=5, schedule="cosine", min_lr_ratio=0.1)


def make_sgd(params):
    return torch.optim.SGD(params, lr=SGD_OPT.lr, momentum=0.9)


OPTIMIZERS = {"adamw": (make_adamw, OPT), "sgd": (make_sgd, SGD_OPT)}


def global_batch(batch_fn, step: int, world: int):
    """Every rank's every micro-batch of one step, concatenated along the batch dim."""
    parts = [batch_fn(step, r, m) for r in range(world) for m in range(ACCUM)]
    return tuple(torch.cat(t) for t in zip(*parts))


def reference(kind: str, optim: str = "adamw", world: int = W) -> torch.Tensor:
    """One process, plain torch: the optimizer on the global batch, the same schedule."""
    make_model, batch_fn, loss_fn = MODELS[kind]
    make_opt, ocfg = OPTIMIZERS[optim]
    model = make_model()
    opt = make_opt(model.parameters())
    schedule = lr_schedule(ocfg, STEPS)
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        opt.zero_grad()
        loss_fn(model, global_batch(batch_fn, step, world)).backward()
        opt.step()
    return flat_params(model)


# -- rank workers ----------------------------------------------------------------------

def _train_lowcomm(rank: int, world: int, strategy: str, kind: str, optim: str = "adamw") -> dict:
    make_model, batch_fn, loss_fn = MODELS[kind]
    make_opt, ocfg = OPTIMIZERS[optim]
    model = make_model()
    comm = lowcomm.Comm()
    strat = lowcomm.make_run(strategy, model, comm, make_opt, accum=ACCUM,
                                  schedule=lr_schedule(ocfg, STEPS))
    losses, lrs = [], []
    for step in range(STEPS):
        micro = iter(range(ACCUM + 1))  # one spare, so a strategy that over-pulls shows up as a wrong count

        def next_batch(step=step, micro=micro):
            return batch_fn(step, rank, next(micro))

        res = strat.step(next_batch, loss_fn)
        assert res.micro_batches == ACCUM, res
        losses.append(res.loss)
        lrs.append(res.lr)
    out = {"params": flat_params(model), "losses": losses, "lrs": lrs,
           "opt_bytes": strat.optimizer_state_bytes()}
    if strategy == "zero1":
        out["views"] = _flat_views(strat, model)
    return out


def _flat_views(strat, model) -> dict:
    """Do the model's params and grads still view zero1's flat buffers, at the right offsets?"""
    flat = strat.strategy.flat
    p_base, g_base = flat.params.data_ptr(), flat.grads.data_ptr()
    p_ok, g_ok, values_ok = True, True, True
    offset = 0
    for p in model.parameters():
        n, es = p.numel(), p.element_size()
        p_ok &= p.data_ptr() == p_base + offset * es
        g_ok &= p.grad is not None and p.grad.data_ptr() == g_base + offset * es
        values_ok &= torch.equal(p.detach().reshape(-1), flat.params[offset:offset + n])
        offset += n
    return {"params_view": p_ok, "grads_view": g_ok, "values_match": values_ok,
            "numel": flat.numel, "padded": flat.params.numel(), "shard": flat.shard_size}


def _train_torch_zero(rank: int, world: int, kind: str) -> dict:
    """The peer reference: torch's DistributedDataParallel + ZeroRedundancyOptimizer(AdamW)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    make_model, batch_fn, loss_fn = MODELS[kind]
    model = make_model()
    ddp = DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=OPT.lr,
                                  betas=(OPT.beta1, OPT.beta2), eps=OPT.eps,
                                  weight_decay=OPT.weight_decay)
    schedule = lr_schedule(OPT, STEPS)
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        opt.zero_grad()
        for m in range(ACCUM):
            batch = batch_fn(step, rank, m)
            if m < ACCUM - 1:
                with ddp.no_sync():
                    (loss_fn(ddp, batch) / ACCUM).backward()
            else:
                (loss_fn(ddp, batch) / ACCUM).backward()
        opt.step()
    return {"params": flat_params(model)}


def _all_runs(rank: int, world: int, kind: str, with_peer: bool) -> dict:
    """One spawn trains every variant from a fresh model (spawning costs more than training)."""
    out = {name: _train_lowcomm(rank, world, name, kind) for name in ("ddp", "zero1")}
    out.update({f"{name}_sgd": _train_lowcomm(rank, world, name, kind, "sgd") for name in ("ddp", "zero1")})
    if with_peer:
        out["torch_zero"] = _train_torch_zero(rank, world, kind)
    return out


# -- the checks each exact strategy's test file runs on these runs --------------------

def check_gpt_matches_single_process(strategy, gpt_runs):
    """The ranks hold one model, equal to one process on the global batch, with the schedule applied."""
    runs, refs = gpt_runs
    ref = refs["adamw"]
    out = [runs[r][strategy] for r in range(W)]
    # the ranks hold one model
    assert torch.equal(out[0]["params"], out[1]["params"])
    # training moved the parameters far more than the tolerance, so the check has teeth
    assert rel_err(flat_params(make_gpt()), ref) > 100 * TOL
    err = rel_err(out[0]["params"], ref)
    assert err <= TOL, f"{strategy}: relative parameter error {err:.3e} > {TOL}"
    # the schedule was applied: warmup then cosine, step by step
    sched = lr_schedule(OPT, STEPS)
    assert out[0]["lrs"] == pytest.approx([sched(s) for s in range(STEPS)], rel=1e-12)
    assert out[0]["lrs"][0] < out[0]["lrs"][OPT.warmup_steps - 1] > out[0]["lrs"][-1]
    # a random-token batch starts at ln(256) with N(0, 0.02) init
    first = (out[0]["losses"][0] + out[1]["losses"][0]) / 2
    assert abs(first - math.log(256)) < 0.05


def check_non_gpt_module_with_custom_loss(strategy, mlp_runs):
    """Any module with a custom loss (an MLP with an odd parameter count): the same equivalence."""
    runs, refs = mlp_runs
    ref = refs["adamw"]
    assert rel_err(flat_params(make_mlp()), ref) > 100 * TOL
    out = [runs[r][strategy] for r in range(W)]
    assert torch.equal(out[0]["params"], out[1]["params"])
    err = rel_err(out[0]["params"], ref)
    assert err <= TOL, f"{strategy} on an MLP: relative error {err:.3e} > {TOL}"


def check_gradient_scale_under_sgd(strategy, kind, gpt_runs, mlp_runs):
    """The same equivalence under SGD+momentum, which (unlike Adam) sees the gradient's scale:
    a sum where a mean belongs, in the reduction or the accumulation, fails here."""
    runs, refs = gpt_runs if kind == "gpt" else mlp_runs
    ref = refs["sgd"]
    start = flat_params(make_gpt() if kind == "gpt" else make_mlp())
    assert rel_err(start, ref) > 100 * TOL
    out = [runs[r][f"{strategy}_sgd"] for r in range(W)]
    assert torch.equal(out[0]["params"], out[1]["params"])
    err = rel_err(out[0]["params"], ref)
    assert err <= TOL, f"{strategy}+SGD on {kind}: relative error {err:.3e} > {TOL}"
