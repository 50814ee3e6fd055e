"""ZeRO-1's sharded state whole, and re-cut for another membership (the zero1 family's side of
contract/elastic.py: ShardedStrategy.commit_state / member_state / whole_from_shards).

The optimizer state (AdamW's moments) and the fp32 master copy are sharded by (world, rank):
rank r of W holds elements [r*s, (r+1)*s) of the flat parameter buffer, s = ceil(P/W). So at a
commit point the members all-gather the shards into the whole state, which any member can load
into any new membership by cutting out its own shard (padding, always zero, rebuilt as zeros);
a checkpoint's W shards are put together the same way for a resume on another number of
workers. The flat gradient buffer is this world's and zero at a step's start: left out of the
whole, rebuilt as zeros.

Across replica groups (--replicas R) the strategy runs on the whole tensors its position owns,
on the cross group of its position: the flat buffer is those tensors, sharded across the R
replicas. The same gather, over that group, makes each position's whole state, held alike by
its R ranks; a replica behind takes it from the same position of a donor (elastic/transfer.py),
and it is cut anew for any number of replicas (K, and so each position's tensors, stay).

The cost, stated: the gather moves (W-1)/W of the optimizer state at each commit -- for AdamW in
fp32, 8 bytes a parameter, as much as zero1's own reduce-scatter and all-gather at fp32 (not in
steps.jsonl's wire bytes: it runs between steps) -- and each member holds the whole optimizer
state at the commit, as ddp does: elastic zero1 keeps zero1's step, not its 1/W optimizer memory.
"""
from __future__ import annotations

import torch

from ..errors import RunError


def _sharded(value, shard_size: int) -> bool:
    """An optimizer state entry that has one element per shard element (not a scalar like step)."""
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == shard_size


def gathered(local: dict, s) -> dict:
    """A member's state_dict() with the shards of every member put together (collective)."""
    if len(s.shard_opt.pieces) != 1:
        raise RunError("--elastic runs a sharded strategy with one optimizer parameter group")
    if not local["optimizers"][0]["state"]:
        # No step taken: each master shard is its part of θ, known here. No collective, so a fresh
        # member (a joiner before it receives the state) takes its snapshot alone.
        return assembled(local, s.flat.numel, s.flat.shard_size, lambda entry: s.flat.params.detach().float())

    def gather(entry) -> torch.Tensor:
        shard = entry(local)
        whole = shard.new_empty(shard.numel() * s.comm.world)
        s.comm.all_gather(whole, shard.contiguous())
        return whole

    return assembled(local, s.flat.numel, s.flat.shard_size, gather)


def from_shards(states: list[dict], numel: int) -> dict:
    """The whole state from the state_dict()s of every rank of a membership, in rank order, over
    a flat buffer of `numel` elements."""
    return assembled(states[0], numel, -(-numel // len(states)),
                     lambda entry: torch.cat([entry(state) for state in states]))


def assembled(local: dict, numel: int, shard_size: int, joined) -> dict:
    """`local` with each sharded entry (optimizer moments, master copy) whole: `joined(entry)`
    puts together `entry(state)` of every rank in rank order (padded: cut to `numel`)."""
    (osd,) = local["optimizers"]
    moments = {k: joined(lambda st, k=k: st["optimizers"][0]["state"][0][k])[:numel].clone()
               if _sharded(v, shard_size) else v.clone() if torch.is_tensor(v) else v
               for k, v in osd["state"].get(0, {}).items()}
    master = local["extra"]["master"]
    return _with(local, osd, moments, {"master": None if master is None else
                                       joined(lambda st: st["extra"]["master"])[:numel].clone()})


def cut(whole: dict, s) -> dict:
    """The state_dict() of this member of the current membership, cut from the whole state."""
    flat = s.flat

    def own(full: torch.Tensor) -> torch.Tensor:
        padded = full.new_zeros(flat.shard_size * s.comm.world)
        padded[:flat.numel] = full
        return padded[flat.own].clone()

    (osd,) = whole["optimizers"]
    moments = {k: own(v) if _sharded(v, flat.numel) else v for k, v in osd["state"].get(0, {}).items()}
    master = whole["extra"]["master"]
    buffers = {k: _repadded(whole["extra"][k], flat.params) for k in s.flat_buffers if k in whole["extra"]}
    return _with(whole, osd, moments, {"master": None if master is None else own(master),
                                       "grads": torch.zeros_like(flat.grads), **buffers})


def _repadded(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A flat buffer of another world's padding in this one's (the padding is zero)."""
    out = torch.zeros_like(like, dtype=buffer.dtype)
    n = min(buffer.numel(), out.numel())
    out[:n] = buffer[:n]
    return out


def _with(state: dict, osd: dict, moments: dict, sharded: dict) -> dict:
    """`state` with its one optimizer's state replaced by `moments`, and its sharded extra entries
    by `sharded` (the others, flat buffers of one world, left out)."""
    extra = {k: v for k, v in state["extra"].items() if k != "grads"}
    return {**state, "optimizers": [{"state": {0: moments} if moments else {}, "param_groups": osd["param_groups"]}],
            "extra": {**extra, **sharded}}
