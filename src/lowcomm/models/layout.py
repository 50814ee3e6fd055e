"""A model's layout, in the one place that knows it: trainable tensor shapes and block structure.

Every strategy's communication plan is priced from a `ModelLayout`, never from a bare
parameter count: DeMo's chunks and PowerSGD's matrices depend on each tensor's shape,
Streaming DiLoCo's fragments on which transformer block a tensor sits in. The layout
comes from the model itself (`layout_of(model)`, also on the meta device), so the
trainer, the planner and the contract tests price the same thing.

Fragments (Streaming DiLoCo's rule, from the paper): tensors of transformer block i go
to fragment i mod F; tensors outside blocks (embeddings, final norm) to fragment 0. A
model whose blocks are unknown is cut into F contiguous groups of nearly equal size
(in `parameters()` order, a tensor never split).
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

OUTSIDE = -1  # block index of a tensor that belongs to no transformer block


@dataclass(frozen=True)
class ModelLayout:
    shapes: tuple[tuple[int, ...], ...]  # trainable parameters, in model.parameters() order
    blocks: tuple[int, ...] | None = None  # each tensor's transformer block (OUTSIDE: none); None: unknown

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    def fragments(self, F: int) -> list[list[int]]:
        """Tensor indices of each of F fragments (some may be empty: fewer blocks than F)."""
        if self.blocks is not None:  # (a subset may hold no block's tensor: they still go by the rule)
            return [[j for j, b in enumerate(self.blocks) if max(b, 0) % F == f] for f in range(F)]
        return contiguous_groups(self.numels, F)

    def fragment_sizes(self, F: int) -> list[list[int]]:
        """Each fragment's tensor sizes (an outer gradient is compressed tensor by tensor)."""
        numels = self.numels
        return [[numels[j] for j in group] for group in self.fragments(F)]

    def fragment_numels(self, F: int) -> list[int]:
        return [sum(sizes) for sizes in self.fragment_sizes(F)]

    @functools.lru_cache(maxsize=64)  # the planner asks the same split for every strategy and replica count
    def positions(self, K: int) -> list[list[int]]:
        """Tensor indices each of K ranks of a replica owns (replica groups, engines/inside.py);
        the caller must not change the lists."""
        return owned_tensors(self.numels, K)

    def subset(self, indices: list[int]) -> "ModelLayout":
        """The layout of tensors `indices` only (in that order), blocks kept."""
        blocks = None if self.blocks is None else tuple(self.blocks[j] for j in indices)
        return ModelLayout(tuple(self.shapes[j] for j in indices), blocks)


def owned_tensors(numels: list[int], K: int) -> list[list[int]]:
    """Which tensors each of K positions owns, whole tensors only (DeMo's DCT, PowerSGD's
    matrices and Streaming DiLoCo's blocks need a tensor's shape, which a flat slice loses):
    the largest first, each to the least loaded position (ties: the lowest position);
    each position's indices in model order. The positions wait in a heap of (load, position),
    whose smallest is that least loaded one: O(n log K), where a scan of the K positions for
    each of n tensors took minutes for a planned replica of thousands of ranks."""
    heap, out = [(0, q) for q in range(K)], [[] for _ in range(K)]  # in order: a heap already
    for j in sorted(range(len(numels)), key=lambda j: (-numels[j], j)):
        load, p = heap[0]
        out[p].append(j)
        heapq.heapreplace(heap, (load + numels[j], p))
    return [sorted(group) for group in out]


def contiguous_groups(numels: list[int], F: int) -> list[list[int]]:
    """Indices of consecutive tensors in F groups of nearly equal size (a tensor goes to the
    group its middle element falls in)."""
    total, before, out = sum(numels), 0, [[] for _ in range(F)]
    for j, n in enumerate(numels):
        out[min(F - 1, int((before + n / 2) * F // max(total, 1)))].append(j)
        before += n
    return out


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def layout_of(model: nn.Module) -> ModelLayout:
    """The layout of `model`'s trainable parameters; its blocks are found in a `blocks`
    ModuleList (lowcomm's GPT) or the usual transformers names (`model.layers`, `h`, ...)."""
    params = trainable(model)
    where = {}
    for b, block in enumerate(block_list(model) or []):
        for p in block.parameters():
            where[id(p)] = b
    blocks = tuple(where.get(id(p), OUTSIDE) for p in params) if where else None
    if blocks is not None and all(b == OUTSIDE for b in blocks):  # blocks found, none of them trained
        blocks = None
    return ModelLayout(tuple(tuple(p.shape) for p in params), blocks)


def meta_layout(build: Callable[[], nn.Module]) -> ModelLayout:
    """The layout of the model `build()` returns, built on the meta device: no memory, no
    compute, any size; the caller's random state is left as it was."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"), _SkipMetaFills():
        return layout_of(build())


class _SkipMetaFills(TorchFunctionMode):
    """In this thread, value fills of meta tensors (torch.nn.init's and the tensor methods they
    call) return at once: there is nothing to fill, and torch runs them through Python
    decompositions (normal_ ~1.5 ms a call, most of a meta GPT's build time). Every op here
    keeps the tensor's shape."""

    FILLS = frozenset([getattr(nn.init, n) for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
                      + [torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.erfinv_, torch.Tensor.clamp_])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FILLS:
            tensor = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by name
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


_BLOCK_PATHS = ("blocks", "model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers", "layers", "h")


def block_list(model: nn.Module) -> nn.ModuleList | None:
    for path in _BLOCK_PATHS:
        node = model
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if isinstance(node, nn.ModuleList) and len(node) > 0:
            return node
    return None
