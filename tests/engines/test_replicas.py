"""Replica groups (--replicas R of --workers W, ddp or fsdp inside each replica), every strategy.

Exact reduction: R replicas of K processes at micro-batch m, the replica's processes splitting
what one worker would read, equal R single-process workers at micro-batch K·m (same seed:
final parameters within 1e-6), and the K cross-replica groups together send what the R workers
send. For every registered strategy that runs across replicas, with each engine it runs with
inside (ddp: the tensors each position owns; fsdp: FSDP2's shards), in one W=4 spawn: (2, 2)
against (2, 1) on the replicas' first ranks, plus bytes per level against the level plans (with
fsdp inside, also a run resumed mid-way from its state_dict(), bit-identical). The CLI runs check summary.json's levels at (R, K) = (2, 2), (2, 1) and (1, 2). What cannot run is
refused in one line, exit 2, nothing written.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from dist_utils import rel_err, run_dist

import lowcomm
from lowcomm.checkpoint import read, read_state
from lowcomm.cli.main import main
from lowcomm.comm.control import register_control
from lowcomm.comm.groups import ReplicaLayout, form
from lowcomm.engines.inside import inside_level_plans
from lowcomm.metrics.levels import planned_bytes
from lowcomm.models.layout import layout_of
from lowcomm.plan.levels import replica_state_bytes
from lowcomm.run.driver import make_run
from lowcomm.strategies import available, get

# -- every strategy in one W=4 spawn: (2, 2) against (2, 1) ------------------------------------

R, K, MICRO, SEQ, ACCUM, N_STEPS = 2, 2, 2, 16, 2, 4
# (strategy, engine inside), one row each: every strategy with every engine it runs with
ACROSS = [(n, inside) for inside in ("ddp", "fsdp") for n in available() if get(n).runs_inside(inside)]
IDS = [f"{n}-{inside}" for n, inside in ACROSS]
LOCAL_SGD = {"sync_every": 2, "sync_by": "steps"}
OPTIONS = {"diloco": LOCAL_SGD, "sparseloco": LOCAL_SGD,
           "streaming_diloco": {**LOCAL_SGD, "fragments": 2, "fragment_delay": 1},
           "onebit_adam": {"freeze_variance_after": 2},  # 1-bit from step 3
           "powersgd": {"start": 2},  # compressed from step 3
           "dpu": {"warmup_steps": 2}}  # delayed from step 3: its first delayed step starts no round
# The compressors that round run in float64 here: the replica's mean gradient and a single worker's
# differ in the last bits (4.9e-8 for ddp), so in float32 an element within that of a quantization
# boundary can take the other level, and Adam carries the difference on (quantized: 4.9e-4 on one
# machine, 9e-8 on another). In float64 no element comes that close (quantized: 5.9e-9). 1-bit Adam
# sends signs: a momentum within rounding of zero may still take the other sign and move by its
# block's scale (float64 1.3e-6, float32 5.9e-6 and 1.1e-5 on two machines).
DTYPE = {"quantized": torch.float64, "onebit_adam": torch.float64}
# With fsdp inside a position compresses its shards (torch.chunk's rows: every tensor here has a
# multiple of 16 rows or values, so each shard at K = 2 is a multiple of 8 of the tensor's rows).
# Blocks and chunks of 8 are then the ones a single worker's vector or tensor has, each compressed
# as that worker's is: quantization blocks, SparseLoCo's top-k chunks (absmax values: a scale per
# chunk, where its default statistics are a whole tensor's), DeMo's DCT chunks of 8 per dimension.
FSDP_OPTIONS = {"quantized": {"block_size": 8}, "onebit_adam": {"block_size": 8}, "demo": {"chunk": 8, "topk": 4},
                "sparseloco": {**LOCAL_SGD, "outer_compress": "topk:2,chunk:8,bits:8"}}
TOLERANCE = {"onebit_adam": 5e-5}
# Bytes: the blockwise compressors pad each position's piece to whole blocks on R ranks
# (a few per cent on this small model); the overlapped rounds send a micro-batch count per group.
BYTES_SLACK = {"quantized": 0.1, "onebit_adam": 0.1}
ROUNDS_PER_STEP = {"acco": 2}  # acco's step is an estimate and a real round, each with its count


def _model():
    return lowcomm.GPT(vocab_size=256, seq_len=SEQ, n_layer=1, n_head=2, d_model=16)


def _batch(step: int, worker: int, micro: int, rows: slice):
    """Micro-batch `micro` of worker `worker` (K·MICRO rows), the rows `rows` of it."""
    g = torch.Generator().manual_seed(100_000 * step + 100 * worker + micro)
    seq = torch.randint(0, 256, (K * MICRO, SEQ + 1), generator=g)[rows]
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _options(name, inside="ddp"):
    return {**get(name).reproducible_options, **OPTIONS.get(name, {}),
            **(FSDP_OPTIONS.get(name, {}) if inside == "fsdp" else {})}


def _start(name, comm, replica, inside):
    torch.manual_seed(1234)
    model = _model().to(DTYPE.get(name, torch.float32))
    return model, make_run(name, model, comm, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
                           accum=ACCUM, schedule=lambda step: 1e-2 * min(1.0, (step + 1) / 3),
                           total_steps=N_STEPS, replica=replica, inside=inside, **_options(name, inside))


def _train(name, comm, replica, worker: int, rows: slice, inside="ddp", resume_at=None):
    """The final parameters, whole; `resume_at`: stopped after that step and resumed from its
    state_dict() in a fresh model and run."""
    model, run = _start(name, comm, replica, inside)
    for _ in range(N_STEPS):
        if run.steps_done == resume_at:
            state = copy.deepcopy(run.state_dict())
            run.release()
            model, run = _start(name, comm, replica, inside)
            run.load_state_dict(state)
        step, micro = run.steps_done, iter(range(1000))
        run.step(lambda: _batch(step, worker, next(micro), rows), lowcomm.lm_loss)
    run.close()
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]  # fsdp: gathered
    return torch.cat([p.detach().reshape(-1).clone() for p in whole])


def _replica_life(rank, world, cases):
    layout = ReplicaLayout(world, R)
    levels = form(layout)
    # The reference: the replicas' first ranks as R single workers (the others idle).
    ref, _ = dist.new_subgroups_by_enumeration(layout.cross_ranks())
    control, _ = dist.new_subgroups_by_enumeration(layout.cross_ranks(), backend="gloo")
    register_control(ref, control)
    out, flats = {}, {}
    for name, inside in cases:
        before = {c.level: c.snapshot().wire_bytes for c in (levels.intra, levels.cross)}
        p = layout.position(rank)
        grouped = _train(name, levels.cross, levels.intra, layout.replica(rank), slice(p * MICRO, (p + 1) * MICRO),
                         inside)
        counted = {c.level: c.snapshot().wire_bytes - before[c.level] for c in (levels.intra, levels.cross)}
        resumed = _train(name, levels.cross, levels.intra, layout.replica(rank), slice(p * MICRO, (p + 1) * MICRO),
                         inside, resume_at=N_STEPS // 2) if inside == "fsdp" else None
        options = tuple(sorted(_options(name, inside).items()))
        if p == 0 and (name, options) not in flats:  # one reference per strategy and options
            comm = lowcomm.Comm(ref)
            flats[name, options] = (_train(name, comm, None, layout.replica(rank), slice(None), inside),
                                    comm.snapshot().wire_bytes)
        flat, flat_bytes = flats.get((name, options), (None, 0))
        out[f"{name}-{inside}"] = {"grouped": grouped, "counted": counted, "flat": flat, "flat_bytes": flat_bytes,
                                   "resumed": resumed}
    out["zero1-fsdp-state"] = _held_bytes(levels, layout.replica(rank), slice(p * MICRO, (p + 1) * MICRO))
    out["demo-one-row"] = _refusal(lambda: make_run("demo", torch.nn.Linear(16, 1), levels.cross, torch.optim.AdamW,
                                                    replica=levels.intra, inside="fsdp"))
    return out


def _held_bytes(levels, worker: int, rows: slice) -> int:
    """Bytes zero1 holds per rank with fsdp inside, after a step: FSDP's shards of θ and of ∇θ
    (FSDP holds those from the backward to the reduce), the flat copies and the optimizer's state."""
    _, run = _start("zero1", levels.cross, levels.intra, "fsdp")
    micro = iter(range(1000))
    run.step(lambda: _batch(0, worker, next(micro), rows), lowcomm.lm_loss)
    s = run.strategy
    held = 2 * sum(p.numel() * p.element_size() for p in s.params) + s.optimizer_state_bytes() + sum(
        t.numel() * t.element_size() for t in (s.flat.params, s.flat.grads))
    run.close()
    return held


def _refusal(call) -> str:
    """What `call()` raised, as "Type: message" ("accepted" if nothing)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 -- its test says which
        return f"{type(e).__name__}: {e}"
    return "accepted"


@pytest.fixture(scope="module")
def replica_runs():
    return run_dist(_replica_life, R * K, ACROSS, timeout=600)


def _planned(name, inside, level):
    cls = get(name)
    cls = cls.fsdp_form() if inside == "fsdp" and hasattr(cls, "fsdp_form") else cls  # ddp's is HSDP
    options = cls.Options(**_options(name, inside)).validate(name)
    plans = inside_level_plans(inside, cls, layout_of(_model()), R, K, options, ACCUM)
    if level == "intra":
        # FSDP gathers and reduces in the parameters' dtype; its plan prices fp32, what runs train in
        itemsize = DTYPE.get(name, torch.float32).itemsize if inside == "fsdp" else 4
        return planned_bytes([plans.intra], K, R, lambda op: cls.cost.intra_occurrences(op, N_STEPS, options)) * itemsize // 4
    return planned_bytes(plans.cross, R, K, lambda op: cls.cost.plan_occurrences(op, N_STEPS, options))


@pytest.mark.procs
@pytest.mark.parametrize("name,inside", ACROSS, ids=IDS)
def test_every_strategy_across_replicas_equals_one_worker_per_replica(name, inside, replica_runs):
    case, tolerance = f"{name}-{inside}", TOLERANCE.get(name, 1e-6)
    for rank, out in enumerate(replica_runs):  # rank r·K + p holds what worker r holds
        reference = replica_runs[rank - rank % K][case]["flat"]
        assert rel_err(out[case]["grouped"], reference) <= tolerance, (case, rank)
    cross = sum(out[case]["counted"]["cross"] for out in replica_runs)
    flat = sum(out[case]["flat_bytes"] for out in replica_runs)
    # the K groups together send what the R workers send
    counts = 16 * R * N_STEPS * ROUNDS_PER_STEP.get(name, 1) * (K - 1)
    assert abs(cross - flat) <= BYTES_SLACK.get(name, 0) * flat + counts, (cross, flat)


@pytest.mark.procs
@pytest.mark.parametrize("name,inside", ACROSS, ids=IDS)
def test_every_strategy_sends_its_level_plans(name, inside, replica_runs):
    for level in ("intra", "cross"):
        counted = sum(out[f"{name}-{inside}"]["counted"][level] for out in replica_runs)
        assert counted == _planned(name, inside, level), (name, inside, level)


FSDP = [case for case in ACROSS if case[1] == "fsdp"]


@pytest.mark.procs
@pytest.mark.parametrize("name,inside", FSDP, ids=[f"{n}-{inside}" for n, inside in FSDP])
def test_a_run_resumed_mid_way_ends_where_the_uninterrupted_one_does(name, inside, replica_runs):
    """With fsdp inside a rank's state holds its shards (the zero1 family: its flat copy of them
    too), and a fresh FSDP model loads them: the resumed run continues bit-identically."""
    for rank, out in enumerate(replica_runs):
        assert torch.equal(out[f"{name}-{inside}"]["resumed"], out[f"{name}-{inside}"]["grouped"]), (name, rank)


@pytest.mark.procs
def test_demo_refuses_a_tensor_a_shard_would_hold_no_row_of(replica_runs):
    """A (1, 16) weight at K = 2: rank 1's FSDP shard of it is empty and DeMo's DCT has no chunk
    there; every rank refuses alike, in one line, before any step."""
    for out in replica_runs:
        assert out["demo-one-row"].startswith("UsageError: demo with --inside fsdp: a tensor of shape (1, 16)"), \
            out["demo-one-row"]
        assert "\n" not in out["demo-one-row"]


@pytest.mark.procs
def test_the_planners_memory_with_fsdp_inside_is_what_zero1_holds(replica_runs):
    """`lowcomm plan`'s memory column: with fsdp inside zero1 keeps a flat copy of its shards."""
    cls = get("zero1")
    planned = replica_state_bytes(cls, layout_of(_model()), R * K, R, cls.Options().validate("zero1"), "fsdp")
    for out in replica_runs:
        assert out["zero1-fsdp-state"] == pytest.approx(planned, rel=0.02)


# -- through the CLI: summary.json's levels -------------------------------------------------

STEPS = 4
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife.\n") * 80
# (workers, replicas, micro-batch): (2, 2) replicas of 2, (2, 1) the flat reference, (1, 2)
LAYOUTS = {"2x2": (4, 2, 2), "2x1": (2, 2, 4), "1x2": (2, 1, 2)}
EXTRA = {"ddp": [], "diloco": ["--sync-every", "2", "--sync-by", "steps"]}


def _argv(data, out, strategy, workers, replicas, micro):
    return ["train", "--strategy", strategy, "--workers", str(workers), "--replicas", str(replicas),
            "--micro-batch", str(micro), "--steps", str(STEPS), "--n-layer", "2", "--n-head", "2",
            "--d-model", "16", "--seq-len", "16", "--eval-every", "0", "--eval-batches", "1",
            "--data", str(data), "--out", str(out), "--quiet", "--checkpoint-every", str(STEPS),
            *EXTRA[strategy]]


def _params(out, rank):
    model = read_state(read(sorted(out.glob("ckpt-*"))[-1]), rank)["strategy"]["parts"]["model"]
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


@pytest.mark.procs
@pytest.mark.parametrize("strategy", list(EXTRA))
def test_replicas_of_k_equal_one_worker_at_k_times_the_micro_batch(runs, strategy):
    (grouped, params), (flat, reference) = runs[strategy, "2x2"], runs[strategy, "2x1"]
    for rank, p in enumerate(params):  # rank r·K + p holds what worker r holds
        assert rel_err(p, reference[rank // 2]) <= 1e-6, (strategy, rank)
    assert grouped["tokens"] == flat["tokens"]
    cross = grouped["levels"]["cross"]
    assert cross["groups"] == 2 and cross["ranks_per_group"] == 2
    # each position syncs its part: the K groups together send what the R workers send
    assert cross["wire_bytes"] == flat["levels"]["cross"]["wire_bytes"]
    assert flat["levels"]["intra"]["wire_bytes"] == 0 and grouped["levels"]["intra"]["wire_bytes"] > 0


@pytest.mark.procs
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
    "fsdp": (["--strategy", "powersgd", "--replicas", "2", "--inside", "fsdp"], ("powersgd", "--inside fsdp")),
    "bf16_flat": (["--strategy", "zero1", "--replicas", "2", "--param-dtype", "bf16"], ("--param-dtype bf16",)),
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
