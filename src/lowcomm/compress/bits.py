"""Bit packing: codes of b bits (b in 1, 2, 4, 8) packed into uint8, ceil(n*b/8) bytes per row."""
from __future__ import annotations

import torch

PACKABLE = (1, 2, 4, 8)


def packed_len(n: int, bits: int) -> int:
    """Bytes that n codes of `bits` bits occupy once packed."""
    return -(-n * bits // 8)


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (..., n) uint8 < 2**bits -> (..., ceil(n*bits/8)) uint8, low bits first."""
    if bits not in PACKABLE:
        raise ValueError(f"cannot pack {bits}-bit codes (choose from {PACKABLE})")
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    per = 8 // bits
    n = codes.shape[-1]
    pad = (-n) % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    grouped = codes.reshape(*codes.shape[:-1], -1, per)
    return (grouped << _shifts(bits, codes.device)).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits: (..., ceil(n*bits/8)) uint8 -> (..., n) uint8 codes."""
    if bits not in PACKABLE:
        raise ValueError(f"cannot unpack {bits}-bit codes (choose from {PACKABLE})")
    if bits == 8:
        return packed[..., :n]
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(-1) >> _shifts(bits, packed.device)) & mask
    return codes.reshape(*packed.shape[:-1], -1)[..., :n]
