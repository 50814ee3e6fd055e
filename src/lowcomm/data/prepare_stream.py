"""The source's pieces in batches for encode_batch, read ahead by a thread.

Reading (file I/O, JSON parsing, Arrow conversion) is Python and holds the GIL; encoding is
Rust and lets go of it. The reader thread fills a small queue while the caller encodes, so
both cores stay busy, and the queue's bound keeps memory bounded (DEPTH batches of at most
BATCH_CHARS characters).
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from .sources import Piece, Source

BATCH_CHARS = 1 << 20  # 16 pieces of 64 KB: work for every core; 4 MB batches held ~100 MB more (measured)
BATCH_PIECES = 8192
DEPTH = 3


@dataclass
class Batch:
    pieces: list[Piece]
    done: int  # the source's bytes read once this batch was made (the progress bar's position)


def batches(source: Source) -> Iterator[Batch]:
    """The source's pieces, batched in order, read ahead by a thread."""
    return read_ahead(_batched(source), DEPTH)


def texts(source: Source, progress=None) -> Iterator[list[str]]:
    """Each batch's texts (what a BPE trainer reads), the bar moved as they go."""
    for batch in batches(source):
        if progress is not None:
            progress.advance(batch.done)
        yield [text for text, _ in batch.pieces]
    if progress is not None:
        progress.describe("learning the merges")  # the trainer's second phase, after the last text


def _batched(source: Source) -> Iterator[Batch]:
    pieces, chars = [], 0
    for piece in source.pieces():
        pieces.append(piece)
        chars += len(piece[0])
        if chars >= BATCH_CHARS or len(pieces) >= BATCH_PIECES:
            yield Batch(pieces, source.done)
            pieces, chars = [], 0
    yield Batch(pieces, source.done)


_END = object()


def read_ahead(items: Iterator, depth: int) -> Iterator:
    """`items`, produced by a daemon thread up to `depth` ahead; its exception is raised here.
    Closing the generator (an error or Ctrl-C in the caller) stops the thread at its next item."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce():
        try:
            for item in items:
                if not _put(ready, (item, None), stop):
                    return
            _put(ready, (_END, None), stop)
        except BaseException as e:  # handed to the consumer, raised in its thread
            _put(ready, (_END, e), stop)

    threading.Thread(target=produce, name="prepare-reader", daemon=True).start()
    try:
        while True:
            item, error = ready.get()
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
    finally:
        stop.set()


def _put(ready: queue.Queue, item, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            ready.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
