"""powersgd: torch's PowerSGD hook on DDP, through Comm. Bytes counted equal the plan at W=2
and W=3 (each bucket's all-reduce rounded on its own), and the hook's error feedback and
warm-started factors survive state_dict, also when a resumed process lays DDP's buckets out
anew."""
from __future__ import annotations

import pytest

from compressed_common import (assert_bytes_equal_plans, assert_round_trip, counted_bytes, in_shared_spawn,
                               round_trip, shared_results)

pytestmark = pytest.mark.procs

# start 2 makes their 3 steps cross into compression
BYTE_CASES = [("powersgd", {"start": 2}, 3), ("powersgd", {"start": 2, "rank": 1}, 3)]
W3_CASES = BYTE_CASES[1:]  # W=3: fewer cases, the run is the cost

# Several DDP buckets, saved just before PowerSGD's first compressed step: the resumed
# process's DDP lays its first step's buckets out differently from the straight run's.
MULTI_BUCKET = {"start": 3, "bucket_mb": 0.01}
SAVED = {"one bucket": {"start": 2}, "several buckets": MULTI_BUCKET}


@in_shared_spawn
def powersgd_checks(rank, world, path):
    if world != 2:
        return {"bytes": counted_bytes(rank, W3_CASES)}
    return {"bytes": counted_bytes(rank, BYTE_CASES),
            **{key: round_trip(rank, "powersgd", options) for key, options in SAVED.items()}}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return {world: shared_results(powersgd_checks, world, tmp_path_factory) for world in (2, 3)}


@pytest.mark.parametrize("world", [2, 3])
def test_counted_bytes_equal_the_plans(world, spawned):
    assert_bytes_equal_plans([r["bytes"] for r in spawned[world]], BYTE_CASES if world == 2 else W3_CASES,
                             world, slack_per_op=True)


@pytest.mark.parametrize("key", SAVED)
def test_hook_state_survives_state_dict(key, spawned):
    results = [r[key] for r in spawned[2]]
    assert_round_trip(results)
    saved = results[0][2]
    if key == "several buckets":
        assert len(saved["layout"]) > 1  # it did run with several buckets
