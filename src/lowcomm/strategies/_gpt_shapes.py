"""Parameter shapes for plans that depend on them (demo, powersgd).

`comm_plan(num_params, world, options)` receives only the parameter count. Strategies
whose traffic depends on each tensor's shape accept `shapes=` (a list of parameter
shapes, what `[tuple(p.shape) for p in model.parameters()]` gives) and, without it,
assume lowcomm's bundled GPT (byte vocabulary 256, tied embeddings) and recover its
dimensions from the count: first the presets' (n_layer, d_model) with any seq_len,
then n_layer = 1, 2, ... with the largest d_model that leaves a whole seq_len.
That is exact for the presets and for the contract tests' GPT (1 layer, d_model 16,
seq 16); for other models pass `shapes=`.
"""
from __future__ import annotations

VOCAB = 256
PRESET_DIMS = ((4, 144), (6, 384), (8, 512))  # (n_layer, d_model) of tiny, small, medium


def _seq_len(num_params: int, n_layer: int, d: int) -> int | None:
    rest = num_params - VOCAB * d - 2 * d - n_layer * (12 * d * d + 4 * d)
    if rest > 0 and rest % d == 0:
        return rest // d
    return None


def gpt_dims(num_params: int) -> tuple[int, int, int]:
    """(n_layer, d_model, seq_len) of a lowcomm GPT with this many parameters."""
    for n_layer, d in PRESET_DIMS:
        t = _seq_len(num_params, n_layer, d)
        if t is not None:
            return n_layer, d, t
    for n_layer in range(1, 65):
        d = 1
        while 12 * n_layer * (d + 1) ** 2 < num_params:
            d += 1
        for dd in range(d, 0, -1):
            t = _seq_len(num_params, n_layer, dd)
            if t is not None:
                return n_layer, dd, t
    raise ValueError(f"{num_params} parameters is no lowcomm GPT; pass shapes=")


def gpt_shapes(num_params: int) -> list[tuple[int, ...]]:
    """The parameter shapes, in model.parameters() order, of the GPT with this count; a
    count no lowcomm GPT has gives one flat tensor (the plan's collectives stay right, its
    bytes are then an estimate: pass shapes= for other models)."""
    try:
        n_layer, d, t = gpt_dims(num_params)
    except ValueError:
        return [(num_params,)]
    shapes = [(VOCAB, d), (t, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,), (3 * d, d), (d, d), (d,), (d,), (4 * d, d), (d, 4 * d)]
    return shapes + [(d,), (d,)]
