"""What slowed a run: the slow-link flag while it runs (diagnose/slowlink.py, fed records here),
and the report's "What slowed this run" section and per-rank time plot (bench/report/slowed.py),
which also names the stalled collectives flagged during the run."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tiny_runs import EVEN_WORK, TINY

from lowcomm.cli.main import main
from lowcomm.diagnose.slowlink import SlowLinkFlags
from lowcomm.bench.preflight import plots_available
from lowcomm.bench.report import RecordedRun
from lowcomm.bench.report.slowed import STRAGGLER_RATIO, causes, section


def _record(exposed: list[float], model: float | None) -> dict:
    record = {"per_rank": {"exposed_comm_s": exposed, "compute_s": [0.01] * len(exposed)}}
    if model is not None:
        record["link_model_s"] = model
    return record


def test_a_link_well_above_its_model_is_flagged_with_both_figures():
    flags = SlowLinkFlags()
    assert flags.flags(_record([0.26, 0.24], 0.1)) == ["slow link x2.4 (exposed 240 ms, link model 100 ms)"]


def test_a_healthy_link_no_link_and_a_late_peer_are_not_flagged():
    flags = SlowLinkFlags()
    assert flags.flags(_record([0.11, 0.105], 0.1)) == []  # about what the model says
    assert flags.flags(_record([0.5, 0.5], None)) == []  # no emulated link: nothing to compare with
    # rank 0 waited 400 ms for a late rank 1, which itself waited the link's 100 ms: a straggler, not the link
    assert flags.flags(_record([0.4, 0.1], 0.1)) == []
    # twice a 1 ms model is still only a few ms: noise on a busy machine, under the floor
    assert flags.flags(_record([0.004, 0.005], 0.001)) == []


# The emulated device sleeps (F - 1) times its own measured compute, so the rule's ratio is F times
# the ratio of the two ranks' own median compute, which moves with the load (EVEN_WORK's comment;
# TINY's model once fell under the rule's 1.5 at x3, "exposed 54 %" named instead). At x10 with
# EVEN_WORK the rule's 1.5 holds while rank 1's own compute is at least 0.15 of rank 0's, 5.7 times
# below the lowest measured (1 / 1.17): the load moves the ratio, never the answer. The sleep costs
# no CPU.
SLOWDOWN, STEPS = 10, 8


@pytest.mark.procs
def test_a_slowed_rank_is_named_as_the_straggler_in_the_report(tmp_path, data_file):
    out = tmp_path / "run"
    assert main(["train", *TINY, *EVEN_WORK, "--steps", str(STEPS), "--slowdown", f"1,{SLOWDOWN}",
                 "--data", str(data_file), "--out", str(out)]) == 0
    assert main(["report", str(out), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    slowed = text.split("## What slowed this run\n\n")[1].split("\n")[0]
    m = re.match(r"\*\*ddp\*\*: rank 1 computed (\d+\.\d)x slower than the others \(median compute per step "
                 rf"[\d.]+ ms vs [\d.]+ ms\): a straggler \(emulated: --slowdown made it x{SLOWDOWN}\)", slowed)
    assert m, slowed
    assert float(m[1]) >= STRAGGLER_RATIO  # the rule's threshold: the ratio itself moves with the load
    (cause, *_) = json.loads((tmp_path / "report" / "report.json").read_text())["slowed"]["ddp"]
    assert cause["cause"] == "straggler" and cause["rank"] == 1
    if plots_available():
        assert (tmp_path / "report" / "rank_breakdown.png").stat().st_size > 0


def _run(steps: list[dict], **summary) -> RecordedRun:
    base = {"strategy": "ddp", "workers": 2, "steps": len(steps), "wall_s": 10.0, "slowdown": [1.0, 1.0],
            "compute_s_per_rank": [8.0, 8.0], "exposed_comm_s_per_rank": [1.0, 1.0], "exposed_comm_fraction": 0.1}
    return RecordedRun("ddp", Path("run"), base | summary, steps, {})


def _step(compute: list[float], exposed: list[float], **extra) -> dict:
    return {"per_rank": {"compute_s": compute, "exposed_comm_s": exposed}} | extra


def test_the_section_names_a_slow_link_from_its_flagged_steps():
    slow = _step([0.1, 0.1], [0.25, 0.24], link_model_s=0.1, flags=["slow link x2.4 (exposed 240 ms, link model 100 ms)"])
    run = _run([slow] * 3 + [_step([0.1, 0.1], [0.1, 0.1], link_model_s=0.1)])
    ((cause, text),) = [(c["cause"], c["text"]) for c in causes(run)]
    assert cause == "slow link"
    assert text == ("the link was slower than its model on 3 of 4 steps (median exposed 240 ms per step vs "
                    "100 ms the link model prices the bytes at, x2.4)")


def test_the_section_names_the_stalled_collectives_with_the_longest():
    calm = _step([0.1, 0.1], [0.1, 0.1], step=7, flags=["stalled barrier #29 every rank 1.5 s"])
    late = _step([0.1, 0.1], [2.6, 0.1], step=9, flags=["stalled all_reduce #33 rank 1 2.5 s (step 8)"])
    run = _run([calm, _step([0.1, 0.1], [0.1, 0.1], step=8), late])
    ((cause, text),) = [(c["cause"], c["text"]) for c in causes(run)]
    assert cause == "stalled collective"
    assert text == ("2 stalled collectives held every rank up for 4.0 s, 40 % of the wall time; the longest at "
                    "step 8: stalled all_reduce #33 rank 1 2.5 s")


def test_the_section_splits_exposed_time_by_level_and_says_when_nothing_stood_out():
    levels = {"cross": {"wire_bytes": 1, "exposed_comm_s_per_rank": [4.25, 4.25]},
              "intra": {"wire_bytes": 1, "exposed_comm_s_per_rank": [0.75, 0.75]}}
    run = _run([_step([0.1, 0.1], [0.5, 0.5])], exposed_comm_fraction=0.5, exposed_comm_s_per_rank=[5.0, 5.0],
               compute_s_per_rank=[4.0, 4.0], levels=levels, replicas=1, tokens=100)
    (cause,) = causes(run)
    assert cause["text"] == "communication was exposed for 50 % of the wall time, 85 % of it across replicas"
    calm = _run([_step([0.1, 0.1], [0.01, 0.01])] * 5)
    assert causes(calm) == []
    assert section([calm]) == ("\n## What slowed this run\n\n**ddp**: nothing stood out: per rank, 80 % of the time "
                               "computing, 10 % waiting on the network, 10 % other.\n")
