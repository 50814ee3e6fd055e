"""The CLI run's inner optimizer factory and learning-rate schedule, from its OptimConfig."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..config import OptimConfig


def adamw_factory(cfg: OptimConfig):
    """make_optimizer(params) for strategies: AdamW with the run's settings, weight decay on
    every parameter (a Python-API user's own make_optimizer may return param groups: every
    strategy honours each group's lr and weight decay)."""
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
