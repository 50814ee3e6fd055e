"""`lowcomm plan` prices a defence against untrusted workers beyond its wire: every worker's
contribution held in memory, the aggregate's memory traffic and --score's forwards, each sync
(robust/costs.py). Pure Python, no worker is started."""
import math

import pytest

from lowcomm.comm.link import LinkModel
from lowcomm.models.layout import ModelLayout
from lowcomm.plan import planner
from lowcomm.robust.costs import PASSES
from lowcomm.strategies import get

W, N, SEQ, TFLOPS, H = 8, 10_000_000, 256, 50.0, 20
LAYOUT = ModelLayout(((N // 2,), (N // 2,)))


def cluster() -> planner.Cluster:
    per_token = planner.flops_seconds_per_token(N, TFLOPS * 1e12)
    return planner.Cluster(LAYOUT, W, 4 * 2**20, per_token, LinkModel(10e9 / 8, 0.0), seq_len=SEQ)


def predicted(name: str, **options) -> planner.Prediction:
    o = get(name).Options(**options).validate(name)
    return planner.predict(name, cluster(), o)


@pytest.mark.parametrize("name", ["diloco", "sparseloco"])
@pytest.mark.parametrize("rule", ["median", "trimmed:0.25", "centered-clip:1", "median-norm-clip"])
def test_a_robust_outer_step_costs_its_passes_over_every_workers_contribution_each_sync(name, rule):
    plain = predicted(name, sync_every=H)
    robust = predicted(name, sync_every=H, aggregate=rule)
    held = W * N * 4  # every worker's Δ as fp32 rows
    bandwidth = TFLOPS * 1e12 / planner.FLOPS_PER_BYTE
    assert plain.defence is None and plain.defence_s == 0
    assert robust.model_state_bytes - plain.model_state_bytes == held
    assert math.isclose(robust.defence_s, PASSES[rule.partition(":")[0]] * held / bandwidth / H, rel_tol=1e-9)
    # in the step's time beside its compute and its wait (an all-gather in place of an all-reduce: longer)
    assert math.isclose(robust.step_s, robust.compute_s + robust.defence_s + robust.exposed_comm_s, rel_tol=1e-9)
    assert robust.exposed_comm_s >= plain.exposed_comm_s  # sparseloco gathers its top-k already
    assert rule.partition(":")[0] in robust.label


def test_scoring_costs_three_forwards_of_its_sequences_each_sync_on_every_worker():
    robust = predicted("diloco", sync_every=H, aggregate="median-norm-clip")
    scored = predicted("diloco", sync_every=H, aggregate="median-norm-clip", score=True, score_batches=4)
    forwards = 3 * 4 * SEQ * 2 * N  # FLOPs: one batch's loss before, two after, of 4 sequences each
    assert math.isclose(scored.defence_s - robust.defence_s, forwards / (TFLOPS * 1e12) / H, rel_tol=1e-9)
    assert scored.model_state_bytes == robust.model_state_bytes


def test_demo_aggregates_every_senders_decoded_payload_every_step():
    plain, robust = predicted("demo"), predicted("demo", aggregate="median")
    assert math.isclose(robust.defence_s, PASSES["median"] * W * N * 4 / (TFLOPS * 1e12 / planner.FLOPS_PER_BYTE),
                        rel_tol=1e-9)
    assert robust.label == "demo median" and plain.label == "demo"


def test_demos_scoring_costs_its_three_forwards_once_every_score_every_steps():
    robust = predicted("demo", aggregate="median-norm-clip")
    scored = predicted("demo", aggregate="median-norm-clip", score=True, score_batches=4, score_every=5)
    forwards = 3 * 4 * SEQ * 2 * N  # as the outer-sync engine's, at one scored step in 5
    assert math.isclose(scored.defence_s - robust.defence_s, forwards / (TFLOPS * 1e12) / 5, rel_tol=1e-9)


def test_the_plan_table_says_what_each_defence_costs(capsys):
    from lowcomm.cli.main import main
    code = main(["plan", "--strategies", "diloco,sparseloco", "--aggregate", "median-norm-clip", "--score",
                 "--worker-tflops", "100", "--params", "350M", "--workers", "8"])
    out = capsys.readouterr().out
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("defence, ")]
    assert len(lines) == 2 and all("median-norm-clip" in line and "scoring" in line for line in lines), out
