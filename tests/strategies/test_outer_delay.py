"""--outer-delay 1, the local-SGD family's one-step-delayed outer step (PCCL's async DiLoCo):
each strategy against a single-process transcription of the algorithm, bytes = plan, a state
taken with a reduction in flight continues bit-identically, and delay 0 is today's algorithm."""
from __future__ import annotations

import pytest
import torch

from dist_utils import flat_params, rel_err
from local_sgd import (adamw, build, check_counted_bytes, count_bytes, diloco_h4, inner_step, outer_sgd,
                       reference_workers, train)
from lowcomm.contract.context import flat_of, write_flat
from lowcomm.contract.parts import as_joiner

H, STEPS = 2, 9  # four periods and a final one that ends mid-period (the final drain)
WARMUP = 4  # --outer-delay-warmup: two synchronous syncs, then two delayed ones and the final
OUTER = dict(outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True)  # DiLoCo's outer SGD
BYTE_CASES = [(dict(sync_every=3, outer_delay=1), 7), (dict(sync_every=2, outer_delay=1, outer_precision="int8"), 5)]


def delayed_reference(world: int, steps: int, every: int, outer_lr=0.7, outer_momentum=0.9, nesterov=True,
                      warmup: int = 0) -> torch.Tensor:
    """PCCL's async DiLoCo (examples/nanogpt_diloco/async_diloco.py), transcribed for `world`
    workers in one process: at the end of each period, Δ_r = θ − x_r against the θ the period
    started from; the mean issued a period ago (if any) takes the outer step; every worker
    restarts from θ. The run's last step is a final sync (lowcomm's, not the script's, which
    drops the last mean): this period's Δ, then both means in order. `warmup`: the syncs up to
    that step take their own mean's outer step at once (a synchronous start), so the first sync
    after it has no earlier mean left to apply: every mean takes one outer step, in order."""
    first, workers, inner = reference_workers(world)
    theta = torch.nn.Parameter(flat_of(first.parameters()).float().clone(), requires_grad=False)
    outer_step = outer_sgd(theta, outer_lr, outer_momentum, nesterov)

    def mean_delta():
        return sum(theta.detach() - flat_of(m.parameters()).float() for m in workers) / world

    def restart():
        for m in workers:
            write_flat(theta.detach(), list(m.parameters()))

    previous = None
    for t in range(1, steps + 1):
        inner_step(workers, inner, t)
        if t == steps:
            last = mean_delta()
            if previous is not None:
                outer_step(previous)
            outer_step(last)
            restart()
        elif t % every == 0 and t <= warmup:
            outer_step(mean_delta())
            restart()
        elif t % every == 0:
            delta = mean_delta()
            if previous is not None:
                outer_step(previous)
            previous = delta
            restart()
    return theta.detach().clone()


def _delayed_run(rank, name, options):
    model, run = build(name, adamw, total_steps=STEPS, sync_every=H, outer_delay=1, **options)
    train(run, rank, STEPS)
    run.close()
    return flat_params(model)


def _delayed_diloco(rank, world):
    return _delayed_run(rank, "diloco", OUTER)


def _delayed_sparseloco(rank, world):  # its preset's outer step (lr 1, no momentum), the wire lossless
    return _delayed_run(rank, "sparseloco", dict(outer_compress="none"))


def _warm_diloco(rank, world):  # syncs at steps 2 and 4 wait for their mean; from step 6 a period late
    return _delayed_run(rank, "diloco", dict(outer_delay_warmup=WARMUP, **OUTER))


def _warm_streaming(rank, world):  # the warm-up's syncs wait at once: τ = 1 and α = 0.5 do not apply
    return _delayed_run(rank, "streaming_diloco", dict(fragments=1, fragment_delay=1, merge_alpha=0.5,
                                                       outer_delay_warmup=WARMUP, **OUTER))


def _delayed_streaming(rank, world):  # one fragment: a period's mean lands at the next sync, whatever τ
    return _delayed_run(rank, "streaming_diloco", dict(fragments=1, fragment_delay=1, **OUTER))


def _resumed(rank, world):
    """diloco --outer-delay 1: a state taken at step 5 (period 2's mean in flight) loaded into a
    fresh run continues to the same parameters as the run that never stopped."""
    model, straight = build("diloco", adamw, total_steps=STEPS, sync_every=H, outer_delay=1, **OUTER)
    train(straight, rank, STEPS)
    straight.close()
    _, first = build("diloco", adamw, total_steps=STEPS, sync_every=H, outer_delay=1, **OUTER)
    train(first, rank, 5)
    in_flight = bool(first.strategy.sync.in_flight)
    state = first.state_dict()
    first.release()
    resumed_model, resumed = build("diloco", adamw, total_steps=STEPS, sync_every=H, outer_delay=1, **OUTER)
    resumed.load_state_dict(state)
    train(resumed, rank, STEPS - 5)
    resumed.close()
    return flat_params(model), flat_params(resumed_model), in_flight


def _rejoined(rank, world):
    """diloco --outer-delay 1, token-weighted as --elastic runs it: a state taken at step 5 (step 4's
    mean in flight) loaded by rank 0 as its own and by rank 1 as a joiner's (its part of the mean
    fresh: nothing trained); at step 6 the reduction goes out again on the group, and the outer
    step (lr 1, no momentum) applies rank 0's Δ alone. Returns (rank 0's part, θ_global before, after)."""
    options = dict(total_steps=STEPS, sync_every=H, outer_delay=1, outer_weights="tokens", outer_lr=1.0,
                   outer_momentum=0.0)
    _, first = build("diloco", adamw, **options)
    train(first, rank, 5)
    state = first.state_dict()
    first.release()
    _, run = build("diloco", adamw, **options)
    run.load_state_dict(as_joiner(run.strategy.state_parts(), state) if rank == 1 else state)
    train(run, rank, 1)
    after = run.strategy.sync.globals[0].detach().clone()
    run.release()
    return state["parts"]["in_flight"][0]["data"], state["parts"]["globals"][0], after


def _delay0(rank, world):
    """--outer-delay 0 given explicitly, and --outer-delay 1 with a warm-up as long as the run:
    each the synchronous algorithm (the shared diloco H=4 run)."""
    finals = []
    for options in (dict(outer_delay=0, eager=False), dict(outer_delay=1, eager=True, outer_delay_warmup=10)):
        model, run = build("diloco", adamw, total_steps=10, sync_every=4, **options)
        train(run, rank, 10)
        run.close()
        finals.append(flat_params(model))
    return *finals, diloco_h4(rank, world)


def _bytes(rank, world):
    return count_bytes(rank, "diloco", BYTE_CASES)


LOCAL_SGD_RUNS = {"delay_diloco": (_delayed_diloco, (2,)), "delay_warm": (_warm_diloco, (2,)),
                  "delay_warm_streaming": (_warm_streaming, (2,)), "delay_sparseloco": (_delayed_sparseloco, (2,)),
                  "delay_streaming": (_delayed_streaming, (2,)), "delay_resumed": (_resumed, (2,)),
                  "delay_zero": (_delay0, (2,)), "delay_bytes": (_bytes, (2,)), "delay_rejoined": (_rejoined, (2,))}


@pytest.mark.procs
@pytest.mark.parametrize("scenario, outer", [("delay_diloco", OUTER),
                                             ("delay_sparseloco", dict(outer_lr=1.0, outer_momentum=0.0)),
                                             ("delay_streaming", OUTER)])
def test_a_one_step_delayed_outer_step_equals_its_transcription(local_sgd_runs, scenario, outer):
    ranks = local_sgd_runs(2)
    want = delayed_reference(2, STEPS, H, outer["outer_lr"], outer["outer_momentum"],
                             nesterov=outer.get("outer_nesterov", False) and outer["outer_momentum"] > 0)
    for r, got in enumerate(ranks):
        assert rel_err(got[scenario], want) <= 1e-6, f"{scenario} rank {r}: {rel_err(got[scenario], want):.2e}"
    # the transcription is not the synchronous algorithm: the delay changes what is learned
    sync, _, _ = ranks[0]["delay_zero"]
    assert rel_err(sync, want) > 1e-3


@pytest.mark.procs
@pytest.mark.parametrize("scenario", ["delay_warm", "delay_warm_streaming"])
def test_a_warm_up_takes_its_syncs_outer_steps_at_once_and_the_rest_a_period_late(local_sgd_runs, scenario):
    ranks = local_sgd_runs(2)
    want = delayed_reference(2, STEPS, H, warmup=WARMUP)
    for r, got in enumerate(ranks):
        assert rel_err(got[scenario], want) <= 1e-6, f"{scenario} rank {r}: {rel_err(got[scenario], want):.2e}"
    # neither the delayed run nor the synchronous one
    assert rel_err(ranks[0]["delay_diloco"], want) > 1e-3
    assert rel_err(delayed_reference(2, STEPS, H, warmup=STEPS), want) > 1e-3


@pytest.mark.procs
def test_a_state_taken_with_a_reduction_in_flight_continues_bit_identically(local_sgd_runs):
    for straight, resumed, in_flight in (r["delay_resumed"] for r in local_sgd_runs(2)):
        assert in_flight  # the state was taken while a mean was in flight: the case is not trivial
        assert torch.equal(straight, resumed)


@pytest.mark.procs
def test_a_reloaded_reduction_in_flight_is_reissued_and_a_joiners_part_counts_for_nothing(local_sgd_runs):
    ranks = local_sgd_runs(2)
    part0, before, _ = ranks[0]["delay_rejoined"]
    assert part0.any()
    for r, (_, _, after) in enumerate(rank["delay_rejoined"] for rank in ranks):
        assert torch.equal(after, before - part0), f"rank {r}"


@pytest.mark.procs
def test_a_delay_of_zero_or_a_warm_up_as_long_as_the_run_is_the_synchronous_algorithm_bit_for_bit(local_sgd_runs):
    for explicit, all_warm_up, default in (r["delay_zero"] for r in local_sgd_runs(2)):
        assert torch.equal(explicit, default)
        assert torch.equal(all_warm_up, default)


@pytest.mark.procs
def test_counted_bytes_equal_plan(local_sgd_runs):
    check_counted_bytes(local_sgd_runs(2), "diloco", BYTE_CASES, "delay_bytes")


def test_the_run_says_when_it_starts_how_pccl_runs_the_delay(tmp_path, data_file, monkeypatch, capfd):
    """With outer momentum the delayed mean overshoots: the launch says so in one line (diloco's
    default momentum 0.9; sparseloco has none: nothing said), and so do eager updates, which learned
    more without it; streaming says which of its flags the delay replaces."""
    import lowcomm.launch.launcher
    from lowcomm.cli.main import main

    monkeypatch.setattr(lowcomm.launch.launcher, "launch", lambda *a, **k: None)  # no training here
    said = {}
    for argv in (["--strategy", "diloco"], ["--strategy", "sparseloco"], ["--strategy", "streaming_diloco"],
                 ["--strategy", "diloco", "--outer-momentum", "0"], ["--strategy", "diloco", "--eager"]):
        out = tmp_path / f"run{len(said)}"
        assert main(["train", *argv, "--outer-delay", "1", "--data", str(data_file), "--out", str(out)]) == 0
        said[" ".join(argv)] = [line for line in capfd.readouterr().err.splitlines() if line.startswith("note:")]
    pccl = ("--outer-delay 1 with outer momentum 0.9: a mean a period stale through momentum overshoots; PCCL's "
            "async DiLoCo runs it with --outer-momentum 0 (docs/strategies.md)")
    assert said["--strategy diloco"] == [f"note: {pccl}"]
    assert said["--strategy sparseloco"] == said["--strategy diloco --outer-momentum 0"] == []
    assert said["--strategy diloco --eager"] == ["note: --eager with outer momentum 0.9: measured here, eager "
                                                 "updates learned more with --outer-momentum 0 (docs/strategies.md)"]
    assert said["--strategy streaming_diloco"] == [
        "note: --outer-delay 1: each fragment's mean takes its outer step at the fragment's next sync, a period "
        f"later, and the next period starts from θ_global: --fragment-delay and --merge-alpha do not apply; {pccl}"]


def test_a_warm_up_without_the_delay_is_refused_in_one_line(tmp_path, data_file, capfd):
    from lowcomm.cli.main import main
    out = tmp_path / "run"
    argv = ["train", "--strategy", "diloco", "--outer-delay-warmup", "64", "--data", str(data_file), "--out", str(out)]
    assert main(argv) == 2
    assert capfd.readouterr().err.strip().splitlines() == [
        "error: --outer-delay-warmup 64 needs --outer-delay 1: with --outer-delay 0 every sync waits for its mean "
        "already"]
    assert not out.exists()
