"""The end-of-run paragraph says who attacked, how the outer steps aggregated, and whom scoring
left out (read from summary.json's fields)."""
from __future__ import annotations

from lowcomm.metrics.summary import describe_untrusted


def test_the_paragraph_names_the_attack_the_aggregate_and_who_was_left_out():
    rounds = [{"round": k, "left_out": out} for k, out in enumerate([[], [3], [3], [], [1, 3]])]
    text = describe_untrusted({"attack": "sign-flip", "attackers": [3], "aggregate": "median-norm-clip",
                                "score_rounds": rounds})
    assert text == (" Emulated attack sign-flip by worker(s) 3. Outer steps aggregated by median-norm-clip. Scoring "
                    "left out worker 1 in 1 of 5 rounds (first at round 4); worker 3 in 3 of 5 rounds (first at "
                    "round 1).")
    assert describe_untrusted({"aggregate": "mean", "score_rounds": [{"round": 0, "left_out": []}]}) == \
        " Scoring left nobody out in 1 round."
    assert describe_untrusted({"aggregate": "mean"}) == ""  # an ordinary run: nothing said
    # across replica groups a replica is one worker: named so
    assert describe_untrusted({"attack": "zero", "attackers": [1], "replicas": 2, "workers": 3, "inside": None}) == \
        " Emulated attack zero by worker(s) 1."  # a flat run (here an elastic one that lost a worker)
    text = describe_untrusted({"attack": "sign-flip", "attackers": [1], "replicas": 2, "workers": 4, "inside": "fsdp",
                               "score_rounds": rounds[:2]})
    assert text == (" Emulated attack sign-flip by replica(s) 1. Scoring left out replica 3 in 1 of 2 rounds (first "
                    "at round 1).")


def test_the_report_tabulates_each_workers_score_round_by_round(tmp_path):
    from lowcomm.bench.report.untrusted import section
    from lowcomm.metrics.runs import RecordedRun

    rounds = [{"round": 0, "scores": [0.02, -0.01], "left_out": [], "events": []},
              {"round": 1, "scores": [0.01, -0.03], "left_out": [1],
               "events": ["worker 1 left out: its score was negative for 2 rounds"]}]
    scored = RecordedRun("diloco (byz)", tmp_path, {"attack": "sign-flip", "attackers": [1], "aggregate": "mean",
                                                    "score_rounds": rounds}, [], {})
    plain = RecordedRun("ddp", tmp_path, {"aggregate": "mean"}, [], {})
    text = section([plain, scored])
    assert "**ddp**" not in text and "**diloco (byz)**: Emulated attack sign-flip by worker(s) 1." in text
    assert "| 0 | +0.0200 | -0.0100 |  |" in text
    assert "| 1 | +0.0100 | -0.0300 **out** | worker 1 left out: its score was negative for 2 rounds |" in text
    assert section([plain]) == ""
