"""The directory `lowcomm data prepare` writes, all at once or not at all.

Everything is written into a hidden directory beside --out and renamed into place at the end:
an error, a full disk or Ctrl-C midway leaves no --out (and removes the parents it made).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from ..storage.files import replace_directory
from ..errors import UsageError
from .token_files import PREPARED_FORMAT, PREPARED_VERSION

SPLITS = ("train", "val")
COPY_BYTES = 1 << 24


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse --out before anything is read: a file, a directory holding files without
    --overwrite, or with it one that is not token data (nothing else is deleted)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UsageError(f"--out {out} is not empty (--overwrite replaces the token data in it)")
        if not _is_token_dir(out):
            raise UsageError(f"--out {out} holds files that are not lowcomm token data (no meta.json of "
                             f"lowcomm data prepare): not replaced; give another --out")


def _is_token_dir(out: Path) -> bool:
    try:
        return json.loads((out / "meta.json").read_text()).get("format") == PREPARED_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


class TokenDir:
    """`with TokenDir(out) as d: d.write(split, ids) ... d.commit(meta, tokenizer_json)`."""

    def __init__(self, out: Path, dtype: np.dtype):
        self.out, self.dtype = out, np.dtype(dtype)
        self.made = [p for p in reversed(out.parents) if not p.exists()]  # removed again on failure
        self.tmp = out.parent / f".{out.name}.preparing-{os.getpid()}"
        self.tokens = dict.fromkeys(SPLITS, 0)
        self.files = {}

    def __enter__(self) -> "TokenDir":
        self.tmp.mkdir(parents=True)
        self.files = {s: (self.tmp / f"{s}.bin").open("wb") for s in SPLITS}
        return self

    def write(self, split: str, ids: np.ndarray) -> None:
        if len(ids):
            ids.astype(self.dtype, copy=False).tofile(self.files[split])
            self.tokens[split] += len(ids)

    def move_tail_to_val(self, fraction: float) -> None:
        """The last `fraction` of the training tokens become the validation split (a source of one
        document, or too few for a document of validation: as --data text is split)."""
        self.files["train"].flush()
        n = self.tokens["train"]
        if n < 2:  # nothing to split: prepare refuses the source
            return
        n_val = max(1, int(n * fraction))
        cut = (n - n_val) * self.dtype.itemsize
        with (self.tmp / "train.bin").open("rb") as train:
            train.seek(cut)
            while chunk := train.read(COPY_BYTES):
                self.files["val"].write(chunk)
        self.files["train"].truncate(cut)
        self.tokens["train"], self.tokens["val"] = n - n_val, self.tokens["val"] + n_val

    def commit(self, meta: dict, tokenizer_json: bytes) -> dict:
        """Write tokenizer.json and meta.json (its hash, the token counts), then put the
        directory in place, replacing a previous one."""
        for f in self.files.values():
            f.close()
        (self.tmp / "tokenizer.json").write_bytes(tokenizer_json)
        meta = {"format": PREPARED_FORMAT, "version": PREPARED_VERSION, "dtype": self.dtype.name, **meta,
                "tokens": dict(self.tokens), "tokenizer_sha256": hashlib.sha256(tokenizer_json).hexdigest()}
        (self.tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        replace_directory(self.tmp, self.out)
        return meta

    def __exit__(self, kind, error, trace) -> None:
        for f in self.files.values():
            f.close()
        if kind is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            for parent in reversed(self.made):
                try:
                    parent.rmdir()
                except OSError:
                    break
