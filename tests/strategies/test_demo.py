"""demo: DeMo against an independent transcription of the authors' optimizer (one param group,
and two: biases at lr 0 without decay, the rest at lr 1e-2 with decay 0.1), exact transmission
with k = chunk², bytes counted equal the plan at W=2 and W=3, momenta survive state_dict."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import lowcomm
from lowcomm.run.driver import make_run

from compressed_common import (ACCUM, assert_bytes_equal_plans, assert_round_trip, batch, build, counted_bytes,
                               in_shared_spawn, make_model, make_optimizer, round_trip, schedule, shared_results,
                               steps)
from dist_utils import flat_params, rel_err

pytestmark = pytest.mark.procs

BYTE_CASES = [("demo", {}, 2), ("demo", {"compact_index": True, "values": "bf16"}, 2),
              ("demo", {"values": "sign", "compact_index": True, "chunk": 16, "topk": 5}, 2)]
W3_CASES = BYTE_CASES[1:]  # W=3: fewer cases, the run is the cost


# -- an independent transcription of the authors' standalone optimizer --------------------------
# (github.com/bloc97/DeMo, demo.py: FFT-based DCT, einsum blocks, top-k, scatter-mean decode,
# all_gather of (int64 index, fp32 value), decoupled weight decay, sign-SGD)

def _authors_dct(x):
    shape, N = x.shape, x.shape[-1]
    x = x.contiguous().view(-1, N)
    v = torch.cat([x[:, ::2], x[:, 1::2].flip([1])], dim=1)
    Vc = torch.view_as_real(torch.fft.fft(v, dim=1))
    k = -torch.arange(N, dtype=x.dtype)[None, :] * math.pi / (2 * N)
    V = Vc[:, :, 0] * torch.cos(k) - Vc[:, :, 1] * torch.sin(k)
    V[:, 0] /= math.sqrt(N) * 2
    V[:, 1:] /= math.sqrt(N / 2) * 2
    return 2 * V.view(*shape)


def _authors_idct(X):
    shape, N = X.shape, X.shape[-1]
    Xv = X.contiguous().view(-1, N) / 2
    Xv[:, 0] *= math.sqrt(N) * 2
    Xv[:, 1:] *= math.sqrt(N / 2) * 2
    k = torch.arange(N, dtype=X.dtype)[None, :] * math.pi / (2 * N)
    Wr, Wi = torch.cos(k), torch.sin(k)
    Vtr, Vti = Xv, torch.cat([Xv[:, :1] * 0, -Xv.flip([1])[:, :-1]], dim=1)
    V = torch.stack([Vtr * Wr - Vti * Wi, Vtr * Wi + Vti * Wr], dim=2)
    v = torch.fft.irfft(torch.view_as_complex(V), n=N, dim=1)
    x = v.new_zeros(v.shape)
    x[:, ::2] += v[:, :N - N // 2]
    x[:, 1::2] += v.flip([1])[:, :N // 2]
    return x.view(*shape)


def _smaller_split(n, close_to):
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    for i, d in enumerate(divisors):
        if d == close_to:
            return d
        if d > close_to:
            return divisors[i - 1] if i else d
    return n


class AuthorsDeMo:
    """`hyper`: per parameter (lr scale, weight decay), as param groups set them (the authors'
    optimizer reads lr per group and takes one weight decay); default (1, weight_decay)."""

    def __init__(self, params, decay=0.999, topk=32, chunk=64, weight_decay=0.0, hyper=None):
        self.params, self.decay, self.topk = list(params), decay, topk
        self.hyper = hyper or [(1.0, weight_decay)] * len(self.params)
        self.delta = [torch.zeros_like(p) for p in self.params]
        self.split, self.f, self.b = {}, {}, {}
        for p in self.params:
            for s in p.shape:
                sc = self.split[s] = _smaller_split(s, chunk)
                if sc not in self.f:
                    eye = torch.eye(sc)
                    self.f[sc], self.b[sc] = _authors_dct(eye), _authors_idct(eye)

    def encode(self, x):
        if x.dim() > 1:
            n1, n2 = self.split[x.shape[0]], self.split[x.shape[1]]
            x = x.reshape(x.shape[0] // n1, n1, x.shape[1] // n2, n2)
            return torch.einsum("...ijkl, jb, ld -> ...ikbd", x, self.f[n1], self.f[n2])
        n1 = self.split[x.shape[0]]
        return torch.einsum("...ij, jb -> ...ib", x.reshape(-1, n1), self.f[n1])

    def decode(self, x):
        if x.dim() > 2:
            y, xx, n1, n2 = x.shape
            x = torch.einsum("...ijkl, kb, ld -> ...ibjd", x, self.b[n1], self.b[n2])
            return x.reshape(y * n1, xx * n2)
        return torch.einsum("...ij, jb -> ...ib", x, self.b[x.shape[1]]).reshape(-1)

    def compress(self, x):
        xshape = x.shape
        if x.dim() > 2:
            x = x.reshape(xshape[0], xshape[1], -1)
        k = max(1, min(self.topk, x.shape[-1]))
        idx = torch.topk(x.abs(), k=k, dim=-1, largest=True, sorted=False).indices
        return idx, torch.gather(x, -1, idx), xshape

    def decompress(self, idx, val, xshape):
        x = torch.zeros(xshape)
        if len(xshape) > 2:
            x = x.reshape(xshape[0], xshape[1], -1)
        x.scatter_reduce_(-1, idx, val, reduce="mean", include_self=False)
        return x.reshape(xshape)

    @torch.no_grad()
    def step(self, lr):
        world = dist.get_world_size() if dist.is_initialized() else 1
        for p, delta, (scale, wd) in zip(self.params, self.delta, self.hyper):
            lr_p = lr * scale
            if wd:
                p.mul_(1.0 - lr_p * wd)
            delta.mul_(self.decay).add_(p.grad, alpha=lr_p)
            idx, val, xshape = self.compress(self.encode(delta))
            delta.sub_(self.decode(self.decompress(idx, val, xshape)))
            idxs, vals = [idx], [val]
            if world > 1:
                idxs = [torch.zeros_like(idx) for _ in range(world)]
                vals = [torch.zeros_like(val) for _ in range(world)]
                dist.all_gather(idxs, idx)
                dist.all_gather(vals, val)
            q = self.decode(self.decompress(torch.cat(idxs, -1), torch.cat(vals, -1), xshape))
            p.add_(q.sign(), alpha=-lr_p)


def no_decay_on_biases(model):
    """make_optimizer of the common recipe: biases at lr 0 and no decay, the rest at lr 1e-2
    with decay 0.1 (a norm's bias and its weight have the same shape: they must not share a stack)."""
    names = {id(p): n for n, p in model.named_parameters()}

    def make(params):
        params = list(params)
        biases = [p for p in params if names[id(p)].endswith("bias")]
        rest = [p for p in params if not names[id(p)].endswith("bias")]
        return torch.optim.AdamW([{"params": biases, "lr": 0.0, "weight_decay": 0.0}, {"params": rest}],
                                 lr=1e-2, weight_decay=0.1)
    return make, [(0.0, 0.0) if names[id(p)].endswith("bias") else (1.0, 0.1) for p in model.parameters()]


def against_the_authors(rank, n, groups=False, topk=32):
    """n steps of the strategy and of the transcription from the same start (`groups`: the
    common recipe's two param groups): both parameters and momenta, and the start."""
    model = make_model()
    make, hyper = no_decay_on_biases(model) if groups else (make_optimizer, None)
    start = flat_params(model)
    run = make_run("demo", model, lowcomm.Comm(), make, accum=ACCUM, schedule=schedule, topk=topk)
    steps(run, rank, n)
    ref = make_model()
    authors = AuthorsDeMo(ref.parameters(), topk=topk, weight_decay=0.1, hyper=hyper)
    for step in range(n):
        for p in ref.parameters():
            p.grad = None
        for micro in range(ACCUM):
            (lowcomm.lm_loss(ref, batch(step, rank, micro)) / ACCUM).backward()
        authors.step(schedule(step))
    out = {"strategy": flat_params(model), "authors": flat_params(ref), "start": start,
           "momentum": run.strategy.momentum(), "authors_momentum": authors.delta,
           "biases": [name.endswith("bias") for name, _ in model.named_parameters()]}
    run.close()
    return out


def every_coefficient(rank, world):
    """k = chunk²: every worker's δ is transmitted exactly; the decoded Q and each rank's δ."""
    _, strategy = build("demo", topk=64 * 64)
    decoded = {}
    for i, enc in enumerate(strategy.strategy.encoders):
        def recording(idxs, vals, i=i, orig=enc.decompress):
            q = orig(idxs, vals)
            if len(idxs) == world:
                decoded[i] = q.clone()
            return q
        enc.decompress = recording
    grads_model = make_model()
    for micro in range(ACCUM):
        (lowcomm.lm_loss(grads_model, batch(0, rank, micro)) / ACCUM).backward()
    delta = [schedule(0) * p.grad.clone() for p in grads_model.parameters()]
    steps(strategy, rank, 1)
    left = max(float(d.abs().max()) for d in strategy.strategy.momentum())  # δ, decoded from δ̂
    strategy.close()
    return {"delta": delta, "decoded": [decoded[i] for i in range(len(delta))], "left": left}


@in_shared_spawn
def demo_checks(rank, world, path):
    if world != 2:
        return {"bytes": counted_bytes(rank, W3_CASES)}
    return {"one_group": against_the_authors(rank, 10), "two_groups": against_the_authors(rank, 10, groups=True, topk=8),
            "every_coefficient": every_coefficient(rank, world), "round_trip": round_trip(rank, "demo", {}),
            "bytes": counted_bytes(rank, BYTE_CASES)}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return {world: shared_results(demo_checks, world, tmp_path_factory) for world in (2, 3)}


def test_demo_equals_the_authors_optimizer(spawned):
    for r in spawned[2]:
        err = rel_err(r["one_group"]["strategy"], r["one_group"]["authors"])
        assert err <= 1e-6, f"demo differs from the authors' DeMo by {err:.2e} after 10 steps"
    assert torch.equal(spawned[2][0]["one_group"]["strategy"], spawned[2][1]["one_group"]["strategy"])


def test_each_param_group_steps_at_its_own_lr_and_weight_decay(spawned):
    """Biases at lr 0 stay put and keep no momentum (a bias never shares a stack with the
    same-shaped norm weight: top-k 8 of a 32-chunk leaves momentum behind), the rest moves as
    the transcription with per-group lr and decay."""
    for r in (x["two_groups"] for x in spawned[2]):
        err = rel_err(r["strategy"], r["authors"])
        assert err <= 1e-6, f"demo with two param groups differs from the transcription by {err:.2e}"
        momenta = (torch.cat([m.reshape(-1) for m in r[key]]) for key in ("momentum", "authors_momentum"))
        assert rel_err(*momenta) <= 1e-5
        at, moved = 0, False
        for m, is_bias in zip(r["momentum"], r["biases"]):
            now, before = r["strategy"][at:at + m.numel()], r["start"][at:at + m.numel()]
            at += m.numel()
            if is_bias:
                assert torch.equal(now, before) and float(m.abs().max()) == 0.0
            else:
                moved |= not torch.equal(now, before)
        assert moved and at == r["start"].numel()


def test_demo_with_every_coefficient_transmits_the_mean_momentum(spawned):
    a, b = (r["every_coefficient"] for r in spawned[2])
    assert a["left"] <= 1e-9 and b["left"] <= 1e-9  # nothing left behind in δ
    for qa, qb, da, db in zip(a["decoded"], b["decoded"], a["delta"], b["delta"]):
        mean = (da + db) / 2
        assert torch.equal(qa, qb)
        assert torch.allclose(qa, mean, rtol=0, atol=1e-6 * float(mean.abs().max()) + 1e-12)


def test_momenta_survive_state_dict(spawned):
    results = [r["round_trip"] for r in spawned[2]]
    assert_round_trip(results)
    assert any(float(d.abs().max()) > 0 for d in results[0][2]["dct_momenta"])


def test_one_worker_without_a_group_equals_the_authors_optimizer():
    """One worker decodes the bytes it packed itself. At top-k 5 a 32-long bias sends 5 fp32
    values (20 bytes), so the next tensor's int64 indices start off an 8-byte boundary."""
    r = against_the_authors(0, 3, topk=5)
    err = rel_err(r["strategy"], r["authors"])
    assert err <= 1e-6, f"demo on one worker differs from the authors' DeMo by {err:.2e} after 3 steps"
    assert rel_err(r["strategy"], r["start"]) > 1e-4


@pytest.mark.parametrize("world", [2, 3])
def test_counted_bytes_equal_the_plans(world, spawned):
    assert_bytes_equal_plans([r["bytes"] for r in spawned[world]], BYTE_CASES if world == 2 else W3_CASES, world)
