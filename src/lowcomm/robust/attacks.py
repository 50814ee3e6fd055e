"""Emulated attacks: what a bad worker sends in place of its outer gradient Δ.

Each is a function of this worker's honest Δ and the round's context (`Round`) -> what it
sends, the same shape and dtype (the same protocol, the same bytes):

    sign-flip     −Δ
    scale:K       K·Δ
    noise:σ       a Gaussian vector g, g_j ~ N(0, (σ‖Δ‖)²/n): ‖g‖ ≈ σ‖Δ‖, nothing of Δ in it
    zero          0 (a free rider: takes part, contributes nothing)
    copy          another worker's honest Δ of the same round (a replay; the worker copied is
                  an honest one, picked by the round's generator)
    stale:N       what it sent N rounds before (a replay; its honest Δ while it has sent fewer)
    alie[:z]      "A little is enough" (Baruch, Baruch, Goldberg, NeurIPS 2019): every attacker
                  sends μ − z·σ, μ and σ the coordinate-wise mean and standard deviation of the
                  honest workers' Δ; z by default the paper's z_max = Φ⁻¹((W − s)/W),
                  s = ⌊W/2 + 1⌋ − f for f attackers (at W = 4, f = 1: z = 0, the mean itself:
                  give alie:1 for a shift of one standard deviation)
    wrong-data    its honest Δ of the wrong data: every inner step trains on its assigned windows
                  read backwards (`wrong_data`: the same tokens, their order reversed). A worker
                  that trains on a corpus of its own choosing rather than the pages it was
                  assigned (Covenant's validator checks exactly this: a peer's update must help
                  its own assigned data more than random data): the same token counts as its
                  shard (a data audit by counts or hashes of its pages passes), a normal-looking
                  training loss, text no worker was given. An attack on the data, not on Δ:
                  RunDriver.step applies it (emulation.data_attack); a wrap() loop reads its own
                  data and is refused it (`check_own_loop`)

Only copy and alie read the other workers' contributions (`needs_others`); stale keeps
history. Randomness (noise, copy's pick) comes from the round's generator, seeded by the
run's seed, the round and the rank: a run is reproducible and every attacker differs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import NormalDist

import torch

from ..errors import UsageError

KINDS = ("sign-flip", "scale:K", "noise:σ", "zero", "copy", "stale:N", "alie[:z]", "wrong-data")
_BARE = ("none", "sign-flip", "zero", "copy", "alie", "wrong-data")
_VALUED = {"scale": float, "noise": float, "stale": int, "alie": float}


@dataclass
class Round:
    """What an attack may read of the round it attacks in."""
    rank: int
    round: int
    attackers: tuple[int, ...]
    generator: torch.Generator
    others: torch.Tensor | None = None   # [W, n] every worker's honest Δ (needs_others)
    history: list[torch.Tensor] = field(default_factory=list)  # what this worker sent before, oldest first

    @property
    def honest(self) -> list[int]:
        world = self.others.shape[0] if self.others is not None else 0
        return [r for r in range(world) if r not in self.attackers]


@dataclass(frozen=True)
class Attack:
    """A parsed --attack: its kind and parameter (K, σ, N or z; None: the default)."""
    kind: str = "none"
    param: float | None = None

    @property
    def spec(self) -> str:
        return self.kind if self.param is None else f"{self.kind}:{self.param:g}"

    @property
    def needs_others(self) -> bool:
        return self.kind in ("copy", "alie")

    @property
    def replays(self) -> bool:
        """Does it resend a contribution as sent (any wire format), rather than change values?"""
        return self.kind in ("copy", "stale")

    @property
    def on_data(self) -> bool:
        """Does it change the data the worker trains on (its Δ then sent as is), not its Δ?"""
        return self.kind == "wrong-data"

    @property
    def keeps(self) -> int:
        """Rounds of what it sent that this attack reads back (stale:N)."""
        return int(self.param) if self.kind == "stale" else 0

    def __call__(self, delta: torch.Tensor, ctx: Round) -> torch.Tensor:
        return ATTACKS[self.kind](self, delta, ctx)


def sign_flip(attack: Attack, delta: torch.Tensor, ctx: Round) -> torch.Tensor:
    return -delta


def scale(attack: Attack, delta: torch.Tensor, ctx: Round) -> torch.Tensor:
    return delta * attack.param


def noise(attack: Attack, delta: torch.Tensor, ctx: Round) -> torch.Tensor:
    std = attack.param * float(delta.norm()) / max(delta.numel(), 1) ** 0.5
    return torch.randn(delta.shape, generator=ctx.generator, dtype=delta.dtype).to(delta.device) * std


def zero(attack: Attack, delta: torch.Tensor, ctx: Round) -> torch.Tensor:
    return torch.zeros_like(delta)


def copy(attack: Attack, delta: torch.Tensor, ctx: Round) -> torch.Tensor:
    honest = ctx.honest
    victim = honest[int(torch.randint(len(honest), (1,), generator=ctx.generator))]
    return ctx.others[victim].clone()


def stale(attack: Attack, delta: torch.Tensor, ctx: Round) -> torch.Tensor:
    back = attack.keeps  # history holds the rounds before this one
    return delta if len(ctx.history) < back else ctx.history[-back].clone()


def alie_z(world: int, attackers: int) -> float:
    """Baruch et al.'s z_max for `attackers` of `world` workers."""
    s = world // 2 + 1 - attackers
    return NormalDist().inv_cdf(min(max((world - s) / world, 1e-6), 1 - 1e-6))


def alie(attack: Attack, delta: torch.Tensor, ctx: Round) -> torch.Tensor:
    honest = ctx.others[ctx.honest]
    z = attack.param if attack.param is not None else alie_z(ctx.others.shape[0], len(ctx.attackers))
    spread = honest.std(dim=0, unbiased=False)
    return honest.mean(dim=0) - z * spread


def none(attack: Attack, delta: torch.Tensor, ctx: Round) -> torch.Tensor:
    return delta


ATTACKS = {"none": none, "sign-flip": sign_flip, "scale": scale, "noise": noise, "zero": zero, "copy": copy,
           "stale": stale, "alie": alie, "wrong-data": none}


def wrong_data(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch (inputs x, next-token targets y of windows w: x = w[:-1], y = w[1:]) -> the
    same windows read backwards (w reversed: inputs y reversed, targets x reversed)."""
    x, y = batch
    return y.flip(-1), x.flip(-1)


def check_own_loop(spec: str, name: str = "attack") -> None:
    """wrap(): a loop of the user's own reads its own data, which no emulation reaches (a bad
    spec is left to the options' own check, which names it as for every strategy)."""
    if str(spec).strip() == "wrong-data":
        raise UsageError(f"{name}='wrong-data' changes the data a worker trains on, which lowcomm train's trainer "
                         f"reads and a loop of your own reads itself: feed that rank other data in your loop")


def parse_attack(spec: str, name: str = "--attack") -> Attack:
    """'sign-flip', 'scale:100', 'noise:1', 'zero', 'copy', 'stale:3', 'alie', 'alie:1' -> an Attack."""
    kind, colon, raw = str(spec).strip().partition(":")
    if not colon and kind in _BARE:
        return Attack(kind)
    if colon and kind in _VALUED:
        try:
            value = _VALUED[kind](raw)
        except ValueError:
            value = None
        if value is None or value != value or abs(value) == float("inf") or \
                (kind in ("noise", "stale") and value <= 0):
            wanted = "a positive whole number" if kind == "stale" else \
                "a positive number" if kind == "noise" else "a finite number"
            raise UsageError(f"{name} '{spec}': {kind}'s value must be {wanted}, got '{raw}'")
        return Attack(kind, value)
    raise UsageError(f"{name} '{spec}' is not one of: {', '.join(KINDS)} (or none)")


def parse_ranks(raw: str, name: str = "--attackers") -> tuple[int, ...]:
    """'3' or '5,6' -> the attacking ranks, sorted ('' : none)."""
    text = str(raw).strip()
    if not text:
        return ()
    ranks = []
    for part in text.split(","):
        try:
            ranks.append(int(part))
        except ValueError:
            raise UsageError(f"{name} '{raw}': '{part.strip()}' is not a worker rank (ranks are 0, 1, ...; "
                             f"several: 2,3)") from None
        if ranks[-1] < 0:
            raise UsageError(f"{name} '{raw}': rank {ranks[-1]} is negative")
    if len(set(ranks)) != len(ranks):
        raise UsageError(f"{name} '{raw}' names a rank twice")
    return tuple(sorted(ranks))
