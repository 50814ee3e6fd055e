"""What every registered strategy declares of its state (contract/parts.py), checked in one
process over `available()`: each part has a kind the runtime knows, the run's state_dict() is
exactly its parts, a state that lacks one (or is kept by position, as before the parts) is
refused in one line, a joiner's state is its peer's but for its local parts, and only a state of
replicated parts alone (ddp's) is one a checkpoint stores once."""
from __future__ import annotations

import pytest
import torch

import lowcomm
from lowcomm.contract.parts import LOCAL, REPLICATED, SHARDED, as_joiner, tensors
from lowcomm.errors import UsageError
from lowcomm.run.driver import make_run
from lowcomm.strategies import available

SEQ = 8


CASES = available() + ["diloco eager"]  # eager: a local optimizer (its stand-in's momentum) a joiner starts fresh


def trained(case: str, seed: int = 0, steps: int = 3):
    """A one-process run of `case` after `steps` steps (its reproducible options)."""
    torch.manual_seed(seed)
    name = case.split()[0]
    model = lowcomm.GPT(vocab_size=64, seq_len=SEQ, n_layer=1, n_head=2, d_model=8)
    options = {"diloco": {"sync_every": 2}, "sparseloco": {"sync_every": 2}, "streaming_diloco": {"sync_every": 4},
               "acco": {"deterministic": True}, "dpu": {"warmup_steps": 1}, "powersgd": {"start": 2},
               "diloco eager": {"sync_every": 2, "outer_delay": 1, "eager": True}}
    run = make_run(name, model, lowcomm.Comm(), lambda ps: torch.optim.AdamW(ps, lr=1e-2), accum=2,
                   total_steps=8, **options.get(case, {}))
    g = torch.Generator().manual_seed(seed)

    def batch():
        seq = torch.randint(0, 64, (2, SEQ + 1), generator=g)
        return seq[:, :-1], seq[:, 1:]
    for _ in range(steps):
        run.step(batch, lowcomm.lm_loss)
    return run


@pytest.fixture(scope="module")
def runs():
    built = {case: trained(case) for case in CASES}
    yield built
    for run in built.values():
        run.close()


@pytest.mark.parametrize("name", available())
def test_the_state_is_exactly_the_declared_parts(name, runs):
    run = runs[name]
    parts = run.strategy.state_parts()
    assert all(p.kind in (REPLICATED, LOCAL, SHARDED) for p in parts.values()), name
    assert all(p.layout is not None for p in parts.values() if p.kind == SHARDED), name
    assert all(p.joiner in ("zero", "peer") or callable(p.joiner) for p in parts.values() if p.kind == LOCAL), name
    sd = run.state_dict()
    assert sorted(sd) == ["parts", "precision", "steps_done", "strategy"] and list(sd["parts"]) == list(parts)
    assert "model" in parts


@pytest.mark.parametrize("name", available())
def test_a_state_lacking_a_part_or_kept_by_position_is_refused_in_one_line(name, runs):
    run = runs[name]
    sd = run.state_dict()
    lacking = {**sd, "parts": {k: v for k, v in sd["parts"].items() if k != "model"}}
    with pytest.raises(UsageError, match=r"^the state holds parts \[.*\], the strategy declares \[.*'model'.*\]$"):
        run.load_state_dict(lacking)
    older = {"strategy": run.strategy.name, "steps_done": 3, "model": sd["parts"]["model"], "optimizers": [], "extra": {}}
    with pytest.raises(UsageError, match="^this state was saved by an older lowcomm"):
        run.load_state_dict(older)


@pytest.mark.parametrize("name", CASES)
def test_a_joiner_takes_its_peers_state_but_its_local_parts(name, runs):
    run = runs[name]
    parts = run.strategy.state_parts()
    peer = run.state_dict()
    joiner = as_joiner(parts, peer)
    for key, part in parts.items():
        mine, theirs = tensors(joiner["parts"][key]), tensors(peer["parts"][key])
        assert mine.keys() == theirs.keys(), (name, key)
        if part.kind == LOCAL and part.joiner != "peer":  # a fresh worker's: zeros (an optimizer: its moments)
            assert not any(t.any() for t in mine.values()), (name, key)
        else:
            assert all(torch.equal(mine[k], theirs[k]) for k in theirs), (name, key)


def test_only_ddps_state_is_stored_once_in_a_checkpoint(runs):
    assert [case for case, run in runs.items() if run.state_replicated] == ["ddp"]
