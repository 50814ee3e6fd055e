"""The data a run trains on: byte text (corpus.py) or token files (token_files.py, tokens.py),
what a source holds (info.py), the tokenizer (tokenizer.py) and each rank's batches (loader.py).

Imports: errors.
"""
from .corpus import VOCAB_SIZE, decode, encode, load_bytes
from .info import DataInfo, describe
from .loader import ShardedBatches, check_sizes, check_split, split, val_batches
from .tokens import Tokens, check_data, load_tokens

__all__ = ["VOCAB_SIZE", "decode", "encode", "load_bytes", "ShardedBatches", "check_sizes", "check_split",
           "split", "val_batches", "DataInfo", "describe", "Tokens", "check_data", "load_tokens"]
