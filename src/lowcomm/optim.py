"""The inner optimizer factory and the learning-rate schedule of a run."""
from __future__ import annotations

import math

import torch

from .config import OptimConfig


def adamw_factory(cfg: OptimConfig):
    """make_optimizer(params) for strategies: AdamW with the run's settings.
    Weight decay applies to every parameter: sharded strategies see one flat
    shard, so per-parameter groups would not survive the flattening."""
    def make(params):
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)
    return make


def lr_schedule(cfg: OptimConfig, total_steps: int):
    """step -> lr: linear warmup to cfg.lr, then cosine decay to lr*min_lr_ratio
    at `total_steps` (or constant after warmup)."""
    warmup = min(cfg.warmup_steps, total_steps)
    floor = cfg.lr * cfg.min_lr_ratio

    def lr(step: int) -> float:
        if step < warmup:
            return cfg.lr * (step + 1) / warmup
        if cfg.schedule == "constant" or total_steps <= warmup:
            return cfg.lr
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))
    return lr
