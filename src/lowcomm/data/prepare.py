"""`lowcomm data prepare SOURCE --tokenizer T --out DIR`: text to the token files a run trains on.

It streams: the source is read in pieces (sources.py) by a thread, encoded a batch at a time
by `tokenizers` on every core (prepare_tokenizer.py) and appended to DIR/train.bin or
DIR/val.bin as it goes, so memory stays bounded whatever the source's size. A 'bpe:N'
tokenizer is trained first, on a first pass over the source. The directory appears whole at
the end or not at all (prepare_output.py).

The validation split is made of whole documents, spread evenly through the source: document i
(counting those with text) is held out when floor((i+1)·f) > floor(i·f), f = --val-fraction,
so exactly floor(n·f) of n documents are, the same ones on every run. A source too small for
one held-out document (a single text file) gives its last f of tokens instead, as --data text is split.
"""
from __future__ import annotations

import errno
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DiskFull, UsageError
from .prepare_output import TokenDir, check_out
from .prepare_progress import PrepareBar
from .prepare_stream import batches, texts
from .prepare_tokenizer import Encoder, fixed_encoder, parse_spec, train_bpe
from .sources import Source


@dataclass(frozen=True)
class Prepared:
    out: Path
    meta: dict
    seconds: float

    def summary(self) -> str:
        m, tokens = self.meta, sum(self.meta["tokens"].values())
        return (f"prepared {self.out}: {m['tokens']['train']:,} train + {m['tokens']['val']:,} val tokens, "
                f"{m['documents']['train']:,} + {m['documents']['val']:,} documents, vocab {m['vocab_size']:,} "
                f"({m['dtype']}), {self.seconds:.1f} s, {tokens / max(self.seconds, 1e-9):,.0f} tokens/s")


def prepare(source: str, tokenizer: str, out: str | Path, text_field: str | None = None,
            val_fraction: float = 0.1, overwrite: bool = False, quiet: bool = True) -> Prepared:
    """Tokenize `source` with `tokenizer` ('bytes', 'bpe:N', a tokenizer.json or a directory
    holding one) into the token directory `out`. Bad input raises UsageError before anything is
    written, or, found while reading (a bad JSONL row), with nothing left behind."""
    if not 0 < val_fraction < 1:
        raise UsageError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    spec = parse_spec(tokenizer)
    out = Path(out).expanduser()
    src = Source(source, text_field, skip=out)
    check_out(out, overwrite)
    started = time.perf_counter()
    bar = PrepareBar(src.total, enabled=not quiet)
    try:
        if spec.kind == "bpe":
            bar.start(f"training {spec.text}")
            encoder = train_bpe(texts(src, bar), spec.size)
        else:
            encoder = fixed_encoder(spec)
        bar.start("tokenizing")
        meta = _write(src, encoder, out, val_fraction, bar, spec.text)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"the disk is full writing {out} (nothing was left there)") from None
        raise
    finally:
        bar.close()
    src.warn_not_utf8()
    return Prepared(out, meta, time.perf_counter() - started)


def _write(src: Source, encoder: Encoder, out: Path, val_fraction: float, bar: PrepareBar, asked: str) -> dict:
    with TokenDir(out, encoder.dtype) as target:
        documents = _encode_into(target, src, encoder, val_fraction, bar)
        if documents["val"] == 0:
            target.move_tail_to_val(val_fraction)
        if not target.tokens["train"] or not target.tokens["val"]:
            total = sum(target.tokens.values())
            raise UsageError(f"data source '{src.spec}' holds no text" if not total else
                             f"data source '{src.spec}' is too small to split: {total} token(s)")
        meta = {"vocab_size": encoder.vocab_size, "eot_id": encoder.eot_id,
                "special_tokens": encoder.special_tokens(), "documents": documents, "source": src.label,
                "tokenizer": asked, "source_kind": src.kind, "text_field": src.field if src.has_rows else None,
                "val_fraction": val_fraction, "val_split": "documents" if documents["val"] else "end of the text"}
        return target.commit(meta, encoder.to_json())


def _encode_into(target: TokenDir, src: Source, encoder: Encoder, val_fraction: float,
                 bar: PrepareBar) -> dict[str, int]:
    """Encode every batch and append it, document by document, to its split; returns the
    documents each split got. A document that encodes to nothing is skipped (no separator)."""
    eot = np.asarray([] if encoder.eot_id is None else [encoder.eot_id], dtype=encoder.dtype)
    documents = {"train": 0, "val": 0}
    split, doc_tokens = None, 0
    for batch in batches(src):
        ids = encoder.encode_batch([text for text, _ in batch.pieces])
        parts = {"train": [], "val": []}
        for (_, ends), piece in zip(batch.pieces, ids):
            if split is None:
                split = "val" if _held_out(sum(documents.values()), val_fraction) else "train"
            parts[split].append(piece)
            doc_tokens += len(piece)
            if ends:
                if doc_tokens:
                    parts[split].append(eot)
                    documents[split] += 1
                split, doc_tokens = None, 0
        written = 0
        for name, chunks in parts.items():
            if chunks:
                joined = np.concatenate(chunks)
                target.write(name, joined)
                written += len(joined)
        bar.advance(batch.done, written)
    return documents


def _held_out(index: int, fraction: float) -> bool:
    return math.floor((index + 1) * fraction) > math.floor(index * fraction)
