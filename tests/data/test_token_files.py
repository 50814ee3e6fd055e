"""--data reads token files: a directory `lowcomm data prepare` writes, nanoGPT's .bin and llm.c's
shards, all written here with numpy. What each holds (kind, vocabulary, validation file), that
they are memory-mapped and read window by window (a 4 GiB file is trained on with a few MB of
memory), that several shards read as one array give the batches their concatenation gives, and
that every bad file is one `error:` line naming it, exit 2, no output directory. No process is
started: a bad file is refused before any worker would be."""
from __future__ import annotations

import pickle
import tracemalloc

import numpy as np
import pytest

from lowcomm.cli.main import main
from lowcomm.data import ShardedBatches, check_data, describe, load_tokens, val_batches
from lowcomm.errors import UsageError
from token_data import LLAMA3_MAGIC, ids, write_llmc, write_nanogpt, write_prepared
from tiny_runs import TINY, error_line


def test_a_prepared_directory_gives_its_files_its_vocabulary_and_its_tokenizer(tmp_path):
    train, val = ids(5000, 300), ids(800, 300, seed=1)
    root = write_prepared(tmp_path / "prep", train, val, vocab=300)
    (root / "tokenizer.json").write_text("{}")
    info = describe(str(root))
    assert (info.kind, info.vocab_size, info.tokenizer, info.eot_id) == ("prepared", 300, root / "tokenizer.json", 299)
    tokens = load_tokens(str(root), val_fraction=0.5)  # its val.bin, not a fraction of train.bin
    assert isinstance(tokens.train, np.memmap) and isinstance(tokens.val, np.memmap)
    assert np.array_equal(tokens.train, train) and np.array_equal(tokens.val, val)
    assert "prepared tokens, 5,000 train / 800 val, vocab 300 from meta.json" in tokens.label
    assert describe(str(root), vocab_size=320).vocab_size == 320  # padded, as nanoGPT's 50304
    with pytest.raises(UsageError, match="--vocab-size 299 is smaller than the vocabulary .* \\(300, from meta.json\\)"):
        describe(str(root), vocab_size=299)
    wide = write_prepared(tmp_path / "wide", ids(3000, 70000), ids(500, 70000), vocab=70000, dtype="uint32")
    assert np.array_equal(load_tokens(str(wide), 0.1).train, ids(3000, 70000))


def test_nanogpt_files_take_meta_pkl_or_vocab_size_or_their_largest_id(tmp_path, capsys):
    train, val = ids(4000, 65), ids(600, 65, seed=1)
    char = write_nanogpt(tmp_path / "char", train, val, meta_vocab=70)
    assert describe(str(char)) == describe(str(char.parent))  # the file or its directory
    assert (describe(str(char)).kind, describe(str(char)).vocab_size, describe(str(char)).tokenizer) == ("nanogpt", 70, None)
    gpt2 = write_nanogpt(tmp_path / "gpt2", train, val)
    assert describe(str(gpt2)).vocab_size == 65  # its largest id + 1
    assert describe(str(gpt2), vocab_size=128).vocab_size == 128
    # the launcher's check: the largest id, said in one line, and recorded for the workers
    assert check_data(str(gpt2), 0, 0.1, seq_len=16, world=2) == 65
    assert "says no vocabulary (no meta.pkl beside it, no --vocab-size): the model's is its largest id + 1, 65" \
        in capsys.readouterr().err
    assert check_data(str(char), 0, 0.1, seq_len=16, world=2) == 0  # meta.pkl says: nothing to record
    tokens = load_tokens(str(gpt2), 0.5)
    assert np.array_equal(tokens.val, val) and len(tokens.train) == 4000
    alone = write_nanogpt(tmp_path / "alone", train)  # no val.bin: --val-fraction splits train.bin
    tokens = load_tokens(str(alone), 0.25)
    assert np.array_equal(tokens.train, train[:3000]) and np.array_equal(tokens.val, train[3000:])
    assert check_data(str(alone), 0, 0.25, 16, 2) == 65
    assert "has no validation file beside it: --val-fraction 0.25" in capsys.readouterr().err


def test_llmc_shards_read_as_one_stream_give_the_batches_of_their_concatenation(tmp_path):
    parts = [ids(1500, 50257, seed=s) for s in range(3)]
    for i, part in enumerate(parts):
        write_llmc(tmp_path / "shards" / f"web_train_{i + 1:06d}.bin", part)
    write_llmc(tmp_path / "shards" / "web_val_000000.bin", ids(700, 50257, seed=9))
    info = describe(str(tmp_path / "shards"))
    assert (info.kind, info.vocab_size, info.tokenizer) == ("llmc", 50257, None)
    tokens = load_tokens(str(tmp_path / "shards"), 0.1)
    whole = np.concatenate(parts)
    assert len(tokens.train) == len(whole) and np.array_equal(tokens.val, ids(700, 50257, seed=9))
    assert np.array_equal(np.asarray(tokens.train[1490:3010]), whole[1490:3010])  # across two files
    assert np.array_equal(np.asarray(tokens.train[-5:]), whole[-5:])
    for rank in range(2):  # each rank's shard, order and windows: as from the joined array
        mine, ref = (ShardedBatches(t, rank, 2, 32, 3, seed=7) for t in (tokens.train, whole))
        for _ in range(60):  # past an epoch
            assert all(np.array_equal(a, b) for a, b in zip(mine.next(), ref.next()))
    one = load_tokens(str(tmp_path / "shards" / "web_train_000002.bin"), 0.1)  # a shard: its val beside it
    assert np.array_equal(one.train, parts[1]) and len(one.val) == 700
    llama = write_llmc(tmp_path / "llama" / "x_train.bin", ids(2000, 128256), magic=LLAMA3_MAGIC)
    assert describe(str(llama)).vocab_size == 128256
    assert np.array_equal(load_tokens(str(llama), 0.1).train[:1800], ids(2000, 128256)[:1800])


def test_a_file_larger_than_memory_is_mapped_not_read(tmp_path):
    # 4 GiB of ids, sparse on disk: the loader reads the windows it draws, nothing more
    big = tmp_path / "big" / "train.bin"
    big.parent.mkdir()
    with big.open("wb") as f:
        f.truncate(4 << 30)
        f.seek(123456 * 2)
        f.write(np.uint16(42).tobytes())
    tracemalloc.start()
    try:
        tokens = load_tokens(str(big), 0.001, vocab_size=50304)
        loader = ShardedBatches(tokens.train, 1, 2, 1024, 4, seed=0)
        for _ in range(5):
            x, _ = loader.next()
        val_batches(tokens.val, 0, 2, 1024, 4, 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB allocated reading a 4 GiB file"
    assert x.shape == (4, 1024) and len(tokens.train) + len(tokens.val) == 2 << 30


def _bad_cases(tmp_path):
    """(--data, extra flags, the file the error names, words of the error) of each bad input."""
    good_train, good_val = ids(3000, 300), ids(500, 300, seed=1)
    over = good_train.copy()
    over[1234] = 300  # at the vocabulary meta.json says
    prep_over = write_prepared(tmp_path / "over", over, good_val, vocab=300)
    cut = write_prepared(tmp_path / "cut", good_train, good_val, vocab=300)
    (cut / "train.bin").write_bytes((cut / "train.bin").read_bytes()[:4000])
    foreign_meta = write_prepared(tmp_path / "foreign-meta", good_train, good_val, vocab=300, format="other")
    newer = write_prepared(tmp_path / "newer", good_train, good_val, vocab=300, version=2)
    odd = write_nanogpt(tmp_path / "odd", good_train, good_val)
    odd.write_bytes(odd.read_bytes() + b"\0")
    small = write_nanogpt(tmp_path / "small", good_train, good_val)
    zipped = tmp_path / "model" / "pytorch_model.bin"
    zipped.parent.mkdir()
    zipped.write_bytes(b"PK\x03\x04" + bytes(4000))
    evil = write_nanogpt(tmp_path / "evil", good_train, good_val)
    (evil.parent / "meta.pkl").write_bytes(pickle.dumps(print))  # a pickle that names a callable
    short = write_llmc(tmp_path / "short" / "a_train.bin", good_train, count=3500)
    long = write_llmc(tmp_path / "long" / "a_train.bin", good_train, count=2500)
    v2 = write_llmc(tmp_path / "v2" / "a_train.bin", good_train, version=2)
    stub = tmp_path / "stub" / "a_train.bin"
    stub.parent.mkdir()
    stub.write_bytes(np.int32(20240520).tobytes() + bytes(100))
    return [
        (prep_over, [], prep_over / "train.bin", "holds token id 300, at or above its vocabulary 300 (meta.json)"),
        (small, ["--vocab-size", "200"], small, "holds token id 299, at or above --vocab-size 200"),
        (cut, [], cut / "train.bin", "truncated: it holds 2,000 tokens, its meta.json says 3,000"),
        (foreign_meta, [], foreign_meta / "meta.json", "is not a lowcomm token directory's meta.json"),
        (newer, [], newer / "meta.json", "format version 2; this lowcomm reads version 1"),
        (odd, [], odd, "truncated: 6,001 bytes is not a whole number of uint16 token ids"),
        (zipped, [], zipped, "is not token ids: it is a zip archive"),
        (evil, [], evil.parent / "meta.pkl", "is not nanoGPT's meta.pkl"),
        (short, [], short, "truncated: its header says 3,500 tokens, the file holds 3,000"),
        (long, [], long, "longer than its header says: its header says 2,500 tokens"),
        (v2, [], v2, "GPT-2 magic 20240520 with header version 2; this lowcomm reads version 1"),
        (stub, [], stub, "truncated: 104 bytes, less than llm.c's 1024-byte header"),
    ]


def test_every_bad_token_file_is_one_line_naming_it_and_nothing_is_written(tmp_path, capsys):
    for data, extra, named, words in _bad_cases(tmp_path):
        out = tmp_path / f"run-{data.parent.name}-{data.name}"
        code = main(["train", "--data", str(data), *TINY, *extra, "--steps", "2", "--out", str(out)])
        line = error_line(capsys.readouterr().err)
        assert code == 2 and f"'{named}'" in line and words in line, (data, line)
        assert not out.exists(), data


def test_a_text_directory_with_a_token_file_in_it_points_to_the_token_file(tmp_path):
    (tmp_path / "notes.txt").write_text("some text\n" * 50)
    (tmp_path / "extra.bin").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(UsageError, match="extra.bin' looks like pre-tokenized tokens .* give --data the token file"):
        load_tokens(str(tmp_path), 0.1)
