"""ACCO and DPU against single-process references of their recurrences (W=2, gloo).

The references are written here from ALGORITHMS.md, not from the strategy code:
    ACCO  estimate: θ̃_{t+1} = opt(θ_t; ∇θ̃_t / n)   with the optimizer state restored
          real:     θ_{t+1} = opt(θ_t; (∇θ̃_t + ∇θ_t) / N)
    DPU   θ_{t+1} = opt(θ_t; g(θ_{t-1})) after `warmup` synchronous steps
Micro-batch k of rank r is a deterministic function of (r, k), so the reference
can recompute exactly the gradients each rank computed.
"""
from __future__ import annotations

import copy
import os
import time

import pytest
import torch
from dist_utils import rel_err, run_dist

import lowcomm
from lowcomm.models import GPT, lm_loss
from lowcomm.comm.pacer import Pacer

# The GPU check (bench/gpu_check.sh) reruns this file with CUDA tensors and other W.
DEVICE = torch.device(os.environ.get("LOWCOMM_TEST_DEVICE", "cpu"))
W = int(os.environ.get("LOWCOMM_TEST_WORLD", "2"))
ACCUM, LR = 2, 3e-3
DIMS = dict(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(**DIMS).to(DEVICE)


def micro_batch(rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + k)
    # A learnable pattern (next byte = previous + 1, mod 32) plus noise, so losses move.
    start = torch.randint(0, 32, (4, 1), generator=g)
    seq = (start + torch.arange(DIMS["seq_len"] + 1)) % 32
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, 256, seq.shape, generator=g), seq)
    return seq[:, :-1].to(DEVICE), seq[:, 1:].to(DEVICE)


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


class Counter:
    """next_batch for rank r: micro-batches (r, 0), (r, 1), ... in order."""

    def __init__(self, rank: int):
        self.rank, self.k = rank, 0

    def __call__(self):
        batch = micro_batch(self.rank, self.k)
        self.k += 1
        return batch


def flat(model) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def grad_sum(model, theta, batches) -> torch.Tensor:
    """Σ over batches of ∇ mean-loss at θ (what the strategies accumulate before dividing by N)."""
    torch.nn.utils.vector_to_parameters(theta, model.parameters())
    model.zero_grad(set_to_none=True)
    for b in batches:
        lm_loss(model, b).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


class RefOpt:
    """AdamW over one flat vector, with the snapshot/restore an estimate needs."""

    def __init__(self, theta):
        self.theta = theta.clone().requires_grad_(False)
        self.opt = make_optimizer([self.theta])

    def step(self, grad, keep=True):
        saved = (self.theta.clone(), copy.deepcopy(self.opt.state_dict())) if not keep else None
        self.theta.grad = grad
        self.opt.step()
        new = self.theta.detach().clone()
        if saved is not None:
            self.theta.data.copy_(saved[0])
            self.opt.load_state_dict(saved[1])
        return new


# -- ACCO ------------------------------------------------------------------------

def _acco_worker(rank, world, rounds, slowdown=None, max_accum=0):
    model = make_model()
    comm = lowcomm.Comm()
    deterministic = slowdown is None
    strat = lowcomm.make_run("acco", model, comm, make_optimizer, accum=ACCUM,
                                  deterministic=deterministic, max_accum=max_accum)
    next_batch = Counter(rank)
    loss_fn = lm_loss
    if slowdown is not None:
        # Uneven workers as --slowdown makes them: rank r sleeps (f_r - 1)x its measured
        # compute. A fixed 60 ms of sleep per micro-batch keeps that compute well above
        # the noise of a loaded machine, so the 1:f ratio holds in time.
        strat.pacer = Pacer(rank, world, slowdown=slowdown[rank])

        def loss_fn(model, batch):
            time.sleep(0.06)
            return lm_loss(model, batch)
    estimate_left_state_alone, counts = [], []
    for i in range(rounds):
        before = [t.clone() for t in strat.strategy.shard_opt._state_tensors()] if strat.strategy.estimate_next else None
        counts.append(strat.step(next_batch, loss_fn).micro_batches)
        if before is not None:
            after = strat.strategy.shard_opt._state_tensors()
            estimate_left_state_alone.append(
                len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after)))
    return {"params": flat(model).cpu(), "estimate_clean": estimate_left_state_alone, "counts": counts,
            "micro": next_batch.k, "holds_estimate": strat.strategy.holds_estimate}


def acco_reference(counts: list[list[int]]) -> torch.Tensor:
    """counts[r][j]: micro-batches rank r computed in round j (its first round also
    holds the start-up micro-batch). Every micro-batch weighs 1/N."""
    rounds = len(counts[0])
    model = make_model()
    theta = flat(model)
    ref = RefOpt(theta)
    k = [0] * W

    def take(n_per_rank):  # the next micro-batches of every rank
        out = [micro_batch(r, k[r] + i) for r in range(W) for i in range(n_per_rank[r])]
        for r in range(W):
            k[r] += n_per_rank[r]
        return out, sum(n_per_rank)

    g_prev, n_prev = grad_sum(model, theta, take([1] * W)[0]), W  # start-up: θ_0 plays θ̃_0
    first = [c - 1 for c in (counts[r][0] for r in range(W))]
    for j in range(0, rounds, 2):
        estimate = ref.step(g_prev / n_prev, keep=False)                 # θ̃_{t+1}, state restored
        batches, n_now = take(first if j == 0 else [counts[r][j] for r in range(W)])
        g_now = grad_sum(model, theta, batches)                           # ∇θ_t, beside the estimate
        theta = ref.step((g_prev + g_now) / (n_prev + n_now))             # θ_{t+1}
        batches, n_prev = take([counts[r][j + 1] for r in range(W)])
        g_prev = grad_sum(model, estimate, batches)                       # ∇θ̃_{t+1}
    return theta.cpu()


def test_acco_matches_its_recurrence_and_estimates_leave_no_trace():
    rounds = 20  # 10 optimizer steps
    out = run_dist(_acco_worker, W, rounds)
    for rank in range(W):  # deterministic mode: exactly accum per round (+1 start-up micro-batch)
        assert out[rank]["counts"] == [1 + ACCUM] + [ACCUM] * (rounds - 1)
    expected = acco_reference([out[r]["counts"] for r in range(W)])
    for rank in range(W):
        assert not out[rank]["holds_estimate"]
        err = rel_err(out[rank]["params"], expected)
        assert err <= 1e-5, f"rank {rank}: ACCO differs from its recurrence by {err:.2e}"
        assert out[rank]["estimate_clean"] == [True] * (rounds // 2)
    # The reference must actually train: the parameters moved.
    assert rel_err(expected, flat(make_model()).cpu()) > 1e-3


@pytest.mark.skipif(W < 2, reason="needs two workers, one of them slow")
def test_acco_fast_worker_contributes_more_and_every_micro_batch_weighs_the_same():
    """Rank 1 takes 3x as long per micro-batch (the --slowdown pacer: sleeping costs
    no CPU, like a slower GPU). The fast rank keeps accumulating while each round waits for the slow one,
    so it computes about 3x the micro-batches; the update still equals the
    recurrence with N = the true total of micro-batches, whatever the split."""
    rounds = 8
    # max_accum leaves room: if a round outlasts the slow rank's micro-batches (slow
    # collectives, e.g. gloo with CUDA tensors), both ranks keep accumulating at 1:3.
    out = run_dist(_acco_worker, W, rounds, slowdown=[1.0, 3.0], max_accum=40)
    fast, slow = (sum(out[r]["counts"]) for r in range(W))
    ratio = fast / slow
    print(f"fast/slow micro-batches {fast}/{slow}")
    assert 2.0 <= ratio <= 4.5, f"fast/slow micro-batches {fast}/{slow} = {ratio:.2f}, expected about 3"
    assert all(c >= ACCUM for r in range(W) for c in out[r]["counts"])
    expected = acco_reference([out[r]["counts"] for r in range(W)])
    for rank in range(W):
        err = rel_err(out[rank]["params"], expected)
        assert err <= 1e-5, f"rank {rank}: uneven ACCO differs from its recurrence by {err:.2e}"


# -- DPU -----------------------------------------------------------------------

def _dpu_worker(rank, world, steps, warmup):
    model = make_model()
    strat = lowcomm.make_run("dpu", model, lowcomm.Comm(), make_optimizer, accum=ACCUM,
                                  warmup_steps=warmup)
    next_batch = Counter(rank)
    for _ in range(steps):
        strat.step(next_batch, lm_loss)
    return flat(model).cpu()


def dpu_reference(steps: int, warmup: int) -> torch.Tensor:
    model = make_model()
    theta = flat(model)
    ref = RefOpt(theta)
    pending = None
    for t in range(steps):
        batches = [micro_batch(r, t * ACCUM + i) for r in range(W) for i in range(ACCUM)]
        g = grad_sum(model, theta, batches) / (W * ACCUM)   # g(θ_t)
        if t < warmup:
            theta = ref.step(g)
        else:
            if pending is not None:
                theta = ref.step(pending)                    # θ_{t+1} = opt(θ_t; g(θ_{t-1}))
            pending = g
    return theta.cpu()


@pytest.mark.parametrize("warmup", [0, 3])
def test_dpu_matches_its_one_step_delayed_reference(warmup):
    steps = 12
    out = run_dist(_dpu_worker, W, steps, warmup)
    expected = dpu_reference(steps, warmup)
    for rank in range(W):
        err = rel_err(out[rank], expected)
        assert err <= 1e-5, f"rank {rank}: DPU differs from its reference by {err:.2e}"
    # ...and the delay matters: a synchronous run of the same steps ends elsewhere.
    assert rel_err(expected, dpu_reference(steps, steps)) > 1e-4
