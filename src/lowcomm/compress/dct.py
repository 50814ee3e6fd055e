"""DeMo's chunked DCT-II top-k (Peng et al., arXiv 2411.19870), written from the paper
and the authors' standalone optimizer's description.

A tensor is cut into chunks whose length along each dimension is the largest divisor
of that dimension not above the target (so every shape splits evenly); a 2-D tensor
is cut into 2-D blocks transformed by a 2-D orthonormal DCT-II, a 1-D tensor into 1-D
chunks (tensors of more dimensions are treated as (shape[0], rest)). In each block the
k largest-magnitude coefficients are kept: their index inside the block and their value.

    enc = DCTTopK(shape, chunk=64, k=32, values="fp32", compact_index=False)
    idx, val = enc.compress(x)              # (blocks, k) each
    q = enc.decompress([idx], [val])        # tensor of x's shape (the inverse DCT)
    Q = enc.decompress(idx_list, val_list)  # several workers: each index averaged over
                                            # the workers that sent it
    enc.nbytes()                            # exact wire bytes of (idx, val)

`values`: "fp32" (faithful), "bf16", or "sign" (1 bit per value plus one fp32 scale per
block, the mean |value| of the kept coefficients). Indices: int64 (faithful) or, with
`compact_index`, the smallest type addressing a block (uint8 up to 256, else 16 bits).
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from .bits import pack_bits, packed_len, unpack_bits
from .core import decode_index, encode_index, index_dtype

DCT_VALUES = ("fp32", "bf16", "sign")


def largest_divisor_at_most(n: int, target: int) -> int:
    """The largest divisor of n not above target (n itself when n <= target)."""
    if n <= target:
        return n
    for d in range(target, 0, -1):
        if n % d == 0:
            return d
    return 1


@lru_cache(maxsize=64)
def _dct_matrix64(n: int) -> torch.Tensor:
    """Orthonormal DCT-II as a matrix F: (x @ F)[k] = DCT(x)[k]; F is orthogonal, so
    the inverse (DCT-III) is c @ F.T. Built in float64."""
    i = torch.arange(n, dtype=torch.float64)
    F = torch.cos(math.pi * (2 * i[:, None] + 1) * i[None, :] / (2 * n))
    F[:, 0] *= math.sqrt(1.0 / n)
    F[:, 1:] *= math.sqrt(2.0 / n)
    return F


def dct_matrix(n: int, dtype=torch.float32, device=None) -> torch.Tensor:
    return _dct_matrix64(n).to(dtype=dtype, device=device)


def block_dims(shape, target: int) -> tuple:
    """The chunk length along each of the (at most two) dimensions a tensor is cut along."""
    if len(shape) == 0:
        return (1,)
    if len(shape) == 1:
        return (largest_divisor_at_most(shape[0], target),)
    rows, cols = shape[0], math.prod(shape[1:])
    return (largest_divisor_at_most(rows, target), largest_divisor_at_most(cols, target))


def _count_dtype(workers: int) -> torch.dtype:
    """The smallest type that counts how many of `workers` sent a coefficient."""
    return torch.uint8 if workers < 256 else torch.int32


class DCTTopK:
    def __init__(self, shape, chunk: int = 64, k: int = 32, values: str = "fp32",
                 compact_index: bool = False, device=None, dims=None):
        """`dims`: the block's dimensions instead of block_dims(shape, chunk), e.g. those of
        the tensors a stack of same-width tensors was made of (a stack of rows has divisors
        its members lack)."""
        if values not in DCT_VALUES:
            raise ValueError(f"values must be one of {DCT_VALUES}, got {values}")
        self.shape = tuple(shape)
        self.values, self.compact_index = values, compact_index
        self.dims = tuple(dims) if dims is not None else block_dims(self.shape, chunk)
        if len(self.dims) == 1:
            n = max(1, math.prod(self.shape))
            self.grid = (n // self.dims[0],)
        else:
            self.grid = (self.shape[0] // self.dims[0], math.prod(self.shape[1:]) // self.dims[1])
        self.block = math.prod(self.dims)
        self.blocks = math.prod(self.grid)
        self.k = max(1, min(k, self.block))
        self.idx_dtype = index_dtype(self.block) if compact_index else torch.int64
        self.mats = [dct_matrix(d, device=device) for d in self.dims]

    # -- sizes --------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Wire bytes of one worker's (indices, values)."""
        n = self.blocks * self.k
        idx = n * torch.empty((), dtype=self.idx_dtype).element_size()
        if self.values == "fp32":
            val = 4 * n
        elif self.values == "bf16":
            val = 2 * n
        else:
            val = packed_len(n, 1) + 4 * self.blocks
        return idx + val

    # -- transform ------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x -> DCT coefficients, (blocks, block) with the block's index = row * w + col."""
        if len(self.dims) == 1:
            (w,) = self.dims
            return x.reshape(-1, w) @ self.mats[0]
        # C = Fhᵀ·X·Fw per (h, w) block, as two batched matmuls: about twice as fast on
        # CPU as the equivalent three-operand einsum. The row transform multiplies from the
        # left, on the rows as they lie (a right multiply by a transposed view made matmul
        # copy it first); only the last step, to the blocks' layout, copies.
        h, w = self.dims
        y, xx = self.grid
        a = x.reshape(y * h * xx, w) @ self.mats[1]                  # rows: (y, h, x); cols: d
        a = torch.matmul(self.mats[0].T, a.reshape(y, h, xx * w))    # (y, b, x·d)
        return a.reshape(y, h, xx, w).transpose(1, 2).reshape(self.blocks, self.block)

    def decode(self, c: torch.Tensor) -> torch.Tensor:
        """(blocks, block) coefficients -> a tensor of the original shape (inverse DCT)."""
        if len(self.dims) == 1:
            return (c @ self.mats[0].T).reshape(self.shape)
        # Q = Fh·C·Fwᵀ per block: the row transform from the left on the (y·x) blocks as
        # they lie, so that only the last step, back to the tensor's layout, copies.
        h, w = self.dims
        y, xx = self.grid
        a = c.reshape(y * xx * h, w) @ self.mats[1].T                # rows: (y, x, b); cols: w
        a = torch.matmul(self.mats[0], a.reshape(y * xx, h, w))      # (y·x, h, w)
        return a.reshape(y, xx, h, w).permute(0, 2, 1, 3).reshape(self.shape)

    # -- top-k ------------------------------------------------------------------------------
    def topk(self, coeffs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks, block) -> int64 indices and fp32 values of the k largest |c| per block."""
        idx = coeffs.abs().topk(self.k, dim=-1, sorted=False).indices
        return idx, coeffs.gather(-1, idx)

    def pack(self, idx: torch.Tensor, val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 indices, fp32 values -> what is sent: (index tensor, value bytes or tensor)."""
        idx = encode_index(idx, self.idx_dtype) if self.compact_index else idx
        if self.values == "fp32":
            return idx, val.float()
        if self.values == "bf16":
            return idx, val.to(torch.bfloat16)
        scale = val.abs().mean(-1)
        bits = pack_bits((val >= 0).to(torch.uint8).reshape(-1), 1)
        return idx, torch.cat([bits, scale.float().contiguous().view(torch.uint8)])

    def unpack(self, idx: torch.Tensor, val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of pack: int64 indices (blocks, k) and fp32 values (blocks, k)."""
        idx = decode_index(idx) if self.compact_index else idx
        if self.values in ("fp32", "bf16"):
            return idx.reshape(self.blocks, self.k), val.float().reshape(self.blocks, self.k)
        n = self.blocks * self.k
        nb = packed_len(n, 1)
        signs = unpack_bits(val[:nb], 1, n).float().reshape(self.blocks, self.k) * 2 - 1
        scale = val[nb:].clone().view(torch.float32)
        return idx.reshape(self.blocks, self.k), signs * scale.unsqueeze(-1)

    def compress(self, x: torch.Tensor):
        """x -> the packed (indices, values) one worker sends."""
        return self.pack(*self.topk(self.encode(x)))

    def decompress(self, idx_list, val_list) -> torch.Tensor:
        """Workers' packed (indices, values) -> the decoded tensor: at each coefficient the
        mean of the values of the workers that sent it (zero where none did), inverse DCT.
        Each of idx_list / val_list: one packed tensor per worker, or them all stacked as
        one (workers, ...) tensor (e.g. a view of a gathered buffer: nothing copied)."""
        idx, val = self._received(idx_list, val_list)
        # The coefficients are built in a zero buffer kept between calls and put back to zero
        # where written: the sent coefficients are a few percent of the tensor, and filling a
        # fresh full-size buffer (twice, with the counts) cost more than the scatters.
        c, n = self._scratch(val.device, len(idx_list))
        try:
            return self.decode(self._scatter_mean(c, n, idx, val, len(idx_list)))
        finally:  # (scatter_ of a zero tensor: much faster on CPU than of the scalar 0)
            c.scatter_(-1, idx, torch.zeros_like(val))
            n.scatter_(-1, idx, torch.zeros_like(idx, dtype=n.dtype))

    def _received(self, idx_list, val_list):
        """-> int64 indices and fp32 values, (blocks, workers·k): the workers side by side."""
        if isinstance(idx_list, torch.Tensor) and self.values != "sign":  # unpack is elementwise
            idx = decode_index(idx_list) if self.compact_index else idx_list
            idx, val = idx.reshape(-1, self.blocks, self.k), val_list.float().reshape(-1, self.blocks, self.k)
        else:
            idx, val = zip(*(self.unpack(i, v) for i, v in zip(idx_list, val_list, strict=True)))
        if len(idx) == 1:
            return idx[0], val[0]
        return torch.cat(tuple(idx), dim=-1), torch.cat(tuple(val), dim=-1)

    def _scratch(self, device, workers):
        z = getattr(self, "_zeros", None)
        if z is None or z[0].device != device or z[1].dtype != _count_dtype(workers):
            self._zeros = (torch.zeros(self.blocks, self.block, device=device),
                           torch.zeros(self.blocks, self.block, dtype=_count_dtype(workers), device=device))
        return self._zeros

    @staticmethod
    def _scatter_mean(c, n, idx, val, workers):
        """Into zero (c, n): at each index the mean of the values sent there. Sum, then
        divide, as scatter_reduce_(mean) does, but touching only the sent positions."""
        if workers == 1:  # one worker's top-k indices are distinct: a plain scatter, same values
            return c.scatter_(-1, idx, val)
        c.scatter_add_(-1, idx, val)
        n.scatter_add_(-1, idx, torch.ones_like(idx, dtype=n.dtype))
        return c.scatter_(-1, idx, c.gather(-1, idx) / n.gather(-1, idx))
