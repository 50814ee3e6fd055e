"""Token files written by the tests themselves, in the three layouts --data reads: a directory as
`lowcomm data prepare` writes it (meta.json, train.bin, val.bin), nanoGPT's raw uint16 .bin (with
its val.bin and, for char-level data, meta.pkl) and llm.c's shards (a 256-int32 header, then the
ids; dev/data/data_common.py's write_datafile)."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np

GPT2_MAGIC, LLAMA3_MAGIC = 20240520, 20240801


def ids(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    """`n` ids below `vocab`, with some structure to learn (a repeated random phrase) and the
    largest id, vocab - 1, present (so a scan for it finds the vocabulary)."""
    phrase = np.random.default_rng(seed).integers(0, vocab, 97)
    out = np.resize(phrase, n)
    out[n // 2] = vocab - 1
    return out


def write_prepared(root: Path, train: np.ndarray, val: np.ndarray, vocab: int, dtype: str = "uint16",
                   **meta) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    train.astype(dtype).tofile(root / "train.bin")
    val.astype(dtype).tofile(root / "val.bin")
    doc = {"format": "lowcomm-tokens", "version": 1, "dtype": dtype, "vocab_size": vocab, "eot_id": vocab - 1,
           "special_tokens": {"<|endoftext|>": vocab - 1}, "tokens": {"train": len(train), "val": len(val)},
           "documents": {"train": 1, "val": 1}, "source": "test", "tokenizer": "test", "tokenizer_sha256": "",
           "val_fraction": 0.1, **meta}
    (root / "meta.json").write_text(json.dumps(doc))
    return root


def write_nanogpt(root: Path, train: np.ndarray, val: np.ndarray | None = None,
                  meta_vocab: int | None = None) -> Path:
    """nanoGPT's data directory: train.bin (returned), val.bin, meta.pkl as its char-level
    prepare.py writes it (vocab_size, itos, stoi)."""
    root.mkdir(parents=True, exist_ok=True)
    train.astype(np.uint16).tofile(root / "train.bin")
    if val is not None:
        val.astype(np.uint16).tofile(root / "val.bin")
    if meta_vocab is not None:
        chars = [chr(32 + i) for i in range(meta_vocab)]
        with (root / "meta.pkl").open("wb") as f:
            pickle.dump({"vocab_size": meta_vocab, "itos": dict(enumerate(chars)),
                         "stoi": {c: i for i, c in enumerate(chars)}}, f)
    return root / "train.bin"


def write_llmc(path: Path, tokens: np.ndarray, magic: int = GPT2_MAGIC, version: int | None = None,
               count: int | None = None) -> Path:
    """One llm.c shard: header (magic, version, token count), then uint16 (GPT-2) or uint32
    (Llama 3) ids. `version`, `count`: what the header says, to write a wrong one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, version if version is not None else (1 if magic == GPT2_MAGIC else 7), \
        len(tokens) if count is None else count
    dtype = np.uint16 if magic == GPT2_MAGIC else np.uint32
    with path.open("wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype).tobytes())
    return path
