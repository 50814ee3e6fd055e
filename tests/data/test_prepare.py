"""`lowcomm data prepare`: every tokenizer kind (bytes, bpe:N, a tokenizer.json, a Hugging Face
tokenizer directory) and every source kind (a text file or directory, JSONL, Parquet, a
`datasets` save_to_disk directory) round-trip: the token files decode to the source's documents,
each followed by the end-of-text id, and meta.json says what they hold. All in process, on
corpora of a few kB written here (the bad inputs and the atomic writes: test_prepare_errors.py)."""
from __future__ import annotations

import hashlib
import io
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

from lowcomm.cli.main import main
from lowcomm.data import describe, load_tokens
from lowcomm.data import sources
from lowcomm.data.prepare import prepare
from lowcomm.data.prepare_progress import PrepareBar
from lowcomm.data.tokenizer import load_tokenizer

DOCS = ["The quick brown fox jumps over the lazy dog.\n", "Héllo, wörld! ☃ 12345\n\nsecond paragraph",
        "  leading spaces and\ttabs\n", "a document that spells <|endoftext|> as text", "short"]


def read(out: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    meta = json.loads((out / "meta.json").read_text())
    return meta, *(np.fromfile(out / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val"))


def documents(ids: np.ndarray, eot: int) -> list[list[int]]:
    """The ids between end-of-text ids (each document is followed by one)."""
    assert len(ids) and ids[-1] == eot
    cuts = np.flatnonzero(ids == eot)
    return [ids[a + 1 if i else 0:b].tolist() for i, (a, b) in enumerate(zip([-1, *cuts[:-1]], cuts))]


def text_dir(root: Path, docs: list[str]) -> Path:
    root.mkdir()
    for i, doc in enumerate(docs):
        (root / f"{i:03d}.txt").write_text(doc)
    return root


def test_bytes_are_the_text_s_bytes_with_end_of_text_after_each_document(tmp_path, capsys):
    src = text_dir(tmp_path / "texts", DOCS)
    assert main(["data", "prepare", str(src), "--tokenizer", "bytes", "--out", str(tmp_path / "tok"),
                 "--val-fraction", "0.2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"prepared {tmp_path / 'tok'}: ") and "4 + 1 documents, vocab 257 (uint16)" in out[0]
    assert out[1] == f"train on it: lowcomm train --data {tmp_path / 'tok'}"
    meta, train, val = read(tmp_path / "tok")
    assert (meta["format"], meta["version"], meta["dtype"], meta["vocab_size"], meta["eot_id"]) == \
        ("lowcomm-tokens", 1, "uint16", 257, 256)
    assert meta["special_tokens"] == {"<|endoftext|>": 256} and meta["tokenizer"] == "bytes"
    # floor((i+1)·0.2) > floor(i·0.2): the fifth document is held out
    assert documents(train, 256) == [list(d.encode()) for d in DOCS[:4]]
    assert documents(val, 256) == [list(DOCS[4].encode())]
    assert meta["tokens"] == {"train": len(train), "val": len(val)} and meta["documents"] == {"train": 4, "val": 1}
    tokenizer_json = (tmp_path / "tok" / "tokenizer.json").read_bytes()
    assert meta["tokenizer_sha256"] == hashlib.sha256(tokenizer_json).hexdigest()
    tokenizer = load_tokenizer(tmp_path / "tok")  # what lowcomm sample and --data read
    assert (tokenizer.vocab_size, tokenizer.eot_id) == (257, 256)
    for doc in DOCS:
        assert tokenizer.encode(doc.replace("<|endoftext|>", "")) == list(doc.replace("<|endoftext|>", "").encode())
        assert tokenizer.decode(tokenizer.encode(doc)) == doc
    assert tokenizer.decode(train.tolist()) == "<|endoftext|>".join(DOCS[:4]) + "<|endoftext|>"


def test_the_progress_bar_shows_tokens_their_rate_and_the_time_left():
    from rich.console import Console
    screen = io.StringIO()
    bar = PrepareBar(1_000_000, console=Console(file=screen, force_terminal=True, width=150))
    bar.start("tokenizing")
    bar.advance(100_000, 23_456)
    time.sleep(0.05)  # rich tells the time left from the rate between two updates
    bar.advance(250_000, 100_000)
    bar.close()
    shown = screen.getvalue()
    assert "tokenizing" in shown and "25%" in shown and "123,456 tokens" in shown and "tokens/s" in shown
    assert re.search(r"\d+:\d\d:\d\d", shown)  # the time left
    quiet = PrepareBar(10, enabled=False, console=Console(file=io.StringIO(), force_terminal=True))
    assert quiet._bar is None


def test_pydoc_topics_text_not_utf8_and_an_out_inside_the_source(tmp_path, capsys):
    from pydoc_data.topics import topics
    prepare("pydoc", "bytes", tmp_path / "pydoc")
    meta = read(tmp_path / "pydoc")[0]
    assert sum(meta["documents"].values()) == len([t for t in topics.values() if t])
    src = text_dir(tmp_path / "texts", ["plain text\n", "more text\n"])
    (src / "latin1.txt").write_bytes("café crème\n".encode("latin-1"))
    prepare(str(src), "bytes", src / "tok", val_fraction=0.34)
    assert "latin1.txt' is not UTF-8" in capsys.readouterr().err
    assert bytes(read(src / "tok")[2][:-1].tolist()).decode() == "caf\ufffd cr\ufffdme\n"
    prepare(str(src), "bytes", src / "tok", val_fraction=0.34, overwrite=True)  # its own --out is not read
    assert read(src / "tok")[0]["documents"] == {"train": 2, "val": 1}


def test_the_token_directory_is_what_data_reads(tmp_path):
    prepare(str(text_dir(tmp_path / "texts", DOCS * 4)), "bytes", tmp_path / "tok")
    meta, train, val = read(tmp_path / "tok")
    info = describe(str(tmp_path / "tok"))
    assert (info.kind, info.vocab_size, info.eot_id) == ("prepared", 257, 256)
    tokens = load_tokens(str(tmp_path / "tok"), val_fraction=0.1)
    assert np.array_equal(tokens.train, train) and np.array_equal(tokens.val, val)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> tuple[Path, Path]:
    """A bpe:300 trained on a small text directory: (source, token directory)."""
    root = tmp_path_factory.mktemp("bpe")
    src = text_dir(root / "texts", DOCS * 8)
    prepare(str(src), "bpe:300", root / "tok", val_fraction=0.25)
    return src, root / "tok"


def test_bpe_is_trained_on_the_source_and_decodes_back_to_it(bpe_dir):
    _, out = bpe_dir
    meta, train, val = read(out)
    tokenizer = load_tokenizer(out)
    assert 257 < meta["vocab_size"] <= 300 and meta["vocab_size"] == tokenizer.vocab_size
    assert meta["eot_id"] == tokenizer.eot_id == tokenizer.inner.token_to_id("<|endoftext|>")
    assert meta["tokenizer"] == "bpe:300" and meta["documents"] == {"train": 30, "val": 10}
    docs = [tokenizer.decode(d) for d in documents(train, meta["eot_id"])]
    assert docs == [d for i, d in enumerate(DOCS * 8) if (i + 1) % 4]  # every fourth held out
    assert len(train) < sum(len(d.encode()) for d in docs)  # merges were learnt: fewer tokens than bytes
    assert [tokenizer.decode(d) for d in documents(val, meta["eot_id"])] == \
        [d for i, d in enumerate(DOCS * 8) if not (i + 1) % 4]
    tokenizer.inner.encode_special_tokens = True  # as prepare encodes: "<|endoftext|>" in a text is text
    assert documents(val, meta["eot_id"])[0] == tokenizer.encode(DOCS[3])


def test_a_tokenizer_json_is_copied_as_given_and_encodes_the_documents(bpe_dir, tmp_path):
    src, trained = bpe_dir
    given = tmp_path / "mine.json"
    given.write_bytes((trained / "tokenizer.json").read_bytes())
    prepare(str(src), str(given), tmp_path / "tok")
    meta, train, _ = read(tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == given.read_bytes()
    assert meta["tokenizer"] == str(given)
    assert meta["tokenizer_sha256"] == hashlib.sha256(given.read_bytes()).hexdigest()
    tokenizer = load_tokenizer(given)
    tokenizer.inner.encode_special_tokens = True
    held_out = {9, 19, 29, 39}  # 0.1 of 40 documents
    assert documents(train, meta["eot_id"]) == [tokenizer.encode(d) for i, d in enumerate(DOCS * 8)
                                                if i not in held_out]
    # a prepared directory as the tokenizer: the ids of the run that trained it, its end-of-text from meta.json
    prepare(str(src), str(trained), tmp_path / "again", val_fraction=0.25)
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (tmp_path / "again" / name).read_bytes() == (trained / name).read_bytes()


def test_a_hugging_face_tokenizer_directory_ends_documents_with_its_eos_token(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = sorted({w for d in DOCS for w in d.split()} - {"<|endoftext|>"})  # eos is "</s>" alone
    inner = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}},
                                       unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>",
                                         unk_token="[UNK]").save_pretrained(tmp_path / "hf")
    prepare(str(text_dir(tmp_path / "texts", DOCS)), str(tmp_path / "hf"), tmp_path / "tok", val_fraction=0.2)
    meta, train, val = read(tmp_path / "tok")
    assert meta["eot_id"] == 2 and meta["vocab_size"] == len(words) + 3
    assert documents(train, 2)[0] == [words.index(w) + 3 for w in DOCS[0].split()]
    assert load_tokenizer(tmp_path / "tok").eot_id == 2  # read back from meta.json, beside the tokenizer.json


def test_a_vocabulary_over_65536_ids_is_written_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0, "<|endoftext|>": 70_000, **{f"w{i}": i for i in range(1, 70_000)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    inner.save(str(tmp_path / "big.json"))
    src = text_dir(tmp_path / "texts", ["w1 w69999 w5", "w65536 w7", "w2"])
    prepare(str(src), str(tmp_path / "big.json"), tmp_path / "tok", val_fraction=0.34)
    meta, train, val = read(tmp_path / "tok")
    assert (meta["dtype"], meta["vocab_size"], meta["eot_id"]) == ("uint32", 70_001, 70_000)
    assert train.tolist() == [1, 69_999, 5, 70_000, 65_536, 7, 70_000] and val.tolist() == [2, 70_000]
    assert (tmp_path / "tok" / "train.bin").stat().st_size == 7 * 4


def test_jsonl_rows_are_documents_and_a_null_or_blank_row_is_skipped(tmp_path):
    rows = [{"text": d, "id": i} for i, d in enumerate(DOCS)] + [{"text": None}]
    lines = [json.dumps(r) for r in rows]
    lines.insert(2, "")
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    prepare(str(tmp_path / "c.jsonl"), "bytes", tmp_path / "tok", val_fraction=0.2)
    meta, train, val = read(tmp_path / "tok")
    assert documents(train, 256) + documents(val, 256) == [list(d.encode()) for d in DOCS]
    assert (meta["source_kind"], meta["text_field"], meta["documents"]) == ("jsonl", "text", {"train": 4, "val": 1})
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in DOCS))
    prepare(str(tmp_path / "b.jsonl"), "bytes", tmp_path / "tok2", text_field="body", val_fraction=0.2)
    assert np.array_equal(read(tmp_path / "tok2")[1], train)
    (tmp_path / "c.json").write_bytes((tmp_path / "c.jsonl").read_bytes())  # .json given itself: JSON lines
    prepare(str(tmp_path / "c.json"), "bytes", tmp_path / "tok3", val_fraction=0.2)
    assert np.array_equal(read(tmp_path / "tok3")[1], train)
    (tmp_path / "texts").mkdir()  # in a text directory, a .json file is a text document like the others
    (tmp_path / "texts" / "config.json").write_text('{"a": 1}')
    prepare(str(tmp_path / "texts"), "bytes", tmp_path / "tok4", val_fraction=0.5)
    assert np.concatenate(read(tmp_path / "tok4")[1:]).tolist() == list(b'{"a": 1}') + [256]


def test_parquet_and_datasets_directories_are_read_with_pyarrow(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    monkeypatch.setattr(sources, "PYTHON_ROWS", 1)  # each batch of 2 rows turned into strings a row at a time
    import pyarrow.parquet as pq
    table = pa.table({"id": list(range(len(DOCS))), "text": DOCS})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=2)
    prepare(str(tmp_path / "c.parquet"), "bytes", tmp_path / "pq", val_fraction=0.2)
    expected = read(tmp_path / "pq")
    assert documents(expected[1], 256) == [list(d.encode()) for d in DOCS[:4]]
    # A Dataset as `datasets` save_to_disk writes it: an IPC stream per shard, state.json naming them
    ds = write_saved_dataset(tmp_path / "ds", pa, [table.slice(0, 3), table.slice(3)])
    prepare(str(ds), "bytes", tmp_path / "from_ds", val_fraction=0.2)
    got = read(tmp_path / "from_ds")
    assert np.array_equal(got[1], expected[1]) and np.array_equal(got[2], expected[2])
    assert got[0]["source_kind"] == "datasets"
    with pa.ipc.new_file(tmp_path / "c.arrow", table.schema) as writer:  # an arrow file alone (IPC file format)
        writer.write_table(table, max_chunksize=2)
    prepare(str(tmp_path / "c.arrow"), "bytes", tmp_path / "from_arrow", val_fraction=0.2)
    assert np.array_equal(read(tmp_path / "from_arrow")[1], expected[1])
    # A DatasetDict: its train split is read (prepare makes its own validation split)
    write_saved_dataset(tmp_path / "dd" / "train", pa, [table])
    write_saved_dataset(tmp_path / "dd" / "test", pa, [pa.table({"id": [9], "text": ["not this"]})])
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    prepare(str(tmp_path / "dd"), "bytes", tmp_path / "from_dd", val_fraction=0.2)
    assert np.array_equal(read(tmp_path / "from_dd")[1], expected[1])


def write_saved_dataset(root: Path, pa, shards: list) -> Path:
    root.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{len(shards):05d}.arrow" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        with pa.ipc.new_stream(root / name, shard.schema) as writer:
            writer.write_table(shard, max_chunksize=2)
    (root / "dataset_info.json").write_text(json.dumps({"features": {"id": {"dtype": "int64", "_type": "Value"},
                                                                     "text": {"dtype": "string", "_type": "Value"}}}))
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                 "_fingerprint": "0", "_split": None}))
    return root


def test_the_validation_documents_are_spread_evenly_and_the_same_every_time(tmp_path):
    docs = [f"document number {i}\n" for i in range(25)]
    src = text_dir(tmp_path / "texts", docs)
    prepare(str(src), "bytes", tmp_path / "a", val_fraction=0.2)
    prepare(str(src), "bytes", tmp_path / "b", val_fraction=0.2)
    meta, train, val = read(tmp_path / "a")
    assert [bytes(d).decode() for d in documents(val, 256)] == [docs[i] for i in (4, 9, 14, 19, 24)]
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert meta["val_split"] == "documents" and meta["val_fraction"] == 0.2


def test_one_text_file_is_one_document_split_at_its_end(tmp_path):
    text = "".join(f"line {i} of a single file\n" for i in range(200))
    (tmp_path / "one.txt").write_text(text)
    prepare(str(tmp_path / "one.txt"), "bytes", tmp_path / "tok", val_fraction=0.1)
    meta, train, val = read(tmp_path / "tok")
    whole = list(text.encode()) + [256]
    assert train.tolist() + val.tolist() == whole and len(val) == int(len(whole) * 0.1)
    assert meta["documents"] == {"train": 1, "val": 0} and meta["val_split"] == "end of the text"


def test_pieces_of_a_long_document_encode_as_the_whole_would(tmp_path, monkeypatch, bpe_dir):
    """Small pieces and reads, so a document is cut hundreds of times, a multi-byte character
    split across reads: bytes and BPE ids are those of the whole text."""
    monkeypatch.setattr(sources, "PIECE_CHARS", 40)
    monkeypatch.setattr(sources, "READ_BYTES", 37)
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "☃é", "12", "x", "...", "Hello", "world"]
    spaces = [" ", " ", " ", "\n", "\n\n", "  ", "\t", " \n"]
    text = "".join(w + s for w, s in zip(rng.choice(words, 2000), rng.choice(spaces, 2000)))
    (tmp_path / "long.txt").write_text(text)
    prepare(str(tmp_path / "long.txt"), "bytes", tmp_path / "b", val_fraction=0.1)
    assert np.concatenate(read(tmp_path / "b")[1:]).tolist() == list(text.encode()) + [256]
    trained = bpe_dir[1] / "tokenizer.json"
    prepare(str(tmp_path / "long.txt"), str(trained), tmp_path / "t", val_fraction=0.1)
    meta, train, val = read(tmp_path / "t")
    tokenizer = load_tokenizer(trained)
    assert np.concatenate([train, val]).tolist() == tokenizer.encode(text) + [meta["eot_id"]]
