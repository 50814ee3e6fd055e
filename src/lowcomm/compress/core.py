"""Row-wise compressors: a float tensor (..., n) -> a Payload of small tensors -> back.

Every compressor here works on the last dimension, so a (W, m) tensor is W
independent rows (ZeRO-style shards) of `nbytes(m)` wire bytes each.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .bits import pack_bits, packed_len, unpack_bits

Layout = list  # [(dtype, count per row), ...]


@dataclass
class Payload:
    """What crosses the wire: `parts` (tensors with the input's leading dims) for
    rows of `n` values. `to_bytes` / `from_bytes` turn it into one uint8 buffer."""
    parts: tuple
    n: int


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Compressor:
    """Base of the row-wise compressors. Subclasses implement layout, compress, decompress.

    compress(x (..., n)) -> Payload        decompress(payload) -> (..., n) float32
    nbytes(n)            exact wire bytes of one row (sum of the layout)
    to_bytes(payload)    (..., nbytes(n)) uint8, ready for all_to_all / all_gather
    from_bytes(buf, n)   the inverse of to_bytes
    bound(x)             the stated worst-case error ||x - decompress(compress(x))||_inf or 2-norm
    """
    name = "identity"

    def layout(self, n: int) -> Layout:
        return [(torch.float32, n)]

    def nbytes(self, n: int) -> int:
        return sum(count * _itemsize(dtype) for dtype, count in self.layout(n))

    def compress(self, x: torch.Tensor) -> Payload:
        return Payload((x.float().contiguous(),), x.shape[-1])

    def decompress(self, payload: Payload) -> torch.Tensor:
        return payload.parts[0]

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decompress(self.compress(x))

    def support(self, payload: Payload) -> torch.Tensor | None:
        """1.0 where the payload carries a value, 0.0 elsewhere; None: it carries every value."""
        return None

    def combine(self, payloads: list, weights: list) -> torch.Tensor:
        """Several workers' payloads -> Σ_r w_r x_r, decoded in list order (every rank that holds
        the same payloads gets the same bits). A value only some workers sent (top-k) is the
        weighted mean over those that sent it, scaled to the whole weight Σ_r w_r: with equal
        weights, the mean of the workers that sent it, as DeMo / SparseLoCo decode."""
        total = mass = None
        for p, w in zip(payloads, weights, strict=True):
            if w == 0:
                continue
            x = self.decompress(p)
            total = x * w if total is None else total.add_(x, alpha=w)
            m = self.support(p)
            if m is not None:
                mass = m * w if mass is None else mass.add_(m, alpha=w)
        if total is None:
            return self.decompress(payloads[0]).zero_()
        if mass is None:
            return total
        whole = float(sum(weights))
        return torch.where(mass > 0, total * (whole / mass.clamp(min=1e-30)), torch.zeros_like(total))

    def to_bytes(self, payload: Payload) -> torch.Tensor:
        return torch.cat([p.contiguous().view(torch.uint8) for p in payload.parts], dim=-1)

    def from_bytes(self, buf: torch.Tensor, n: int) -> Payload:
        parts, at = [], 0
        for dtype, count in self.layout(n):
            size = count * _itemsize(dtype)
            # a fresh contiguous copy: clone() keeps a one-row slice's stride (the whole row's
            # length), which a view as a wider dtype refuses when it is not a multiple
            parts.append(buf[..., at:at + size].clone(memory_format=torch.contiguous_format).view(dtype))
            at += size
        if at != buf.shape[-1]:
            raise ValueError(f"{self.name}: {buf.shape[-1]} bytes for rows of {n} values, expected {at}")
        return Payload(tuple(parts), n)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """(..., n) -> (..., ceil(n/block), block), zero-padded."""
    n = x.shape[-1]
    pad = (-n) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, block)


class IntQuantizer(Compressor):
    """Symmetric b-bit integers (b = 8, 4 or 2) with one fp32 absmax scale per block:
    q = round(x / s), s = absmax / (2^(b-1) - 1), codes packed b bits each.
    Bytes per row: ceil(n*b/8) + 4*ceil(n/block). Error bound: |x - x^| <= s/2 elementwise."""

    def __init__(self, bits: int = 8, block: int = 256):
        if bits not in (2, 4, 8):
            raise ValueError(f"IntQuantizer bits must be 8, 4 or 2, got {bits}")
        if block < 1:
            raise ValueError(f"block size must be positive, got {block}")
        self.bits, self.block = bits, block
        self.qmax = 2 ** (bits - 1) - 1
        self.name = f"int{bits}"

    def layout(self, n):
        return [(torch.uint8, packed_len(n, self.bits)), (torch.float32, -(-n // self.block))]

    def compress(self, x):
        n = x.shape[-1]
        blocks = _blocks(x.float(), self.block)
        scale = blocks.abs().amax(-1) / self.qmax
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / safe.unsqueeze(-1)).clamp_(-self.qmax, self.qmax)
        codes = (q + self.qmax).to(torch.uint8).reshape(*x.shape[:-1], -1)[..., :n]
        return Payload((pack_bits(codes, self.bits), scale.contiguous()), n)

    def decompress(self, payload):
        packed, scale = payload.parts
        n = payload.n
        q = unpack_bits(packed, self.bits, n).float() - self.qmax
        out = _blocks(q, self.block) * scale.unsqueeze(-1)
        return out.reshape(*q.shape[:-1], -1)[..., :n]

    def bound(self, x):
        """Elementwise bound: half a quantization step of x's block (plus rounding)."""
        blocks = _blocks(x.float(), self.block)
        step = blocks.abs().amax(-1, keepdim=True) / self.qmax
        return (step.expand_as(blocks) / 2).reshape(*x.shape[:-1], -1)[..., :x.shape[-1]]


class SignQuantizer(Compressor):
    """1-bit sign with one fp32 scale per block, s = mean |x| over the block:
    x^ = s * sign(x) (x >= 0 -> +s). Bytes per row: ceil(n/8) + 4*ceil(n/block).
    Error: ||x - x^||^2 = ||x||^2 - m*s^2 per block of m values (s minimises it), so never
    above ||x||^2."""

    def __init__(self, block: int = 256):
        if block < 1:
            raise ValueError(f"block size must be positive, got {block}")
        self.block, self.bits, self.name = block, 1, "sign1"

    def layout(self, n):
        return [(torch.uint8, packed_len(n, 1)), (torch.float32, -(-n // self.block))]

    def _counts(self, n, device):
        counts = torch.full((-(-n // self.block),), float(self.block), device=device)
        counts[-1] = n - (counts.numel() - 1) * self.block
        return counts

    def compress(self, x):
        n = x.shape[-1]
        x = x.float()
        blocks = _blocks(x, self.block)
        scale = blocks.abs().sum(-1) / self._counts(n, x.device)
        return Payload((pack_bits((x >= 0).to(torch.uint8), 1), scale.contiguous()), n)

    def decompress(self, payload):
        packed, scale = payload.parts
        n = payload.n
        signs = unpack_bits(packed, 1, n).float() * 2 - 1
        out = _blocks(signs, self.block) * scale.unsqueeze(-1)
        return out.reshape(*signs.shape[:-1], -1)[..., :n]


def index_dtype(size: int) -> torch.dtype:
    """The smallest integer type that addresses `size` positions (uint8, int16 as
    unsigned 16-bit, int32, int64)."""
    if size <= 256:
        return torch.uint8
    if size <= 65536:
        return torch.int16
    if size <= 2 ** 31:
        return torch.int32
    return torch.int64


def encode_index(idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.int16:  # unsigned 16-bit stored in int16's bits
        return (idx.to(torch.int32) - 32768).to(torch.int16)
    return idx.to(dtype)


def decode_index(idx: torch.Tensor) -> torch.Tensor:
    if idx.dtype == torch.int16:
        return idx.to(torch.int64) + 32768
    return idx.to(torch.int64)


VALUE_BITS = (32, 16, 8, 4, 2)
VALUE_SCHEMES = ("absmax", "stat")
STAT_RANGE = 6.0  # the statistical quantizer's range in standard deviations (SparseLoCo's)


class ValueCodec:
    """Values of kept coefficients at 32 (fp32), 16 (bf16) or 8/4/2 bits, by one of two schemes:
    - absmax: symmetric integers with one fp32 absmax scale per group of values (per chunk);
    - stat:   SparseLoCo's statistical quantizer, per row: shift = mean, step = 6σ/2^b
              (σ unbiased, of the centred values), code = clamp(round((v − shift)/step) + 2^(b−1),
              0, 2^b − 1), decoded through a table of each code's mean centred value (2^b fp32)
              plus the shift: 2^b + 1 fp32 per row."""

    def __init__(self, bits: int, scheme: str = "absmax"):
        if bits not in VALUE_BITS:
            raise ValueError(f"value bits must be one of {VALUE_BITS}, got {bits}")
        if scheme not in VALUE_SCHEMES:
            raise ValueError(f"value scheme must be one of {VALUE_SCHEMES}, got {scheme!r}")
        self.bits, self.scheme = bits, scheme
        self.stat = scheme == "stat" and bits <= 8

    def layout(self, groups: int, per: int) -> Layout:
        if self.bits == 32:
            return [(torch.float32, groups * per)]
        if self.bits == 16:
            return [(torch.bfloat16, groups * per)]
        extra = 1 + 2 ** self.bits if self.stat else groups
        return [(torch.uint8, packed_len(groups * per, self.bits)), (torch.float32, extra)]

    def encode(self, vals: torch.Tensor, real: torch.Tensor | None = None) -> tuple:
        """vals (..., groups, per) -> parts; `real` (the same shape, bool): which values are the
        row's own, not its padding (None: all), the only ones the statistical quantizer's
        mean, σ and table are taken over."""
        lead = vals.shape[:-2]
        if self.bits == 32:
            return (vals.float().reshape(*lead, -1).contiguous(),)
        if self.bits == 16:
            return (vals.to(torch.bfloat16).reshape(*lead, -1).contiguous(),)
        if self.stat:
            return self._stat_encode(vals.float().reshape(*lead, -1),
                                     None if real is None else real.reshape(*lead, -1).float())
        q = IntQuantizer(self.bits, vals.shape[-1]).compress(vals.reshape(*lead, -1))
        return q.parts

    def decode(self, parts: tuple, groups: int, per: int, lead) -> torch.Tensor:
        if self.bits in (32, 16):
            return parts[0].float().reshape(*lead, groups, per)
        if self.stat:
            codes = unpack_bits(parts[0], self.bits, groups * per).long()
            table = parts[1]
            out = table[..., 1:].gather(-1, codes) + table[..., :1]
            return out.reshape(*lead, groups, per)
        out = IntQuantizer(self.bits, per).decompress(Payload(parts, groups * per))
        return out.reshape(*lead, groups, per)

    def _stat_encode(self, v: torch.Tensor, real: torch.Tensor | None = None) -> tuple:
        """v (..., m) -> (packed codes, [shift, table of 2^b code means]) per row; the statistics
        over the values `real` (0/1 weights) marks, as the reference quantizes only a tensor's
        own values (padding gets a code too, which the decoder drops)."""
        bins = 2 ** self.bits
        if real is None:
            shift = v.mean(-1, keepdim=True)
            c = v - shift
            m = v.shape[-1]
            std = c.norm(dim=-1, keepdim=True) / math.sqrt(m - 1) if m > 1 else torch.zeros_like(shift)
            weight = torch.ones_like(c)
        else:
            m = real.sum(-1, keepdim=True)
            shift = (v * real).sum(-1, keepdim=True) / m.clamp(min=1)
            c = v - shift
            std = torch.where(m > 1, (c * real).norm(dim=-1, keepdim=True) / (m - 1).clamp(min=1).sqrt(), 0.0)
            weight = real
        step = STAT_RANGE * std / bins
        step = torch.where((step > 0) & torch.isfinite(step), step, torch.ones_like(step))
        codes = torch.round(c / step + bins // 2).clamp_(0, bins - 1).long()
        sums = torch.zeros(*v.shape[:-1], bins).scatter_add_(-1, codes, c * weight)
        counts = torch.zeros(*v.shape[:-1], bins).scatter_add_(-1, codes, weight)
        table = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
        return (pack_bits(codes.to(torch.uint8), self.bits),
                torch.cat([shift, table], dim=-1).contiguous())


class TopK(Compressor):
    """Top-k by magnitude in each chunk of `chunk` values (the row zero-padded to whole
    chunks): k per chunk given directly or as a fraction of the chunk. Sends k indices
    per chunk in the smallest integer type that addresses a chunk, and the k values at
    `value_bits` (32, 16 = bf16, or 8/4/2 with a per-chunk fp32 scale).
    Bytes per row: chunks*k*(index bytes) + value bytes. Lossless when k = chunk and
    value_bits = 32; otherwise the error is the dropped values plus the values' rounding."""

    def __init__(self, chunk: int = 256, k: int | None = None, fraction: float | None = None,
                 value_bits: int = 32, values: str = "absmax"):
        if (k is None) == (fraction is None):
            raise ValueError("TopK needs exactly one of k and fraction")
        if chunk < 1:
            raise ValueError(f"chunk must be positive, got {chunk}")
        k = k if k is not None else max(1, round(fraction * chunk))
        if not 1 <= k <= chunk:
            raise ValueError(f"k must be within 1..{chunk}, got {k}")
        self.chunk, self.k = chunk, k
        self.values = ValueCodec(value_bits, values)
        self.idx_dtype = index_dtype(chunk)
        self.name = f"top{k}of{chunk}@{value_bits}" + ("stat" if self.values.stat else "")

    def layout(self, n):
        chunks = -(-n // self.chunk)
        return [(self.idx_dtype, chunks * self.k)] + self.values.layout(chunks, self.k)

    def compress(self, x):
        n = x.shape[-1]
        chunks = _blocks(x.float(), self.chunk)
        idx = chunks.abs().topk(self.k, dim=-1, sorted=False).indices
        vals = chunks.gather(-1, idx)
        lead = x.shape[:-1]
        # A short last chunk can have padding among its k: not the row's values (see encode).
        real = None if n % self.chunk == 0 else \
            idx + torch.arange(0, chunks.shape[-2] * self.chunk, self.chunk, device=idx.device).unsqueeze(-1) < n
        return Payload((encode_index(idx, self.idx_dtype).reshape(*lead, -1),
                        *self.values.encode(vals, real)), n)

    def decompress(self, payload):
        n = payload.n
        idx_part, *val_parts = payload.parts
        lead = idx_part.shape[:-1]
        chunks = -(-n // self.chunk)
        idx = decode_index(idx_part).reshape(*lead, chunks, self.k)
        vals = self.values.decode(tuple(val_parts), chunks, self.k, lead)
        out = torch.zeros(*lead, chunks, self.chunk, dtype=torch.float32, device=idx.device)
        out.scatter_(-1, idx, vals)
        return out.reshape(*lead, -1)[..., :n]

    def support(self, payload):
        n, idx_part = payload.n, payload.parts[0]
        lead = idx_part.shape[:-1]
        chunks = -(-n // self.chunk)
        idx = decode_index(idx_part).reshape(*lead, chunks, self.k)
        out = torch.zeros(*lead, chunks, self.chunk, dtype=torch.float32, device=idx.device)
        out.scatter_(-1, idx, 1.0)
        return out.reshape(*lead, -1)[..., :n]
