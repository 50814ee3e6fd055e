"""Text from a causal LM, token by token: the last `context` tokens in, the next one drawn from the
last position's logits (divided by the temperature, cut to the top k), appended, repeated.

One loop for lowcomm's GPT and transformers models alike (their logits read as lm_loss reads
them); the whole window is recomputed each token (no KV cache): sampling from a trained small
model, not serving.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .gpt import logits_of


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], max_tokens: int, context: int = 0, temperature: float = 1.0,
             top_k: int = 0, generator: torch.Generator | None = None) -> list[int]:
    """`max_tokens` token ids following `prompt` (a non-empty list of ids). `context`: the most
    tokens the model takes (0: no limit); `temperature` 0 picks the likeliest token each time;
    `top_k` 0 draws from the whole vocabulary. The same generator state gives the same tokens."""
    if not prompt:
        raise ValueError("generate: the prompt holds no token")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    try:
        for _ in range(max_tokens):
            window = ids[:, -context:] if context else ids
            logits = logits_of(model(window))[:, -1, :].float()
            ids = torch.cat([ids, next_token(logits, temperature, top_k, generator)], dim=1)
    finally:
        model.train(was_training)
    return ids[0, len(prompt):].tolist()


def next_token(logits: torch.Tensor, temperature: float, top_k: int,
               generator: torch.Generator | None) -> torch.Tensor:
    """One id per row of `logits` (batch, vocab), as a (batch, 1) tensor."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).to(logits.device)
