"""What an elastic run's lead writes when a quorum forms: its line of membership.jsonl, and the
steps.jsonl records a lead before it committed but did not write (train/elastic.py's _record)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from ..elastic.membership import View


def write_quorum(out_dir: Path, view: View, step: int, in_round: int | None, healed: list[int], every: list) -> None:
    """membership.jsonl's line of the quorum `view`: from which committed `step` (and, redoing a
    round's last step, the round step it went back to: rounds.py), who received the state (`heal`:
    from whom, its bytes and seconds, the emulated link's price: elastic/transfer.py), and
    `every` member's (hash of the committed state all must hold alike, taken after the state was
    loaded into this membership; hash of the state it resumed from, equal to it: nothing lost in
    a transfer or a re-shard; its steps.jsonl; its fault: the members it had and the collective it
    was in when it found them gone, from its flight ring). After a fault: the members lost."""
    faults = {view.slots[r]: e[3]["in"] for r, e in enumerate(every) if e[3] is not None}
    before = {s for e in every if e[3] is not None for s in e[3]["members"]}
    # lost: gone, or back already as a restarted process with nothing committed (-1)
    fresh = {slot for slot, committed in zip(view.slots, view.steps) if committed < 0}
    fault = {"fault": {"lost": sorted(before - (set(view.slots) - fresh)), "in": faults}} if faults else {}
    with open(out_dir / "membership.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "round": in_round, "quorum": view.quorum, "slots": list(view.slots),
                            "committed": list(view.steps), "healed": [view.slots[r] for r in healed],
                            "heal": getattr(healed, "record", None),
                            "state_sha256": [e[0] for e in every], "resumed_sha256": [e[1] for e in every],
                            **fault, "time": time.time(), **view.described()}) + "\n")


def write_due(log, due: dict, log_file: str | None) -> None:
    """The records of the last commit (`due`: {"file", "records"}, carried with the committed state)
    that are missing from the steps.jsonl `log` continues: committed, but the last lead failed
    before writing them. Only into the file they were due in (under torchrun each job has its own)."""
    logged = {r["step"] for r in log.kept}
    for record in due["records"] if due["file"] == log_file else ():
        if record["step"] not in logged:
            log.write(record)
            log.kept.append(record)
