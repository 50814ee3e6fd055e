"""Blockwise-absmax int8/int4 quantizers for DiLoCo's outer gradients (private, interim).

A stop-gap until `lowcomm.compress` (issue 9) lands: the interface is the one
DiLoCo needs, so swapping this module for compress/ is a one-import change.

    payload = quantize(t, bits)                 # (packed uint8, scales fp32)
    t2 = dequantize(*payload, numel, bits)      # fp32, t.numel() elements
    wire_nbytes(numel, bits)                    # bytes of one payload (packed + scales)

Per block of BLOCK values: scale = absmax / L with L = 2**(bits-1) - 1 (127
or 7), q = round(x / scale) in [-L, L], stored with an offset of L+1 as
unsigned; int4 packs two values per byte (low nibble first). Rounding is to
nearest, so |x - deq(q)| <= scale / 2 per element. bits=32 passes fp32 through.
"""
from __future__ import annotations

import torch

BLOCK = 64
BITS = (4, 8)


def _levels(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"unsupported bits {bits} (choose from {BITS})")
    return 2 ** (bits - 1) - 1


def packed_nbytes(numel: int, bits: int) -> int:
    return -(-numel * bits // 8)


def scale_count(numel: int) -> int:
    return -(-numel // BLOCK)


def wire_nbytes(numel: int, bits: int) -> int:
    """Bytes of one quantized payload of `numel` values: packed values + fp32 scales."""
    return packed_nbytes(numel, bits) + 4 * scale_count(numel)


def quantize(t: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """t (any shape, float) -> (packed uint8 of packed_nbytes, fp32 scales of scale_count)."""
    levels = _levels(bits)
    x = t.detach().reshape(-1).float()
    n = x.numel()
    blocks = scale_count(n)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = x
    padded = padded.view(blocks, BLOCK)
    scales = padded.abs().amax(dim=1) / levels
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(padded / safe[:, None]).clamp_(-levels, levels).to(torch.int16) + (levels + 1)
    q = q.reshape(-1)[:n].to(torch.uint8)
    if bits == 4:
        if n % 2:
            q = torch.cat([q, q.new_zeros(1)])
        q = q[0::2] | (q[1::2] << 4)
    return q.contiguous(), scales.contiguous()


def dequantize(packed: torch.Tensor, scales: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """The fp32 values (numel of them) a payload from `quantize` stands for."""
    levels = _levels(bits)
    if bits == 4:
        q = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:numel]
    else:
        q = packed[:numel]
    values = q.to(torch.float32) - (levels + 1)
    blocks = scale_count(numel)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=packed.device)
    padded[:numel] = values
    return (padded.view(blocks, BLOCK) * scales[:, None]).reshape(-1)[:numel]
