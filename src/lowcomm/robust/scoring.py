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
contribution is scored by one validator other than its contributor (`scorers`: every worker, or
--validators) and one all-reduce shares the scores (engines/outer_scoring.py), so every worker
decides alike even where forward passes differ in the last bit; a contribution no validator but
its own contributor could score (a lone validator's) is not scored (None), its standing unchanged.
A worker whose score is negative for `patience` rounds in a row is left out of the aggregate, and
taken back once it is non-negative for `patience` rounds in a row (it is still scored every round;
near a plateau a flipped update's score flickers around 0, and one lucky round does not bring it
back). Replays are named: contributions equal bit for bit within a round are a copy, and the
aggregate takes their content once (the group's first row); who copied whom cannot be told from
the bits, so the history's `copies` names the group and `left_out` names none of it (its content
is in the aggregate). A contribution equal to one of an earlier round is stale, and an all-zero
one sent nothing: each is left out of its round. A perturbed copy is not caught.
"""
from __future__ import annotations

import hashlib
import weakref

import torch
import torch.nn as nn

from ..errors import UsageError
from ..models.gpt import lm_loss

STALE_ROUNDS = 8  # rounds of contributions whose fingerprints are kept to name a stale one
PROBE_SCALE = 0.2  # Gauntlet applies a contribution at 0.2 x the learning rate: the loss's slope along it
LEFT_OUT = "worker {} left out: its score was negative for {}"
TAKEN_BACK = "worker {} taken back: its score was non-negative for {}"


def rounds_text(n: int) -> str:
    return f"{n} round{'s' * (n != 1)}"


def scorers(world: int, validators: tuple[int, ...], round_: int) -> list[int | None]:
    """Who scores each worker's contribution in round `round_`: contribution r goes to the
    validators other than r, in rank order, at position (r + round_) mod their count -- so no
    validator scores its own, the work is spread over the validators, and the scorer of a
    contribution rotates round by round (one colluding validator does not score the same peer
    every round). With every worker a validator this is the cyclic shift r -> (r + 1 + round_
    mod (W - 1)) mod W: one contribution per worker and round. None: only r itself validates."""
    out: list[int | None] = []
    for r in range(world):
        others = [v for v in validators if v != r]
        out.append(others[(r + round_) % len(others)] if others else None)
    return out


def base_scorers(assigned: list[int | None]) -> list[int | None]:
    """Who computes worker b's batch's loss at θ_global, once for the round (every validator reads
    it from the shared table): the scorer of b's contribution (whose own batch it is), or where
    that is not scored, the scorer of the contribution before (whose random batch it is); None
    where nobody needs it. A validator of one contribution then runs three forwards, not four."""
    world = len(assigned)
    return [assigned[b] if assigned[b] is not None else assigned[(b - 1) % world] for b in range(world)]


def gauntlet_scores(base: list[float], own_after: list[float], random_after: list[float],
                    assigned: list[int | None]) -> tuple[list[float | None], list[float | None]]:
    """(score_r, fit_r) of every contribution (the module docstring) from the round's shared losses:
    `base[b]`, worker b's batch at θ_global; `own_after[r]` and `random_after[r]`, r's own batch and
    the next worker's at θ_global − 0.2·lr·Δ_r. None where a contribution was not scored."""
    def gain(before: float, after: float) -> float:
        return (before - after) / before if before > 0 else 0.0
    world, scores, fits = len(assigned), [], []
    for r in range(world):
        if assigned[r] is None:
            scores.append(None)
            fits.append(None)
            continue
        own, rand = gain(base[r], own_after[r]), gain(base[(r + 1) % world], random_after[r])
        scores.append(rand)
        fits.append(1.0 if own > rand else -1.0)
    return scores, fits


def first_of_equal_rows(rows: torch.Tensor) -> torch.Tensor:
    """bool [W]: False for a row equal bit for bit to an earlier one (a copy's content counted
    once, as `Scoreboard.judge` counts it, where no fingerprint is taken)."""
    keep = torch.ones(rows.shape[0], dtype=torch.bool)
    for r in range(1, rows.shape[0]):
        keep[r] = not any(torch.equal(rows[r], rows[k]) for k in range(r) if keep[k])
    return keep


def standing_changes(round_entry: dict, patience: int) -> list[str]:
    """What the progress line says of a scored round (a Scoreboard history entry): the workers its
    fields `newly_left_out` and `taken_back` name (absent in an entry of an older checkpoint: none),
    in the words of its events. A worker's run of rounds is exactly `patience` long when it
    changes standing: a run only grows past it on the side the worker already stands on."""
    return [LEFT_OUT.format(w, rounds_text(patience)) for w in round_entry.get("newly_left_out", ())] + \
        [TAKEN_BACK.format(w, rounds_text(patience)) for w in round_entry.get("taken_back", ())]


class HeldBatch:
    """The first `sequences` sequences a model was trained on since `take()`: caught by a forward
    pre-hook, in training mode only (not an evaluation, not a probe). Where nothing was trained
    since (the final sync of a streaming run's other fragments), the sequences held before.
    A worker's held sequences are its *assigned* data (what a validator knows of it): where it
    trains on other data (--attack wrong-data), the trainer hands them in first (`hold`, reached
    by `HeldBatch.of(model)`), and the forward of the wrong data is then not caught."""

    _of: "weakref.WeakKeyDictionary[nn.Module, HeldBatch]" = weakref.WeakKeyDictionary()

    def __init__(self, model: nn.Module, sequences: int):
        self.sequences, self.ids, self.last, self.paused = sequences, None, None, False
        self.model = weakref.ref(model)
        self.hook = model.register_forward_pre_hook(self._seen, with_kwargs=True)
        HeldBatch._of[model] = self

    @classmethod
    def of(cls, model: nn.Module) -> "HeldBatch | None":
        """The HeldBatch on `model` (or on the module it wraps), if --score made one."""
        inner = getattr(model, "module", None)  # a wrapper's (DDP's) own module
        return cls._of.get(model, cls._of.get(inner) if isinstance(inner, nn.Module) else None)

    def hold(self, ids) -> None:
        """`ids` [n, T] (token ids a worker trains on, or was assigned) are this period's held
        sequences, unless some are held already or the scoring itself is running (`paused`)."""
        if self.ids is None and not self.paused and is_token_ids(ids):
            self.ids = ids[:self.sequences].detach().clone()

    def _seen(self, module, args, kwargs):
        if module.training and self.ids is None and not self.paused:
            ids = args[0] if args else kwargs.get("input_ids")
            if not is_token_ids(ids):  # a model not called on token ids: nothing to score a contribution by
                raise UsageError(f"score=True scores a language model by its next-token loss on the token ids a "
                                 f"worker trains on, and this model is called on {described(ids)}: score a model "
                                 f"called on token ids (an integer tensor [batch, sequence], 2 positions or more)")
            self.hold(ids)

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
        model = self.model()
        if model is not None and HeldBatch._of.get(model) is self:
            del HeldBatch._of[model]


def is_token_ids(ids) -> bool:
    return isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] >= 2 and \
        not ids.is_floating_point() and not ids.is_complex() and ids.dtype != torch.bool


def described(value) -> str:
    """A model's first input, in a few words."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    return "no input_ids" if value is None else f"a {type(value).__name__}"


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

    def __init__(self, world: int, patience: int, slots: list[int] | None = None):
        self.patience = patience
        self.slots = list(slots) if slots is not None else list(range(world))  # each rank's slot
        self.negative: dict[int, int] = {}  # slot -> rounds in a row with a negative score
        self.positive: dict[int, int] = {}  # slot -> rounds in a row with a non-negative score
        self.left_out: set[int] = set()     # slots
        self.rounds = 0
        # per round: scores (rank order; `workers`: their slots), left out, the slots its scores left out
        # (`newly_left_out`) and took back (`taken_back`), and events (the same and the replays, in words)
        self.history: list[dict] = []
        self.seen: list[dict[str, int]] = []  # per earlier round: fingerprint -> slot

    def judge(self, rows: torch.Tensor, scores: list[float | None] | None, fits: list[float | None] | None,
              prints: list[str] | None = None, zeros: list[bool] | None = None) -> torch.Tensor:
        """This round's scores (None: no sequence to score on, no worker's standing changes; a None
        entry: that contribution was not scored) -> which rows the aggregate takes (bool [W]).
        `prints` and `zeros`: the rows' fingerprints and which are all zero, where the caller knows
        them (across replica groups: of the whole rows, of which `rows` is a part)."""
        world, events, slot = rows.shape[0], [], self.slots
        prints = prints or [fingerprint(rows[r]) for r in range(world)]
        zeros = zeros if zeros is not None else [not rows[r].any() for r in range(world)]
        replay, copied, copies = [False] * world, [False] * world, []
        for r, fp in enumerate(prints):
            if zeros[r]:
                replay[r] = True
                events.append(f"worker {slot[r]} sent nothing (a zero contribution)")
                continue
            group = [k for k, other in enumerate(prints) if other == fp]
            if group[0] < r:  # counted once: the aggregate takes the first row of the group
                copied[r] = True
            elif len(group) > 1:
                copies.append(sorted(slot[k] for k in group))
                events.append(f"workers {' and '.join(str(w) for w in copies[-1])} sent the same contribution "
                              f"(a copy by one of them: counted once)")
            old = next((k for k, seen in enumerate(self.seen) if fp in seen), None)
            if old is not None:
                replay[r] = True
                events.append(f"worker {slot[r]} sent a contribution of round {self.rounds - len(self.seen) + old} "
                              f"(stale)")
        newly, back = [], []  # slots whose standing this round's scores changed
        for r, s in enumerate(scores or ()):
            if s is None:
                continue
            w = slot[r]
            self.negative[w] = self.negative.get(w, 0) + 1 if s < 0 else 0
            self.positive[w] = self.positive.get(w, 0) + 1 if s >= 0 else 0
            if w not in self.left_out and self.negative[w] >= self.patience:
                self.left_out.add(w)
                newly.append(w)
                events.append(LEFT_OUT.format(w, rounds_text(self.negative[w])))
            elif w in self.left_out and self.positive[w] >= self.patience:
                self.left_out.discard(w)
                back.append(w)
                events.append(TAKEN_BACK.format(w, rounds_text(self.positive[w])))
        self.seen = (self.seen + [dict((fp, slot[r]) for r, fp in enumerate(prints))])[-STALE_ROUNDS:]
        admitted = torch.tensor([slot[r] not in self.left_out and not replay[r] for r in range(world)])
        if not admitted.any():  # nobody left: the round keeps every worker rather than none
            admitted[:] = True
        left_out = sorted(slot[r] for r in range(world) if not admitted[r])  # whose contribution is not taken
        admitted &= ~torch.tensor(copied)  # a copy's content is taken, once (who copied whom is unknowable)
        self.history.append({"round": self.rounds, "scores": scores, "fits": fits, "workers": slot[:world],
                             "left_out": left_out, "copies": copies,
                             "newly_left_out": sorted(newly), "taken_back": sorted(back), "events": events})
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
