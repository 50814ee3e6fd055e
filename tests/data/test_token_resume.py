"""Training on token files, and resuming it bit for bit: the data's order comes from the seed and
the stream's position is in the checkpoint, alike for a directory `lowcomm data prepare` wrote
(a bpe:300 trained on a small corpus), nanoGPT's files and
llm.c's shards (two training shards read as one stream), in a plain run resumed with --resume and
in an elastic run resumed from a commit point's checkpoint. The launcher's part (the vocabulary
found and recorded, the run's data named in summary.json, the loader's time in steps.jsonl) in one
CLI run. Budget: one W=2 spawn trains the three sources twice; two CLI launches each for the
plain and the elastic run."""
from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from lowcomm import checkpoint as K
from lowcomm.cli.main import build_parser, config_from_args, main
from tiny_runs import TEXT, trained
from token_data import ids, write_llmc, write_nanogpt

from dist_utils import run_dist

STEPS, CKPT = 6, 3
FLAGS = ["--workers", "2", "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
         "--micro-batch", "2", "--warmup", "1", "--eval-every", "3", "--eval-batches", "1", "--quiet"]


def sources(root: Path) -> dict[str, Path]:
    """The three layouts, each with a vocabulary of its own (the model's follows it)."""
    texts = root / "texts"
    texts.mkdir()
    for i in range(12):  # documents: prepare holds every tenth or so out for validation
        (texts / f"{i:02d}.txt").write_text(TEXT[i * 500:(i + 1) * 500] + f" document {i}\n")
    prepared = root / "prepared"
    assert main(["data", "prepare", str(texts), "--tokenizer", "bpe:300", "--out", str(prepared), "--quiet"]) == 0
    nanogpt = write_nanogpt(root / "nanogpt", ids(3000, 90, seed=2), ids(400, 90, seed=3)).parent  # no meta.pkl
    for i in (1, 2):
        write_llmc(root / "llmc" / f"web_train_{i:06d}.bin", ids(1500, 50257, seed=i))
    write_llmc(root / "llmc" / "web_val_000000.bin", ids(400, 50257, seed=9))
    return {"prepared": prepared, "nanogpt": nanogpt, "llmc": root / "llmc"}


def config(data: Path, out: Path, *extra: str):
    from lowcomm import config as C
    cfg = config_from_args(build_parser().parse_args(
        ["train", *FLAGS, "--data", str(data), "--steps", str(STEPS), "--checkpoint-every", str(CKPT),
         "--out", str(out), *extra]))
    C.validate(cfg)
    return cfg


def _train(cfg, rank, world):
    t = trained(cfg, rank, world)
    vocab = t.model.tok_emb.num_embeddings
    return torch.cat([p.detach().reshape(-1).clone() for p in t.model.parameters()]), vocab


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def _lives(rank, world, root, data_of):
    """Each source straight through (checkpoints at CKPT and the end), then resumed from CKPT."""
    found = {}
    for name, data in data_of.items():
        out = Path(root) / f"run-{name}"
        straight, vocab = _train(config(data, out), rank, world)
        straight_records = _records(out) if rank == 0 else None
        cfg = config(data, out)
        cfg.resume_from = str(out / K.name_of(CKPT))
        resumed, _ = _train(cfg, rank, world)
        found[name] = {"straight": straight, "resumed": resumed, "vocab": vocab, "straight_records": straight_records,
                       "resumed_records": _records(out) if rank == 0 else None}
    return found


@pytest.mark.procs
def test_token_files_train_and_resume_bit_for_bit(tmp_path):
    for name in ("prepared", "nanogpt", "llmc"):
        (tmp_path / f"run-{name}").mkdir()
    data_of = sources(tmp_path)  # written here, once: the ranks only read them
    prepared_vocab = json.loads((data_of["prepared"] / "meta.json").read_text())["vocab_size"]
    assert 257 < prepared_vocab <= 300
    lives = run_dist(_lives, 2, str(tmp_path), data_of, timeout=600)
    for name, vocab in (("prepared", prepared_vocab), ("nanogpt", 90), ("llmc", 50257)):
        for rank in range(2):
            life = lives[rank][name]
            assert life["vocab"] == vocab, name
            assert torch.equal(life["straight"], life["resumed"]), (name, rank)
        straight, resumed = lives[0][name]["straight_records"], lives[0][name]["resumed_records"]
        assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
        assert [r["loss"] for r in resumed] == [r["loss"] for r in straight], name
        assert [r["val_loss"] for r in resumed if "val_loss" in r] == [r["val_loss"] for r in straight if "val_loss" in r]
        assert all(0 < r["loader_s"] < r["wall_s"] for r in straight), name
    assert torch.equal(lives[0]["llmc"]["straight"], lives[1]["llmc"]["straight"])


@pytest.mark.procs
def test_the_launcher_finds_records_and_names_the_data_s_vocabulary(tmp_path, capfd):
    data = sources(tmp_path)["nanogpt"]
    out = tmp_path / "run"
    assert main(["train", *FLAGS, "--data", str(data), "--steps", "3", "--out", str(out)]) == 0
    err = capfd.readouterr().err
    assert "the model's is its largest id + 1, 90" in err and "has no validation file" not in err, err
    assert tomllib.loads((out / "config.toml").read_text())["data"]["vocab_size"] == 90  # no worker scans again
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"] == f"{data} (nanogpt tokens, 3,000 train / 400 val, vocab 90 from data.vocab_size)"
    assert all(r["loader_s"] > 0 for r in _records(out))


@pytest.mark.elastic
def test_an_elastic_run_on_token_files_resumes_bit_for_bit(tmp_path, capfd, monkeypatch):
    pytest.importorskip("torchft", reason="--elastic needs torchft (pip install 'lowcomm[elastic]')")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    data = sources(tmp_path)["prepared"]
    whole = tmp_path / "whole"
    argv = ["train", *FLAGS, "--elastic", "--data", str(data), "--steps", "8", "--checkpoint-every", "4",
            "--keep", "3"]
    assert main([*argv, "--out", str(whole)]) == 0, capfd.readouterr().err
    uninterrupted = json.loads((whole / "summary.json").read_text())
    assert "prepared tokens" in uninterrupted["data"] and "from meta.json" in uninterrupted["data"]
    resumed = tmp_path / "resumed"  # as a run stopped after step 4 would have left it
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "ckpt-000008")
    (resumed / "summary.json").unlink()
    assert main(["train", "--resume", str(resumed), "--quiet"]) == 0, capfd.readouterr().err
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["elastic"]["final_params_sha256"] == uninterrupted["elastic"]["final_params_sha256"]
    losses = [[r["loss"] for r in map(json.loads, (run / "steps.jsonl").read_text().splitlines())]
              for run in (whole, resumed)]
    assert losses[0] == losses[1] and len(losses[0]) == 8
    assert np.isfinite(losses[0]).all()
