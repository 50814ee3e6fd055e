"""Fixtures shared by the strategies' test files: one spawn trains every exact variant, and
one spawn per world size runs every local-SGD scenario."""
import pytest
from dist_utils import run_dist

from exact_reference import OPTIMIZERS, W, _all_runs, reference


@pytest.fixture(scope="session")
def gpt_runs():
    return run_dist(_all_runs, W, "gpt", True), {o: reference("gpt", o) for o in OPTIMIZERS}


@pytest.fixture(scope="session")
def mlp_runs():
    return run_dist(_all_runs, W, "mlp", False), {o: reference("mlp", o) for o in OPTIMIZERS}


@pytest.fixture(scope="session")
def local_sgd_runs(request):
    """runs(world) -> each rank's {scenario: result}: every scenario that a collected test file
    lists in LOCAL_SGD_RUNS for that world size (see local_sgd.py), all in one process group,
    spawned once per session and world size."""
    from local_sgd import run_scenarios

    scenarios: dict[str, tuple] = {}
    for module in {item.module for item in request.session.items if getattr(item, "module", None)}:
        scenarios.update(getattr(module, "LOCAL_SGD_RUNS", {}))
    done: dict[int, list[dict]] = {}

    def runs(world: int) -> list[dict]:
        if world not in done:
            todo = [(name, fn) for name, (fn, worlds) in sorted(scenarios.items()) if world in worlds]
            done[world] = run_dist(run_scenarios, world, todo, timeout=300)
        return done[world]
    return runs
