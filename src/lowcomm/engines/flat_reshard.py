"""ZeRO-1's sharded state: the zero1 family's state parts (contract/parts.py; flat.py's
ShardedStrategy.state_parts), and their layouts: whole, and re-cut for another membership (overlap.py's
round buffer re-padded).

The optimizer state (AdamW's moments) and the fp32 master copy are sharded by (world, rank):
rank r of W holds elements [r*s, (r+1)*s) of the flat parameter buffer, s = ceil(P/W). So at a
commit point the members all-gather the shards into the whole state, which any member can load
into any new membership by cutting out its own shard (padding, always zero, rebuilt as zeros);
a checkpoint's W shards are put together the same way for a resume on another number of
workers. The flat gradient buffer is this world's and zero at a step's start: left out of the
whole, rebuilt as zeros. A round buffer (acco's and dpu's B) is this worker's own, in its
world's padding: re-padded for the new one.

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

from ..contract.parts import LOCAL, SHARDED, Part, optimizer_part
from ..errors import RunError


def sharded_parts(s, model: Part) -> dict[str, Part]:
    """The state parts of ShardedStrategy `s` (flat.py): the model (with FSDP inside, the flat copies of
    its shards follow a load), the shard optimizer's state and the master copy, sharded; the flat
    gradient buffer, this worker's own. Across replica groups the same holds for each position's
    tensors, sharded across the replicas at that position."""
    def load_model(sd: dict) -> None:
        model.load(sd)
        if not s.flat.aliased:
            s.flat.read_params()

    def load_master(master) -> None:
        if master is not None:  # None: an alias of the parameters (zero1 in fp32)
            s.shard_opt.master.data.copy_(master)

    master = lambda: None if s.shard_opt.aliased else s.shard_opt.master.detach().clone()  # noqa: E731
    return {"model": Part(model.save, load_model),
            "optimizer": optimizer_part(s.shard_opt.optimizer, SHARDED, layout=OptimizerShards(s)),
            "master": Part(master, load_master, SHARDED, layout=Shards(s)),
            "grads": Part(s.flat.grads.clone, s.flat.grads.copy_, LOCAL, layout=Scratch(s.flat.grads))}


def _sharded(value, shard_size: int) -> bool:
    """An optimizer state entry that has one element per shard element (not a scalar like step)."""
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == shard_size


class Shards:
    """A flat shard of strategy `s` (its master copy): gathered whole, joined from a checkpoint's
    ranks, cut for this member. `s` is read when used: its group changes with the membership."""

    def __init__(self, s):
        self.s = s

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Every member's shard, in rank order, cut to the parameters (collective)."""
        whole = shard.new_empty(shard.numel() * self.s.comm.world)
        self.s.comm.all_gather(whole, shard.contiguous())
        return whole[:self.s.flat.numel].clone()

    def own(self, full: torch.Tensor) -> torch.Tensor:
        """This member's shard of a whole flat tensor (padded with zeros)."""
        flat = self.s.flat
        padded = full.new_zeros(flat.shard_size * self.s.comm.world)
        padded[:flat.numel] = full
        return padded[flat.own].clone()

    def whole(self, master):
        if master is None:  # an alias of the parameters (zero1 in fp32): the model holds it
            return None
        if not self.s.shard_opt.optimizer.state:
            # No step taken: each master shard is its part of θ, known here. No collective, so a fresh
            # member (a joiner before it receives the state) takes its snapshot alone.
            return self.s.flat.params.detach().float()[:self.s.flat.numel].clone()
        return self.gather(master)

    def joined(self, masters: list):
        return None if masters[0] is None else torch.cat(masters)[:self.s.flat.numel].clone()

    def cut(self, master):
        return None if master is None else self.own(master)


class OptimizerShards(Shards):
    """The shard optimizer's state_dict(): its moments sharded as the master copy, its scalars (step) whole."""

    def whole(self, osd: dict) -> dict:
        if len(self.s.shard_opt.pieces) != 1:
            raise RunError("--elastic runs a sharded strategy with one optimizer parameter group")
        if not osd["state"]:  # no step taken: nothing to gather (Shards.whole)
            return _with(osd, {})
        return self._moments(osd, lambda v: self.gather(v), self.s.flat.shard_size)

    def joined(self, osds: list[dict]) -> dict:
        numel = self.s.flat.numel
        return self._moments(osds[0], None, -(-numel // len(osds)),
                             lambda k: torch.cat([osd["state"][0][k] for osd in osds])[:numel].clone())

    def cut(self, osd: dict) -> dict:
        return self._moments(osd, self.own, self.s.flat.numel)

    @staticmethod
    def _moments(osd: dict, each, size: int, by_key=None) -> dict:
        """`osd` with each sharded moment (`size` elements) replaced by each(moment) (or by_key(its key))."""
        moments = {k: (each(v) if by_key is None else by_key(k)) if _sharded(v, size)
                   else v.clone() if torch.is_tensor(v) else v for k, v in osd["state"].get(0, {}).items()}
        return _with(osd, moments)


def _with(osd: dict, moments: dict) -> dict:
    return {"state": {0: moments} if moments else {}, "param_groups": osd["param_groups"]}


class Scratch:
    """The flat gradient buffer: this world's, zero at a step's start; left out of the whole."""

    def __init__(self, like: torch.Tensor):
        self.like = like

    def whole(self, value):
        return None

    def joined(self, values):
        return None

    def cut(self, value):
        return torch.zeros_like(self.like)


class Repadded(Scratch):
    """A flat buffer of this worker's own (acco's and dpu's round buffer B), in its world's padding:
    kept whole, re-padded for another membership (the padding is zero)."""

    def whole(self, value):
        return value.clone()

    def joined(self, values):
        return values[0]

    def cut(self, buffer):
        out = torch.zeros_like(self.like, dtype=buffer.dtype)
        n = min(buffer.numel(), out.numel())
        out[:n] = buffer[:n]
        return out
