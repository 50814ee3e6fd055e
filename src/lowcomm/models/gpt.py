"""A small GPT: pre-norm blocks, tied input/output embeddings, N(0, 0.02) init.

With that init the logits start near zero, so the first loss is close to
ln(vocab_size) -- a quick sanity check that the data and loss are wired right.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model, bias=False),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int = 256, seq_len: int = 128, n_layer: int = 4,
                 n_head: int = 4, d_model: int = 144):
        super().__init__()
        self.seq_len = seq_len  # the positions it has: it takes sequences of at most this many tokens
        self.checkpoint_blocks = False  # activation checkpointing (--activation-checkpointing)
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        recompute = self.checkpoint_blocks and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            # activation checkpointing: keep only each block's input; its activations are
            # recomputed in backward (same values, same gradients: the ops are deterministic)
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.head(self.ln_f(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """Next-token cross-entropy: the loss function lowcomm's trainer uses.

    * ``batch = (x, y)`` (tuple or list): ``y`` holds the targets already
      shifted (``y[:, t]`` is the token after ``x[:, t]``). Calls ``model(x)``;
      the logits are its output, or the output's ``.logits`` (a transformers
      ``ModelOutput``) or ``["logits"]`` (a dict). Then mean cross-entropy over
      the vocabulary -- for lowcomm's :class:`GPT` exactly the same ops as ever.
    * ``batch`` a dict (e.g. ``{"input_ids", "labels", "attention_mask"}``):
      calls ``model(**batch)`` and returns the model's own ``.loss``. With
      transformers, ``labels`` are aligned with ``input_ids`` (the model shifts
      them itself; -100 is ignored), unlike ``y`` above.
    """
    if isinstance(batch, Mapping):
        out = model(**batch)
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if loss is None:
            raise ValueError(f"lm_loss: the model returned no loss for a dict batch "
                             f"(keys: {', '.join(map(str, batch))}); include 'labels'")
        return loss
    x, y = batch
    logits = logits_of(model(x))
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def logits_of(output) -> torch.Tensor:
    """The logits of a model's output: the output itself, its ``.logits`` (a transformers
    ``ModelOutput``) or its ``["logits"]`` (a dict)."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    raise TypeError(f"lm_loss: model output is a {type(output).__name__}, not logits "
                    f"(a tensor, or an object/dict with 'logits')")
