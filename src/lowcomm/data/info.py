"""What a data source holds, told cheaply (no token is read): its vocabulary, its tokenizer and
its kind, so the model can be sized and a run's outputs can carry the tokenizer before any
worker reads the data."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .tokenizer import BYTE_VOCAB, BYTES


@dataclass(frozen=True)
class DataInfo:
    kind: str  # "text" (byte tokens), "prepared" (lowcomm data prepare), "nanogpt", "llmc"
    vocab_size: int
    tokenizer: str | Path  # "bytes", or the tokenizer.json the tokens were made with
    eot_id: int | None = None


def describe(source: str, vocab_size: int = 0) -> DataInfo:
    """The DataInfo of --data `source` (`vocab_size`: --vocab-size, 0 when not given)."""
    return DataInfo("text", BYTE_VOCAB, BYTES)
