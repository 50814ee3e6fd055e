"""The end-of-run paragraph says who attacked, how the outer steps aggregated, and whom scoring
left out (read from summary.json's fields)."""
from __future__ import annotations

from lowcomm.metrics.summary import _describe_untrusted


def test_the_paragraph_names_the_attack_the_aggregate_and_who_was_left_out():
    rounds = [{"round": k, "left_out": out} for k, out in enumerate([[], [3], [3], [], [1, 3]])]
    text = _describe_untrusted({"attack": "sign-flip", "attackers": [3], "aggregate": "median-norm-clip",
                                "score_rounds": rounds})
    assert text == (" Emulated attack sign-flip by worker(s) 3. Outer steps aggregated by median-norm-clip. Scoring "
                    "left out worker 1 in 1 of 5 rounds (first at round 4); worker 3 in 3 of 5 rounds (first at "
                    "round 1).")
    assert _describe_untrusted({"aggregate": "mean", "score_rounds": [{"round": 0, "left_out": []}]}) == \
        " Scoring left nobody out in 1 round."
    assert _describe_untrusted({"aggregate": "mean"}) == ""  # an ordinary run: nothing said
