"""A strategy's state, declared once: named parts, each with how it is saved and loaded, whose it
is, and what a joiner starts it from -- in the style of torchft's Manager.register_state_dict_fn.

    def state_parts(self):
        return {**super().state_parts(),              # the engine's parts (the model, its buffers)
                "optimizer": optimizer_part(self.optimizer),
                "residuals": Part(self.ef.state_dict, self.ef.load_state_dict, LOCAL)}

Everything that keeps or moves a strategy's state reads these declarations and nothing else: the
run's state_dict()/load_state_dict() (run/driver.py: {"parts": {name: saved}} beside the step
count), a checkpoint's layout (a state of replicated parts only, e.g. ddp's, is stored once), and
an elastic run's commit, hash, heal and rollback (contract/elastic.py says what each kind means):

- REPLICATED: every member holds it alike at a commit point (θ, a replicated optimizer's state,
  θ_global and the outer momentum). Hashed (membership.jsonl's `state_sha256`); what a joiner, or
  a member behind, receives from a peer.
- LOCAL: this worker's own (error-feedback residuals, local momenta, what it trained since a
  sync). Kept in its snapshot, so a rollback restores it; never hashed. A joiner starts it as a
  fresh worker at that step holds it (`joiner="zero"`, zeros as every worker at step 0), never as
  a copy of its donor's, which would apply the donor's residual twice -- unless a fresh value
  would mislead it (`joiner="peer"`: the local-SGD family's inner AdamW, as torchft's DiLoCo
  heals its inner optimizer from a peer); `after_join` then sets what follows from it.
- SHARDED: each member holds its shard (ZeRO's optimizer state and master copy). Its `layout`
  puts the shards together at a commit (`whole`, collective) or from a checkpoint's ranks
  (`joined`) and cuts this member's shard out of the whole (`cut`). A local part laid out by the
  membership (a flat buffer of one world's padding) may carry a layout too.

Parts are saved and loaded in the order declared.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from ..errors import UsageError

REPLICATED, LOCAL, SHARDED = "replicated", "local", "sharded"


class Layout(Protocol):
    """How a part laid out by the membership is made whole and cut anew (engines/flat_reshard.py)."""

    def whole(self, value): ...            # this member's value -> the whole (collective: a commit)
    def joined(self, values: list): ...    # every rank's value, in rank order (a checkpoint's) -> the whole
    def cut(self, whole): ...              # the whole -> this member's value in the current membership


@dataclass(frozen=True)
class Part:
    """One named piece of a strategy's state (the module docstring)."""
    save: Callable[[], Any]
    load: Callable[[Any], None]
    kind: str = REPLICATED
    joiner: str | Callable[[Any], Any] = "zero"  # a LOCAL part for a joiner: "zero", "peer" or fn(peer's value)
    after_join: Callable[[], None] | None = None  # after a joiner loaded every part
    layout: Layout | None = None


def attributes(obj, *names: str, kind: str = REPLICATED) -> dict[str, Part]:
    """A part for each plain attribute `names` of `obj` (a counter, a flag, a list of them: copied)."""
    return {n: Part(lambda n=n: copy.copy(getattr(obj, n)), lambda v, n=n: setattr(obj, n, copy.copy(v)), kind)
            for n in names}


def optimizer_part(optimizer: torch.optim.Optimizer, kind: str = REPLICATED, joiner="zero", **kw) -> Part:
    """An optimizer's state_dict() as a part; a joiner's fresh one has zero moments (its param
    groups, the hyperparameters, kept)."""
    if joiner == "zero":
        joiner = lambda sd: {**sd, "state": fresh(sd["state"])}  # noqa: E731
    return Part(optimizer.state_dict, optimizer.load_state_dict, kind, joiner, **kw)


def fresh(value):
    """What a fresh worker holds in place of `value`: zeros of its tensors and numbers, the same
    structure (an AdamW state of zero moments at step 0 steps exactly as an empty one)."""
    if torch.is_tensor(value):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: fresh(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(fresh(v) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return type(value)(0)
    return value


def tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested state (dicts, lists), by its dotted path."""
    if torch.is_tensor(obj):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in tensors(v, f"{prefix}.{k}").items()}
    if isinstance(obj, (list, tuple)):
        return {k2: v2 for i, v in enumerate(obj) for k2, v2 in tensors(v, f"{prefix}.{i}").items()}
    return {}


# -- what the run, the checkpoint and the elastic runtime derive from the declarations ---------------
def save_parts(parts: dict[str, Part]) -> dict:
    return {name: part.save() for name, part in parts.items()}


def load_parts(parts: dict[str, Part], saved: dict) -> None:
    if set(saved) != set(parts):
        raise UsageError(f"the state holds parts {sorted(saved)}, the strategy declares {sorted(parts)}")
    for name, part in parts.items():
        part.load(saved[name])


def replicated_only(parts: dict[str, Part]) -> bool:
    """Whether every part is held alike by every member (a checkpoint stores such a state once)."""
    return all(part.kind == REPLICATED for part in parts.values())


def laid_out(parts: dict[str, Part]) -> bool:
    """Whether a membership's state must be put together from every member's (a sharded part)."""
    return any(part.kind == SHARDED for part in parts.values())


def _each(parts: dict[str, Part], sd: dict, how) -> dict:
    """`sd` (a run's state_dict()) with each part's value v replaced by how(part, v)."""
    return {**sd, "parts": {name: how(parts[name], value) for name, value in sd["parts"].items()}}


def commit_state(parts: dict[str, Part], sd: dict) -> dict:
    """The run's state_dict() at a commit point as a member of any later membership can load it
    (collective where a part is sharded: its shards gathered whole)."""
    return _each(parts, sd, lambda p, v: p.layout.whole(v) if p.layout else copy.deepcopy(v))


def member_state(parts: dict[str, Part], whole: dict) -> dict:
    """This member's state_dict() in its current membership, from a commit_state()."""
    return _each(parts, whole, lambda p, v: p.layout.cut(copy.deepcopy(v)) if p.layout else copy.deepcopy(v))


def whole_from_shards(parts: dict[str, Part], states: list[dict]) -> dict:
    """A commit_state() from the state_dict() of every rank of a membership, in rank order (a
    checkpoint's): its laid-out parts joined, the others rank 0's."""
    return {**states[0], "parts": {name: part.layout.joined([st["parts"][name] for st in states])
                                   if part.layout else states[0]["parts"][name] for name, part in parts.items()}}


def replicated_tensors(parts: dict[str, Part], sd: dict) -> dict[str, torch.Tensor]:
    """The tensors of a commit's state (commit_state) that every member holds alike: what is hashed."""
    return tensors({name: value for name, value in sd["parts"].items() if parts[name].kind != LOCAL})


def as_joiner(parts: dict[str, Part], peer: dict) -> dict:
    """A peer's commit state as a joiner loads it: each local part fresh, its donor's, or as its
    `joiner` makes it from its donor's."""
    def joined(part: Part, value):
        if part.kind != LOCAL or part.joiner == "peer":
            return value
        return fresh(value) if part.joiner == "zero" else part.joiner(value)
    return _each(parts, peer, joined)


def after_join(parts: dict[str, Part]) -> None:
    """A joiner has loaded a peer's state (as_joiner): what follows from it."""
    for part in parts.values():
        if part.after_join is not None:
            part.after_join()
