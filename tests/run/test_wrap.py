"""`lowcomm.wrap()`: the user's loop drives any strategy; misuse gets one-line errors;
a transformers model trains through it and through `lowcomm train --model hf:...`.

(That every registered strategy gives the same parameters driven push-style as
through `step()` is in tests/test_contract.py, over the registry.)
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import lowcomm
from lowcomm import UsageError
from lowcomm.cli.main import main

from dist_utils import rel_err, run_dist

TEXT = ("Now is the winter of our discontent made glorious summer by this sun of York; "
        "and all the clouds that lour'd upon our house in the deep bosom of the ocean buried. ") * 40


def text_batch(step: int, rank: int, seq: int = 32, rows: int = 4) -> dict:
    """A transformers-style batch of byte windows: labels aligned with input_ids (the model shifts)."""
    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    g = torch.Generator().manual_seed(1000 * step + rank)
    starts = torch.randint(0, len(data) - seq, (rows,), generator=g)
    ids = torch.stack([data[s:s + seq] for s in starts])
    return {"input_ids": ids, "labels": ids.clone()}


def _hf_through_wrap(rank, world):
    pytest.importorskip("transformers")
    out = {}
    for strategy, options in (("zero1", {}), ("acco", {"deterministic": True})):
        torch.manual_seed(0)
        model = lowcomm.build_hf_causal_lm("gpt2", vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=64)
        losses = []
        with lowcomm.wrap(model, lambda p: torch.optim.AdamW(p, lr=3e-3), strategy, accum=2, **options) as run:
            step = 0
            while run.steps < 30:
                loss = run.model(**text_batch(step, rank)).loss  # the PreTrainedModel's own loss
                step += 1
                if run.backward(loss) is not None:
                    losses.append(run.result.loss)
                    assert run.stepped and run.result.tokens >= 2 * 4 * 32
            with run.evaluating() as m, torch.no_grad():
                val = float(m(**text_batch(10_000, rank)).loss)
        out[strategy] = (losses, val)
    # ddp's forward must go through the wrapper: bypassing it is refused, not silently unsynced
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    run = lowcomm.wrap(net, lambda p: torch.optim.SGD(p, lr=0.1), "ddp")
    try:
        run.backward(net(torch.randn(2, 4)).pow(2).mean())
        out["bypass"] = None
    except UsageError as e:
        out["bypass"] = str(e)
    run.close()
    return out


@pytest.fixture(scope="module")
def hf_runs():
    pytest.importorskip("transformers")
    return run_dist(_hf_through_wrap, 2, timeout=300)


@pytest.mark.procs
@pytest.mark.parametrize("strategy", ["zero1", "acco"])
def test_transformers_gpt2_trains_through_wrap(hf_runs, strategy):
    for rank_out in hf_runs:
        losses, val = rank_out[strategy]
        first, last = losses[0], sum(losses[-3:]) / 3  # first: mostly at θ_0 (acco's real round is at θ̃_1)
        assert first > 5.0 and last < first - 1.0, f"{strategy}: loss {first:.3f} -> {last:.3f}"
        assert val < first - 1.0


@pytest.mark.procs
def test_ddp_refuses_a_forward_that_bypassed_its_wrapper(hf_runs):
    assert "run the forward on run.model" in hf_runs[0]["bypass"]


@pytest.mark.procs
def test_cli_trains_a_transformers_model(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "run"
    rc = main(["train", "--model", "hf:gpt2", "--n-layer", "2", "--n-head", "2", "--d-model", "64",
               "--seq-len", "32", "--steps", "4", "--eval-every", "2", "--eval-batches", "1",
               "--strategy", "zero1", "--out", str(out), "--quiet"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["model"] == "hf:gpt2" and s["strategy"] == "zero1" and s["steps"] == 4
    assert s["final_val_loss"] < 5.6 and s["wire_bytes_total"] > 0


@pytest.mark.parametrize("argv,needle", [
    (["--model", "hf:no_such_arch"], "no_such_arch"),
    (["--model", "hf:"], "names no architecture"),
    (["--model", "hf:gpt2", "--d-model", "30", "--n-head", "4"], "--d-model 30 must be divisible by --n-head 4"),
])
def test_bad_hf_model_exits_2(argv, needle, tmp_path, capsys):
    pytest.importorskip("transformers")
    rc = main(["train", *argv, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run").exists()


def test_without_transformers_the_hf_model_says_what_to_install(tmp_path, monkeypatch, capsys):
    """A Python where `import transformers` fails: exit 2 and the install line, nothing written."""
    import sys
    monkeypatch.setitem(sys.modules, "transformers", None)  # how Python marks a module that cannot be imported
    code = main(["train", "--model", "hf:gpt2", "--out", str(tmp_path / "run")])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install" in lines[0] and "lowcomm[hf]" in lines[0], lines
    assert not (tmp_path / "run").exists()


# -- misuse, on one process without a group ------------------------------------------------

def _run(strategy="zero1", **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, lowcomm.wrap(model, lambda p: torch.optim.SGD(p, lr=0.1), strategy, **kw)


def _loss(run):
    return run.model(torch.randn(3, 4)).pow(2).mean()


def test_backward_twice_on_one_loss_is_refused():
    _, run = _run(accum=2)
    loss = _loss(run)
    run.backward(loss)
    with pytest.raises(UsageError, match="backward\\(\\) was called twice on the same loss"):
        run.backward(loss)
    run.close()


@pytest.mark.parametrize("strategy", ["zero1", "acco", "dpu"])
def test_zero_grad_on_a_sharded_model_is_refused(strategy):
    model, run = _run(strategy)
    with pytest.raises(UsageError, match=f"do not call zero_grad\\(\\) on a model trained with '{strategy}'"):
        model.zero_grad()
    run.close()
    model.zero_grad()  # after close() the model is the user's again


def test_acco_max_accum_below_accum_is_refused_as_on_the_cli():
    with pytest.raises(UsageError, match="--max-accum \\(acco.max_accum\\) 2 is below --accum 4"):
        _run("acco", accum=4, max_accum=2)
    _, run = _run("acco", accum=4)
    assert run.strategy.max_accum == 16  # 0: 4 x accum
    run.close()


def test_evaluating_or_saving_mid_step_is_refused():
    _, run = _run(accum=2)
    run.backward(_loss(run))
    for call in (lambda: run.evaluating().__enter__(), run.state_dict):
        with pytest.raises(UsageError, match="between optimizer steps"):
            call()
    run.backward(_loss(run))
    assert run.stepped and run.state_dict()["steps_done"] == 1
    run.close()
    with pytest.raises(UsageError, match="was closed"):
        run.backward(_loss(run))


@pytest.mark.parametrize("loss,needle", [
    (lambda run: run.model(torch.randn(3, 4)), "scalar loss"),
    (lambda run: torch.tensor(1.0), "does not require grad"),
    (lambda run: 0.5, "scalar loss tensor"),
])
def test_bad_losses_are_refused(loss, needle):
    _, run = _run()
    with pytest.raises(UsageError, match=needle):
        run.backward(loss(run))
    run.close()


def test_wrap_takes_options_and_emulation_by_name():
    _, run = _run("acco", max_accum=8, link="100mbit,1ms", slowdown=2.0)
    assert run.strategy.max_accum == 8 and run.strategy.comm.link.bandwidth == 12.5e6
    assert run.pacer.slowdown == 2.0
    run.close()
    for kw, needle in (({"max_acum": 8}, "unknown option 'max_acum' for strategy 'acco'"),
                       ({"link": "fast"}, "must be BANDWIDTH,LATENCY"),
                       ({"slowdown": 0.5}, "must be at least 1"),
                       ({"max_accum": -1}, "--max-accum \\(acco.max_accum\\) must be at least 0")):
        with pytest.raises(UsageError, match=needle):
            _run("acco", **kw)


def test_tokens_are_counted_for_tuple_and_dict_batches():
    from lowcomm.contract.context import batch_tokens
    ids = torch.zeros(4, 32, dtype=torch.long)
    assert batch_tokens((ids, ids)) == 128
    assert batch_tokens({"input_ids": ids, "labels": ids}) == 128
    mask = torch.ones(4, 32, dtype=torch.long)
    mask[:, 20:] = 0  # padding is not a token
    assert batch_tokens({"input_ids": ids, "attention_mask": mask}) == 80


# -- replica groups through wrap(): the user's loop unchanged ---------------------------------

REPLICA_STEPS, ROWS = 4, 4  # ROWS: what one replica reads per micro-batch, split among its ranks


def _replica_data(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + replica)
    return torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 1, generator=g)


def _user_loop(rank, world, strategy, replicas):
    """A user's loop: its own model, data and loss; the data sharded by where the run says
    this rank is (flat: replica = rank, one rank in it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    kw = {"replicas": replicas, "intra_link": "10gbit,50us"} if replicas else {}
    with lowcomm.wrap(model, lambda p: torch.optim.AdamW(p, lr=1e-2), strategy, accum=2, **kw) as run:
        assert run.replica_size * run.replicas == world
        assert run.replica_rank * run.replica_size + run.rank_in_replica == rank
        rows = ROWS // run.replica_size
        mine = slice(run.rank_in_replica * rows, (run.rank_in_replica + 1) * rows)
        micro = 0
        while run.steps < REPLICA_STEPS:
            x, y = _replica_data(micro, run.replica_rank)
            micro += 1
            run.backward(torch.nn.functional.mse_loss(run.model(x[mine]), y[mine]))
        where = (run.replicas, run.replica_rank, run.replica_size, run.rank_in_replica)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    refused = {}
    cases = (("three", {"strategy": strategy, "replicas": 3}),
             ("group", {"strategy": strategy, "replicas": 2, "group": dist.new_group(list(range(world)))}))
    for name, kw in cases if replicas else ():
        try:
            lowcomm.wrap(torch.nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1), **kw)
        except UsageError as e:
            refused[name] = str(e)
    return params, where, refused


@pytest.fixture(scope="module")
def replica_runs():
    return {(strategy, replicas): run_dist(_user_loop, 4 if replicas else 2, strategy, replicas, timeout=180)
            for strategy in ("zero1", "ddp") for replicas in (2, None)}


@pytest.mark.procs
@pytest.mark.parametrize("strategy", ["zero1", "ddp"])
def test_replicas_through_wrap_equal_one_worker_at_k_times_the_micro_batch(replica_runs, strategy):
    """W=4 as 2 replicas of 2 (each rank half of its replica's micro-batch) ends with the
    parameters of 2 single-process workers reading the whole micro-batch."""
    grouped, flat = replica_runs[strategy, 2], replica_runs[strategy, None]
    for rank, (params, where, _) in enumerate(grouped):
        assert where == (2, rank // 2, 2, rank % 2)
        reference = flat[rank // 2][0]
        assert rel_err(params, reference) <= 1e-6, (strategy, rank, rel_err(params, reference))
    assert flat[1][1] == (2, 1, 1, 0)  # a flat run: each rank its own replica


@pytest.mark.procs
@pytest.mark.parametrize("case,needle", [
    ("three", "replicas=3 does not divide the world size 4"),
    ("group", "pass group= or replicas=, not both"),
])
def test_bad_replicas_through_wrap_are_refused_in_one_line(replica_runs, case, needle):
    message = replica_runs["zero1", 2][0][2][case]
    assert needle in message and "\n" not in message, message


@pytest.mark.parametrize("kw,needle", [
    ({"replicas": 2}, "replicas=2 does not divide the world size 1"),
    ({"replicas": -1}, "replicas must be at least 1"),
    ({"replicas": "2"}, "replicas must be a whole number of replicas, got '2'"),
    ({"intra_link": "10gbit,50us"}, "intra_link needs replica groups: replicas fewer than the world size (1)"),
    ({"replicas": 1, "inside": "tp"}, "unknown inside 'tp' (choose from: ddp, fsdp)"),
    ({"inside": "fsdp"}, "inside='fsdp' needs replica groups: replicas fewer than the world size (1)"),
])
def test_bad_replicas_on_one_process_are_refused(kw, needle):
    with pytest.raises(UsageError) as e:
        _run("zero1", **kw)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


# -- lowcomm 0.1's spellings: still working, each with a warning that says what to call ------

def test_make_strategy_report_still_works_with_a_deprecation_warning():
    torch.manual_seed(0)
    run = lowcomm.make_strategy("powersgd", torch.nn.Linear(4, 1), lowcomm.Comm(),
                                lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.warns(DeprecationWarning, match=r"run\.report\(\) is deprecated: call run\.strategy\.report\(\)"):
        report = run.report()
    assert report == run.strategy.report() == {"powersgd_rank": 4, "powersgd_start": 10}
    run.close()


def test_wrap_strategy_evaluating_and_close_still_work_with_a_deprecation_warning():
    model, run = _run("acco", accum=1, deterministic=True)
    while not run.stepped:
        run.backward(_loss(run))
    with pytest.warns(DeprecationWarning, match=r"run\.strategy\.evaluating\(\) is deprecated: call run\.evaluating\(\)"):
        with run.strategy.evaluating() as evaluated:
            assert evaluated is model  # acco: θ swapped in, not the estimate it trains on
    with pytest.warns(DeprecationWarning, match=r"run\.strategy\.close\(\) is deprecated: call run\.close\(\)"):
        run.strategy.close()
    with pytest.raises(UsageError, match="was closed"):
        run.backward(_loss(run))
