"""bench/byzantine.py's reading of its runs: which round caught the attackers, and what a sync
step costs beside the same run's local steps (--cost)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import byzantine  # noqa: E402


def steps(walls: list[float], synced: set[int]) -> list[dict]:
    return [{"wall_s": w, "wire_bytes": 100 if i in synced else 0} for i, w in enumerate(walls)]


def test_a_sync_step_is_a_step_that_sent_bytes_and_the_final_sync_is_left_out():
    # H = 4: steps 3 and 7 sync; the last step (the final sync) is slow and ends the run
    run = steps([0.02, 0.02, 0.03, 0.08, 0.02, 0.02, 0.02, 0.06, 0.5], {3, 7, 8})
    synced, local, local_per_sync = byzantine.sync_walls(run)
    assert synced == pytest.approx(0.07) and local == pytest.approx(0.02)
    assert local_per_sync == pytest.approx(9 / 2 - 1)


def test_an_attacker_is_caught_where_left_out_or_named_in_a_copy():
    rounds = [{"round": 0, "left_out": [], "copies": []},
              {"round": 1, "left_out": [3], "copies": []},
              {"round": 2, "left_out": [3], "copies": [[5, 6]]}]
    assert byzantine.left_out_at({"score_rounds": rounds}, [3]) == "1"
    assert byzantine.left_out_at({"score_rounds": rounds}, [3, 6]) == "2"  # 6 copied (or was copied)
    assert byzantine.left_out_at({"score_rounds": rounds}, [4]) == "-"
    assert byzantine.left_out_at({}, [3]) == ""  # not scored


def test_each_defence_is_listed_with_its_median():
    assert byzantine.listed({"mnc": [0.9, 1.0, 0.8]}, "{:.2f}") == "mnc 0.90 1.00 0.80 (median 0.90)"


@pytest.mark.parametrize("argv, said", [
    (["--rounds", "2"], "--rounds needs --cost"),
    (["--size", "small"], "--size needs --cost"),
    (["--cost", "--attackers", "1"], "--attackers is not read by --cost"),
    (["--cost", "--seeds", "0"], "--seeds is not read by --cost"),
])
def test_a_flag_of_the_other_mode_is_refused_not_ignored(monkeypatch, argv, said):
    monkeypatch.setattr(sys, "argv", ["byzantine.py", *argv])
    monkeypatch.setattr(byzantine, "run", lambda *a: pytest.fail("a run started"))
    monkeypatch.setattr(byzantine, "cost", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as refused:
        byzantine.main()
    assert str(refused.value).startswith(f"error: {said} (")
