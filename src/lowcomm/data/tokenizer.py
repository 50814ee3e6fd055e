"""The tokenizer a run's tokens were made with, to turn text into ids and ids into text.

Two kinds: bytes (lowcomm's byte-level text: id = byte value, vocab 256, no file) and any
Hugging Face `tokenizers` tokenizer (a `tokenizer.json`, or a tokenizer directory holding one),
which is what `lowcomm data prepare` writes beside its token files and `lowcomm sample` reads.
The `tokenizers` library (Rust, offline) does the work; this module only loads and names it.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import UsageError

BYTES = "bytes"
BYTE_VOCAB = 256
END_OF_TEXT = "<|endoftext|>"  # the separator between documents, where the tokenizer has one


class ByteTokenizer:
    """Text as its UTF-8 bytes: what lowcomm trains on when --data is text."""
    name = BYTES
    vocab_size = BYTE_VOCAB
    eot_id = None  # byte text is one stream: documents are joined by a newline

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < BYTE_VOCAB).decode("utf-8", errors="replace")


class FileTokenizer:
    """A `tokenizers` tokenizer read from a tokenizer.json (`path`)."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UsageError(f"tokenizer '{path}' needs the tokenizers library: pip install 'lowcomm[hf]' "
                             f"(or: pip install tokenizers)") from None
        try:
            self.inner = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type with the parser's message
            raise UsageError(f"tokenizer '{path}' cannot be read: {str(e).splitlines()[0] if str(e) else e}") from None
        self.name, self.path = str(path), path
        self.vocab_size = self.inner.get_vocab_size(with_added_tokens=True)
        self.eot_id = self.inner.token_to_id(END_OF_TEXT)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.inner.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(spec: str | Path) -> ByteTokenizer | FileTokenizer:
    """'bytes', a tokenizer.json, or a directory with a tokenizer.json in it (a Hugging Face
    tokenizer directory, or a directory `lowcomm data prepare` wrote)."""
    if str(spec) == BYTES:
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise UsageError(f"tokenizer directory '{spec}' holds no tokenizer.json")
        path = path / "tokenizer.json"
    elif not path.is_file():
        raise UsageError(f"tokenizer '{spec}' does not exist (give 'bytes', a tokenizer.json or a directory "
                         f"holding one)")
    return FileTokenizer(path)
