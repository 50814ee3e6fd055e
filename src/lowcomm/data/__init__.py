"""The data a run trains on: byte text (corpus.py) or token files (token_files.py, tokens.py),
what a source holds (info.py), the tokenizer (tokenizer.py) and each rank's batches (loader.py).

The names below are imported on first use (PEP 562): `lowcomm data prepare` needs none of the
ones that import torch (loader.py), and starts without it (222 MB and seconds less).
Imports: lazy (the names above, imported on first use), storage (a prepared directory put in place whole), errors.
"""
from __future__ import annotations

from ..lazy.exports import lazy_exports

_EXPORTS = {
    **{n: ".corpus" for n in ("VOCAB_SIZE", "decode", "encode", "load_bytes")},
    **{n: ".info" for n in ("DataInfo", "describe")},
    **{n: ".loader" for n in ("ShardedBatches", "check_sizes", "check_split", "split", "val_batches")},
    **{n: ".tokens" for n in ("Tokens", "check_data", "load_tokens")},
}

__all__ = ["VOCAB_SIZE", "decode", "encode", "load_bytes", "ShardedBatches", "check_sizes", "check_split",
           "split", "val_batches", "DataInfo", "describe", "Tokens", "check_data", "load_tokens"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
