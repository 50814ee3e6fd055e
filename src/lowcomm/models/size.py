"""The dimensions of the model `lowcomm plan --params N` prices, from its parameter count.

The rule, for a model whose count grows with n_layer and d_model (lowcomm's GPT, or a
transformers architecture built the same way):

    n_head  = d_model / 64                  head dimension 64, as GPT-2 and GPT-3
    d_model = a multiple of 64, the one for which a model of d_model / 96 layers has the
              count nearest N (on a log scale)
    n_layer = the whole number of layers (at least 1) that brings the count nearest N

d_model / n_layer = 96 is the width-to-depth ratio of GPT-3's 2.7B and LLaMA's 7B-class
models (their ratios are 80 and 128); Kaplan et al. (2020) find the loss nearly flat for
ratios between about 20 and 200, so the plan's traffic depends on N more than on this
choice. A dimension the user fixes is kept and the others follow the same way (a fixed
n_head makes d_model a multiple of lcm(64, n_head)). For lowcomm's GPT (vocab 256) at
seq_len 128, N = 453,676,032 gives n_layer 16, d_model 1536 (and 1e6 gives 2 x 192, 1.3e9
23 x 2176, 7e9 40 x 3840).

Counts come from the model itself (`count(n_layer, n_head, d_model)`: the caller builds it
on the meta device), never from a formula of its shapes.
"""
from __future__ import annotations

import math
from typing import Callable

ASPECT = 96           # d_model / n_layer
WIDTH_STEP = 64       # d_model is a multiple of this
HEAD_DIM = 64
MAX_PARAMS = 10**13   # 10 trillion: beyond any dense model trained; larger asks are refused
MAX_LAYERS = 1000     # as deep as DeepNet, the deepest transformer trained (a meta build takes ~1 s)

Count = Callable[[int, int, int], int]  # (n_layer, n_head, d_model) -> trainable parameters


def dims_for(params: int, count: Count, n_layer: int = 0, n_head: int = 0,
             d_model: int = 0) -> tuple[int, int, int]:
    """(n_layer, n_head, d_model) of the model of about `params` parameters by the rule above;
    a dimension given (non-zero) is kept. ValueError when no model of this kind is near it."""
    if params > MAX_PARAMS:
        raise ValueError(f"{params:.3g} parameters is more than the plan builds (at most {MAX_PARAMS:.0e})")
    if n_layer and d_model:
        raise ValueError("n_layer and d_model are both given, and they set the count")
    step = math.lcm(WIDTH_STEP, n_head) if n_head else WIDTH_STEP

    def heads(d: int) -> int:
        return n_head or d // HEAD_DIM

    def base_and_layer(d: int) -> tuple[int, int]:
        one, two = count(1, heads(d), d), count(2, heads(d), d)
        return 2 * one - two, two - one

    def size(d: int) -> float:  # at n_layer, or at the ratio's (fractional) number of layers
        base, layer = base_and_layer(d)
        return base + (n_layer or d / ASPECT) * layer

    d_model = d_model or step * _nearest(size, params, step)
    base, layer = base_and_layer(d_model)
    n_layer = n_layer or max(1, round((params - base) / layer))
    total = base + n_layer * layer  # a count grows by the same amount with each layer
    if not params / 2 <= total <= 2 * params or n_layer > MAX_LAYERS:
        raise ValueError(f"the nearest model has {total:,} parameters (n_layer {n_layer}, d_model {d_model})"
                         + (f", more than {MAX_LAYERS} layers" if n_layer > MAX_LAYERS else ""))
    return n_layer, heads(d_model), d_model


def _nearest(size: Callable[[int], float], target: float, step: int) -> int:
    """The k >= 1 whose size(step * k) is nearest `target` on a log scale (size grows with k)."""
    hi = 1
    while size(step * hi) < target:
        hi *= 2
    lo = hi // 2  # 0, or size(step * lo) < target
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(step * mid) < target else (lo, mid)
    if lo >= 1 and target / size(step * lo) < size(step * hi) / target:
        return lo
    return hi
