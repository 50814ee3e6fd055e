"""The text a run trains on (corpus.py) and each rank's batches of it (loader.py).

Imports: errors.
"""
from .corpus import VOCAB_SIZE, decode, encode, load_bytes
from .loader import ShardedBatches, check_sizes, split, val_batches

__all__ = ["VOCAB_SIZE", "decode", "encode", "load_bytes", "ShardedBatches", "check_sizes",
           "split", "val_batches"]
