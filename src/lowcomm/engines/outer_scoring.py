"""--score on the outer-sync engine: every contribution scored before it is aggregated
(robust/scoring.py has the rule, Covenant's; this module runs it on the engine's θ_global).

At each sync the wire gathers every worker's Δ_r (outer_wire.py) and asks `admit(key, rows)`
which rows to aggregate. The workers share the sequences each held this period (one
bookkeeping all-gather of token ids), and the scoring is spread over the validators (every
worker, or --validators): `scorers` gives each contribution one validator other than its
contributor, rotating round by round, and one all-reduce of W × 4 values (the losses) gives every
worker every score, so all decide alike. A validator's cost per round and contribution it
scores: two forwards of --score-batches sequences at θ_global − 0.2·lr·Δ_r (on the contributor's
batch and on the next worker's), and the contributor's batch's loss at θ_global, which every
validator that needs it reads from the table (`base_scorers`: each batch's computed once; every
worker validating: three forwards each, whatever W). A worker that validates nothing runs no
forward. An emulated attacker scores honestly (it attacks only its own contribution).

The same all-reduce carries each worker's seconds of scoring work that round (its forwards and
the rows' fingerprints), so every worker knows the round's slowest (`seconds`); they and the
trainer step each round merged at are kept beside the scoreboard, not in it (they are not the
run's state: a resumed run's earlier rounds are in its steps.jsonl already), for `rounds_from`.
"""
from __future__ import annotations

import hashlib
import json
import time
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..contract.context import write_flat
from ..contract.parts import LOCAL, Part
from ..models.layout import trainable
from ..robust.aggregators import clipped_to_median_norm, spread_over
from ..robust.probe import probe_losses
from ..robust.scoring import (PROBE_SCALE, HeldBatch, Scoreboard, base_scorers, fingerprint, gauntlet_scores, scorers,
                              standing_changes)

# Per worker r: its batch's loss at θ_global, its contribution's own and random losses after the
# probe's move; and r's own seconds of scoring work.
COLUMNS = 4
# The longest held sequence the one gather carries: a 128k-position model's room would pad 4 MB a
# worker; longer sequences take a second gather instead.
ROOM_TOKENS = 4096


def room_for(model: nn.Module, sequences: int) -> tuple[int, int]:
    """(sequences, tokens) of each worker's held sequences that one gather shares, alike on every
    worker: the longest sequence `model` (or the module it wraps) takes, lowcomm's GPT's seq_len,
    a Hugging Face model's max_position_embeddings, up to ROOM_TOKENS; no tokens where unknown."""
    inner = getattr(model, "module", model)
    n = getattr(inner, "seq_len", None) or getattr(getattr(inner, "config", None), "max_position_embeddings", None)
    return sequences, min(n, ROOM_TOKENS) if isinstance(n, int) and n > 0 else 0


class OuterScoring:
    """Scores and admits the contributions to `sync`'s fragments (an OuterSync over `model`): a
    fragment's Δ_r moves only that fragment, the others held at their θ_global. `o`: the
    strategy's options (outer_lr, score_batches, score_patience, validators); `inside`: across
    replica groups, the engine inside this rank's replica (engines/inside.py; None: a flat run)."""

    def __init__(self, sync, model: nn.Module, o, inside=None):
        self.sync, self.model, self.lr = sync, model, o.outer_lr
        self.replica = ReplicaScoring(inside, model) if inside is not None and inside.comm.world > 1 else None
        self.held = HeldBatch(model, o.score_batches)
        self.room = room_for(model, o.score_batches)  # what one gather shares of each worker's held sequences
        self.board = Scoreboard(sync.comm.world, o.score_patience)
        self.validators = o.validator_ranks(sync.comm.world)
        self.clips = o.aggregator().rule == "median-norm-clip"
        self.seconds: dict[int, list[float]] = {}  # round -> each worker's seconds of scoring work
        self.steps: dict[int, int] = {}            # round -> the trainer step its merge is due at

    def admit(self, key: str, rows: torch.Tensor, sizes=None, clipped: bool = False) -> torch.Tensor:
        """Every worker's Δ_r of the sync (rows [W, n], rank order) -> which the aggregate takes.
        `clipped` (a compressed wire: Covenant's setting): under median-norm-clip each row is scored
        as the merge takes it, clipped to the median norm per tensor (`sizes`), as Covenant's
        validator applies a peer's decoded payload (neurons/validator.py, update_model_with_gradient):
        a 100x row is scored as the honest-norm row it becomes, not as a 100x step (the fp32/bf16
        wire scores Δ_r as sent). Replays are named by the rows as sent."""
        total = self.replica.norm_total if self.replica else None  # a norm spread over the replica
        probe = clipped_to_median_norm(rows, sizes, total) if clipped and self.clips else rows
        comm, world, round_ = self.sync.comm, rows.shape[0], self.board.rounds
        batches = self._share(comm, self.held.take(), rows.device)
        assigned = scorers(world, self.validators, round_)
        mine = [r for r in range(world) if assigned[r] == comm.rank]
        bases = [b for b, v in enumerate(base_scorers(assigned)) if v == comm.rank]
        t0 = time.perf_counter()
        table = torch.zeros(world, COLUMNS, dtype=torch.float64, device=rows.device)
        i = next(i for i, (f, _) in enumerate(self.sync.fragments) if key == f"fragment{f}")
        base, after = self._losses(i, probe, bases, mine, batches)
        for b, loss in zip(bases, base):
            table[b, 0] = loss
        for r, losses in zip(mine, after):
            table[r, 1:3] = torch.tensor(losses, dtype=torch.float64)
        prints, zeros = self.replica.replays(rows) if self.replica else ([fingerprint(row) for row in rows], None)
        table[comm.rank, 3] = time.perf_counter() - t0
        comm.meta_all_reduce(table, op="sum")
        table = table.cpu()
        self.seconds[round_] = [float(s) for s in table[:, 3]]
        if self.sync.pending.get(i):  # 0: the final sync, at the run's last step (or at its close)
            self.steps[round_] = self.sync.pending[i]
        if batches.numel() == 0:  # nobody held a sequence: no evidence this round
            return self.board.judge(rows, None, None, prints, zeros)
        scores, fits = gauntlet_scores(*(table[:, c].tolist() for c in range(3)), assigned)
        return self.board.judge(rows, scores, fits, prints, zeros)

    def _share(self, comm, mine: torch.Tensor | None, device) -> torch.Tensor:
        """Every worker's held sequences [W, n, T], cut to the fewest and shortest any holds (none
        held anywhere: [W, 0, 0], and every score of the round is 0). One bookkeeping all-gather:
        each worker sends its sequences' shape and them, padded to `room` (the same on every
        worker); a second, of the cut sequences, only where every worker held longer ones than
        the room takes (a model whose length is unknown: a room of none)."""
        held = mine if mine is not None else torch.zeros(0, 0, dtype=torch.long, device=device)
        n_room, t_room = self.room
        block = torch.zeros(2 + n_room * t_room, dtype=torch.long, device=device)
        block[:2] = torch.tensor(held.shape, dtype=torch.long)
        fits = held[:n_room, :t_room]
        block[2:].view(n_room, t_room)[:fits.shape[0], :fits.shape[1]] = fits
        every = comm.meta_all_gather(block)
        n, t = (int(v) for v in every[:, :2].min(dim=0).values)
        if self.replica:  # the fewest and shortest of every rank's: each position's cut alike
            n, t = self.replica.fewest(n, t, device)
        if n <= n_room and t <= t_room:  # every worker's first n x t are in the block
            return every[:, 2:].reshape(len(every), n_room, t_room)[:, :n, :t].contiguous()
        return comm.meta_all_gather(held[:n, :t].to(device=device, dtype=torch.long).contiguous())

    def _losses(self, i: int, rows: torch.Tensor, bases: list[int], mine: list[int], batches: torch.Tensor):
        """This validator's losses of the round (robust/probe.py) for fragment i: `bases` at θ_global,
        each contribution in `mine` applied at θ_global − 0.2·lr·Δ_r, the fragment's other tensors
        held at their θ_global."""
        params, g = self.sync.fragments[i][1], self.sync.globals[i].detach()

        def move(r: int) -> None:
            write_flat(g - PROBE_SCALE * self.lr * rows[r].to(g.dtype), params)
        return self.probe(batches, bases, mine, rows.shape[0], move, self.sync.globals_in_model)

    def probe(self, batches, bases, mine, world, move, around):
        """probe_losses (robust/probe.py), across replica groups on the whole model and the replica's data."""
        if self.replica:
            move, around = self.replica.whole(move, around)
        return probe_losses(self.model, self.held, batches, bases, mine, world, move, around,
                            pooled=self.replica.pooled if self.replica else None)

    def state_parts(self) -> dict[str, Part]:
        """The scoreboard (alike on every worker, hashed with the replicated state under --elastic)
        and the held sequences (each worker's own; a joiner holds none yet: it catches its own as
        it trains, not its donor's)."""
        board = self.board
        return {"scores": Part(lambda: hashed(board.state_dict()), board.load_state_dict),
                "held_sequences": Part(self.held.state_dict, self.held.load_state_dict, LOCAL,
                                       joiner=lambda sd: {"ids": None, "last": None})}

    def rounds_from(self, first: int) -> list[tuple[int | None, dict]]:
        """The scored rounds from round `first` on: (the trainer step whose outer step took it, None
        where unknown: the final sync, or a round loaded with the state; its history entry with
        `score_s`, the slowest worker's seconds of scoring work that round, and
        `score_s_per_rank`, each worker's, where this process scored it)."""
        out = []
        for entry in self.board.history[first:]:
            k, seconds = entry["round"], self.seconds.get(entry["round"])
            timed = {"score_s": round(max(seconds), 6), "score_s_per_rank": [round(s, 6) for s in seconds]} \
                if seconds else {}
            out.append((self.steps.get(k), {**entry, **timed}))
        return out

    def standing_changes(self, entry: dict) -> list[str]:
        """What the progress line says of a round: the workers it left out or took back."""
        return standing_changes(entry, self.board.patience)

    def report(self) -> dict:
        return self.board.report()


class ReplicaScoring:
    """--score across replica groups (--replicas R): a replica of K processes is one worker, and its
    ranks hold parts of θ and of every Δ_r (with ddp inside the tensors its position owns, with
    fsdp its shard of each tensor) and each its own held sequences (its micro-batches). The
    outer-sync engine runs the scoring on the part each rank holds, across the R ranks of its
    position, and these make a position's round the replica's:

    - a probe moves the whole model: with ddp inside every position's tensors are shared in the
      replica before each forward (one bookkeeping all-gather of θ a probe) and the model put back
      as it was after; with fsdp inside FSDP's forward gathers the moved shards (the parameters it
      keeps gathered after a forward are freed first, and again after the probes);
    - each loss is the mean of the replica's positions' (the loss on all the replica's held
      sequences: one bookkeeping all-reduce a round), so every position scores alike, as one
      worker holding them all would;
    - a contribution's fingerprint, and whether it is all zero, are of the whole row (every
      position's part: one bookkeeping all-gather of 21 bytes a row), not of a part that may be empty;
    - the held sequences are cut to the fewest and shortest any rank holds, on every position.
    """

    def __init__(self, inside, model: nn.Module):
        self.inside, self.comm, self.model = inside, inside.comm, model
        spread = spread_over(inside)
        self.norm_total = None if spread.whole_tensors else spread.total  # median-norm-clip's norms, as the merge's

    def fewest(self, n: int, t: int, device) -> tuple[int, int]:
        counts = torch.tensor([n, t], dtype=torch.long, device=device)
        return tuple(int(v) for v in self.comm.meta_all_reduce(counts, op="min"))

    def pooled(self, losses: list[float]) -> list[float]:
        values = torch.tensor(losses, dtype=torch.float64)
        return (self.comm.meta_all_reduce(values, op="sum") / self.comm.world).tolist()

    def replays(self, rows: torch.Tensor) -> tuple[list[str], list[bool]]:
        """(each row's fingerprint, whether it is all zero), of the whole row across the replica."""
        mine = torch.tensor([list(bytes.fromhex(fingerprint(row))) + [int(not row.any())] for row in rows],
                            dtype=torch.uint8)
        every = self.comm.meta_all_gather(mine.to(rows.device)).cpu()  # [K, W, 21]
        prints = [hashlib.sha1(every[:, r, :20].numpy().tobytes()).hexdigest() for r in range(rows.shape[0])]
        return prints, [bool(every[:, r, 20].all()) for r in range(rows.shape[0])]

    def whole(self, move, around):
        """(move, around) of a probe on the whole model (the module docstring). The share is the
        driver's around an evaluation: with ddp inside every position's tensors to the replica,
        with fsdp the gathered parameters FSDP keeps after a forward freed, so that the next
        forward gathers the shards as the probe moved them (and training's, as they are after)."""
        everything, inside = trainable(self.model), self.inside

        def share() -> None:
            inside.share(everything, counted=False)

        def shared_move(r: int) -> None:
            move(r)
            share()

        @contextmanager
        def shared_around():
            kept = [p.detach().clone() for p in everything] if inside.name == "ddp" else None
            try:
                with around():
                    share()
                    yield
            finally:
                with torch.no_grad():
                    for p, k in zip(everything, kept or ()):
                        p.copy_(k)
                if kept is None:
                    share()
        return shared_move, shared_around


def hashed(state: dict) -> dict:
    """A replicated part's state of plain values (the scoreboard's counters and history), with a
    digest of them as a tensor: an elastic run hashes a commit's replicated tensors
    (contract/parts.py), so members that disagree on who is left out differ in state_sha256."""
    text = json.dumps(state, sort_keys=True, default=str).encode()
    return {**state, "digest": torch.tensor(list(hashlib.sha256(text).digest()), dtype=torch.uint8)}
