"""DCTTopK over all of a model's tensors at once, on one wire buffer (DeMo's compressor, batched).

Tensors whose blocks have the same dims and whose rows are equally long (1-D: the same
chunk), such as a GPT's many equal layer shapes, are stacked into one (blocks, block)
coefficient tensor (`Stack`): one matmul / topk / scatter per stack instead of one per
tensor. Tensors of different `keys` (e.g. param groups, which step at different learning
rates) are never stacked together. The wire stays per tensor, in tensor order, so what is
sent does not depend on how tensors were stacked:

    dct = DCTStacks(shapes, chunk=64, k=32, values="fp32", compact_index=False, keys=None)
    for s in dct.stacks:                            # s.members: the tensors it stacks
        top, val = s.enc.topk(s.enc.encode(s.stack([x[m] for m in s.members])))
    mine = dct.pack([(top, val) of each stack])     # this worker's bytes (uint8)
    qs = dct.decode(gathered.view(world, -1))       # per tensor: each coefficient's mean over
                                                    # the workers that sent it, inverse DCT
    dct.split(per_stack)                            # per tensor: its rows of a per-stack tensor
"""
from __future__ import annotations

import itertools
import math

import torch

from .dct import DCTTopK


def encoders(shapes, chunk: int, k: int, values: str = "fp32", compact_index: bool = False,
             device=None) -> list[DCTTopK]:
    """One DCTTopK per tensor shape (its wire bytes: .nbytes())."""
    return [DCTTopK(s, chunk, k, values, compact_index, device=device) for s in shapes]


class Stack:
    """Tensors transformed and top-k'd as one stack of rows. Member m's blocks are rows
    [r0, r1) of the stack's (blocks, block) coefficients, in the member's own order."""

    def __init__(self, members, encoders, chunk, k, values, compact_index, device):
        self.members = members
        first = encoders[members[0]]
        self.one_d = len(first.dims) == 1
        self.widths = [math.prod(encoders[m].shape) if self.one_d else encoders[m].shape[0] for m in members]
        shape = (sum(self.widths),) if self.one_d else (sum(self.widths), math.prod(first.shape[1:]))
        self.enc = DCTTopK(shape, chunk, k, values, compact_index, device=device, dims=first.dims)
        ends = list(itertools.accumulate(encoders[m].blocks for m in members))
        self.rows = list(zip([0] + ends[:-1], ends))

    def stack(self, tensors):
        """The members' tensors (None: zeros) as the fp32 stack the encoder transforms; None if all are."""
        if all(t is None for t in tensors):
            return None
        tail, device = (() if self.one_d else self.enc.shape[1:]), self.enc.mats[0].device
        return torch.cat([torch.zeros(n, *tail, device=device) if t is None else t.reshape(n, *tail).float()
                          for t, n in zip(tensors, self.widths)])


class DCTStacks:
    def __init__(self, shapes, chunk: int, k: int, values: str = "fp32", compact_index: bool = False,
                 device=None, keys=None):
        self.encoders = encoders(shapes, chunk, k, values, compact_index, device=device)
        keys = keys if keys is not None else [None] * len(self.encoders)
        by_key: dict = {}
        for i, (e, key) in enumerate(zip(self.encoders, keys)):
            dims = e.dims if len(e.dims) == 1 else (e.dims, math.prod(e.shape[1:]))
            by_key.setdefault((key, dims), []).append(i)
        self.stacks = [Stack(members, self.encoders, chunk, k, values, compact_index, device)
                       for members in by_key.values()]
        self._templates = None

    def nbytes(self) -> int:
        """Wire bytes of one worker's (indices, values) of every tensor."""
        return sum(e.nbytes() for e in self.encoders)

    def zeros(self, device=None) -> list[torch.Tensor]:
        """A zero (blocks, block) coefficient tensor per stack."""
        return [torch.zeros(s.enc.blocks, s.enc.block, device=device) for s in self.stacks]

    def split(self, per_stack: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per tensor, a view of its rows of its stack's tensor in `per_stack`."""
        out = [None] * len(self.encoders)
        for s, t in zip(self.stacks, per_stack):
            for m, (r0, r1) in zip(s.members, s.rows):
                out[m] = t[r0:r1]
        return out

    def pack(self, sent: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Each stack's (int64 indices, fp32 values) -> this worker's bytes, tensor by tensor."""
        packed = [None] * len(self.encoders)
        for s, (top, val) in zip(self.stacks, sent):
            for m, (r0, r1) in zip(s.members, s.rows):
                packed[m] = self.encoders[m].pack(top[r0:r1], val[r0:r1])
        return torch.cat([t.reshape(-1).view(torch.uint8) for pair in packed for t in pair])

    def decode(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Every worker's bytes (rows: workers) -> per tensor, the decoded mean (DCTTopK.decompress)."""
        at, qs = 0, []
        for enc, (idx0, val0) in zip(self.encoders, self._sent_dtypes()):
            ni, nv = idx0.numel() * idx0.element_size(), val0.numel() * val0.element_size()
            # every worker's (index, value) of this tensor, as (world, n) views of the buffer
            idxs, vals = _as(rows[:, at:at + ni], idx0.dtype), _as(rows[:, at + ni:at + ni + nv], val0.dtype)
            at += ni + nv
            qs.append(enc.decompress(idxs, vals))
        return qs

    def _sent_dtypes(self):
        """Per tensor, empty (index, value) tensors of the sent dtypes and sizes."""
        if self._templates is None:
            self._templates = []
            for enc in self.encoders:
                i, v = enc.pack(torch.zeros(enc.blocks, enc.k, dtype=torch.int64), torch.zeros(enc.blocks, enc.k))
                self._templates.append((torch.empty(i.numel(), dtype=i.dtype), torch.empty(v.numel(), dtype=v.dtype)))
        return self._templates


def _as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Received bytes (rows: workers) as `dtype`: a view where offset and row length
    allow, else a copy. The copy is a clone, never contiguous(): one worker's slice is
    already contiguous, so contiguous() would return it at its misaligned offset."""
    try:
        return buf.view(dtype)
    except RuntimeError:
        return buf.clone(memory_format=torch.contiguous_format).view(dtype)
