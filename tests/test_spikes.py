"""The loss-spike flag (diagnose/spikes.py): a step whose loss leaps far above the median of the
recent steps is flagged in its steps.jsonl record and on the progress line, like the other
always-on flags; the ordinary descent of a run, its noise and a non-finite loss are not."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

from lowcomm.train.outputs import StepOutputs
from lowcomm.diagnose.spikes import LossSpikeFlags
from lowcomm.metrics.summary import Totals

# The training losses of `lowcomm train --strategy diloco --workers 4 --replicas 2 ...
# --steps 30` (two decimals), whose step 20 read 9.65 between values near 3.3.
LOSSES = [5.56, 5.29, 5.07, 4.89, 4.79, 4.67, 4.55, 4.41, 4.23, 4.06, 3.88, 3.71, 3.61, 3.50, 3.41,
          3.40, 3.32, 3.33, 3.34, 9.65, 3.29, 3.30, 3.32, 3.32, 3.29, 3.27, 3.33, 3.30, 3.28, 3.31]


def _flagged(losses: list[float]) -> dict[int, list[str]]:
    spikes = LossSpikeFlags()
    found = {step: spikes.flags({"loss": loss}) for step, loss in enumerate(losses, 1)}
    return {step: flags for step, flags in found.items() if flags}


def test_the_step_that_leaps_above_the_recent_median_is_flagged_with_both_figures():
    assert _flagged(LOSSES) == {20: ["loss spike 9.65 (x2.8 the median 3.46 of the last 10 steps)"]}


def test_a_descent_its_noise_and_a_non_finite_loss_are_not_spikes():
    assert _flagged(LOSSES[:19] + LOSSES[20:]) == {}
    noisy = [3.3 + (0.4 if step % 3 == 0 else -0.2) for step in range(40)]  # 3.1 to 3.7 on every third step
    assert _flagged(noisy) == {}
    assert _flagged([0.05, 0.04, 0.05, 0.04, 0.05, 0.04, 0.12]) == {}  # x2.8, but 0.08 nats: under the floor
    assert _flagged(LOSSES[:19] + [math.nan, math.inf] + LOSSES[20:]) == {}
    assert _flagged([5.5, 9.0]) == {}  # two steps are no recent level yet


def _outputs(tmp_path, steps: int) -> StepOutputs:
    cfg = SimpleNamespace(steps=steps, strategy="diloco", resume_from="", tensorboard="", wandb="")
    trainer = SimpleNamespace(cfg=cfg, rank=0, world=1, step=0, loader_s={},
                              run=SimpleNamespace(levels=[], strategy=None))
    return StepOutputs(trainer, tmp_path, quiet=False)


def _record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "tokens": 64, "micro_batches": 1, "wire_bytes": 0,
            "compute_s": 0.01, "comm_s": 0.0, "exposed_comm_s": 0.0, "wall_s": 0.01,
            "per_rank": {"compute_s": [0.01], "exposed_comm_s": [0.0], "micro_batches": [1]}}


def test_a_spike_inside_a_gather_is_on_its_record_and_on_the_gathers_progress_line(tmp_path, capsys):
    """Records arrive five at a time (--log-every); the progress line shows the last one, so a
    spike on an earlier step is named there with its step."""
    outputs, totals = _outputs(tmp_path, len(LOSSES)), Totals(1)
    losses = LOSSES[:18] + [9.65, 3.34] + LOSSES[20:]  # the spike at step 19, not a gather's last
    for first in range(1, len(losses) + 1, 5):
        records = [_record(step, losses[step - 1]) for step in range(first, first + 5)]
        outputs.write(records, totals)
        outputs.show(records[-1]["step"], totals, records[-1], elapsed=1.0)
    outputs.close()
    logged = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [(r["step"], r["flags"]) for r in logged if "flags" in r] == [
        (19, ["loss spike 9.65 (x2.7 the median 3.55 of the last 10 steps)"])]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in lines if "loss spike" in line] == ["step 20/30"]
    assert "step 19: loss spike 9.65" in next(line for line in lines if line.startswith("step 20/30"))
