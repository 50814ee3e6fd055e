"""Error feedback: what a compressor dropped is added to the next input.

    ef = ErrorFeedback(IntQuantizer(8))
    payload, sent = ef.compress("grad", g)     # compresses g + residual["grad"]
    # residual["grad"] is now (g + old residual) - sent, so sent + residual = input

One residual per key (a tensor, a shard, a stage) on this worker; `state_dict()` /
`load_state_dict()` carry them bit-exactly (strategies put them in their own state).
"""
from __future__ import annotations

import torch

from .core import Compressor, Payload


class ErrorFeedback:
    """`decay` β < 1 lets old residuals fade: the input is x + β·residual (SparseLoCo's
    error-feedback decay, e ← β·e + Δ); β = 1 is classic error feedback."""

    def __init__(self, compressor: Compressor, enabled: bool = True, decay: float = 1.0):
        self.compressor, self.enabled, self.decay = compressor, enabled, decay
        self.residuals: dict[str, torch.Tensor] = {}

    def compress(self, key: str, x: torch.Tensor, compressor: Compressor | None = None) -> tuple[Payload, torch.Tensor]:
        """(payload of x + β·residual, its decompressed value); updates the residual.
        `compressor`: this key's own (e.g. PerTensor over its tensors), else the one given at start."""
        compressor = compressor or self.compressor
        inp = x.float()
        if self.enabled and key in self.residuals:
            residual = self.residuals[key]
            inp = inp + (residual if self.decay == 1.0 else self.decay * residual)
        payload = compressor.compress(inp)
        sent = compressor.decompress(payload)
        if self.enabled:
            self.residuals[key] = inp - sent
        return payload, sent

    def state_dict(self) -> dict:
        return {k: v.clone() for k, v in self.residuals.items()}

    def load_state_dict(self, sd: dict) -> None:
        self.residuals = {k: v.clone() for k, v in sd.items()}
