"""Single-process pieces for checking the overlapped strategies (acco, dpu) against their
recurrences, written from ALGORITHMS.md, not from the strategy code. Micro-batch k of rank
r is a deterministic function of (r, k), so a reference can recompute exactly the
gradients each rank computed.

Checked against the authors' code (edouardoyallon/acco, trainer_decoupled.py) and equal to it:
ACCO's start-up gradient at θ_0 fills the buffer and the accumulator (prepare_grads and
prepare_buffer_com, lines 244-294); a round divides the reduced gradient sum by the all-reduced
count, steps the shard and all-gathers it, snapshotting and restoring shard and AdamW state on
estimate rounds (communication_step, lines 67-125); after a round the model takes the gathered
parameters, the buffer takes the accumulator, and the accumulator is zeroed after estimate
rounds only (update_buffers_step, lines 43-63, called from train_acco, lines 501-517), so a
real update sums the gradients at θ̃_t and θ_t. DPU applies last step's gradient (train_dpu,
lines 619-663), without that code's zeroing on every other step only (ALGORITHMS.md)."""
from __future__ import annotations

import copy
import os

import torch

from lowcomm.models import GPT, lm_loss

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
