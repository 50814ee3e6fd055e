"""What slowed a run: the slow-link flag while it runs (metrics/slowlink.py, fed records here),
and the report's "What slowed this run" section and per-rank time plot (report/slowed.py)."""
from __future__ import annotations

from lowcomm.metrics.slowlink import SlowLinkFlags


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
