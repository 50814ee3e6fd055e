"""The outer-sync engine's schedule, read off a one-worker run (no process group: Comm does each
collective's local effect): at which trainer step each fragment's mean takes its outer step,
synchronous, streaming (F, τ), one period late after a warm-up, and at the run's final sync."""
from __future__ import annotations

import pytest
from local_sgd import adamw, build, train


def outer_steps(name: str, steps: int, **options) -> list[tuple[int, int]]:
    """(trainer step from 1, fragment) of every outer step a run of `steps` steps takes."""
    _, run = build(name, adamw, total_steps=steps, **options)
    strategy, seen = run.strategy, []
    real = strategy.outer_step

    def recorded(i, delta, ctx=None):
        seen.append((strategy.steps_done + 1, i))
        real(i, delta, ctx)

    strategy.outer_step = recorded
    train(run, 0, steps)
    run.close()
    return seen


@pytest.mark.parametrize("name, options, expected", [
    # every H-th step, and once more at the last step of a run that ends mid-period
    ("diloco", {"sync_every": 4}, [(4, 0), (8, 0), (10, 0)]),
    # fragment 1 syncs at 2, 6 and fragment 0 at 4, 8, each mean landing τ = 1 step later;
    # the final sync at 10 sends every fragment and waits for both
    ("streaming_diloco", {"sync_every": 4, "fragments": 2, "fragment_delay": 1},
     [(3, 1), (5, 0), (7, 1), (9, 0), (10, 0), (10, 1)]),
    # the warm-up's sync at 2 waits for its mean; the sync at 4 has no mean of the period before,
    # 6 takes 4's, and the final sync at 8 takes 6's, then its own
    ("diloco", {"sync_every": 2, "outer_delay": 1, "outer_delay_warmup": 2, "outer_momentum": 0.0},
     [(2, 0), (6, 0), (8, 0), (8, 0)]),
], ids=["synchronous", "streaming", "one-period-late"])
def test_each_mean_takes_its_outer_step_when_its_schedule_says(name, options, expected):
    steps = expected[-1][0]
    assert outer_steps(name, steps, **options) == expected
