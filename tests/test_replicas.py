"""Replica groups (--replicas R of --workers W, ddp inside each replica), as a user runs them.

Exact reduction: R replicas of K processes at micro-batch m, the replica's processes splitting
what one worker would read, equal R single-process workers at micro-batch K·m (same seed:
final parameters within 1e-6; ddp's K cross-replica groups, each syncing its position's 1/K,
together send what the R workers send, diloco's each send it). Bytes per level equal the plan at (R, K) = (2, 2), (2, 1) and (1, 2). What is not built
yet is refused in one line, exit 2, nothing written. Six tiny CLI runs (W <= 4, 4 steps).
"""
from __future__ import annotations

import json

import pytest
import torch
from dist_utils import rel_err

from lowcomm.checkpoint import read, read_state
from lowcomm.cli import main

STEPS = 4
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife.\n") * 80
# (workers, replicas, micro-batch): (2, 2) replicas of 2, (2, 1) the flat reference, (1, 2)
LAYOUTS = {"2x2": (4, 2, 2), "2x1": (2, 2, 4), "1x2": (2, 1, 2)}
EXTRA = {"ddp": [], "diloco": ["--sync-every", "2", "--sync-by", "steps"]}
SPLIT = ("ddp",)  # the strategies whose cross-replica groups each sync only their position's 1/K


def _argv(data, out, strategy, workers, replicas, micro):
    return ["train", "--strategy", strategy, "--workers", str(workers), "--replicas", str(replicas),
            "--micro-batch", str(micro), "--steps", str(STEPS), "--n-layer", "2", "--n-head", "2",
            "--d-model", "16", "--seq-len", "16", "--eval-every", "0", "--eval-batches", "1",
            "--data", str(data), "--out", str(out), "--quiet", "--checkpoint-every", str(STEPS),
            *EXTRA[strategy]]


def _params(out, rank):
    model = read_state(read(sorted(out.glob("ckpt-*"))[-1]), rank)["strategy"]["model"]
    return torch.cat([model[k].detach().reshape(-1).float() for k in sorted(model)])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    data = root / "text.txt"
    data.write_text(TEXT)
    done = {}
    for strategy in EXTRA:
        for name, (workers, replicas, micro) in LAYOUTS.items():
            out = root / f"{strategy}-{name}"
            assert main(_argv(data, out, strategy, workers, replicas, micro)) == 0
            done[strategy, name] = (json.loads((out / "summary.json").read_text()),
                                    [_params(out, r) for r in range(workers)])
    return done


@pytest.mark.parametrize("strategy", list(EXTRA))
def test_replicas_of_k_equal_one_worker_at_k_times_the_micro_batch(runs, strategy):
    (grouped, params), (flat, reference) = runs[strategy, "2x2"], runs[strategy, "2x1"]
    for rank, p in enumerate(params):  # rank r·K + p holds what worker r holds
        assert rel_err(p, reference[rank // 2]) <= 1e-6, (strategy, rank)
    assert grouped["tokens"] == flat["tokens"]
    cross = grouped["levels"]["cross"]
    assert cross["groups"] == 2 and cross["ranks_per_group"] == 2
    # ddp splits by position (HSDP): the K groups together send what the R workers send;
    # diloco syncs the whole model in each of them.
    groups = 1 if strategy in SPLIT else cross["groups"]
    assert cross["wire_bytes"] / groups == flat["levels"]["cross"]["wire_bytes"]
    assert flat["levels"]["intra"]["wire_bytes"] == 0 and grouped["levels"]["intra"]["wire_bytes"] > 0


@pytest.mark.parametrize("strategy", list(EXTRA))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bytes_per_level_equal_the_plan(runs, strategy, layout):
    summary = runs[strategy, layout][0]
    for level in ("intra", "cross"):
        counted = summary["levels"][level]
        assert counted["wire_bytes"] == counted["planned_wire_bytes"], (level, counted)
    assert summary["wire_bytes_total"] == summary["planned_wire_bytes_total"] == sum(
        summary["levels"][level]["wire_bytes"] for level in ("intra", "cross"))


REFUSED = {
    "zero1": (["--strategy", "zero1", "--replicas", "2"], ("zero1", "--replicas")),
    "streaming": (["--strategy", "streaming_diloco", "--replicas", "2"], ("streaming_diloco", "--replicas")),
    "powersgd": (["--strategy", "powersgd", "--replicas", "2"], ("powersgd", "--replicas")),
    "fsdp": (["--strategy", "ddp", "--replicas", "2", "--inside", "fsdp"], ("ddp", "--inside fsdp")),
    "inside_unknown": (["--replicas", "2", "--inside", "tp"], ("--inside", "tp")),
    "not_dividing": (["--replicas", "3"], ("--replicas 3", "--workers 4")),
    "negative": (["--replicas", "-1"], ("replicas", "-1")),
    "intra_link_flat": (["--intra-link", "10gbit,50us"], ("--intra-link", "--replicas")),
    "intra_link_bad": (["--replicas", "2", "--intra-link", "fast"], ("--intra-link", "fast")),
    "sync_by_time": (["--strategy", "diloco", "--replicas", "2", "--sync-by", "time"], ("--sync-by time",)),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_in_one_line(case, tmp_path, capsys):
    flags, names = REFUSED[case]
    out = tmp_path / "run"
    assert main(["train", "--workers", "4", "--steps", "2", "--out", str(out), "--quiet", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert all(name in err for name in names), err
    assert not out.exists()


def test_toml_spelling(tmp_path):
    from lowcomm import config as C
    path = tmp_path / "run.toml"
    path.write_text('workers = 4\nreplicas = 2\ninside = "ddp"\n[intra_link]\nbandwidth = "10gbit"\nlatency = "50us"\n')
    cfg = C.load_toml(path)
    C.validate(cfg)
    assert (cfg.replicas, cfg.inside, cfg.intra_link.bandwidth) == (2, "ddp", 10e9 / 8)
    assert C.load_toml(_write(tmp_path / "again.toml", C.to_toml(cfg))).intra_link == cfg.intra_link


def _write(path, text):
    path.write_text(text)
    return path
