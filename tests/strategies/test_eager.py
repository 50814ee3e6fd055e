"""--eager, the local-SGD family's eager updates (Kale et al., arXiv 2502.12996) on the one-step
delayed outer step: each strategy against a single-process transcription of the paper's
per-worker recursion (every worker its own outer parameters and outer momentum), bytes = plan,
a state taken with a reduction in flight continues bit-identically, and bad input is refused."""
from __future__ import annotations

import pytest
import torch

from dist_utils import flat_params, rel_err
from local_sgd import (adamw, build, check_counted_bytes, count_bytes, inner_step, make_model, outer_sgd,
                       reference_workers, train)
from lowcomm.compress import ErrorFeedback
from lowcomm.contract.context import flat_of, write_flat
from lowcomm.engines.outer_wire import WireFormat

H, STEPS, MID = 2, 9, 6  # four periods and a final one that ends mid-period; MID: a sync step
WARMUP = 4  # --outer-delay-warmup: syncs at steps 2 and 4 wait for their mean, eager from step 6 (MID)
DILOCO = dict(outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True)  # DiLoCo's outer SGD
DILOCO_M0 = dict(outer_lr=0.7, outer_momentum=0.0, outer_nesterov=False)  # eager's measured best
SPARSE = dict(outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False)  # SparseLoCo's preset
SPARSELOCO_WIRE = WireFormat(compress="topk:64,chunk:4096,bits:2,quant:stat", ef_decay=0.95)
BYTE_CASES = [(dict(sync_every=3, outer_delay=1, eager=True), 7),
              (dict(sync_every=2, outer_delay=1, eager=True, outer_compress="topk:16,chunk:256,bits:2"), 5)]


def eager_reference(world: int, outer: dict, wire: WireFormat | None = None,
                    warmup: int = 0) -> tuple[list, torch.Tensor]:
    """Kale et al.'s eager updates (their DiLoCo with eager outer steps), `world` workers in one
    process. Worker m trains H inner steps from its own outer parameters θ_m, sends
    Δ_m = θ_m − x_m, and without waiting steps its own outer optimizer with
        Δ̃_m = Δ̄_prev + (Δ_m − Δ_m,prev) / M
    (Δ̄_prev: the mean sent a period ago, landed now; nothing before the first) and restarts from
    θ_m. `wire`: the mean is of the workers' compressed, error-fed Δ_m (SparseLoCo's), the stand-in
    their own Δ_m. The run's last step is lowcomm's final sync, not the paper's: every mean lands on
    the consensus θ (the outer step on the means alone) and the stand-ins are withdrawn. `warmup`
    (lowcomm's, not the paper's): the syncs up to that step take their mean's outer step at once,
    every worker on the consensus θ, and the first eager sync after them has no earlier mean left.
    Returns (each worker's θ_m after the sync at step MID, the final θ)."""
    first, workers, inner = reference_workers(world)
    theta0 = flat_of(first.parameters()).float()
    own = [torch.nn.Parameter(theta0.clone(), requires_grad=False) for _ in range(world)]
    own_step = [outer_sgd(p, outer["outer_lr"], outer["outer_momentum"], outer["outer_nesterov"]) for p in own]
    consensus = torch.nn.Parameter(theta0.clone(), requires_grad=False)
    consensus_step = outer_sgd(consensus, outer["outer_lr"], outer["outer_momentum"], outer["outer_nesterov"])
    sizes = [p.numel() for p in first.parameters()]
    ef = [ErrorFeedback(wire.compressor(sizes), decay=wire.ef_decay) if wire else None for _ in range(world)]

    def mean_of(deltas):
        if wire is None:
            return sum(deltas) / world
        payloads = [e.compress("all", d, e.compressor)[0] for e, d in zip(ef, deltas)]
        return ef[0].compressor.combine(payloads, [1.0 / world] * world)

    previous, mine_before, mid = None, [torch.zeros_like(theta0)] * world, None
    for t in range(1, STEPS + 1):
        inner_step(workers, inner, t)
        if t % H and t != STEPS:
            continue
        deltas = [p.detach() - flat_of(m.parameters()).float() for p, m in zip(own, workers)]
        mean = mean_of(deltas)
        if previous is not None:
            consensus_step(previous)
        if t == STEPS:
            consensus_step(mean)
            return mid, consensus.detach().clone()
        if t <= warmup:
            consensus_step(mean)
            for m in range(world):
                own[m].data.copy_(consensus.detach())
                write_flat(own[m].detach(), list(workers[m].parameters()))
            continue
        for m in range(world):  # the eager outer step: own fresh share in, own stale share out
            own_step[m]((previous if previous is not None else 0) + (deltas[m] - mine_before[m]) / world)
            write_flat(own[m].detach(), list(workers[m].parameters()))
        previous, mine_before = mean, deltas
        if t == MID:
            mid = [p.detach().clone() for p in own]


def _eager_run(rank, name, options):
    model, run = build(name, adamw, total_steps=STEPS, sync_every=H, outer_delay=1, eager=True, **options)
    train(run, rank, MID)
    mid = flat_params(model)  # this worker's θ_m: where its next period starts
    train(run, rank, STEPS - MID)
    run.close()
    return mid, flat_params(model)


def _eager_diloco(rank, world):
    return _eager_run(rank, "diloco", DILOCO)


def _eager_sparseloco(rank, world):  # its preset's outer step, its wire: top-k, 2 bits, error feedback
    return _eager_run(rank, "sparseloco", {})


def _eager_streaming(rank, world):  # one fragment: a period's mean lands at the next sync, whatever τ
    return _eager_run(rank, "streaming_diloco", dict(fragments=1, fragment_delay=1, **DILOCO))


def _eager_warm(rank, world):
    return _eager_run(rank, "diloco", dict(outer_delay_warmup=WARMUP, **DILOCO_M0))


def _resumed(rank, world):
    """diloco --eager: a state taken at step 5 (period 2's mean in flight, a share standing in)
    loaded into a fresh run continues to the same parameters as the run that never stopped."""
    options = dict(total_steps=STEPS, sync_every=H, outer_delay=1, eager=True, **DILOCO)
    model, straight = build("diloco", adamw, **options)
    train(straight, rank, STEPS)
    straight.close()
    _, first = build("diloco", adamw, **options)
    train(first, rank, 5)
    in_flight, standing = bool(first.strategy.sync.in_flight), bool(first.strategy.sync.stand_in.applied[0].any())
    state = first.state_dict()
    first.release()
    resumed_model, resumed = build("diloco", adamw, **options)
    resumed.load_state_dict(state)
    train(resumed, rank, STEPS - 5)
    resumed.close()
    return flat_params(model), flat_params(resumed_model), in_flight and standing


def _bytes(rank, world):
    return count_bytes(rank, "diloco", BYTE_CASES)


LOCAL_SGD_RUNS = {"eager_diloco": (_eager_diloco, (2,)), "eager_sparseloco": (_eager_sparseloco, (2,)),
                  "eager_streaming": (_eager_streaming, (2,)), "eager_warm": (_eager_warm, (2,)),
                  "eager_resumed": (_resumed, (2,)),
                  "eager_bytes": (_bytes, (2,))}


@pytest.mark.procs
@pytest.mark.parametrize("scenario, outer, wire, warmup", [("eager_diloco", DILOCO, None, 0),
                                                           ("eager_sparseloco", SPARSE, SPARSELOCO_WIRE, 0),
                                                           ("eager_streaming", DILOCO, None, 0),
                                                           ("eager_warm", DILOCO_M0, None, WARMUP)])
def test_eager_updates_equal_the_papers_per_worker_recursion(local_sgd_runs, scenario, outer, wire, warmup):
    ranks = local_sgd_runs(2)
    mid, final = eager_reference(2, outer, wire, warmup)
    for r, got in enumerate(ranks):
        got_mid, got_final = got[scenario]
        assert rel_err(got_mid, mid[r]) <= 1e-6, f"{scenario} rank {r} θ_m at step {MID}: {rel_err(got_mid, mid[r]):.2e}"
        assert rel_err(got_final, final) <= 1e-6, f"{scenario} rank {r} final θ: {rel_err(got_final, final):.2e}"
    assert rel_err(mid[0], mid[1]) > 1e-4  # not trivially: the workers' θ_m differ by their stand-ins


@pytest.mark.procs
def test_an_eager_state_taken_with_a_reduction_in_flight_continues_bit_identically(local_sgd_runs):
    for straight, resumed, in_flight in (r["eager_resumed"] for r in local_sgd_runs(2)):
        assert in_flight  # a mean in flight and a share standing in: the case is not trivial
        assert torch.equal(straight, resumed)


@pytest.mark.procs
def test_eager_counted_bytes_equal_plan(local_sgd_runs):
    check_counted_bytes(local_sgd_runs(2), "diloco", BYTE_CASES, "eager_bytes")


@pytest.mark.parametrize("argv, said", [
    (["--eager"], "error: --eager needs --outer-delay 1: the worker's own pseudo-gradient stands in for a mean in "
                  "flight, and with --outer-delay 0 none is"),
    (["--eager", "--outer-delay", "1", "--sync-by", "time"],
     "error: --eager does not run with --sync-by time: a worker's share of a FedNova mean is known only when the "
     "mean lands")])
def test_eager_without_a_mean_in_flight_is_refused_in_one_line(tmp_path, data_file, capfd, argv, said):
    from lowcomm.cli.main import main
    out = tmp_path / "run"
    assert main(["train", "--strategy", "diloco", *argv, "--data", str(data_file), "--out", str(out)]) == 2
    assert capfd.readouterr().err.strip().splitlines() == [said]
    assert not out.exists()


def test_the_plan_labels_and_prices_eager_as_the_delayed_step():
    """Eager updates move the same bytes at the same time as the delayed step: the plan says which."""
    from lowcomm.models.layout import layout_of
    from lowcomm.strategies import get
    cls, layout = get("diloco"), layout_of(make_model())
    delayed, eager = (cls.Options(sync_every=4, outer_delay=1, eager=e).validate("diloco") for e in (False, True))
    assert (cls.cost.plan_label(cls, delayed), cls.cost.plan_label(cls, eager)) == ("diloco H=4 delayed", "diloco H=4 eager")
    assert cls.comm_plan(layout, 4, delayed) == cls.comm_plan(layout, 4, eager)
