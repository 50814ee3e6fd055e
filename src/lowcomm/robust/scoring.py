"""Contribution scoring (--score): Covenant's validator rule ("Gauntlet", one-covenant/templar),
run by every worker on every contribution of an outer step before it is aggregated.

Each worker holds the first --score-batches sequences it trained on since the last sync (its
own assigned data, caught as its model's input: `HeldBatch`), and the workers share them at the
sync. Worker r's contribution Δ_r is scored on the model every worker holds, θ_global:

    L_b(θ)     next-token loss of batch b at θ
    own        worker r's batch;  random: the next worker's, (r + 1) mod W (data r was not given)
    score_r  = (L_random(θ_g) − L_random(θ_g − 0.2·lr·Δ_r)) / L_random(θ_g)  Gauntlet's score
    fit_r    = +1 if Δ_r improved own more than random, else −1        (did it train on its data?)

lr is the outer learning rate: Δ_r applied as if it were the round's mean, at Gauntlet's 0.2 of
the step (the slope along Δ_r, not a full step that may overshoot on a few sequences). Each
contribution is scored by one other worker and one all-reduce shares the scores
(engines/outer_scoring.py), so every worker decides alike even where forward passes differ in
the last bit. A worker whose score is negative for `patience` rounds in a row is left out of the
aggregate, and taken back once it is non-negative for `patience` rounds in a row (it is still
scored every round; near a plateau a flipped update's score flickers around 0, and one lucky
round does not bring it back). Replays are named and counted once: a contribution equal bit for
bit to another worker's of the same round (a copy: the later rank's copy is left out of that
round), or to one of an earlier round (stale: left out of that round); an all-zero one sent
nothing and is left out of its round. A perturbed copy is not caught.
"""
from __future__ import annotations

import hashlib
import sys

import torch
import torch.nn as nn

from ..models.gpt import lm_loss

STALE_ROUNDS = 8  # rounds of contributions whose fingerprints are kept to name a stale one
PROBE_SCALE = 0.2  # Gauntlet applies a contribution at 0.2 x the learning rate: the loss's slope along it


class HeldBatch:
    """The first `sequences` sequences a model was trained on since `take()`: caught by a forward
    pre-hook, in training mode only (not an evaluation, not a probe). Where nothing was trained
    since (the final sync of a streaming run's other fragments), the sequences held before."""

    def __init__(self, model: nn.Module, sequences: int):
        self.sequences, self.ids, self.last, self.paused = sequences, None, None, False
        self.hook = model.register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, module, args, kwargs):
        if self.ids is None and module.training and not self.paused:
            ids = args[0] if args else kwargs.get("input_ids")
            if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] >= 2:
                self.ids = ids[:self.sequences].detach().clone()

    def take(self) -> torch.Tensor | None:
        """This period's held sequences (the last held where none was seen since; None: none ever),
        and a new period."""
        if self.ids is not None:
            self.last, self.ids = self.ids, None
        return self.last

    def state_dict(self) -> dict:
        return {"ids": self.ids, "last": self.last}

    def load_state_dict(self, sd: dict) -> None:
        self.ids, self.last = sd["ids"], sd["last"]

    def close(self) -> None:
        self.hook.remove()


def next_token_loss(model: nn.Module, ids: torch.Tensor) -> float:
    """Mean next-token loss of sequences `ids` (each predicts its next token)."""
    return float(lm_loss(model, (ids[:, :-1], ids[:, 1:])))


def fingerprint(row: torch.Tensor) -> str:
    return hashlib.sha1(row.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


class Scoreboard:
    """The scores over the rounds and who is left out (identical on every worker). A worker is
    named by its slot (`slots[rank]`: under --elastic the launcher's worker number, stable across
    quorums; else its rank), so its standing outlives a change of membership: one left out and
    gone comes back left out, and rows come in the rank order of the round's members."""

    def __init__(self, world: int, patience: int, loud: bool = False, slots: list[int] | None = None):
        self.patience, self.loud = patience, loud
        self.slots = list(slots) if slots is not None else list(range(world))  # each rank's slot
        self.negative: dict[int, int] = {}  # slot -> rounds in a row with a negative score
        self.positive: dict[int, int] = {}  # slot -> rounds in a row with a non-negative score
        self.left_out: set[int] = set()     # slots
        self.rounds = 0
        self.history: list[dict] = []      # per round: scores (rank order; `workers`: their slots), left out, events
        self.seen: list[dict[str, int]] = []  # per earlier round: fingerprint -> slot

    def judge(self, rows: torch.Tensor, scores: list[float] | None, fits: list[float] | None) -> torch.Tensor:
        """This round's scores (None: no sequence to score on, no worker's standing changes) ->
        which rows the aggregate takes (bool [W])."""
        world, events, slot = rows.shape[0], [], self.slots
        prints = [fingerprint(rows[r]) for r in range(world)]
        replay = [False] * world
        for r, fp in enumerate(prints):
            if not rows[r].any():
                replay[r] = True
                events.append(f"worker {slot[r]} sent nothing (a zero contribution)")
                continue
            first = prints.index(fp)
            if first < r:
                replay[r] = True
                events.append(f"worker {slot[r]} sent worker {slot[first]}'s contribution (a copy)")
            old = next((k for k, seen in enumerate(self.seen) if fp in seen), None)
            if old is not None:
                replay[r] = True
                events.append(f"worker {slot[r]} sent a contribution of round {self.rounds - len(self.seen) + old} "
                              f"(stale)")
        for r, s in enumerate(scores or ()):
            w = slot[r]
            self.negative[w] = self.negative.get(w, 0) + 1 if s < 0 else 0
            self.positive[w] = self.positive.get(w, 0) + 1 if s >= 0 else 0
            if w not in self.left_out and self.negative[w] >= self.patience:
                self.left_out.add(w)
                events.append(f"worker {w} left out: its score was negative for {self.negative[w]} rounds")
            elif w in self.left_out and self.positive[w] >= self.patience:
                self.left_out.discard(w)
                events.append(f"worker {w} taken back: its score was non-negative for {self.positive[w]} rounds")
        self.seen = (self.seen + [dict((fp, slot[r]) for r, fp in enumerate(prints))])[-STALE_ROUNDS:]
        admitted = torch.tensor([slot[r] not in self.left_out and not replay[r] for r in range(world)])
        if not admitted.any():  # nobody left: the round keeps every worker rather than none
            admitted[:] = True
        self.history.append({"round": self.rounds, "scores": scores, "fits": fits, "workers": slot[:world],
                             "left_out": sorted(slot[r] for r in range(world) if not admitted[r]), "events": events})
        if self.loud:
            for e in events:
                print(f"outer round {self.rounds}: {e}", file=sys.stderr, flush=True)
        self.rounds += 1
        return admitted

    def report(self) -> dict:
        return {"score_rounds": self.history}

    def state_dict(self) -> dict:
        return {"negative": dict(self.negative), "positive": dict(self.positive), "left_out": sorted(self.left_out),
                "rounds": self.rounds, "history": [dict(h) for h in self.history],
                "seen": [dict(s) for s in self.seen]}

    def load_state_dict(self, sd: dict) -> None:
        self.negative, self.positive = dict(sd["negative"]), dict(sd["positive"])
        self.left_out, self.rounds = set(sd["left_out"]), sd["rounds"]
        self.history, self.seen = [dict(h) for h in sd["history"]], [dict(s) for s in sd["seen"]]
