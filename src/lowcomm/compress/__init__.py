"""Compression of what is sent, shared by every strategy (quantized, demo, DiLoCo's outer
gradient, ...).

A compressor turns a float tensor into a Payload -- the tensors to send -- and back,
and states its exact wire bytes. Row-wise compressors work on the last dimension, so a
(W, m) tensor is W shards compressed independently (one all_to_all row each):

    from lowcomm.compress import make_compressor, ErrorFeedback
    c = make_compressor("int4", block=128)     # int8 | int4 | int2 | sign | topk | none
    p = c.compress(x)                          # Payload(parts, n)
    buf = c.to_bytes(p)                        # (..., c.nbytes(n)) uint8: send this
    y = c.decompress(c.from_bytes(buf, n))     # float32, x's shape
    ef = ErrorFeedback(c)                      # residual per key: sent + residual = input
    p, sent = ef.compress("outer", x)          # ef.state_dict() -> the strategy's state
    c = parse_spec("topk:0.02,bits:2")         # one-line SPEC (diloco's --outer-compress)
    mean = c.combine(payloads, weights)        # several workers' payloads, decoded and averaged

Compressors (bytes per row of n values):
- IntQuantizer(bits=8|4|2, block): absmax scale per block, ceil(n*bits/8) + 4*ceil(n/block);
  |x - x^| <= absmax(block)/(2*(2^(bits-1)-1)).
- SignQuantizer(block): 1-bit sign, scale = mean|x| per block, ceil(n/8) + 4*ceil(n/block);
  ||x - x^||^2 = ||x||^2 - m*s^2 per block.
- TopK(chunk, k= or fraction=, value_bits=32|16|8|4|2, values=absmax|stat): k per chunk,
  indices in the smallest integer type addressing a chunk; lossless for k = chunk at 32 bits.
  Values below 16 bits: absmax (fp32 scale per chunk) or stat (SparseLoCo's statistical
  quantizer: per row a mean shift and a table of 2^b code means, 2^b + 1 fp32).
- DCTTopK(shape, chunk, k, values=fp32|bf16|sign, compact_index): DeMo's chunked DCT-II
  top-k of one tensor (see dct.py); decompress averages each index over the senders.
- PerTensor(inner, sizes): `inner` on each tensor of a flat vector alone (its chunks and
  statistics never mix tensors); the sum of each tensor's bytes (per_tensor.py).
Bit packing (bits.pack_bits) is real: 4-bit codes take half a byte on the wire.

Imports: nothing (of lowcomm: torch only).
"""
from __future__ import annotations

from .bits import pack_bits, packed_len, unpack_bits
from .core import (Compressor, IntQuantizer, Payload, SignQuantizer, TopK, ValueCodec,
                   index_dtype)
from .dct import DCTTopK, block_dims, dct_matrix, largest_divisor_at_most
from .feedback import ErrorFeedback
from .per_tensor import PerTensor, per_tensor

__all__ = ["Compressor", "Payload", "IntQuantizer", "SignQuantizer", "TopK", "ValueCodec", "PerTensor", "per_tensor",
           "DCTTopK", "ErrorFeedback", "make_compressor", "parse_spec", "quantizer_for_bits", "pack_bits",
           "unpack_bits", "packed_len", "index_dtype", "block_dims", "dct_matrix",
           "largest_divisor_at_most"]


def make_compressor(kind: str, block: int = 256, **kw) -> Compressor:
    """By name: 'int8', 'int4', 'int2', 'sign' (1-bit), 'topk' (chunk=block, k= or
    fraction=, value_bits=), 'none' (fp32 as is)."""
    if kind in ("int8", "int4", "int2"):
        return IntQuantizer(int(kind[3:]), block)
    if kind in ("sign", "int1", "1bit"):
        return SignQuantizer(block)
    if kind == "topk":
        return TopK(chunk=block, **kw)
    if kind == "none":
        return Compressor()
    raise ValueError(f"unknown compressor '{kind}'")


SPEC_HELP = ("int8 | int4 | int2 | sign | none, optionally ',block:N'; or topk:F (fraction of each chunk) "
             "or topk:K (per chunk) with ',chunk:N' (256), ',bits:32|16|8|4|2' (32) and "
             "',quant:absmax|stat' (absmax: a scale per chunk; stat: SparseLoCo's mean/σ table per row)")


def parse_spec(spec: str) -> Compressor:
    """A compressor from a one-line SPEC (the CLI's --outer-compress), e.g. 'topk:0.02,bits:2',
    'topk:32,chunk:4096,bits:2,quant:stat', 'int4,block:64'. ValueError names what is wrong."""
    kind, kw = None, {}
    for item in (part.strip() for part in spec.split(",")):
        key, _, value = item.partition(":")
        if key in ("int8", "int4", "int2", "sign", "none") and not value:
            kind = kind or key
            continue
        if not value or key not in ("topk", "chunk", "block", "bits", "quant"):
            raise ValueError(f"'{item}' in '{spec}' is not a compressor setting ({SPEC_HELP})")
        if key in kw:
            raise ValueError(f"'{key}' is set twice in '{spec}'")
        kw[key] = value
        if key == "topk":
            kind = "topk"
    if kind is None:
        raise ValueError(f"'{spec}' names no compressor ({SPEC_HELP})")
    try:
        if kind != "topk":
            if set(kw) - {"block"}:
                raise ValueError(f"{', '.join(sorted(set(kw) - {'block'}))} only apply to topk")
            return make_compressor(kind, int(kw.get("block", 256)))
        if "block" in kw:
            raise ValueError("topk takes chunk:, not block:")
        amount = kw["topk"]
        size = {"fraction": float(amount)} if "." in amount or "e" in amount else {"k": int(amount)}
        return TopK(chunk=int(kw.get("chunk", 256)), value_bits=int(kw.get("bits", 32)),
                    values=kw.get("quant", "absmax"), **size)
    except ValueError as e:
        raise ValueError(f"'{spec}': {e}") from None


def quantizer_for_bits(bits: int, block: int = 256) -> Compressor:
    """8 -> int8, 4 -> int4, 2 -> int2, 1 -> 1-bit sign, 32 -> none (fp32 as is)."""
    names = {8: "int8", 4: "int4", 2: "int2", 1: "sign", 32: "none"}
    if bits not in names:
        raise ValueError(f"no quantizer for {bits} bits (choose from {sorted(names)})")
    return make_compressor(names[bits], block)
