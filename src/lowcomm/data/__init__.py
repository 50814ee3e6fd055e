"""The data a run trains on: byte text (corpus.py) or token files (token_files.py, tokens.py),
what a source holds (info.py), the tokenizer (tokenizer.py) and each rank's batches (loader.py).

The names below are imported on first use (PEP 562): `lowcomm data prepare` needs none of the
ones that import torch (loader.py), and starts without it (222 MB and seconds less).
Imports: errors.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    **{n: ".corpus" for n in ("VOCAB_SIZE", "decode", "encode", "load_bytes")},
    **{n: ".info" for n in ("DataInfo", "describe")},
    **{n: ".loader" for n in ("ShardedBatches", "check_sizes", "check_split", "split", "val_batches")},
    **{n: ".tokens" for n in ("Tokens", "check_data", "load_tokens")},
}

__all__ = ["VOCAB_SIZE", "decode", "encode", "load_bytes", "ShardedBatches", "check_sizes", "check_split",
           "split", "val_batches", "DataInfo", "describe", "Tokens", "check_data", "load_tokens"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
