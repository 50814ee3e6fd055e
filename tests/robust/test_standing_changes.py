"""A scored round's entry names the workers its scores left out and took back (`newly_left_out`,
`taken_back`, by slot), and the progress line's words come from those fields, not from matching
the events' text; an entry of an older checkpoint, without them, changes no one's standing."""
from __future__ import annotations

import torch

from lowcomm.robust.scoring import Scoreboard, standing_changes


def rows(k: int, world: int):
    return torch.tensor([[float(10 * k + r + 1), 1.0] for r in range(world)])


def judged(board: Scoreboard, scores: list[list[float]]) -> list[dict]:
    for k, round_scores in enumerate(scores):
        board.judge(rows(k, len(round_scores)), round_scores, [1.0] * len(round_scores))
    return board.history


def test_each_round_names_the_slots_it_left_out_and_took_back_and_the_words_follow():
    # an elastic round's ranks 0..2 are slots 0, 2 and 5: the fields and words name slots
    board = Scoreboard(3, patience=2, slots=[0, 2, 5])
    history = judged(board, [[0.1, -0.1, -0.2], [0.1, -0.1, -0.2], [0.1, 0.3, -0.1], [0.2, 0.1, -0.1],
                             [-0.1, 0.2, 0.3], [-0.1, 0.1, 0.1]])
    assert [(h["newly_left_out"], h["taken_back"]) for h in history] == [
        ([], []), ([2, 5], []), ([], []), ([], [2]), ([], []), ([0], [5])]
    for h in history:  # the words are the events that changed a standing, replays left to the report
        assert standing_changes(h, board.patience) == [e for e in h["events"] if "its score was" in e]
    assert standing_changes(history[5], 2) == ["worker 0 left out: its score was negative for 2 rounds",
                                               "worker 5 taken back: its score was non-negative for 2 rounds"]
    assert board.left_out == {0}


def test_the_words_come_from_the_fields_not_the_events_text():
    board = Scoreboard(2, patience=1)
    board.judge(torch.ones(2, 2), [0.1, 0.1], [1.0, 1.0])  # worker 1 copies worker 0: named, not a standing
    assert board.history[0]["events"] == ["workers 0 and 1 sent the same contribution (a copy by one of them: counted once)"]
    assert standing_changes(board.history[0], 1) == []
    # events that read like a standing change, without the fields (an older checkpoint's entry): none
    older = {"round": 3, "left_out": [1], "events": ["worker 1 left out: its score was negative for 1 round"]}
    assert standing_changes(older, 1) == []


def test_a_board_from_an_older_checkpoint_loads_and_goes_on():
    board = Scoreboard(2, patience=1)
    judged(board, [[0.1, -0.1], [0.1, 0.2]])
    state = board.state_dict()
    for h in state["history"]:  # as a checkpoint written before the fields existed holds them
        del h["newly_left_out"], h["taken_back"]
    resumed = Scoreboard(2, patience=1)
    resumed.load_state_dict(state)
    assert [standing_changes(h, 1) for h in resumed.history] == [[], []]
    resumed.judge(rows(2, 2), [-0.1, 0.1], [1.0, 1.0])
    assert (resumed.history[-1]["newly_left_out"], resumed.history[-1]["taken_back"]) == ([0], [])
    assert resumed.left_out == {0} and resumed.rounds == 3
