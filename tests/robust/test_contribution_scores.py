"""The scoreboard's rule on hand-made rounds: left out after --score-patience negative scores,
taken back after as many non-negative ones, copies and stale replays counted once and named;
and the held sequences every worker gets to score on (threads standing in for workers)."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from lowcomm.engines.outer_scoring import ROOM_TOKENS, OuterScoring, room_for
from lowcomm.robust.scoring import Scoreboard


def rows(*values):
    return torch.tensor([[float(v), 1.0] for v in values])


def test_left_out_after_patience_and_taken_back_when_the_score_recovers():
    board = Scoreboard(3, patience=2)
    scores = [-0.1, -0.2, 0.01, -0.3, 0.05, 0.0, -0.1, 0.2]
    seen = [board.judge(rows(10 * k + 1, 10 * k + 2, 10 * k + 3), [0.1, 0.1, s], [1, 1, -1]).tolist()[2]
            for k, s in enumerate(scores)]
    # out after two negatives; one lucky round (0.01) does not bring it back, two in a row do;
    # then one negative round again is not yet two
    assert seen == [True, False, False, False, False, True, True, True]
    events = [h["events"] for h in board.history]
    assert events[1] == ["worker 2 left out: its score was negative for 2 rounds"]
    assert events[5] == ["worker 2 taken back: its score was non-negative for 2 rounds"]
    assert sum(len(e) for e in events) == 2


def test_a_copy_is_counted_once_and_a_replay_of_an_earlier_round_is_stale():
    board = Scoreboard(3, patience=3)
    assert board.judge(rows(1, 2, 1), [0.1] * 3, [1] * 3).tolist() == [True, True, False]
    assert board.history[0]["events"] == ["workers 0 and 2 sent the same contribution (a copy by one of them: counted once)"]
    assert board.history[0]["copies"] == [[0, 2]] and board.history[0]["left_out"] == []  # its content is in
    assert board.judge(rows(5, 2, 6), [0.1] * 3, [1] * 3).tolist() == [True, False, True]
    assert board.history[1]["events"] == ["worker 1 sent a contribution of round 0 (stale)"]


def test_a_zero_contribution_is_named_and_a_round_never_drops_everyone():
    board = Scoreboard(2, patience=1)
    assert board.judge(torch.ones(2, 2), None, None).tolist() == [True, False]  # no scores: a copy still named
    assert board.judge(torch.zeros(2, 2), [0.0, 0.0], [-1, -1]).tolist() == [True, True]
    assert board.history[1]["events"] == ["worker 0 sent nothing (a zero contribution)",
                                          "worker 1 sent nothing (a zero contribution)"]


def test_a_worker_holds_the_first_sequences_it_trained_on_since_the_last_sync():
    from lowcomm import GPT
    from lowcomm.robust.scoring import HeldBatch

    model = GPT(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=8)
    held = HeldBatch(model, sequences=2)
    first, second = torch.randint(0, 32, (3, 8)), torch.randint(0, 32, (3, 8))
    model.eval()
    model(second)                     # an evaluation: not training data
    model.train()
    held.paused = True
    model(second)                     # a probe of the scoring itself
    held.paused = False
    model(first), model(second)
    assert torch.equal(held.take(), first[:2])
    assert torch.equal(held.take(), first[:2])  # nothing trained since: the sequences held before
    model(second)
    assert torch.equal(held.take(), second[:2])
    held.close()
    model(first)
    assert torch.equal(held.take(), second[:2])


def test_an_unscored_contribution_keeps_its_standing():
    """A lone validator's own contribution has no scorer (None): neither left out nor taken back by score."""
    board = Scoreboard(3, patience=1)
    assert board.judge(rows(1, 2, 3), [None, 0.1, -0.1], [None, 1, -1]).tolist() == [True, True, False]
    assert board.judge(rows(4, 5, 6), [None, -0.1, 0.2], [None, -1, 1]).tolist() == [True, False, True]
    assert board.history[1]["events"] == ["worker 1 left out: its score was negative for 1 round",
                                          "worker 2 taken back: its score was non-negative for 1 round"]
    assert board.negative.get(0, 0) == board.positive.get(0, 0) == 0  # never counted


class ThreadedGather:
    """`world` threads' bookkeeping all-gather: each rank's tensor in, every rank's stacked out
    (rank order), the calls counted per rank."""

    def __init__(self, world: int):
        self.world, self.barrier = world, threading.Barrier(world, timeout=60)  # a failed rank breaks it
        self.slots, self.calls = [None] * world, [0] * world

    def comm(self, rank: int) -> SimpleNamespace:
        return SimpleNamespace(rank=rank, world=self.world, meta_all_gather=lambda t: self.gather(rank, t))

    def gather(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        self.calls[rank] += 1
        self.slots[rank] = tensor.clone()
        self.barrier.wait()
        every = torch.stack(self.slots)
        self.barrier.wait()  # nobody's next tensor overwrites a slot before every rank read it
        return every


def shared(room: tuple[int, int], held: list) -> tuple[list[torch.Tensor], list[int]]:
    """What each of len(held) workers gets from OuterScoring._share, and how many gathers it took."""
    group, out = ThreadedGather(len(held)), [None] * len(held)

    def worker(rank):
        scoring = SimpleNamespace(room=room, replica=None)
        out[rank] = OuterScoring._share(scoring, group.comm(rank), held[rank], torch.device("cpu"))
    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(len(held))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out, group.calls


def test_the_held_sequences_are_shared_cut_to_the_fewest_and_shortest_in_one_gather_where_they_fit():
    held = [torch.randint(0, 50, (3, 8)), torch.randint(0, 50, (4, 6)), torch.randint(0, 50, (4, 9))]
    want = torch.stack([h[:3, :6] for h in held])
    for room, gathers in (((4, 16), 1), ((3, 6), 1), ((4, 5), 2), ((4, 0), 2)):  # (4, 0): the model's length unknown
        every, calls = shared(room, held)
        assert calls == [gathers] * 3, room
        assert all(torch.equal(e, want) for e in every), room
    for room in ((4, 16), (4, 0)):  # a worker that holds none: no evidence
        every, calls = shared(room, [held[0], None, held[2]])
        assert calls == [1] * 3 and all(e.shape == (3, 0, 0) for e in every), room


def test_the_room_is_the_models_positions_up_to_a_bound():
    from lowcomm import GPT
    gpt = GPT(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=8)
    long_context = torch.nn.Linear(2, 2)
    long_context.config = SimpleNamespace(max_position_embeddings=131072)  # as a Hugging Face model says it
    assert room_for(gpt, 4) == room_for(SimpleNamespace(module=gpt), 4) == (4, 8)  # a wrapper's own module
    assert room_for(long_context, 2) == (2, ROOM_TOKENS) and room_for(torch.nn.Linear(2, 2), 4) == (4, 0)


def test_each_batchs_loss_at_the_global_model_is_computed_once_by_a_validator_that_needs_it():
    from lowcomm.robust.scoring import base_scorers, gauntlet_scores, scorers
    for world, validators in ((4, (0, 1, 2, 3)), (3, (0,)), (5, (1, 3)), (2, (0, 1))):
        for round_ in range(3):
            assigned = scorers(world, validators, round_)
            owner = base_scorers(assigned)
            for r, v in enumerate(assigned):  # a scorer needs r's own batch and the next one's
                if v is not None:
                    assert owner[r] is not None and owner[(r + 1) % world] is not None, (world, validators, round_)
            if validators == tuple(range(world)):  # every worker validating: one batch each
                assert sorted(owner) == list(range(world))
    # scores from the shared table: worker 1's random batch is worker 2's, its loss at θ read from there
    scores, fits = gauntlet_scores([2.0, 4.0, 5.0], [0.5, 3.0, 0.0], [1.5, 4.0, 0.0], [1, None, 0])
    assert scores == [(4.0 - 1.5) / 4.0, None, (2.0 - 0.0) / 2.0]
    assert fits == [1.0, None, -1.0]  # worker 0: own gain 0.75 > random 0.625; worker 2: own 1.0, not above 1.0


def test_a_model_not_called_on_token_ids_is_refused_at_its_first_training_forward():
    """--score scores a language model: a user's model called on anything else (wrap()) is told so
    in one line at its first training step, not by a dtype error deep inside a probe's forward."""
    import pytest

    from lowcomm.errors import UsageError
    from lowcomm.robust.scoring import HeldBatch

    mlp = torch.nn.Sequential(torch.nn.Linear(8, 4))
    held = HeldBatch(mlp, sequences=2)
    mlp.eval()
    mlp(torch.randn(3, 8))  # an evaluation is not training data
    mlp.train()
    with pytest.raises(UsageError, match=r"this model is called on a float32 tensor of shape \[3, 8\]: score a model "
                                         r"called on token ids"):
        mlp(torch.randn(3, 8))
    held.close()
