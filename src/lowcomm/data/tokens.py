"""A run's token ids, whatever --data names: byte text (corpus.py) or token files
(token_files.py), memory-mapped so that a file larger than memory trains.

The vocabulary a run's model gets (`vocabulary`): --vocab-size where given (it must hold every
id of the data, and the vocabulary the files declare), else the files' own (meta.json, nanoGPT's
meta.pkl, llm.c's format), else the files' largest id + 1, said in one line. `check_data` runs in
the launcher before any worker starts or anything is written: it reads every token file once,
in chunks, for its largest id (an id at or above the model's vocabulary is refused in one line
naming the file), so a worker never meets an id its embedding lacks.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from .corpus import load_bytes
from .loader import check_split, split
from .token_files import Shard, TokenFiles, find

SCAN_CHUNK = 1 << 24  # ids read at a time for the largest-id scan: 32-64 MB, whatever the file's size
_largest: dict[tuple, int] = {}  # (path, offset, size, mtime) -> largest id: each file is scanned once a process


@dataclass
class Tokens:
    """The training and validation ids of a run (arrays or views of memory-mapped files)."""
    train: object
    val: object
    label: str  # one line: what they are, for the announce line and summary.json
    kind: str  # "text", "prepared", "nanogpt", "llmc"


class ConcatTokens:
    """Several token files read as one array, none of them copied: a range of it is another such
    view, and numpy reads one (np.asarray, np.stack) by copying just its ids, joined across files."""

    def __init__(self, parts: list[np.ndarray], start: int = 0, stop: int | None = None):
        self.parts, self.dtype = parts, parts[0].dtype
        self.bounds = np.cumsum([0] + [len(p) for p in parts])
        self.start, self.stop = start, int(self.bounds[-1]) if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key: slice) -> ConcatTokens:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("token files are read by contiguous ranges")
        a, b, _ = key.indices(len(self))
        return ConcatTokens(self.parts, self.start + a, self.start + max(a, b))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        pieces, at = [], self.start
        i = int(np.searchsorted(self.bounds, at, side="right")) - 1
        while at < self.stop:
            end = min(self.stop, int(self.bounds[i + 1]))
            pieces.append(np.asarray(self.parts[i][at - self.bounds[i]:end - self.bounds[i]]))
            at, i = end, i + 1
        out = np.concatenate(pieces) if pieces else np.empty(0, self.dtype)
        return out if dtype is None else out.astype(dtype)


def joined(shards: list[Shard]):
    """The shards' ids as one array: the memory map itself for one file."""
    maps = [s.open() for s in shards]
    return maps[0] if len(maps) == 1 else ConcatTokens(maps)


def largest_id(shard: Shard) -> int:
    """The largest id of the file, read in chunks (memory stays bounded); once a process a file."""
    stat = shard.path.stat()
    key = (str(shard.path.resolve()), shard.offset, stat.st_size, stat.st_mtime_ns)
    if key not in _largest:
        ids = shard.open()
        _largest[key] = max(int(ids[i:i + SCAN_CHUNK].max()) for i in range(0, len(ids), SCAN_CHUNK))
    return _largest[key]


def vocabulary(files: TokenFiles, vocab_size: int) -> tuple[int, str]:
    """The model's vocabulary for these files and where it came from (`vocab_size`: --vocab-size,
    0 when not given). Scans the files only when nothing declares one."""
    if vocab_size:
        if files.vocab is not None and vocab_size < files.vocab:
            raise UsageError(f"--vocab-size {vocab_size} is smaller than the vocabulary of data '{files.label}' "
                             f"({files.vocab:,}, from {files.vocab_from})")
        return vocab_size, "data.vocab_size"
    if files.vocab is not None:
        return files.vocab, files.vocab_from
    return max(largest_id(s) for s in files.shards) + 1, "its largest id + 1"


def load_tokens(source: str, val_fraction: float, vocab_size: int = 0, quiet: bool = False) -> Tokens:
    """The run's training and validation ids: a text source's bytes split by `val_fraction`; token
    files memory-mapped, their validation file where they have one (else split the same way)."""
    files = find(source)
    if files is None:
        data, label = load_bytes(source, quiet)
        train, val = split(data, val_fraction)
        return Tokens(train, val, label, "text")
    train = joined(files.train)
    if files.val:
        val = joined(files.val)
    else:
        train, val = split(train, val_fraction)
    vocab, vocab_from = vocabulary(files, vocab_size)
    n_files = len(files.shards)
    label = (f"{source} ({files.kind} tokens, {len(train):,} train / {len(val):,} val"
             + (f" in {n_files} files" if n_files > 2 else "") + f", vocab {vocab:,} from {vocab_from})")
    return Tokens(train, val, label, files.kind)


def check_data(source: str, vocab_size: int, val_fraction: float, seq_len: int, world: int,
               quiet: bool = False) -> int:
    """Refuse, in one line naming the file, data a run cannot train on: files cut short, foreign or
    of another version (token_files.py), an id at or above the model's vocabulary, too few tokens
    for a sequence per worker. Returns the --vocab-size the run's workers are to use: the one given,
    or the largest id + 1 found here (so no worker scans the files again), or 0 (the data says)."""
    files = find(source)
    if files is None:
        tokens = load_tokens(source, val_fraction, quiet=True)
        check_split(tokens.train, tokens.val, seq_len, world, tokens.label)
        return vocab_size
    vocab, vocab_from = vocabulary(files, vocab_size)
    for shard in files.shards:
        if (top := largest_id(shard)) >= vocab:
            given = f"--vocab-size {vocab:,}" if vocab_from == "data.vocab_size" else f"its vocabulary {vocab:,} ({vocab_from})"
            raise UsageError(f"data file '{shard.path}' holds token id {top:,}, at or above {given}"
                             + ("; give a --vocab-size above it" if vocab_from == "data.vocab_size" else ""))
    tokens = load_tokens(source, val_fraction, vocab)
    check_split(tokens.train, tokens.val, seq_len, world, source)
    if vocab_from == "its largest id + 1" and not quiet:
        print(f"note: data '{source}' says no vocabulary (no meta.pkl beside it, no --vocab-size): the model's is "
              f"its largest id + 1, {vocab:,}", file=sys.stderr, flush=True)
    if not files.val and not quiet:
        print(f"note: data '{source}' has no validation file beside it: --val-fraction {val_fraction:g} of its "
              f"tokens is held out", file=sys.stderr, flush=True)
    return vocab if vocab_from == "its largest id + 1" else vocab_size
