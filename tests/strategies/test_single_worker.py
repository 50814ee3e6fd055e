"""W=1: the sharded strategies must equal plain AdamW, both in a one-rank gloo
group (collectives really run) and with no process group at all (Comm does
each collective's local effect). A no-op collective here once left zero1's
shard gradient uninitialised. Every strategy runs a user's loop through wrap()
in a process without a group as in a one-rank group (ddp once needed torch's
DDP, which needs a group; one worker's received bytes once sat at an offset
their dtype could not view)."""
from __future__ import annotations

import pytest
import torch
from dist_utils import rel_err, run_dist

import lowcomm
from lowcomm.models import GPT, lm_loss
from lowcomm.strategies import available, get

pytestmark = pytest.mark.procs

STEPS, ACCUM = 6, 2


def make_model():
    torch.manual_seed(0)
    return GPT(vocab_size=256, seq_len=16, n_layer=1, n_head=2, d_model=16)


def batch(k):
    g = torch.Generator().manual_seed(k)
    seq = torch.randint(0, 256, (4, 17), generator=g)
    return seq[:, :-1], seq[:, 1:]


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def train(name: str) -> torch.Tensor:
    model = make_model()
    options = {"deterministic": True} if name == "acco" else {}
    strategy = lowcomm.make_run(name, model, lowcomm.Comm(), make_optimizer, accum=ACCUM, **options)
    counter = iter(range(10_000))
    # acco: an optimizer step takes two rounds; an even count ends holding the real θ
    for _ in range(STEPS if name != "acco" else 2 * STEPS):
        strategy.step(lambda: batch(next(counter)), lm_loss)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def _in_group(rank, world, name):
    return train(name)


def reference() -> torch.Tensor:
    model = make_model()
    opt = make_optimizer(model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        for i in range(ACCUM):
            (lm_loss(model, batch(step * ACCUM + i)) / ACCUM).backward()
        opt.step()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


@pytest.mark.parametrize("name", ["zero1", "dpu"])
def test_one_worker_equals_adamw(name):
    expected = reference() if name == "zero1" else None
    alone = train(name)                              # no process group
    grouped = run_dist(_in_group, 1, name)[0]        # a one-rank gloo group
    assert rel_err(grouped, alone) <= 1e-6
    if expected is not None:
        assert rel_err(alone, expected) <= 1e-5
    assert rel_err(alone, torch.nn.utils.parameters_to_vector(make_model().parameters()).detach()) > 1e-3


def test_one_worker_acco_runs_alone_and_in_a_group():
    assert rel_err(run_dist(_in_group, 1, "acco")[0], train("acco")) <= 1e-6


# Odd sizes: top-k 5 and blocks of 7 leave a worker's bytes off their dtype's alignment (the
# model has 7,520 values: 7,525 in blocks of 7); powersgd past its plain all-reduce start.
ONE_WORKER_OPTIONS = {"demo": {"topk": 5}, "quantized": {"block_size": 7}, "onebit_adam": {"block_size": 7},
                      "powersgd": {"start": 2, "rank": 2}, "diloco": {"sync_every": 2},
                      "sparseloco": {"sync_every": 2}, "streaming_diloco": {"sync_every": 2, "fragments": 2,
                                                                                  "fragment_delay": 1}}


def wrapped(name: str) -> torch.Tensor:
    """A user's loop through wrap(): STEPS · ACCUM backward calls, then close()."""
    model = make_model()
    options = {**get(name).reproducible_options, **ONE_WORKER_OPTIONS.get(name, {})}
    with lowcomm.wrap(model, make_optimizer, name, accum=ACCUM, total_steps=STEPS, **options) as run:
        for k in range(STEPS * ACCUM):
            run.backward(lm_loss(run.model, batch(k)))
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def _wrapped_in_group(rank, world):
    """Each strategy's parameters, or its error as text (each test then fails on its own)."""
    out = {}
    for name in available():
        try:
            out[name] = wrapped(name)
        except Exception as e:  # noqa: BLE001 -- reported by that strategy's test
            out[name] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def wrapped_in_a_group():
    return run_dist(_wrapped_in_group, 1)[0]


@pytest.mark.parametrize("name", available())
def test_every_strategy_runs_a_users_loop_without_a_process_group(name, wrapped_in_a_group):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the group's process: the same float sums
    try:
        alone = wrapped(name)
    finally:
        torch.set_num_threads(threads)
    grouped = wrapped_in_a_group[name]
    assert not isinstance(grouped, str), f"in a one-rank group: {grouped}"
    assert rel_err(alone, grouped) <= 1e-6
    assert rel_err(alone, torch.nn.utils.parameters_to_vector(make_model().parameters()).detach()) > 1e-3
    if name == "ddp":
        assert rel_err(alone, reference()) <= 1e-5
