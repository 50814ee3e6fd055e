"""summary.json's elastic.heals: the heals membership.jsonl recorded, added up (elastic/transfer.py)."""
import json

from lowcomm.elastic.transfer import heal_totals


def test_the_heals_of_membership_jsonl_are_added_up_and_quorums_without_one_are_skipped(tmp_path):
    path = tmp_path / "membership.jsonl"
    quorums = [{"step": 0, "healed": []},  # the first quorum: nobody behind, no record
               {"step": 4, "healed": [3], "heal": {"from": 0, "bytes": 1000, "seconds": 0.25, "link_s": 0.2}},
               {"step": 6, "healed": [], "heal": None},
               {"step": 8, "healed": [1], "heal": {"from": 2, "bytes": 3000, "seconds": 0.5, "link_s": 0.3}}]
    path.write_text("".join(json.dumps(q) + "\n" for q in quorums))
    assert heal_totals(path) == {"heals": 2, "bytes": 4000, "seconds": 0.75, "link_s": 0.5}
    assert heal_totals(tmp_path / "none.jsonl") == {"heals": 0, "bytes": 0, "seconds": 0.0, "link_s": 0.0}
