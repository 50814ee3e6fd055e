"""The contract every registered strategy keeps, checked over `available()`.

A new strategy is covered the moment its file registers it:
- it trains through the CLI at W=1 and W=2, and the bytes Comm counted equal its
  declared `comm_plan` (priced with the ring formulas of comm/wire.py), and the W=2
  run's trace.json nests on every lane (spans contain each other or are disjoint);
- `state_dict()` -> a fresh process -> `load_state_dict()` -> the next steps are
  bit-identical to a run that never stopped (parameters and the whole state);
- `close()` leaves no thread of its own alive;
- a bad value of each of its options exits 2 with one `error:` line naming it;
- driving it push-style (`backward(loss)` in a plain loop) equals the pull-style `step()`.
Strategies whose rounds adapt to timing (acco) run with their `reproducible_options`.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import lowcomm
from lowcomm.models.layout import layout_of
from lowcomm.cli.main import main
from lowcomm.diagnose.trace import comm_wire_bytes, nesting_errors
from lowcomm.run.driver import make_run
from lowcomm.strategies import available, get
from lowcomm.contract.options import cli_flag, type_name
from lowcomm.engines.overlap import OverlappedStrategy

from dist_utils import run_dist

STRATEGIES = available()
ACCUM = 2
SEQ, MICRO = 16, 2


def make_model() -> torch.nn.Module:
    return lowcomm.GPT(vocab_size=256, seq_len=SEQ, n_layer=1, n_head=2, d_model=16)


def batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(100_000 * step + 100 * rank + micro)
    seq = torch.randint(0, 256, (MICRO, SEQ + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def schedule(step: int) -> float:
    return 1e-2 * min(1.0, (step + 1) / 3)


def build(name: str, seed: int = 1234, make_opt=make_optimizer):
    torch.manual_seed(seed)
    model = make_model()
    strategy = make_run(name, model, lowcomm.Comm(), make_opt, accum=ACCUM,
                        schedule=schedule, **get(name).reproducible_options)
    return model, strategy


def pull_steps(strategy, rank: int, n: int) -> None:
    for _ in range(n):
        step, micro = strategy.steps_done, iter(range(1000))
        strategy.step(lambda: batch(step, rank, next(micro)), lowcomm.lm_loss)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def tensors(obj, prefix=""):
    """Every tensor in a nested state, by path (to compare two states entry by entry)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}/{i}")


# -- W=1 and W=2 through the CLI: counted bytes = the declared plan ---------------------------

def plan_bytes(name: str, params: int, world: int, steps: int, options: dict) -> int:
    cls = get(name)
    opts = cls.Options(**options).validate(name)
    layout = layout_of(make_model())  # the CLI run's model (same dims)
    assert layout.numel == params
    return sum(op.wire_bytes(world) * cls.cost.plan_occurrences(op, steps, opts)
               for op in cls.comm_plan(layout, world, opts))


def cli_option_flags(options: dict) -> list[str]:
    out = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("data") / "text.txt"
    p.write_text("It is a truth universally acknowledged, that a single man in possession "
                 "of a good fortune, must be in want of a wife.\n" * 80)
    return p


@pytest.mark.procs
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", STRATEGIES)
def test_cli_run_sends_exactly_its_comm_plan(name, world, tmp_path, text_file):
    steps = 5  # odd, and past dpu's warmup below, so transients are part of the count
    options = {**get(name).reproducible_options}
    extra = ["--dpu-warmup", "2"] if name == "dpu" else []  # the only strategy with a warmup today
    if name == "dpu":
        options["warmup_steps"] = 2
    out = tmp_path / "run"
    rc = main(["train", "--strategy", name, "--workers", str(world), "--steps", str(steps),
               "--accum", str(ACCUM), "--n-layer", "1", "--n-head", "2", "--d-model", "16",
               "--seq-len", str(SEQ), "--micro-batch", str(MICRO), "--eval-every", "0",
               "--eval-batches", "1", "--data", str(text_file), "--out", str(out), "--quiet",
               *cli_option_flags(get(name).reproducible_options), *extra,
               *(["--trace"] if world > 1 else [])])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    want = world * plan_bytes(name, summary["params"], world, steps, options)
    assert summary["wire_bytes_total"] == want, (summary["wire_bytes_total"], want)
    if world > 1:
        assert want > 0
        # Its trace draws properly: on every lane, spans nest (contain each other or are disjoint).
        trace = json.loads((out / "trace.json").read_text())
        assert comm_wire_bytes(trace) == want
        assert nesting_errors(trace) == []


# -- in two W=2 process groups for all strategies at once (spawning is the expensive part) ---

def _first_life(rank, world, names, path):
    """Per strategy: 10 steps pulled vs pushed; 3 steps, state saved, 3 more; threads after close()."""
    out = {}
    for name in names:
        before = set(threading.enumerate())
        model_pull, pull = build(name)
        pull_steps(pull, rank, 10)
        model_push, push = build(name)
        tokens = push_steps(push, rank, 10)
        model, strategy = build(name)
        pull_steps(strategy, rank, 3)
        torch.save(strategy.state_dict(), Path(path) / f"{name}-rank{rank}.pt")
        pull_steps(strategy, rank, 3)
        straight = (flat(model), strategy.state_dict())  # before close(): it may sync once more
        for s in (pull, push, strategy):
            s.close()
        left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
        out[name] = {"pull": flat(model_pull), "push": flat(model_push), "tokens": tokens,
                     "straight": straight, "threads_left": left}
    out["trainer"] = trainer_life(rank, world, path, resume=False)
    return out


def _second_life(rank, world, names, path):
    """Per strategy: a fresh process loads the saved state and takes the same 3 steps."""
    out = {}
    for name in names:
        model, strategy = build(name, seed=99)  # other parameters: the load must replace them
        strategy.load_state_dict(torch.load(Path(path) / f"{name}-rank{rank}.pt", weights_only=False))
        pull_steps(strategy, rank, 3)
        out[name] = (flat(model), strategy.state_dict())
        strategy.close()
    out["trainer"] = trainer_life(rank, world, path, resume=True)
    return out


def trainer_life(rank, world, path, resume: bool):
    """The trainer-level state (strategy + data position + RNG) of a real `lowcomm train`
    worker, for the most stateful strategy: resumed, its next steps equal the straight run's."""
    from lowcomm import config as C
    from lowcomm.train.worker import build
    cfg = C.RunConfig(strategy="acco", workers=world, micro_batch=MICRO, accum=ACCUM, steps=6,
                      data=C.DataConfig(source="pydoc"),
                      model=C.ModelConfig(n_layer=1, n_head=2, d_model=16, seq_len=SEQ))
    C.set_value(cfg, "acco.deterministic", True)
    C.validate(cfg)
    if resume:
        cfg.seed = 5  # other initial parameters and data order: the load must restore both
    t = build(cfg, rank, world, local_rank=0)
    file = Path(path) / f"trainer-rank{rank}.pt"
    if resume:
        t.load_state_dict(torch.load(file, weights_only=False))
    else:
        for _ in range(3):
            t.run.step(t.next_batch, lowcomm.lm_loss)
            t.step += 1
        torch.save(t.state_dict(), file)
    losses = []
    for _ in range(3):
        losses.append(t.run.step(t.next_batch, lowcomm.lm_loss).loss)
        t.step += 1
    t.run.close()
    return losses, flat(t.model), t.loader.state_dict()


def push_steps(strategy, rank: int, n: int) -> list[int]:
    """n optimizer steps driven push-style, as a `lowcomm.wrap()` user's loop does."""
    tokens = []
    while strategy.steps_done < n:
        step, micro = strategy.steps_done, 0
        while True:
            loss = lowcomm.lm_loss(strategy.train_model, batch(step, rank, micro))
            micro += 1
            result = strategy.backward(loss)
            if result is not None:
                tokens.append(result.tokens)
                break
    return tokens


@pytest.fixture(scope="module")
def lives(tmp_path_factory):
    path = tmp_path_factory.mktemp("states")
    first = run_dist(_first_life, 2, STRATEGIES, str(path), timeout=600)
    second = run_dist(_second_life, 2, STRATEGIES, str(path), timeout=600)
    return first, second


@pytest.mark.procs
@pytest.mark.parametrize("name", STRATEGIES)
def test_state_round_trip_continues_bit_identically(name, lives):
    first, second = lives
    for rank in range(2):
        params_a, state_a = first[rank][name]["straight"]
        params_b, state_b = second[rank][name]
        assert torch.equal(params_a, params_b), f"rank {rank}: parameters differ after resuming"
        a, b = dict(tensors(state_a)), dict(tensors(state_b))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"rank {rank}: state entry {key} differs after resuming"
        assert state_a["steps_done"] == state_b["steps_done"] == 6


@pytest.mark.procs
def test_trainer_state_resumes_data_position_and_strategy(lives):
    first, second = lives
    for rank in range(2):
        straight, resumed = first[rank]["trainer"], second[rank]["trainer"]
        assert straight[0] == resumed[0], "losses of the 3 steps after resuming differ"
        assert torch.equal(straight[1], resumed[1]) and straight[2] == resumed[2]


@pytest.mark.procs
@pytest.mark.parametrize("name", STRATEGIES)
def test_push_style_equals_step(name, lives):
    for rank_out in lives[0]:
        r = rank_out[name]
        err = float((r["push"] - r["pull"]).norm() / r["pull"].norm())
        assert err <= 1e-6, f"{name}: a wrap()-style loop differs from step() by {err:.2e}"
        assert all(t >= ACCUM * MICRO * SEQ for t in r["tokens"]), r["tokens"]  # counted by the forward hook


@pytest.mark.procs
@pytest.mark.parametrize("name", STRATEGIES)
def test_close_leaves_no_thread(name, lives):
    for rank_out in lives[0]:
        assert rank_out[name]["threads_left"] == [], f"threads left after close(): {rank_out[name]['threads_left']}"


# -- options: bad values exit 2 with one line; flags of other strategies are refused ---------

def bad_values(f) -> list[str]:
    meta, typ = f.metadata, type_name(f)
    bad = {"bool": ["maybe"], "int": ["1.5x"], "float": ["fast"], "str": []}[typ]
    if meta.get("choices"):
        bad.append("bogus")
    if meta.get("min") is not None:
        bad.append(str(meta["min"] - 1))
    if meta.get("above") is not None:
        bad.append(str(meta["above"]))
    return bad


OPTION_CASES = [(name, f, value) for name in STRATEGIES for f in fields(get(name).Options)
                for value in bad_values(f)]


@pytest.mark.parametrize("name,f,value", OPTION_CASES,
                         ids=[f"{n}{cli_flag(f)}={v}" for n, f, v in OPTION_CASES])
def test_bad_option_value_exits_2_with_one_line(name, f, value, tmp_path, capsys):
    out = tmp_path / "run"
    flag = cli_flag(f)
    argv = [f"{flag}={value}"] if type_name(f) != "bool" else []
    if type_name(f) == "bool":  # a switch on the CLI: the bad value comes from TOML
        toml = tmp_path / "run.toml"
        toml.write_text(f'[{name}]\n{f.name} = "{value}"\n')
        argv = ["--config", str(toml)]
    rc = main(["train", "--strategy", name, "--steps", "1", "--out", str(out), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert value in err[0] and (flag in err[0] or f.name in err[0]), err[0]
    assert not out.exists()


def test_an_option_of_another_strategy_is_refused(tmp_path, capsys):
    ddp_flag = cli_flag(fields(get("ddp").Options)[0])
    other = next(s for s in STRATEGIES if ddp_flag not in {cli_flag(f) for f in fields(get(s).Options)})
    rc = main(["train", "--strategy", other, ddp_flag, "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and f"{ddp_flag} does not apply to strategy '{other}'" in err and "ddp" in err


def test_python_api_defaults_are_the_cli_defaults():
    from lowcomm import config as C
    for name in STRATEGIES:
        cfg = C.RunConfig(strategy=name)
        C.validate(cfg)
        assert cfg.strategy_options() == get(name).Options().validate(name)


# -- ending a user's loop, param groups, a replaced group: every strategy, one W=2 spawn ------

LOOP_LENGTHS = (5, 7, 8, 11)  # backward() calls per rank: mid-step, step boundaries, adaptive rounds


def grouped_optimizer(params):
    """The common recipe's shape: no decay (and here no learning) on biases and norms, decay on the rest."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() < 2], "lr": 0.0, "weight_decay": 0.0},
                              {"params": [p for p in params if p.dim() >= 2]}], lr=1e-2, weight_decay=0.1)


def matrices_only_optimizer(params):
    """The same run with the lr-0 group left out of the optimizer: its tensors are frozen instead."""
    return torch.optim.AdamW([p for p in params if p.dim() >= 2], lr=1e-2, weight_decay=0.1)


def _ends_and_groups(rank, world, names):
    """Per strategy: loops of equal length on every rank ended by close(), with the default
    (timing-dependent) options and a 3x slower rank 1; a run with two param groups, and the
    same run with the lr-0 group frozen; a run whose Comm is replaced after 3 steps."""
    from lowcomm.comm.pacer import Pacer
    out = {}
    for name in names:
        ends = []
        for n in LOOP_LENGTHS:
            torch.manual_seed(7)
            model = make_model()
            # total_steps: a length the loop never reaches (onebit_adam's default warm-up is a
            # fifth of the run, so it needs one; DiLoCo's last sync is at that step)
            run = lowcomm.make_run(name, model, lowcomm.Comm(), make_optimizer, accum=ACCUM, total_steps=1000,
                                   pacer=Pacer(rank, world, slowdown=3.0 if rank == 1 else 1.0))
            for micro in range(n):
                run.backward(lowcomm.lm_loss(run.model, batch(0, rank, micro)))
            run.close()
            ends.append(flat(model))
        grouped = build(name, make_opt=grouped_optimizer)
        pull_steps(grouped[1], rank, 4)
        grouped[1].close()
        frozen_model = make_model_seeded(1234)
        for p in frozen_model.parameters():
            p.requires_grad_(p.dim() >= 2)
        frozen = lowcomm.make_run(name, frozen_model, lowcomm.Comm(), matrices_only_optimizer, accum=ACCUM,
                                  schedule=schedule, **get(name).reproducible_options)
        pull_steps(frozen, rank, 4)
        frozen.close()
        straight, swapped = build(name), build(name)
        pull_steps(straight[1], rank, 6)
        pull_steps(swapped[1], rank, 3)
        swapped[1].use_comm(lowcomm.Comm())
        pull_steps(swapped[1], rank, 3)
        out[name] = {"ends": ends, "initial": flat(make_model_seeded(1234)), "grouped": flat(grouped[0]),
                     "frozen": flat(frozen_model), "straight": flat(straight[0]), "swapped": flat(swapped[0])}
        for _, run in (straight, swapped):
            run.close()
    return out


def make_model_seeded(seed: int):
    torch.manual_seed(seed)
    return make_model()


@pytest.fixture(scope="module")
def ends_and_groups():
    return run_dist(_ends_and_groups, 2, STRATEGIES, timeout=600)


@pytest.mark.procs
@pytest.mark.parametrize("name", STRATEGIES)
def test_close_ends_a_users_loop_on_the_same_parameters_everywhere(name, ends_and_groups):
    """Equal backward() counts on every rank, adaptive rounds, a slow rank: close() agrees on a
    last round, drains it, and every rank holds the same final parameters."""
    rank0, rank1 = ends_and_groups[0][name]["ends"], ends_and_groups[1][name]["ends"]
    for n, a, b in zip(LOOP_LENGTHS, rank0, rank1):
        assert torch.equal(a, b), f"{name}: ranks end a loop of {n} backward() calls on different parameters"


# Strategies that compress across tensor boundaries (a flat vector's blocks or chunks): leaving
# tensors out changes what is compressed, so only the frozen group is compared exactly.
CROSS_TENSOR_COMPRESSION = {"quantized", "sparseloco", "onebit_adam"}


@pytest.mark.procs
@pytest.mark.parametrize("name", STRATEGIES)
def test_each_param_group_keeps_its_own_lr_and_weight_decay(name, ends_and_groups):
    """AdamW with biases and norms at lr 0 / no decay and the matrices at lr 1e-2 / decay 0.1:
    the first group never moves, and the matrices train exactly as when the first group is frozen."""
    model = make_model()
    is_matrix = torch.cat([torch.full((p.numel(),), p.dim() >= 2) for p in model.parameters()])
    for r in ends_and_groups:
        got = r[name]
        assert torch.equal(got["grouped"][~is_matrix], got["initial"][~is_matrix]), "the lr-0 group moved"
        assert not torch.equal(got["grouped"][is_matrix], got["initial"][is_matrix]), "the matrices did not train"
        if name not in CROSS_TENSOR_COMPRESSION:
            torch.testing.assert_close(got["grouped"], got["frozen"], rtol=1e-5, atol=1e-6)


@pytest.mark.procs
@pytest.mark.parametrize("name", STRATEGIES)
def test_a_replaced_comm_between_steps_continues_bit_identically(name, ends_and_groups):
    """The driver's one place where a run's group changes (use_comm), exercised with the same
    group: the run goes on exactly as if nothing had changed."""
    for r in ends_and_groups:
        assert torch.equal(r[name]["straight"], r[name]["swapped"])


# -- a rank that closes first serves the rounds its peers still start ---------------------------

# Strategies whose rounds run beside compute: a peer may start rounds after this rank has closed
# (adaptive acco ends equal backward() counts on different round counts). Forced here without
# timing: their reproducible options fix the rounds, rank 0 stops after CLOSER calls, rank 1 goes
# on for PEER calls, and only once rank 0 has entered close() (a file it writes just before).
ROUNDS_IN_FLIGHT = [n for n in STRATEGIES if issubclass(get(n), OverlappedStrategy)]
ROUND_OPTIONS = {"dpu": {"warmup_steps": 2}}  # delayed rounds from step 3 (DPU's default warm-up is 10)
CLOSER, PEER = (5, 6), 13  # rank 0 ends at a step boundary / mid-step; rank 1 six rounds in


def _close_early(rank, world, names, path):
    out = {}
    for name, n, alone in [(name, n, alone) for name in names for n in CLOSER for alone in (True, False)]:
        torch.manual_seed(7)
        model = make_model()
        run = lowcomm.make_run(name, model, lowcomm.Comm(), make_optimizer, accum=ACCUM, schedule=schedule,
                               **get(name).reproducible_options, **ROUND_OPTIONS.get(name, {}))
        closing = Path(path) / f"{name}-{n}-{alone}.closing"
        for micro in range(n if rank == 0 or alone else PEER):
            if micro == n:  # rank 1 goes on only once rank 0 is in close()
                while not closing.exists():
                    time.sleep(0.01)
            run.backward(lowcomm.lm_loss(run.model, batch(0, rank, micro)))
        if rank == 0:
            closing.touch()
        run.close()
        out[(name, n, alone)] = (flat(model), run.steps_done)
    return out


@pytest.fixture(scope="module")
def closed_early(tmp_path_factory):
    return run_dist(_close_early, 2, ROUNDS_IN_FLIGHT, str(tmp_path_factory.mktemp("closing")), timeout=120)


@pytest.mark.procs
@pytest.mark.parametrize("name", ROUNDS_IN_FLIGHT)
def test_a_closed_rank_serves_the_rounds_its_peer_still_starts(name, closed_early):
    """Rank 0 closes after 5 or 6 backward() calls while rank 1 makes 13: rank 0 takes part in
    rank 1's further rounds (before, it waited in close()'s agreement while rank 1 waited in a
    round: a hang). Both end on the same parameters and step count, and rank 1's extra
    micro-batches were applied (the parameters differ from both ranks stopping early)."""
    for n in CLOSER:
        (p0, steps0), (p1, steps1) = (closed_early[r][(name, n, False)] for r in (0, 1))
        assert torch.equal(p0, p1), f"{name}: ranks end on different parameters (rank 0 closed after {n})"
        assert steps0 == steps1, (name, n, steps0, steps1)
        alone = closed_early[0][(name, n, True)][0]
        assert torch.equal(alone, closed_early[1][(name, n, True)][0])
        assert not torch.equal(p0, alone), f"{name}: rank 1's rounds after rank 0 closed were not applied"


def groups_without_a_top_level_lr(params):
    """Each group names its own lr; the optimizer's `lr` is then torch's default (1e-3)."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "lr": 1e-2},
                              {"params": [p for p in params if p.dim() < 2], "lr": 1e-3, "weight_decay": 0.0}])


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_schedule_scales_each_groups_own_initial_lr(name):
    """schedule(i) is the lr of the group with the largest initial lr, the other keeps its
    tenth of it, and the step's reported lr is what that group steps at (one process, no group)."""
    decaying = lambda i: 1e-2 / (i + 2)  # noqa: E731 -- differs from every initial lr at every step
    model = make_model_seeded(1234)
    run = make_run(name, model, lowcomm.Comm(), groups_without_a_top_level_lr, accum=ACCUM, schedule=decaying,
                   total_steps=1000, **get(name).reproducible_options)
    for _ in range(3):
        step, micro = run.steps_done, iter(range(1000))
        result = run.step(lambda: batch(step, 0, next(micro)), lowcomm.lm_loss)
        # the scheduled groups (diloco's outer SGD is not scheduled)
        groups = [g for opt in run.optimizers() for g in opt.param_groups if "initial_lr" in g]
        assert len(groups) >= 2 and result.lr < 1e-2
        for g in groups:
            want = result.lr if g["initial_lr"] == 1e-2 else result.lr / 10
            assert g["lr"] == pytest.approx(want, rel=1e-12), (g["initial_lr"], g["lr"], result.lr)
    run.close()


def test_a_shard_holding_only_a_lower_groups_values_is_scheduled_as_the_whole_set():
    """A sharded strategy's rank whose shard holds only the 1e-3 group's values still steps it at a
    tenth of the schedule: the largest initial lr is the run's, not this shard's (else ranks differ)."""
    from lowcomm.contract.context import apply_schedule
    from lowcomm.engines.flat import FlatModel, ShardOptimizer, param_groups_of
    model = make_model_seeded(1234)
    params = list(model.parameters())
    reference = groups_without_a_top_level_lr(params)
    groups = param_groups_of(reference, params)
    ends = [sum(p.numel() for _, ps in groups[:g + 1] for p in ps) for g in range(len(groups))]
    world = -(-ends[-1] // (ends[-1] - ends[0])) + 1  # the last shard inside the last group
    flat = FlatModel(model, [p for _, ps in groups for p in ps], world, world - 1, group_ends=ends)
    assert [g for g, _, _ in flat.own_pieces()] == [1]
    shard = ShardOptimizer(flat, groups_without_a_top_level_lr, reference)
    assert apply_schedule([shard.optimizer], lambda i: 4e-3, 0) == 4e-3
    assert shard.optimizer.param_groups[0]["lr"] == pytest.approx(4e-4, rel=1e-12)
