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

Compressors (bytes per row of n values):
- IntQuantizer(bits=8|4|2, block): absmax scale per block, ceil(n*bits/8) + 4*ceil(n/block);
  |x - x^| <= absmax(block)/(2*(2^(bits-1)-1)).
- SignQuantizer(block): 1-bit sign, scale = mean|x| per block, ceil(n/8) + 4*ceil(n/block);
  ||x - x^||^2 = ||x||^2 - m*s^2 per block.
- TopK(chunk, k= or fraction=, value_bits=32|16|8|4|2): k per chunk, indices in the
  smallest integer type addressing a chunk; lossless for k = chunk at 32 bits.
- DCTTopK(shape, chunk, k, values=fp32|bf16|sign, compact_index): DeMo's chunked DCT-II
  top-k of one tensor (see dct.py); decompress averages each index over the senders.
Bit packing (bits.pack_bits) is real: 4-bit codes take half a byte on the wire.
"""
from __future__ import annotations

from .bits import pack_bits, packed_len, unpack_bits
from .core import (Compressor, IntQuantizer, Payload, SignQuantizer, TopK, ValueCodec,
                   index_dtype)
from .dct import DCTTopK, block_dims, dct_matrix, largest_divisor_at_most
from .feedback import ErrorFeedback

__all__ = ["Compressor", "Payload", "IntQuantizer", "SignQuantizer", "TopK", "ValueCodec",
           "DCTTopK", "ErrorFeedback", "make_compressor", "quantizer_for_bits", "pack_bits",
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


def quantizer_for_bits(bits: int, block: int = 256) -> Compressor:
    """8 -> int8, 4 -> int4, 2 -> int2, 1 -> 1-bit sign, 32 -> none (fp32 as is)."""
    names = {8: "int8", 4: "int4", 2: "int2", 1: "sign", 32: "none"}
    if bits not in names:
        raise ValueError(f"no quantizer for {bits} bits (choose from {sorted(names)})")
    return make_compressor(names[bits], block)
