"""A compressor applied to each tensor of a flat vector on its own.

    c = PerTensor(TopK(4096, k=64, value_bits=2, values="stat"), sizes=[p.numel() for p in params])
    payload = c.compress(flat)      # each tensor's own chunks (zero-padded) and own statistics

Why: a compressor's blocks, chunks and statistics (a quantization scale, top-k's chunk, the
statistical quantizer's mean and σ) then never mix two tensors, as in SparseLoCo's reference
code (per parameter). It also makes the result a function of each tensor alone, so a replica
whose ranks each own whole tensors compresses exactly what one worker holding them all would.
The wire bytes are the sum of each tensor's: `nbytes(n) = Σ inner.nbytes(size)`.
"""
from __future__ import annotations

import torch

from .core import Compressor, Payload


class PerTensor(Compressor):
    def __init__(self, inner: Compressor, sizes: list[int]):
        if not sizes or min(sizes) < 1:
            raise ValueError(f"PerTensor needs tensor sizes >= 1, got {sizes}")
        self.inner, self.sizes = inner, list(sizes)
        self.name = f"{inner.name} per tensor"
        self._bytes = [inner.nbytes(s) for s in self.sizes]

    def _check(self, n: int) -> None:
        if n != sum(self.sizes):
            raise ValueError(f"{self.name}: a row of {n} values, expected {sum(self.sizes)}")

    def layout(self, n):
        self._check(n)
        return [(torch.uint8, sum(self._bytes))]

    def compress(self, x):
        self._check(x.shape[-1])
        return Payload(tuple(self.inner.compress(piece) for piece in x.split(self.sizes, dim=-1)), x.shape[-1])

    def decompress(self, payload):
        return torch.cat([self.inner.decompress(p) for p in payload.parts], dim=-1)

    def support(self, payload):
        masks = [self.inner.support(p) for p in payload.parts]
        if all(m is None for m in masks):
            return None
        return torch.cat([torch.ones_like(self.inner.decompress(p)) if m is None else m
                          for p, m in zip(payload.parts, masks)], dim=-1)

    def to_bytes(self, payload):
        return torch.cat([self.inner.to_bytes(p) for p in payload.parts], dim=-1)

    def from_bytes(self, buf, n):
        self._check(n)
        if buf.shape[-1] != sum(self._bytes):
            raise ValueError(f"{self.name}: {buf.shape[-1]} bytes, expected {sum(self._bytes)}")
        pieces = buf.split(self._bytes, dim=-1)
        return Payload(tuple(self.inner.from_bytes(b, s) for b, s in zip(pieces, self.sizes)), n)


def per_tensor(inner: Compressor, sizes: list[int]) -> Compressor:
    """`inner` on each tensor alone; `inner` itself for a single tensor (the same bytes and values)."""
    return inner if len(sizes) == 1 else PerTensor(inner, sizes)
