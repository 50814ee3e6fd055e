"""--attack wrong-data names a worker by its slot under --elastic, as the other attacks do: after a
member is lost and the ranks shift, the reversed windows stay with the worker --attackers names,
not with whichever worker now holds its old rank. The driver's step is run for real (W = 1, no
process group), its membership named as the elastic member names it (elastic.support.configure)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

import lowcomm
from lowcomm.elastic.support import configure
from lowcomm.models import lm_loss

SEQ = 8


def trained_on(attackers: str, slots: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor, object]:
    """The inputs one step trained on (the loss function's batch) and the batch handed in, with the
    run's engine's attackers, for a W = 1 diloco run whose rank 0 holds `slots` (None: a plain run)."""
    torch.manual_seed(0)
    model = lowcomm.GPT(vocab_size=32, seq_len=SEQ, n_layer=1, n_head=2, d_model=8)
    run = lowcomm.make_run("diloco", model, lowcomm.Comm(), lambda p: torch.optim.AdamW(p, lr=1e-2), total_steps=2,
                           sync_every=2, attack="wrong-data", attackers=attackers)
    if slots is not None:  # as an elastic member names its membership (its replicas' slots, rank order)
        configure(run, SimpleNamespace(min_workers=1, replicas=0, workers=3), slots)
    seq = torch.randint(0, 32, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    given, seen = (seq[:, :-1], seq[:, 1:]), []
    run.step(lambda: given, lambda m, batch: seen.append(batch[0]) or lm_loss(m, batch))
    attackers_of_engine = run.strategy.sync.attackers
    run.close()
    return seen[0], given, attackers_of_engine


def test_the_reversed_windows_follow_the_slot_not_the_rank():
    reversed_ = lambda given: given[1].flip(-1)  # noqa: E731  (attacks.wrong_data: the targets read backwards)
    # a plain run: the rank is the worker
    inputs, given, _ = trained_on("0", None)
    assert torch.equal(inputs, reversed_(given))
    # worker 0 was lost and worker 2 is rank 0 of this membership: it attacks, as --attackers 2 says
    inputs, given, engine = trained_on("2", (2,))
    assert torch.equal(inputs, reversed_(given)) and engine.slots == (2,)
    # worker 1 holds rank 0 now: worker 0's attack does not move to it
    inputs, given, engine = trained_on("0", (1,))
    assert torch.equal(inputs, given[0]) and engine.slots == (1,)
