"""The state an elastic worker keeps at a commit point, whatever the membership that follows.

ddp's and diloco's state (RunDriver.state_dict()) does not depend on the group, so a commit
keeps a copy of it. zero1's optimizer state (AdamW's moments) and its master copy are sharded by
(world, rank): rank r of W holds elements [r*s, (r+1)*s) of the flat parameter buffer, s =
ceil(P/W). So at each of its commit points (every step) the members all-gather the shards into
the whole state, which any member can load into any new membership by cutting out its own shard
(padding, always zero, rebuilt as zeros). A joiner receives the whole state like any other, and
a checkpoint's W shards are put together the same way for a resume with another number of
workers (from_shards).

The cost, stated: the gather moves (W-1)/W of the optimizer state a step -- for AdamW in fp32,
8 bytes a parameter, as much as zero1's own reduce-scatter and all-gather at fp32, so twice the
bytes a step (not in steps.jsonl's wire bytes: it runs between steps) -- and each member holds
the whole optimizer state at the commit, as ddp does: elastic zero1 keeps zero1's step but not
its 1/W optimizer memory.
"""
from __future__ import annotations

import copy

import torch

from ..errors import RunError

GATHERED = ("zero1",)  # strategies whose commit points keep the whole of a sharded state


def snapshot(strategy: str, run) -> dict:
    """The run's state, as a member of any later membership can load it (collective for zero1)."""
    state = run.state_dict()
    return _whole(state, run.strategy) if strategy in GATHERED else copy.deepcopy(state)


def load(strategy: str, run, state: dict) -> None:
    """Load a snapshot into a run built for this worker's current membership."""
    state = copy.deepcopy(state)
    run.load_state_dict(_own(state, run.strategy) if strategy in GATHERED else state)


def _sharded(value, shard_size: int) -> bool:
    """An optimizer state entry that has one element per shard element (not a scalar like step)."""
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == shard_size


def _whole(local: dict, s) -> dict:
    """A zero1 member's state_dict() with the shards of every member put together."""
    if len(s.shard_opt.pieces) != 1:
        raise RunError("--elastic runs zero1 with one optimizer parameter group")

    def gather(entry) -> torch.Tensor:
        shard = entry(local)
        whole = shard.new_empty(shard.numel() * s.comm.world)
        s.comm.all_gather(whole, shard.contiguous())
        return whole

    return _assembled(local, s.flat.numel, s.flat.shard_size, gather)


def from_shards(states: list[dict], numel: int) -> dict:
    """The whole state from the state_dict()s of every rank of a membership (a checkpoint's,
    in rank order) over a flat buffer of `numel` elements: what `snapshot` made at that commit."""
    return _assembled(states[0], numel, -(-numel // len(states)),
                      lambda entry: torch.cat([entry(state) for state in states]))


def _assembled(local: dict, numel: int, shard_size: int, joined) -> dict:
    """`local` with each sharded entry (optimizer moments, master copy) whole: `joined(entry)`
    puts together `entry(state)` of every rank in rank order (padded: cut to `numel`)."""
    (osd,) = local["optimizers"]
    moments = {k: joined(lambda st, k=k: st["optimizers"][0]["state"][0][k])[:numel].clone()
               if _sharded(v, shard_size) else v.clone() if torch.is_tensor(v) else v
               for k, v in osd["state"].get(0, {}).items()}
    master = local["extra"]["master"]
    return _with(local, osd, moments, {"master": None if master is None else
                                       joined(lambda st: st["extra"]["master"])[:numel].clone()})


def _own(whole: dict, s) -> dict:
    """The state_dict() of this member of the current membership, cut from the whole state."""
    flat = s.flat

    def cut(full: torch.Tensor) -> torch.Tensor:
        padded = full.new_zeros(flat.shard_size * s.comm.world)
        padded[:flat.numel] = full
        return padded[flat.own].clone()

    (osd,) = whole["optimizers"]
    moments = {k: cut(v) if _sharded(v, flat.numel) else v for k, v in osd["state"].get(0, {}).items()}
    master = whole["extra"]["master"]
    return _with(whole, osd, moments, {"master": None if master is None else cut(master),
                                       "grads": torch.zeros_like(flat.grads)})


def _with(state: dict, osd: dict, moments: dict, extra: dict) -> dict:
    """`state` with its one optimizer's state replaced by `moments`, and `extra`."""
    return {**state, "optimizers": [{"state": {0: moments} if moments else {}, "param_groups": osd["param_groups"]}],
            "extra": extra}
