"""Fixtures shared by the strategies' test files: one spawn trains every exact variant."""
import pytest
from dist_utils import run_dist

from exact_reference import OPTIMIZERS, W, _all_runs, reference


@pytest.fixture(scope="session")
def gpt_runs():
    return run_dist(_all_runs, W, "gpt", True), {o: reference("gpt", o) for o in OPTIMIZERS}


@pytest.fixture(scope="session")
def mlp_runs():
    return run_dist(_all_runs, W, "mlp", False), {o: reference("mlp", o) for o in OPTIMIZERS}
