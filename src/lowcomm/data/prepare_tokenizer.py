"""The tokenizer `lowcomm data prepare --tokenizer T` encodes with, and its batch encoding.

T is 'bytes' (id = byte value, "<|endoftext|>" = 256), 'bpe:N' (a byte-level BPE of N tokens
trained on the source by the `tokenizers` library, GPT-2's pre-tokenizer, "<|endoftext|>" = 0),
a tokenizer.json, or a Hugging Face tokenizer directory (its tokenizer.json; the end-of-text
token from its tokenizer_config.json's eos_token where it has no "<|endoftext|>").
Encoding is `tokenizers`' encode_batch, in Rust on every core; byte tokens skip it (they are
the text's UTF-8 bytes, the same ids the written tokenizer.json gives).
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UsageError
from .tokenizer import BYTES, END_OF_TEXT, FileTokenizer, byte_level_tokenizer, load_tokenizer

MIN_BPE = 257  # the 256 bytes of the byte-level alphabet and the end-of-text token
UINT16_IDS = 1 << 16


@dataclass(frozen=True)
class TokenizerSpec:
    """--tokenizer as parsed: kind 'bytes', 'bpe' (with `size`) or 'file' (with `path`)."""
    text: str
    kind: str
    size: int = 0
    path: Path | None = None


def parse_spec(text: str) -> TokenizerSpec:
    """Check --tokenizer before any data is read: one line naming the bad value."""
    if text == BYTES:
        return TokenizerSpec(text, "bytes")
    if text.startswith("bpe:") or text == "bpe":
        size = text[4:]
        if not size.isdigit() or int(size) < MIN_BPE:
            raise UsageError(f"--tokenizer {text}: bpe:N needs a whole number of tokens N >= {MIN_BPE} "
                             f"(256 bytes and the end-of-text token), e.g. bpe:8192")
        return TokenizerSpec(text, "bpe", size=int(size))
    path = Path(text).expanduser()
    if not path.exists() and not _looks_like_path(text):
        raise UsageError(f"--tokenizer {text}: unknown tokenizer (give bytes, bpe:N, a tokenizer.json or a "
                         f"tokenizer directory; nothing is downloaded)")
    load_tokenizer(path)  # exists, is read by `tokenizers`, a directory holds a tokenizer.json
    return TokenizerSpec(text, "file", path=path / "tokenizer.json" if path.is_dir() else path)


def _looks_like_path(text: str) -> bool:
    return os.sep in text or text.startswith((".", "~")) or text.endswith(".json")


class Encoder:
    """Text to ids with a `tokenizers` tokenizer; `to_json()` is what tokenizer.json holds."""

    def __init__(self, tokenizer: FileTokenizer, is_bytes: bool = False, source_json: bytes | None = None):
        self.inner, self.is_bytes = tokenizer.inner, is_bytes
        # A document's text that spells "<|endoftext|>" is text, not the separator (as tiktoken's
        # encode_ordinary): only prepare puts the end-of-text id between documents.
        self.inner.encode_special_tokens = True
        self.vocab_size, self.eot_id = tokenizer.vocab_size, tokenizer.eot_id
        self.dtype = np.dtype(np.uint16 if self.vocab_size <= UINT16_IDS else np.uint32)
        self.source_json = source_json

    def special_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self.inner.get_added_tokens_decoder().items() if t.special}

    def to_json(self) -> bytes:
        """The file as given (a user's tokenizer.json is copied byte for byte), else serialized."""
        return self.source_json if self.source_json is not None else self.inner.to_str().encode("utf-8")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        try:
            return self._encode(texts)
        except (UnicodeEncodeError, TypeError):  # a lone surrogate (JSON's "\ud800") is no UTF-8: U+FFFD
            return self._encode([t.encode("utf-8", "replace").decode("utf-8") for t in texts])

    def _encode(self, texts: list[str]) -> list[np.ndarray]:
        if self.is_bytes:
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        encode = getattr(self.inner, "encode_batch_fast", self.inner.encode_batch)  # fast: no offsets
        return [np.asarray(e.ids, dtype=self.dtype) for e in encode(texts, add_special_tokens=False)]


def fixed_encoder(spec: TokenizerSpec) -> Encoder:
    """The encoder of 'bytes' or of a tokenizer file (not 'bpe:N', which is trained: train_bpe)."""
    if spec.kind == "bytes":
        return Encoder(FileTokenizer(inner=byte_level_tokenizer()), is_bytes=True)
    tokenizer = FileTokenizer(spec.path)
    return Encoder(tokenizer, source_json=spec.path.read_bytes())


def train_bpe(batches: Iterable[list[str]], size: int) -> Encoder:
    """A byte-level BPE of at most `size` tokens (fewer when the text has fewer merges to make),
    trained by `tokenizers` on the batches of text as they stream in."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(batches, trainer=trainer)
    return Encoder(FileTokenizer(inner=tokenizer))
