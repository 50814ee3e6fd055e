"""What a data source holds, told cheaply: its vocabulary, its tokenizer and its kind, so the
model can be sized and a run's outputs can carry the tokenizer before any worker reads the data.
Only token files that declare no vocabulary (nanoGPT's .bin without meta.pkl, no --vocab-size)
are read, once a process, for their largest id (tokens.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from .token_files import find
from .tokenizer import BYTE_VOCAB, BYTES
from .tokens import vocabulary


@dataclass(frozen=True)
class DataInfo:
    kind: str  # "text" (byte tokens), "prepared" (lowcomm data prepare), "nanogpt", "llmc"
    vocab_size: int
    tokenizer: str | Path | None  # "bytes", the tokenizer.json the ids were made with, or None: none came with them
    eot_id: int | None = None


def describe(source: str, vocab_size: int = 0) -> DataInfo:
    """The DataInfo of --data `source` (`vocab_size`: --vocab-size, 0 when not given). Token files
    cut short, foreign or of another version are refused here, in one line naming the file."""
    files = find(source)
    if files is None:
        if vocab_size and vocab_size < BYTE_VOCAB:
            raise UsageError(f"--vocab-size {vocab_size} is smaller than the {BYTE_VOCAB} ids of byte text "
                             f"(data '{source}')")
        return DataInfo("text", vocab_size or BYTE_VOCAB, BYTES)
    return DataInfo(files.kind, vocabulary(files, vocab_size)[0], files.tokenizer, files.eot_id)
