"""What a run computed, recomputed outside it: the first batch each rank trains on, and the
validation loss as the run measures it, from the run's data and flags (the loader and the
validation split the workers use). Shared by the tests of --init-from and of the final model."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from lowcomm.data import load_tokens, val_batches
from lowcomm.data.loader import ShardedBatches
from lowcomm.models import lm_loss

# A run of two workers with no model dims given (--init-from sets them), evaluated at its end only.
RUN = ["--workers", "2", "--seq-len", "16", "--micro-batch", "2", "--eval-every", "0", "--eval-batches", "2",
       "--log-every", "1", "--quiet"]
WORLD, SEQ_LEN, MICRO_BATCH, EVAL_BATCHES, SEED, VAL_FRACTION = 2, 16, 2, 2, 0, 0.1


def first_batches(source: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's first training micro-batch (x, y) of a RUN over `source` (seed 0)."""
    data = load_tokens(str(source), VAL_FRACTION)
    return [ShardedBatches(data.train, rank, WORLD, SEQ_LEN, MICRO_BATCH, SEED).next() for rank in range(WORLD)]


@torch.no_grad()
def val_loss(model: torch.nn.Module, source: Path) -> float:
    """The validation loss a RUN over `source` reports for `model`: every rank's batches, weighted
    by their sequences (train/loop.py's evaluate)."""
    data = load_tokens(str(source), VAL_FRACTION)
    model.eval()
    total = count = 0.0
    for rank in range(WORLD):
        for x, y in val_batches(data.val, rank, WORLD, SEQ_LEN, MICRO_BATCH, EVAL_BATCHES):
            total += float(lm_loss(model, (x, y))) * x.shape[0]
            count += x.shape[0]
    return total / count


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())
