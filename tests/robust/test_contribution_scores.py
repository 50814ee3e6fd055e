"""The scoreboard's rule on hand-made rounds: left out after --score-patience negative scores,
taken back at the first non-negative one, copies and stale replays counted once and named."""
from __future__ import annotations

import torch

from lowcomm.robust.scoring import Scoreboard


def rows(*values):
    return torch.tensor([[float(v), 1.0] for v in values])


def test_left_out_after_patience_and_taken_back_when_the_score_recovers():
    board = Scoreboard(3, patience=2)
    seen = [board.judge(rows(10 * k + 1, 10 * k + 2, 10 * k + 3), [0.1, 0.1, s], [1, 1, -1]).tolist()
            for k, s in enumerate([-0.1, -0.2, -0.3, 0.05, -0.1])]
    assert seen == [[True] * 3, [True, True, False], [True, True, False], [True] * 3, [True] * 3]
    events = [h["events"] for h in board.history]
    assert events[1] == ["worker 2 left out: its score was negative for 2 rounds"]
    assert events[3] == ["worker 2 taken back: its score recovered (+0.0500)"]
    assert events[4] == []  # one negative round again: not yet


def test_a_copy_is_counted_once_and_a_replay_of_an_earlier_round_is_stale():
    board = Scoreboard(3, patience=3)
    assert board.judge(rows(1, 2, 1), [0.1] * 3, [1] * 3).tolist() == [True, True, False]
    assert board.history[0]["events"] == ["worker 2 sent worker 0's contribution (a copy)"]
    assert board.judge(rows(5, 2, 6), [0.1] * 3, [1] * 3).tolist() == [True, False, True]
    assert board.history[1]["events"] == ["worker 1 sent a contribution of round 0 (stale)"]


def test_a_zero_contribution_is_named_and_a_round_never_drops_everyone():
    board = Scoreboard(2, patience=1)
    assert board.judge(torch.zeros(2, 2), [0.0, 0.0], [-1, -1]).tolist() == [True, True]
    assert board.history[0]["events"] == ["worker 0 sent nothing (a zero contribution)",
                                          "worker 1 sent nothing (a zero contribution)"]
