"""The tokenizer a run's tokens were made with, to turn text into ids and ids into text.

Two kinds: bytes (lowcomm's byte-level text: id = byte value, vocab 256, no file) and any
Hugging Face `tokenizers` tokenizer (a `tokenizer.json`, or a tokenizer directory holding one),
which is what `lowcomm data prepare` writes beside its token files and `lowcomm sample` reads.
Prepared byte tokens carry one too (byte_level_tokenizer: the same ids, plus "<|endoftext|>" =
256 between documents). The `tokenizers` library (Rust, offline) does the work; this module
only builds, loads and names it.
"""
from __future__ import annotations

import json
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
    """A `tokenizers` tokenizer read from a tokenizer.json (`path`), or one built in memory (`inner`)."""

    def __init__(self, path: Path | None = None, inner=None):
        if inner is None:
            inner = _read_tokenizer_json(path)
        self.inner, self.path = inner, path
        self.name = str(path) if path is not None else "in memory"
        # the largest id + 1: added tokens may sit above the model's vocabulary
        self.vocab_size = max(inner.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.eot_id = end_of_text_id(inner, path)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.inner.decode([int(i) for i in ids], skip_special_tokens=False)


def _read_tokenizer_json(path: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(f"tokenizer '{path}' needs the tokenizers library: pip install 'lowcomm[hf]' "
                         f"(or: pip install tokenizers)") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type with the parser's message
        raise UsageError(f"tokenizer '{path}' cannot be read: {str(e).splitlines()[0] if str(e) else e}") from None


def end_of_text_id(inner, path: Path | None) -> int | None:
    """The id that ends a document: "<|endoftext|>" where the tokenizer has it, else what the
    files beside `path` say (a prepared directory's meta.json; a Hugging Face directory's
    tokenizer_config.json eos_token), else a common end-of-sequence token, else None."""
    names = [END_OF_TEXT]
    if path is not None:
        beside = path.parent
        meta = _json(beside / "meta.json")
        if meta.get("format") == "lowcomm-tokens" and "eot_id" in meta:
            return meta["eot_id"]
        eos = _json(beside / "tokenizer_config.json").get("eos_token")
        names.append(eos.get("content") if isinstance(eos, dict) else eos)
    for name in names + ["<|end_of_text|>", "</s>", "<eos>", "<|im_end|>"]:
        if isinstance(name, str) and (found := inner.token_to_id(name)) is not None:
            return found
    return None


def _json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def byte_level_tokenizer():
    """The `tokenizers` tokenizer of byte text with documents: id = byte value (GPT-2's byte-level
    alphabet, no merges) and "<|endoftext|>" = 256, so decode(encode(text)) == text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([END_OF_TEXT])
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (what the ByteLevel pre-tokenizer maps bytes to)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


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
