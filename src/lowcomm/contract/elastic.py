"""How a strategy's state survives a change of membership (--elastic): what it declares.

The elastic runtime (elastic/, train/elastic.py) names no strategy: it reads these. The state is
the run's (RunDriver.state_dict(): "model", "optimizers", "extra"), split in two:

- replicated: what every member holds alike at a commit point (parameters, θ_global, a replicated
  optimizer's state, the outer momentum). It is hashed (membership.jsonl's `state_sha256`) and is
  what a joiner, or a member behind, receives from a peer;
- local, `local_state`: paths into that state that are this worker's own -- error-feedback
  residuals, local momenta, what it trained since a sync. Kept in the worker's snapshot, so a
  rollback restores them; never hashed; and a joiner starts them as a fresh worker at that step
  holds them (zeros, as every worker at step 0), never as a copy of its donor's, which would
  apply the donor's residual twice. Each strategy's docstring says where its reference does so.
  Except `from_donor`: local parts a joiner copies from its donor because a fresh value would
  mislead it, not because members hold them alike (a local-SGD worker's inner AdamW moments:
  torchft's DiLoCo heals its inner optimizer from a peer; a fresh Adam's first steps are
  sign steps, a full lr on every coordinate).

In the style of torchft's Manager.register_state_dict_fn (what a healing replica receives) and
should_commit (where a step is kept):

    local_state = ("extra.residuals",)          the worker's own parts; the rest is replicated
    from_donor = ()                             local parts a joiner copies from its donor
    commits_at(options, step)                   where every member agrees (default: every step)
    redoes_last_step(options)                   a failed commit redoes only its last step (rounds.py)
    commit_state(sd) / member_state(whole)      a commit's state as any membership can load it, and
                                                this member's cut of it (ZeRO's shards: gathered, re-cut)
    sharded_state, whole_from_shards(states)    a checkpoint's per-rank states put together the same way
    fresh_local(path, value)                    a fresh worker's value of a local part (default: zeros)
    join_from_peer()                            after a joiner loaded a peer's state (diloco: θ <- θ_global)
    elastic_refusal(options, across_replicas)   why these options cannot run elastically (None: they can)
    elastic_options(options)                    the options an elastic run runs (local SGD: token-weighted merges)
    require_contributors(n) / contribution()    --min-workers as an outer step's quorum; who contributed to it
"""
from __future__ import annotations

import copy
from typing import ClassVar

import torch


def tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested state (dicts, lists), by its dotted path."""
    if torch.is_tensor(obj):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in tensors(v, f"{prefix}.{k}").items()}
    if isinstance(obj, (list, tuple)):
        return {k2: v2 for i, v in enumerate(obj) for k2, v2 in tensors(v, f"{prefix}.{i}").items()}
    return {}


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


def _key(node, part: str):
    return int(part) if isinstance(node, list) else part


def replaced(sd: dict, path: str, how) -> dict:
    """`sd` with the value at dotted `path` replaced by how(value) (absent: `sd` unchanged);
    the containers along the path are copied, the rest shared."""
    head, _, rest = path.partition(".")
    key = _key(sd, head)
    if (isinstance(sd, dict) and key not in sd) or (isinstance(sd, list) and key >= len(sd)):
        return sd
    out = dict(sd) if isinstance(sd, dict) else list(sd)
    out[key] = replaced(sd[key], rest, how) if rest else how(sd[key])
    return out


class ElasticPart:
    """The elastic side of Strategy (see the module docstring)."""

    local_state: ClassVar[tuple[str, ...]] = ()
    from_donor: ClassVar[tuple[str, ...]] = ()  # local parts a joiner takes from its donor (module docstring)
    sharded_state: ClassVar[bool] = False  # True: a commit_state() is put together from every rank's

    @classmethod
    def commits_at(cls, options, step: int) -> bool:
        return True

    @classmethod
    def redoes_last_step(cls, options) -> bool:
        return False

    @classmethod
    def elastic_refusal(cls, options, across_replicas: bool) -> str | None:
        return None

    @classmethod
    def elastic_options(cls, options):
        return options

    def require_contributors(self, n: int) -> None:
        """An update that merges what each member trained needs `n` members that trained."""

    def contribution(self) -> dict | None:
        """The last merge's contributors and tokens (steps.jsonl's `outer`), None without one."""
        return None

    @classmethod
    def replicated_state(cls, sd: dict) -> dict[str, torch.Tensor]:
        """The tensors of a commit's state (commit_state) that every member holds alike."""
        for path in cls.local_state:
            sd = replaced(sd, path, lambda _: None)
        return tensors({"model": sd["model"], "optimizers": [o["state"] for o in sd["optimizers"]],
                        "extra": sd["extra"]})

    @classmethod
    def as_joiner(cls, peer: dict) -> dict:
        """A peer's commit state as a joiner loads it: every local part fresh but those it takes
        from its donor (module docstring)."""
        for path in cls.local_state:
            if path in cls.from_donor:
                continue
            peer = replaced(peer, path, lambda value, path=path: cls.fresh_local(path, value))
        return peer

    @classmethod
    def fresh_local(cls, path: str, value):
        """A fresh worker's value of local part `path` (default: zeros, `fresh`)."""
        return fresh(value)

    def commit_state(self, sd: dict) -> dict:
        """The run's state_dict() at a commit point as a member of any later membership can load
        it (collective where it is sharded)."""
        return copy.deepcopy(sd)

    def member_state(self, whole: dict) -> dict:
        """This member's state_dict() in its current membership, from a commit_state()."""
        return copy.deepcopy(whole)

    def whole_from_shards(self, states: list[dict]) -> dict:
        """A commit_state() from the state_dict() of every rank of a membership, in rank order
        (a checkpoint's), where `sharded_state`; else each rank's own state is whole."""
        return states[0]

    def join_from_peer(self) -> None:
        """A joiner has loaded a peer's state (as_joiner): set what follows from it."""
