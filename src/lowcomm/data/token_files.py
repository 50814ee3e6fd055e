"""Which token files a --data source names, and what their headers say (no token is read).

Three layouts, told from the source itself:
  - a directory `lowcomm data prepare` wrote: meta.json ("format": "lowcomm-tokens"), train.bin,
    val.bin (raw ids, the dtype meta.json says), tokenizer.json;
  - nanoGPT's raw uint16 ids: a `.bin` file, or a directory holding train.bin; its val.bin beside
    it; the vocabulary from the meta.pkl beside it (char-level data), else --vocab-size, else the
    files' largest id + 1 (tokens.py finds it);
  - llm.c's shards (dev/data/data_common.py): a header of 256 int32s (magic, version, token
    count), then the ids: magic 20240520 version 1 (GPT-2, uint16) or 20240801 version 7
    (Llama 3, uint32); a shard, or a directory of them (names with "val" are the validation
    shards), with the validation shard(s) found beside a "..._train..." file.
A file that is cut short, foreign or of another version is refused in one line naming it.
"""
from __future__ import annotations

import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UsageError

LLMC_HEADER_BYTES = 256 * 4
# magic: (name, version, dtype, vocabulary) of the token files llm.c writes
LLMC_FORMATS = {20240520: ("GPT-2", 1, np.uint16, 50257), 20240801: ("Llama 3", 7, np.uint32, 128256)}
PREPARED_FORMAT, PREPARED_VERSION = "lowcomm-tokens", 1
# What a .bin that is no token file often is, told from its first bytes
# (signatures of 4 bytes or more: a shorter one could be two real token ids)
FOREIGN = {b"PK\x03\x04": "a zip archive (a PyTorch pytorch_model.bin?)", b"\x93NUMPY": "a NumPy .npy array",
           b"GGUF": "a GGUF model file"}


@dataclass(frozen=True)
class Shard:
    """One file's ids: `count` ids of `dtype` from byte `offset` of `path`."""
    path: Path
    dtype: type
    offset: int
    count: int

    def open(self) -> np.ndarray:
        """The ids, memory-mapped: nothing is read until a window of them is."""
        if self.count == 0:
            return np.empty(0, dtype=self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.count,))


@dataclass
class TokenFiles:
    kind: str  # "prepared", "nanogpt", "llmc"
    label: str  # the source as the user named it
    train: list[Shard]
    val: list[Shard]  # empty: none beside the training files (--val-fraction splits them)
    vocab: int | None = None  # declared by the files (meta.json, meta.pkl, llm.c's format), else None
    vocab_from: str = ""  # where `vocab` was read
    tokenizer: Path | None = None  # the tokenizer.json the ids were made with, where one came with them
    eot_id: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def shards(self) -> list[Shard]:
        return self.train + self.val


def find(source: str) -> TokenFiles | None:
    """The token files --data `source` names, or None when it names text (read as bytes)."""
    if source in ("shakespeare", "pydoc"):
        return None
    path = Path(source).expanduser()
    if path.is_dir():
        if (path / "meta.json").is_file() and (_is_prepared(path / "meta.json") or (path / "train.bin").is_file()):
            return _prepared(path, source)
        if (path / "train.bin").is_file():
            return _nanogpt(path / "train.bin", source)
        shards = [p for p in sorted(path.glob("*.bin")) if _magic(p) in LLMC_FORMATS]
        return _llmc(shards, source, from_dir=True) if shards else None
    if path.is_file():
        if _magic(path) in LLMC_FORMATS:
            return _llmc([path] + _llmc_val_beside(path), source, from_dir=False)
        if path.suffix == ".bin":
            return _nanogpt(path, source)
    return None


def _magic(path: Path) -> int | None:
    head = _head(path, 4)
    return int.from_bytes(head, "little") if len(head) == 4 else None


def _head(path: Path, n: int) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(n)
    except OSError as e:
        raise UsageError(f"data file '{path}' cannot be read: {e.strerror or e}") from None


def _is_prepared(meta: Path) -> bool:
    try:
        return json.loads(meta.read_text()).get("format") == PREPARED_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _prepared(path: Path, source: str) -> TokenFiles:
    """A directory `lowcomm data prepare` wrote: meta.json says the dtype, vocabulary and counts."""
    meta_file = path / "meta.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"data file '{meta_file}' cannot be read as JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != PREPARED_FORMAT:
        raise UsageError(f"data file '{meta_file}' is not a lowcomm token directory's meta.json (format "
                         f"{meta.get('format') if isinstance(meta, dict) else None!r}, expected '{PREPARED_FORMAT}')")
    if meta.get("version") != PREPARED_VERSION:
        raise UsageError(f"data file '{meta_file}' is of format version {meta.get('version')!r}; this lowcomm reads "
                         f"version {PREPARED_VERSION}: prepare the data again with this version")
    dtype, vocab, counts = meta.get("dtype"), meta.get("vocab_size"), meta.get("tokens") or {}
    if dtype not in ("uint16", "uint32") or not isinstance(vocab, int) or vocab < 1:
        raise UsageError(f"data file '{meta_file}' says dtype {dtype!r} and vocab_size {vocab!r}: expected "
                         f"'uint16' or 'uint32' and a positive vocabulary")
    shards = {split: _raw(path / f"{split}.bin", np.dtype(dtype).type, counts.get(split)) for split in ("train", "val")}
    tokenizer = path / "tokenizer.json"
    return TokenFiles("prepared", source, [shards["train"]], [shards["val"]], vocab, "meta.json",
                      tokenizer if tokenizer.is_file() else None, meta.get("eot_id"))


def _raw(path: Path, dtype: type, expected: int | None = None) -> Shard:
    """Raw ids with no header (nanoGPT's layout, and lowcomm's): whole ids, as many as expected."""
    if not path.is_file():
        raise UsageError(f"data file '{path}' does not exist")
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    head = _head(path, 8)
    if what := next((what for sign, what in FOREIGN.items() if head.startswith(sign)), None):
        raise UsageError(f"data file '{path}' is not token ids: it is {what}")
    if size % itemsize:
        raise UsageError(f"data file '{path}' is truncated: {size:,} bytes is not a whole number of "
                         f"{np.dtype(dtype).name} token ids")
    if expected is not None and size // itemsize != expected:
        raise UsageError(f"data file '{path}' is truncated: it holds {size // itemsize:,} tokens, its meta.json "
                         f"says {expected:,}")
    if size == 0:
        raise UsageError(f"data file '{path}' is empty")
    return Shard(path, dtype, 0, size // itemsize)


def _nanogpt(path: Path, source: str) -> TokenFiles:
    """nanoGPT's uint16 ids: `path`, its val.bin beside it, its meta.pkl's vocabulary if any."""
    val = path.parent / "val.bin"
    files = TokenFiles("nanogpt", source, [_raw(path, np.uint16)],
                       [_raw(val, np.uint16)] if val.is_file() and val.resolve() != path.resolve() else [])
    meta = path.parent / "meta.pkl"
    if meta.is_file():
        files.vocab, files.vocab_from = _meta_pkl_vocab(meta), "meta.pkl"
    return files


class _PlainUnpickler(pickle.Unpickler):
    """nanoGPT's meta.pkl is a dict of ints, strings and dicts: nothing else is built (a pickle
    may name any callable; a data file must not run code)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it names {module}.{name}, not plain data")


def _meta_pkl_vocab(meta: Path) -> int:
    try:
        with meta.open("rb") as f:
            found = _PlainUnpickler(f).load()
    except Exception as e:  # pickle raises many kinds for a file that is not one
        raise UsageError(f"data file '{meta}' is not nanoGPT's meta.pkl: {e}") from None
    vocab = found.get("vocab_size") if isinstance(found, dict) else None
    if not isinstance(vocab, int) or vocab < 1:
        raise UsageError(f"data file '{meta}' holds no vocab_size (nanoGPT's meta.pkl has one)")
    return vocab


def _llmc_val_beside(path: Path) -> list[Path]:
    """The validation shards beside llm.c's training shard `path`: its name with 'val' for
    'train' and any shard number (fineweb_train_000001.bin -> fineweb_val_*.bin)."""
    if "train" not in path.name:
        return []
    pattern = re.sub(r"\d+", "*", path.name.replace("train", "val"))
    return [p for p in sorted(path.parent.glob(pattern)) if p != path]


def _llmc(paths: list[Path], source: str, from_dir: bool) -> TokenFiles:
    """llm.c's shards: the first is the training file given (a directory: every one without
    'val' in its name trains), the validation shards are the others with 'val' in their names."""
    shards = [_llmc_shard(p) for p in paths]
    is_val = [("val" in p.name) and (from_dir or i > 0) for i, p in enumerate(paths)]
    train = [s for s, v in zip(shards, is_val) if not v]
    if not train:
        raise UsageError(f"data source '{source}' holds only validation shards (names with 'val'); give the "
                         f"training shards too")
    magics = {_magic(p) for p in paths}
    if len(magics) > 1:
        raise UsageError(f"data source '{source}' mixes llm.c formats ({', '.join(LLMC_FORMATS[m][0] for m in sorted(magics))}): "
                         f"give shards of one tokenizer")
    name, _, _, vocab = LLMC_FORMATS[magics.pop()]
    return TokenFiles("llmc", source, train, [s for s, v in zip(shards, is_val) if v], vocab,
                      f"llm.c's {name} format")


def _llmc_shard(path: Path) -> Shard:
    head = _head(path, LLMC_HEADER_BYTES)
    if len(head) < LLMC_HEADER_BYTES:
        raise UsageError(f"data file '{path}' is truncated: {len(head)} bytes, less than llm.c's "
                         f"{LLMC_HEADER_BYTES}-byte header")
    magic, version, count = (int(v) for v in np.frombuffer(head, dtype="<i4", count=3))
    if magic not in LLMC_FORMATS:
        raise UsageError(f"data file '{path}' is not an llm.c token shard (magic {magic}, expected one of "
                         f"{', '.join(map(str, LLMC_FORMATS))})")
    name, want, dtype, _ = LLMC_FORMATS[magic]
    if version != want:
        raise UsageError(f"data file '{path}' has llm.c's {name} magic {magic} with header version {version}; "
                         f"this lowcomm reads version {want} ({np.dtype(dtype).name} tokens)")
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if count < 0 or size != LLMC_HEADER_BYTES + count * itemsize:
        held = (size - LLMC_HEADER_BYTES) / itemsize
        cut = "truncated" if held < count else "longer than its header says"
        raise UsageError(f"data file '{path}' is {cut}: its header says {count:,} tokens, the file holds "
                         f"{held:,.{0 if held == int(held) else 1}f}")
    if count == 0:
        raise UsageError(f"data file '{path}' holds no tokens")
    return Shard(path, dtype, LLMC_HEADER_BYTES, count)
