"""The trainer's state as DCP stores it, and read back on one process.

DCP keeps one copy of an entry that several ranks save under the same key (it treats it
as replicated and de-duplicates it), so per-rank state -- data position, RNG, ZeRO-1/ACCO
shards, DPU's pending gradient, error-feedback residuals, DiLoCo's local θ -- goes under a
per-rank key `rank<r>`, and only state that is identical on every rank (a strategy that
declares only replicated state parts, e.g. ddp's parameters and optimizer) goes under the
shared key `shared`, written once. DCP flattens nested dicts into dotted keys, which turns
integer keys (an optimizer's `state[0]`) into strings and drops empty containers; so each
namespace is stored as its tensors (`tensors.<i>`, real DCP tensor entries) plus a
`skeleton`: the nested structure with each tensor replaced by its index, which DCP pickles
as one bytes entry. Loading is rank-local (`no_dist`): a rank reads its own namespace and
the shared one, with a template built from DCP's metadata.
"""
from __future__ import annotations

import pickle
import warnings
from typing import Any

import torch

from ..config.nodes import per_replica
from ..errors import RunError
from .choose import Found


class _Ref:
    """Where a tensor sat in a skeleton: its index in the namespace's tensor list."""

    def __init__(self, i: int):
        self.i = i

    def __reduce__(self):
        return (_Ref, (self.i,))


# Skeletons pickle _Ref by its module's name, and checkpoints on disk (including those written
# before the package was split) name it lowcomm.checkpoint._Ref: keep that name (see __init__).
_Ref.__module__ = "lowcomm.checkpoint"


def _walk(obj: Any, leaf: type, fn) -> Any:
    """`obj` with each `leaf` inside its dicts, lists and tuples replaced by fn(leaf)."""
    if isinstance(obj, leaf):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _walk(v, leaf, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_walk(v, leaf, fn) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _split(obj: Any, tensors: list) -> Any:
    """The skeleton of `obj`; its tensors (on the CPU) are appended to `tensors`."""
    def ref(t: torch.Tensor) -> _Ref:
        tensors.append(t.detach().cpu() if t.device.type != "cpu" else t.detach())
        return _Ref(len(tensors) - 1)
    return _walk(obj, torch.Tensor, ref)


def _join(skeleton: Any, tensors: dict) -> Any:
    return _walk(skeleton, _Ref, lambda ref: tensors[str(ref.i)])


def _namespace(state: Any) -> dict:
    tensors: list = []
    skeleton = _split(state, tensors)
    # Pickled here, so DCP stores the skeleton as one opaque bytes entry instead of flattening it.
    return {"tensors": {str(i): t for i, t in enumerate(tensors)}, "skeleton": pickle.dumps(skeleton)}


def to_dcp(trainer, wall_s: float, replicated: bool) -> dict:
    """What this rank hands dcp.save: worker.Trainer.state_dict() plus the run's wall time,
    under `rank<r>`, with the strategy's state under `shared` when it is replicated."""
    state = {**trainer.state_dict(), "run": {"wall_s": wall_s}}
    strategy_state = state.pop("strategy")
    key = f"rank{trainer.rank}"
    if not replicated:
        return {key: _namespace({**state, "strategy": strategy_state})}
    return {key: _namespace(state), "shared": _namespace({"strategy": strategy_state})}


def read_state(found: Found, rank: int | None) -> dict:
    """What rank `rank` saved (None: only the shared part), as worker.Trainer.state_dict() laid
    it out plus "run"; read on this process alone."""
    import torch.distributed.checkpoint as dcp

    wanted = ["shared"] if found.replicated else []
    if rank is not None:
        wanted.append(f"rank{rank}")
    template = _template(found, wanted)
    if any(ns not in template for ns in wanted):
        raise RunError(f"checkpoint {found.path} holds no state for rank {rank}")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(template, checkpoint_id=str(found.path), no_dist=True)
    state: dict = {}
    for ns in wanted:
        part = template[ns]
        state.update(_join(pickle.loads(part["skeleton"]), part.get("tensors", {})))
    return state


def _template(found: Found, wanted: list[str]) -> dict:
    """Empty tensors (and None for bytes entries) where DCP's metadata lists an entry of the
    namespaces `wanted`, nested as DCP's dotted keys say: what dcp.load fills in."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(found.path)).read_metadata().state_dict_metadata
    template: dict = {}
    for key, md in meta.items():
        if key.split(".", 1)[0] not in wanted:
            continue
        parts = key.split(".")
        node = template
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = (torch.empty(md.size, dtype=md.properties.dtype)
                           if isinstance(md, TensorStorageMetadata) else None)
    return template


def load(trainer, found: Found) -> dict:
    """Load checkpoint `found` into the trainer: rank-local reads of its own namespace; written by
    another world size, its strategy state re-cut for this one (recut.py, as an elastic run's first
    quorum does) with fresh data order and RNG. Returns the run's bookkeeping saved with it
    ({"wall_s": ...})."""
    if found.world != trainer.world:
        from .recut import load_recut  # (it imports this module)
        load_recut(trainer.run, found, trainer.rank, per_replica(trainer.cfg))
        trainer.step = found.step
        return {}
    state = read_state(found, trainer.rank)
    trainer.load_state_dict(state)
    if trainer.step != found.step:
        raise RunError(f"checkpoint {found.path} holds step {trainer.step}, its name says {found.step}")
    return state.get("run", {})
