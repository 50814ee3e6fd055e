"""With replica groups every view splits bytes and waits by level: the progress line and the
end paragraph, steps.jsonl, the trace's collectives, and `lowcomm report`. One tiny run of 2
replicas of 2 processes (W=4, 4 steps, traced) as a user starts it, checked against its own
summary.json; a flat run's records, line and report keep their old shape."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from lowcomm.metrics.progress import level_text
from lowcomm.metrics.runlog import FIELDS, LEVEL_FIELDS, step_record
from lowcomm.diagnose.trace import comm_wire_bytes, nesting_errors
from lowcomm.bench.report import load_entries, write_report

pytestmark = pytest.mark.procs

STEPS, WORKERS = 4, 4
LEVELS = ("cross", "intra")
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife.\n") * 80


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("levels")
    (root / "text.txt").write_text(TEXT)
    out = root / "run"
    argv = ["train", "--strategy", "ddp", "--workers", str(WORKERS), "--replicas", "2",
            "--intra-link", "10gbit,50us", "--link", "100mbit,5ms", "--steps", str(STEPS),
            "--micro-batch", "2", "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
            "--eval-every", "0", "--eval-batches", "1", "--data", str(root / "text.txt"), "--trace",
            "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "lowcomm", *argv], capture_output=True, text=True, timeout=300,
                          check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return {"out": out, "stdout": proc.stdout, "summary": json.loads((out / "summary.json").read_text()),
            "steps": steps, "trace": json.loads((out / "trace.json").read_text())}


def test_step_records_split_bytes_and_waits_by_level_as_the_summary_counts_them(run):
    summary, steps = run["summary"], run["steps"]
    assert len(steps) == STEPS
    for r in steps:
        assert r["wire_bytes_cross"] + r["wire_bytes_intra"] == r["wire_bytes"]
        for level in LEVELS:
            slowest = max(r["per_rank"][f"exposed_comm_s_{level}"])
            assert r[f"exposed_comm_s_{level}"] == pytest.approx(slowest, abs=1e-6)  # per rank: rounded
    for level in LEVELS:
        counted = summary["levels"][level]
        assert counted["wire_bytes"] > 0
        assert sum(r[f"wire_bytes_{level}"] for r in steps) == counted["wire_bytes"], level
        per_rank = [sum(r["per_rank"][f"exposed_comm_s_{level}"][i] for r in steps) for i in range(WORKERS)]
        assert per_rank == pytest.approx(counted["exposed_comm_s_per_rank"], abs=1e-5 * STEPS), level


def test_progress_line_and_end_paragraph_show_each_level(run):
    summary, stdout = run["summary"], run["stdout"]
    last = next(line for line in stdout.splitlines() if line.startswith(f"step {STEPS}/{STEPS}"))
    m = re.search(r"across replicas ([\d.,]+) MB/step exposed (\d+)% \| inside replicas ([\d.,]+) MB/step "
                  r"exposed (\d+)%", last)
    assert m, last
    for level, shown in zip(LEVELS, (m[1], m[3])):
        assert float(shown) == pytest.approx(summary["levels"][level]["wire_bytes"] / 1e6 / STEPS, abs=1e-3)
    assert "By level (2 replicas of 2" in stdout and "bytes per token" in stdout


def test_trace_tags_each_collective_with_its_level_and_lane(run):
    doc, summary = run["trace"], run["summary"]
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    comm = [e for e in spans if e["cat"] == "comm"]
    assert {e["args"]["level"] for e in comm} == set(LEVELS)
    assert {e["args"]["level"] for e in spans if e["cat"] == "meta"} == {"world"}  # bookkeeping, on the world
    for level in LEVELS:
        assert comm_wire_bytes(doc, level) == summary["levels"][level]["wire_bytes"], level
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    for e in comm:  # each level on lanes of its own, named by it
        assert lanes[e["pid"], e["tid"]].startswith(f"{e['args']['level']} comm "), (e, lanes)
    assert {"cross comm 0", "intra comm 0"} <= set(lanes.values())
    assert {e["args"]["level"] for e in spans if e["cat"] == "wait"} <= {"cross", "intra", "world"}
    assert not nesting_errors(doc)


def test_report_shows_bytes_per_token_and_waits_per_level(run, tmp_path):
    summary = run["summary"]
    rows = write_report(load_entries([str(run["out"])]), tmp_path / "report")
    text = (tmp_path / "report" / "report.md").read_text()
    assert "| B/token across replicas | exposed % across | B/token inside replicas | exposed % inside |" in text
    assert "on 4 workers as 2 replicas of 2, link 100mbit,5ms across replicas, link 10gbit,50us inside" in text
    assert re.search(r"By level \(.*\): ddp [\d.,]+ across replicas \(\d+%\), [\d.,]+ inside \(\d+%\)\.", text), text
    row = rows[0]
    for level in LEVELS:
        assert row[f"{level}_bytes_per_token"] == summary["levels"][level]["wire_bytes"] / summary["tokens"]
        waited = sum(summary["levels"][level]["exposed_comm_s_per_rank"]) / WORKERS
        assert row[f"{level}_exposed_pct"] == pytest.approx(100 * waited / summary["wall_s"])
    for name in ("loss_vs_time.png", "loss_vs_bytes.png", "time_breakdown.png", "tokens_per_s.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0


def test_a_flat_run_keeps_its_record_line_and_report(run, tmp_path, monkeypatch):
    monkeypatch.setattr("lowcomm.bench.report.write_plots", lambda *a: [])  # the test above draws them
    every_rank = torch.ones(WORKERS, len(FIELDS) + len(LEVEL_FIELDS), dtype=torch.float64)
    record = step_record(1, every_rank)
    assert not any(key.endswith(("_cross", "_intra")) for key in [*record, *record["per_rank"]])
    assert level_text({}) == ""
    flat = tmp_path / "flat"  # the same run, read as if it had been flat
    shutil.copytree(run["out"], flat)
    summary = {**run["summary"], "replicas": WORKERS, "levels": None}
    (flat / "summary.json").write_text(json.dumps(summary))
    config = (flat / "config.toml").read_text()
    (flat / "config.toml").write_text(config.replace("replicas = 2", "replicas = 0"))
    rows = write_report(load_entries([str(flat)]), tmp_path / "report")
    text = (tmp_path / "report" / "report.md").read_text()
    assert "across" not in text and "By level" not in text
    assert not any("bytes_per_token" in key for key in rows[0])
