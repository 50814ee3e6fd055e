"""`lowcomm data prepare` refuses bad input in one `error:` line naming the bad value (exit 2)
and leaves nothing behind: no --out, no hidden temporary directory, no parent it made, whether
the input is refused before reading or found bad midway (a bad JSONL row after thousands of
good ones, Ctrl-C while encoding). In process, on files of a few kB."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lowcomm.cli.main import main
from lowcomm.data import prepare_stream
from lowcomm.data.prepare_tokenizer import Encoder
from tiny_runs import error_line
from token_data import write_llmc, write_nanogpt, write_prepared

CASES = ["missing_source", "empty_directory", "empty_file", "jsonl_without_the_field", "jsonl_invalid_json",
         "jsonl_not_text", "parquet_without_the_column", "bpe_too_small", "bpe_not_a_number",
         "tokenizer_path_missing", "unknown_tokenizer", "tokenizer_not_a_tokenizer", "prepared_directory_as_source",
         "nanogpt_bin_as_source", "llmc_shard_as_source", "binary_file", "out_not_empty", "val_fraction_out_of_range",
         "text_field_on_text", "no_out", "unknown_action"]


def case_args(case: str, tmp: Path, out: Path) -> tuple[list[str], tuple[str, ...]]:
    """(what follows `lowcomm data`, what the error line names) for each bad input."""
    text = tmp / "t.txt"
    text.write_text("some text\n")
    jsonl = tmp / "c.jsonl"
    prepare = ["prepare", "--out", str(out)]
    if case == "missing_source":
        return [*prepare, str(tmp / "nope.txt")], (str(tmp / "nope.txt"), "does not exist")
    if case == "empty_directory":
        (tmp / "empty").mkdir()
        return [*prepare, str(tmp / "empty")], (str(tmp / "empty"), "empty directory")
    if case == "empty_file":
        (tmp / "blank.txt").write_text("")
        return [*prepare, str(tmp / "blank.txt")], ("blank.txt", "holds no text")
    if case == "jsonl_without_the_field":
        jsonl.write_text('{"text": "a"}\n{"body": "b", "id": 1}\n')
        return [*prepare, str(jsonl)], (f"{jsonl}:2", "no field 'text'", "body, id")
    if case == "jsonl_invalid_json":
        jsonl.write_text('{"text": "a"}\n\n{"text": "b",\n')
        return [*prepare, str(jsonl)], (f"{jsonl}:3", "not valid JSON")
    if case == "jsonl_not_text":
        jsonl.write_text('{"text": 5}\n')
        return [*prepare, str(jsonl)], (f"{jsonl}:1", "int, not text")
    if case == "parquet_without_the_column":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"body": ["x"], "id": [1]}), tmp / "c.parquet")
        return [*prepare, str(tmp / "c.parquet"), "--text-field", "content"], \
            ("c.parquet", "no column 'content'", "columns: body, id")
    if case == "bpe_too_small":
        return [*prepare, str(text), "--tokenizer", "bpe:100"], ("bpe:100", "N >= 257")
    if case == "bpe_not_a_number":
        return [*prepare, str(text), "--tokenizer", "bpe:8k"], ("bpe:8k", "whole number")
    if case == "tokenizer_path_missing":
        return [*prepare, str(text), "--tokenizer", str(tmp / "tok.json")], (str(tmp / "tok.json"), "does not exist")
    if case == "unknown_tokenizer":
        return [*prepare, str(text), "--tokenizer", "gpt2"], ("gpt2", "unknown tokenizer")
    if case == "tokenizer_not_a_tokenizer":
        (tmp / "bad.json").write_text('{"not": "a tokenizer"}')
        return [*prepare, str(text), "--tokenizer", str(tmp / "bad.json")], (str(tmp / "bad.json"), "cannot be read")
    if case == "prepared_directory_as_source":
        src = write_prepared(tmp / "prep", np.arange(100), np.arange(10), vocab=300)
        return [*prepare, str(src)], (str(src), "token data already", "--data")
    if case == "nanogpt_bin_as_source":
        src = write_nanogpt(tmp / "ng", np.arange(1000) % 300, np.arange(100))
        return [*prepare, str(src)], (str(src), "token data already")
    if case == "llmc_shard_as_source":
        src = write_llmc(tmp / "shard_train_000001.bin", np.arange(1000) % 300)
        return [*prepare, str(src)], (str(src), "token data already")
    if case == "binary_file":
        (tmp / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
        return [*prepare, str(tmp / "img.png")], ("img.png", "not text")
    if case == "out_not_empty":
        out.mkdir(parents=True)
        (out / "mine.txt").write_text("keep me")
        return [*prepare, str(text)], (str(out), "not empty", "--overwrite")
    if case == "val_fraction_out_of_range":
        return [*prepare, str(text), "--val-fraction", "1.5"], ("--val-fraction", "1.5")
    if case == "text_field_on_text":
        return [*prepare, str(text), "--text-field", "body"], ("--text-field body", "is text")
    if case == "no_out":
        return ["prepare", str(text)], ("--out",)
    assert case == "unknown_action"
    return ["make", str(text), "--out", str(out)], ("'make'", "prepare")


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, tmp_path, capsys):
    out = tmp_path / "new" / "tok"
    argv, named = case_args(case, tmp_path, out)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["data", *argv]) == 2
    line = error_line(capsys.readouterr().err)
    for word in named:
        assert word in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no --out, no parent, no hidden temp dir
    if case == "out_not_empty":
        assert [p.name for p in out.iterdir()] == ["mine.txt"]


def test_a_bad_row_found_midway_leaves_nothing_behind(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(prepare_stream, "BATCH_PIECES", 16)  # many batches written before the bad row
    rows = [json.dumps({"text": f"row {i}"}) for i in range(2000)] + ['{"text": "cut short']
    (tmp_path / "c.jsonl").write_text("\n".join(rows) + "\n")
    for tokenizer in ("bytes", "bpe:300"):  # found while encoding, or while training the BPE
        assert main(["data", "prepare", str(tmp_path / "c.jsonl"), "--tokenizer", tokenizer,
                     "--out", str(tmp_path / "a" / "b" / "tok")]) == 2
        assert f"{tmp_path / 'c.jsonl'}:2001: not valid JSON" in error_line(capsys.readouterr().err)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_ctrl_c_while_encoding_leaves_the_previous_data_in_place(tmp_path, capsys, monkeypatch):
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": f"row {i}"}) for i in range(500)))
    out = tmp_path / "tok"
    assert main(["data", "prepare", str(tmp_path / "c.jsonl"), "--out", str(out), "--quiet"]) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(prepare_stream, "BATCH_PIECES", 16)
    calls = []
    real = Encoder.encode_batch

    def interrupted(self, texts):
        calls.append(len(texts))
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(self, texts)

    monkeypatch.setattr(Encoder, "encode_batch", interrupted)
    assert main(["data", "prepare", str(tmp_path / "c.jsonl"), "--tokenizer", "bytes", "--out", str(out),
                 "--overwrite", "--val-fraction", "0.5"]) == 130
    assert error_line(capsys.readouterr().err) == "error: interrupted"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first  # the old data, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "tok"]


def test_overwrite_replaces_token_data_and_nothing_else(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("some text\n" * 50)
    out = tmp_path / "tok"
    args = ["data", "prepare", str(tmp_path / "t.txt"), "--out", str(out), "--quiet"]
    assert main(args) == 0 and main(args) == 2  # not empty
    assert main([*args, "--overwrite", "--val-fraction", "0.5"]) == 0
    assert json.loads((out / "meta.json").read_text())["val_fraction"] == 0.5
    other = tmp_path / "notes"
    other.mkdir()
    (other / "a.txt").write_text("mine")
    capsys.readouterr()
    assert main(["data", "prepare", str(tmp_path / "t.txt"), "--out", str(other), "--overwrite"]) == 2
    assert "not lowcomm token data" in error_line(capsys.readouterr().err)
    assert [p.name for p in other.iterdir()] == ["a.txt"]
