"""A plain --resume on another number of workers re-cuts a sharded state (zero1, acco, dpu) exactly
as an elastic run's first quorum does: the two paths load the same state, which equals the whole
state put together here by hand from the checkpoint's shards (2 -> 1), or its shards cut by hand
from the whole (1 -> 2, the second worker's own parts fresh); the resumed run then trains on.

Three shared spawns, each for every strategy: trained on 1 worker with a checkpoint at step CKPT;
trained on 2, and the run of 1 resumed on 2; the run of 2 resumed on 1. A checkpoint of replicas of
another size is refused in one line."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lowcomm import checkpoint as K
from lowcomm.cli.main import build_parser, config_from_args
from lowcomm.strategies.registry import reproducible_flags

from dist_utils import run_dist

pytestmark = pytest.mark.procs

SHARDED = ("zero1", "acco", "dpu")
STEPS, CKPT = 4, 3
OPTIONS = {"dpu": ["--dpu-warmup", "1"]}  # a delayed gradient waits in dpu's round buffer at CKPT


def config(name: str, out: Path, workers: int):
    from lowcomm import config as C
    cfg = config_from_args(build_parser().parse_args([
        "train", "--strategy", name, "--workers", str(workers), "--steps", str(STEPS), "--n-layer", "1",
        "--n-head", "2", "--d-model", "16", "--seq-len", "16", "--micro-batch", "2", "--warmup", "1",
        "--eval-every", "0", "--eval-batches", "1", "--data", "pydoc", "--out", str(out), "--quiet",
        "--checkpoint-every", str(CKPT), *reproducible_flags(name), *OPTIONS.get(name, [])]))
    C.validate(cfg)
    return cfg


def _life(rank, world, root, train: bool, resume_from: int | None):
    """Each strategy trained on `world` workers (`train`: into NAME-wWORLD) and/or its run of
    `resume_from` workers resumed here from its step-CKPT checkpoint (NAME-wFROM-on-WORLD, a copy):
    loaded by the plain path and by the elastic path, each into a trainer of its own; the plain one
    then trains to the end. Returns the resumed states."""
    from lowcomm.elastic import checkpoints as elastic_checkpoints
    from lowcomm.train.worker import build, run_plain
    from tiny_runs import trained
    out = {}
    for name in SHARDED:
        if train:
            (Path(root) / f"{name}-w{world}").mkdir(exist_ok=True)  # the launcher's part
            trained(config(name, Path(root) / f"{name}-w{world}", world), rank, world)
        if resume_from is None:
            continue
        cfg = config(name, Path(root) / f"{name}-w{resume_from}-on-{world}", world)
        cfg.resume_from = str(Path(cfg.out) / K.name_of(CKPT))
        plain = build(cfg, rank, world, local_rank=0)
        K.load(plain, K.read(Path(cfg.resume_from)))
        elastic = build(cfg, rank, world, local_rank=0)
        member = SimpleNamespace(t=elastic, cfg=cfg, step=0, restart_data=lambda draws: None)
        elastic_checkpoints.load(member, SimpleNamespace(world=world, rank=rank, size=lambda: 1))
        out[name] = {"plain": copy.deepcopy(plain.run.state_dict()), "elastic": elastic.run.state_dict(),
                     "steps": (plain.step, elastic.step)}
        elastic.run.release()
        try:
            run_plain(plain, Path(cfg.out), quiet=True)
        finally:
            plain.run.close()
        out[name]["params"] = torch.cat([p.detach().reshape(-1) for p in plain.model.parameters()])
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """{workers after the resume: every rank's states}, and the runs' folder: 1 -> 2 and 2 -> 1."""
    root = tmp_path_factory.mktemp("runs")

    def copies(before: int, after: int) -> None:
        for name in SHARDED:  # the launcher's choice: taken, not refused
            found = K.latest(root / f"{name}-w{before}", config(name, root, after), after, warn=pytest.fail)
            assert (found.world, found.step, found.replicated) == (before, STEPS, False)
            shutil.copytree(root / f"{name}-w{before}", root / f"{name}-w{before}-on-{after}")
    run_dist(_life, 1, str(root), True, None, timeout=600)
    copies(1, 2)
    on_two = run_dist(_life, 2, str(root), True, 1, timeout=600)
    copies(2, 1)
    return {2: on_two, 1: run_dist(_life, 1, str(root), False, 2, timeout=600)}, root


def whole_by_hand(ckpt: Path, numel: int) -> dict:
    """What one worker holds after a re-cut of a 2-worker checkpoint of a model of `numel`
    parameters: rank 0's state with each sharded entry (optimizer moments, master copy) the two
    shards end to end, cut to the model's size; its own flat round buffer cut to that size; its
    flat gradient buffer zero."""
    found = K.read(ckpt)
    ranks = [K.read_state(found, r)["strategy"] for r in range(2)]
    state = ranks[0]
    joined = lambda get: torch.cat([get(st["parts"]) for st in ranks])[:numel]  # noqa: E731
    parts = state["parts"]
    moments = parts["optimizer"]["state"][0]
    for k, v in moments.items():
        if v.dim() == 1:
            moments[k] = joined(lambda st, k=k: st["optimizer"]["state"][0][k])
    if parts["master"] is not None:
        parts["master"] = joined(lambda st: st["master"])
    if "buffer" in parts:
        parts["buffer"] = parts["buffer"][:numel]
    parts["grads"] = torch.zeros(numel, dtype=parts["grads"].dtype)
    return state


def describe(x) -> str:
    if not torch.is_tensor(x):
        return repr(x)
    return f"{x.dtype} {tuple(x.shape)}, sum {x.double().sum().item():.6g}"


def difference(a, b, path: str = "") -> str | None:
    """The first path where two states differ (tensors bit for bit), None when equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        return next((d for k in a if (d := difference(a[k], b[k], f"{path}.{k}"))), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: {len(a)} != {len(b)} entries"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := difference(x, y, f"{path}.{i}"))), None)
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape \
            and torch.equal(a, b)
        return None if same else f"{path}: tensors differ ({describe(a)} against {describe(b)})"
    return None if a == b else f"{path}: {a!r} != {b!r}"


def trained_on(root: Path, run: str) -> list[int]:
    """The workers that trained each step of a run (steps.jsonl): the resumed run's after CKPT."""
    steps = [json.loads(line) for line in (root / run / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    return [len(r["per_rank"]["micro_batches"]) for r in steps]


@pytest.mark.parametrize("name", SHARDED)
def test_a_plain_resume_on_fewer_workers_recuts_as_the_elastic_path_does(name, resumed):
    states, root = resumed
    mine = states[1][0][name]
    assert mine["steps"] == (CKPT, CKPT)
    assert difference(mine["plain"], mine["elastic"]) is None, difference(mine["plain"], mine["elastic"])
    expected = whole_by_hand(root / f"{name}-w2" / K.name_of(CKPT), mine["params"].numel())
    assert difference(mine["plain"], expected) is None, difference(mine["plain"], expected)
    assert torch.isfinite(mine["params"]).all()
    assert trained_on(root, f"{name}-w2-on-1") == [2] * CKPT + [1] * (STEPS - CKPT)


@pytest.mark.parametrize("name", SHARDED)
def test_a_plain_resume_on_more_workers_cuts_the_whole_state_and_the_new_worker_joins(name, resumed):
    """From 1 worker on 2: each takes its shard of the one worker's state, as the elastic path
    cuts it; the second worker's own parts (its round buffer) start fresh, as a joiner's."""
    states, root = resumed
    whole = K.read_state(K.read(root / f"{name}-w1" / K.name_of(CKPT)), 0)["strategy"]
    for rank, ranks in enumerate(states[2]):
        mine = ranks[name]
        assert mine["steps"] == (CKPT, CKPT)
        assert difference(mine["plain"], mine["elastic"]) is None, difference(mine["plain"], mine["elastic"])
        numel = mine["params"].numel()
        size = -(-numel // 2)

        def shard(full: torch.Tensor) -> torch.Tensor:
            return torch.cat([full, full.new_zeros(2 * size - numel)])[rank * size:(rank + 1) * size]
        got, want = mine["plain"]["parts"], whole["parts"]
        moments = got["optimizer"]["state"][0]
        assert all(torch.equal(moments[k], shard(v) if v.dim() == 1 else v) for k, v in want["optimizer"]["state"][0].items())
        if want["master"] is not None:
            assert torch.equal(got["master"], shard(want["master"]))
        assert difference(got["model"], want["model"]) is None
        if rank == 1 and "buffer" in want:
            assert want["buffer"].any() and not got["buffer"].any()
        assert torch.isfinite(mine["params"]).all()
    assert trained_on(root, f"{name}-w1-on-2") == [1] * CKPT + [2] * (STEPS - CKPT)


def test_a_checkpoint_of_replicas_of_another_size_is_refused_in_one_line(resumed):
    _, root = resumed
    found = K.read(root / "zero1-w2" / K.name_of(CKPT))
    four_by_two = K.Found(found.path, CKPT, 4, False, per_replica=2)  # replicas of 2 processes
    cfg = config("zero1", root, 2)
    with pytest.raises(K.WorldSizeError, match=r"written by replicas of 2 process\(es\) and strategy 'zero1' keeps "
                                                r".* cannot be re-cut for replicas of 1; resume with --workers 4"):
        K.check_world(four_by_two, cfg, 2)
    K.check_world(K.Found(found.path, CKPT, 4, True, per_replica=2), cfg, 2)  # a replicated state is taken
