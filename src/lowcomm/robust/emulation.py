"""An attacker in a run: the emulated attack applied where a worker hands its outer gradient
to the wire, on the ranks `--attackers` names, and nowhere else (an attacker otherwise runs
the protocol as every worker does: same collectives, same bytes). An attack on values
(sign-flip, scale, noise, zero, alie) changes the Δ the wire then encodes (`values`); a replay
(copy, stale) resends what was on the wire (`payload`): on a compressed wire the very bytes
another worker sent this round, or this one sent N rounds before, as a real copier would.

Every rank calls `Attackers.contribution` at each sync of each fragment (the syncs are
collective and in the same order everywhere): the round counter advances alike on every rank,
and an attack that reads the other workers' Δ (copy, alie) learns them through one extra
all-gather -- the emulation's oracle, a real attacker's eavesdropping, counted with the
bookkeeping (`Comm.meta`), not with the strategy's bytes, as the protocol itself sends none
of it. The rounds and stale's replays are the attacker's state (the engine's part "attack"):
a resumed run attacks as the uninterrupted one.

wrong-data attacks the data, not Δ (its Δ goes to the wire as is): `data_attack` is the loss
RunDriver.step trains such a worker with (the CLI's trainer drives every run by it), the worker
named as the engine names it (`worker_of`: by slot under --elastic, as RunDriver.slots holds them);
a loss of the caller's own (RunDriver.backward, wrap()) never reaches the data, and is refused there.
"""
from __future__ import annotations

import torch

from ..comm import Comm
from ..contract.parts import LOCAL, Part
from ..errors import UsageError
from .attacks import Attack, Round, wrong_data
from .scoring import HeldBatch


def round_seed(seed: int, round_: int, rank: int) -> int:
    """The generator seed of `rank`'s attack at `round_` of a run seeded `seed`."""
    return ((seed * 1_000_003 + round_) * 1009 + rank) % (2**63)


def attackers_of(options) -> "Attackers | None":
    """--attack's emulated bad workers of a strategy's RobustOptions, seeded by the run's seed
    (torch's, set where the model was built from it), or None."""
    attack = options.emulated_attack()
    return Attackers(attack, options.attacking_ranks(), torch.initial_seed()) if attack.kind != "none" else None


class Attackers:
    """The attack `attack` of the workers `ranks`, on one worker. A worker is named by its slot
    (`slots[comm.rank]`: under --elastic the launcher's worker number, stable across quorums, as
    `name_members` sets them; else its rank), so an attacker stays one as members come and go."""

    def __init__(self, attack: Attack, ranks: tuple[int, ...], seed: int):
        self.attack, self.ranks, self.seed = attack, tuple(ranks), seed
        self.slots: tuple[int, ...] | None = None           # each rank's slot (None: the rank itself)
        self.rounds: dict[str, int] = {}                     # key -> syncs of it so far
        self.history: dict[str, list[torch.Tensor]] = {}     # key -> what this rank sent, oldest first

    def values(self, comm: Comm, key: str, delta: torch.Tensor) -> torch.Tensor:
        """The Δ this rank hands the wire (every rank calls it, before the wire encodes)."""
        return delta if self.attack.replays else self.contribution(comm, key, delta)

    def payload(self, comm: Comm, key: str, data: torch.Tensor) -> torch.Tensor:
        """What this rank's wire sends (every rank calls it, after the wire encoded)."""
        return self.contribution(comm, key, data) if self.attack.replays else data

    def contribution(self, comm: Comm, key: str, delta: torch.Tensor) -> torch.Tensor:
        """What this rank sends for its honest `delta` of sync `key` (collective where the attack
        reads the others': every rank calls it)."""
        others = comm.meta_all_gather(delta) if self.attack.needs_others else None
        round_ = self.rounds.get(key, 0)
        self.rounds[key] = round_ + 1
        me = worker_of(comm.rank, self.slots)
        if me not in self.ranks:
            return delta
        history = self.history.setdefault(key, [])
        generator = torch.Generator().manual_seed(round_seed(self.seed, round_, me))
        present = tuple(r for r, s in enumerate(self.slots) if s in self.ranks) if self.slots else self.ranks
        sent = self.attack(delta, Round(comm.rank, round_, present, generator, others, history))  # rows by rank
        if self.attack.keeps:
            history.append(sent.detach().clone())
            del history[:-self.attack.keeps]
        return sent

    def state_dict(self) -> dict:
        return {"rounds": dict(self.rounds), "history": {k: [t.clone() for t in v] for k, v in self.history.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self.rounds = dict(sd["rounds"])
        self.history = {k: [t.clone() for t in v] for k, v in sd["history"].items()}

    def part(self) -> Part:
        """The attacker's state as a strategy's part: this worker's own; a joiner counts the rounds
        as everyone does (they advance alike on every rank) and holds no replay of its own."""
        return Part(self.state_dict, self.load_state_dict, LOCAL,
                    joiner=lambda sd: {"rounds": dict(sd["rounds"]), "history": {}})

    def report(self) -> dict:
        """summary.json's record of the emulated attack."""
        return {"attack": self.attack.spec, "attackers": list(self.ranks)}


def untrusted_parts(attackers: "Attackers | None", scoring) -> dict[str, Part]:
    """What --score and --attack add to a strategy's state, on the outer-sync engine and on a
    strategy that gathers its payloads itself (gathered.py) alike: the scoring's parts (its
    scoreboard and held sequences) and the attacker's rounds and replays."""
    parts = dict(scoring.state_parts()) if scoring is not None else {}
    if attackers is not None:
        parts["attack"] = attackers.part()
    return parts


def name_by_slot(slots, attackers: "Attackers | None", scoring) -> None:
    """Under --elastic: the slot of each rank of this membership (the launcher's worker number,
    stable across quorums), by which --attackers and --score's scoreboard name a worker."""
    if attackers is not None:
        attackers.slots = tuple(slots)
    if scoring is not None:
        scoring.board.slots = list(slots)


def worker_of(rank: int, slots: tuple[int, ...] | None) -> int:
    """The worker --attackers names rank `rank` by: its slot in this membership (`slots`, each rank's:
    under --elastic the launcher's worker number, stable across quorums), else the rank itself."""
    return slots[rank] if slots else rank


def data_attack(options, worker: int, loss_fn):
    """The loss worker `worker` (worker_of its rank) trains with: `loss_fn`, or on a worker that --attack
    wrong-data names, `loss_fn` of its micro-batches read backwards (attacks.wrong_data). Its
    --score sequences stay its assigned ones: each micro-batch is handed to the model's HeldBatch
    before the wrong data's forward (a validator scores a worker on the data it was given)."""
    if not attacks_data(options, worker):
        return loss_fn

    def on_wrong_data(model, batch):
        held = HeldBatch.of(model)
        if held is not None:
            held.hold(batch[0])
        return loss_fn(model, wrong_data(batch))
    return on_wrong_data


def attacks_data(options, worker: int) -> bool:
    """Does --attack wrong-data name this worker? (Asked at every step and micro-batch: the spec's
    string is compared before anything is parsed.)"""
    return str(getattr(options, "attack", "none")).strip() == "wrong-data" and worker in options.attacking_ranks()


def refuse_own_loss(options, worker: int) -> None:
    """A run driven by a loss of its caller's own (RunDriver.backward), on a worker that --attack
    wrong-data names: the attack changes the batches, which only RunDriver.step reads."""
    if attacks_data(options, worker):
        raise UsageError("attack='wrong-data' changes the data this rank trains on: drive the run with "
                         "step(next_batch, loss_fn), which reads the batches, not backward(loss) of your own")
