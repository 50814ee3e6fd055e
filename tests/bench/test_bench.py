"""`lowcomm bench` and `lowcomm report` on a tiny configuration (2 strategies that train,
one made to fail, W=2, a few steps): the report's numbers are the runs' own, every plot
is a real PNG, and a failing strategy does not stop the others."""
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest

from lowcomm.cli.main import main
from lowcomm.bench.report import PLOTS
from lowcomm.bench.report.table import COLUMNS
from lowcomm.strategies import Options, Strategy, available, register
from lowcomm.strategies.registry import unregister

pytestmark = pytest.mark.procs

BROKEN = "bench_broken"
TINY = ["--workers", "2", "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "32",
        "--micro-batch", "4", "--eval-batches", "2", "--link", "1gbit,1ms", "--quiet"]


@dataclass
class BrokenOptions(Options):
    def __reduce__(self):
        return _options_in_a_worker, ()


def _options_in_a_worker() -> BrokenOptions:
    """A worker unpickles the run's config, whose options are BrokenOptions: this registers the
    strategy there. In the test process it is registered only while the bench runs, so no
    other test (the contract tests iterate over the registry) ever sees it."""
    if BROKEN not in available():
        register(BROKEN)(Broken)
    return BrokenOptions()


class Broken(Strategy):
    """Fails as soon as a worker builds it."""
    Options = BrokenOptions

    def __init__(self, *args, **kwargs):
        raise RuntimeError("deliberately broken strategy")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "cmp"
    register(BROKEN)(Broken)
    try:
        code = main(["bench", "--strategies", f"ddp,{BROKEN},zero1", "--tokens", "2560", *TINY, "--out", str(out)])
    finally:
        unregister(BROKEN)
    assert code == 1  # a run failed: the exit status says so, after everything else was written
    return out


def summary(path: Path) -> dict:
    return json.loads((path / "summary.json").read_text())


def table(report_md: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in report_md.splitlines() if line.startswith("| ")][1:]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows}


def test_bench_writes_runs_report_and_plots(bench):
    meta = json.loads((bench / "bench.json").read_text())
    assert [(r["label"], r["status"]) for r in meta["runs"]] == [("ddp", "ok"), (BROKEN, "failed"), ("zero1", "ok")]
    assert "deliberately broken strategy" in meta["runs"][1]["error"]
    answer = (bench / "report.md").read_text().split("\n\n")[1]
    assert answer.startswith("**Answer.**") and f"Failed, so left out: {BROKEN}" in answer
    for name in ("ddp", "zero1"):
        s = summary(bench / name)
        assert s["strategy"] == name and s["steps"] == 2560 // (2 * 4 * 32) and s["tokens"] == 2560
    for name in PLOTS:
        data = (bench / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
        width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
        assert width >= 400 and height >= 300
        assert f"({name})" in (bench / "report.md").read_text()


def test_table_numbers_are_the_runs_numbers(bench):
    rows = table((bench / "report.md").read_text())
    assert rows[BROKEN][0].startswith("failed:") and "deliberately broken strategy" in rows[BROKEN][0]
    finals = {n: summary(bench / n)["final_val_loss"] for n in ("ddp", "zero1")}
    target = max(finals.values())
    for name in ("ddp", "zero1"):
        s = summary(bench / name)
        expect = {"final val loss": s["final_val_loss"], "tokens/s": s["tokens_per_s"], "tokens trained": s["tokens"],
                  "wire MB/step/rank": s["wire_bytes_per_rank_per_step"] / 1e6,
                  "exposed comm %": 100 * s["exposed_comm_fraction"],
                  "optimizer state MB/rank": s["optimizer_state_bytes_per_rank"] / 1e6,
                  "peak memory MiB": s["peak_mem_bytes"] / 2**20}
        for (key, header, fmt), cell in zip(COLUMNS, rows[name]):
            if header in expect:
                assert cell == fmt.format(expect[header]), (name, header)
        steps = [json.loads(line) for line in (bench / name / "steps.jsonl").read_text().splitlines()]
        if finals[name] == target:  # the worst run reaches the target at its last step: all of its time and bytes
            headers = [h for _, h, _ in COLUMNS]
            t = rows[name][headers.index("time to target (s)")]
            mb = rows[name][headers.index("MB sent to target (all ranks)")]
            assert t == f"{sum(r['wall_s'] for r in steps):.1f}"
            assert mb == f"{sum(r['wire_bytes'] for r in steps) / 1e6:.2f}"
    report = json.loads((bench / "report.json").read_text())
    assert report["target_loss"] == target
    by_label = {r["label"]: r for r in report["rows"]}
    assert by_label["zero1"]["tokens_per_s"] == summary(bench / "zero1")["tokens_per_s"]


def test_report_rebuilds_from_run_dirs_and_refuses_others(bench, tmp_path, capsys):
    out = tmp_path / "again"
    assert main(["report", str(bench / "ddp"), str(bench / "zero1"), "--out", str(out)]) == 0
    again = json.loads((out / "report.json").read_text())["rows"]
    first = {r["label"]: r for r in json.loads((bench / "report.json").read_text())["rows"]}
    assert again == [first["ddp"], first["zero1"]]
    assert all((out / name).is_file() for name in PLOTS)
    capsys.readouterr()
    (tmp_path / "not_a_run").mkdir()
    assert main(["report", str(bench / "ddp"), str(tmp_path / "not_a_run"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "is not a lowcomm run" in err[0]
    assert not (tmp_path / "x").exists()


def test_plan_calibrates_from_the_bench(bench, capsys):
    assert main(["plan", "--calibrate", str(bench), "--strategies", "ddp,zero1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # one worker's compute per token, measured as a step waits for it: each step's slowest rank's
    # forward/backward seconds over its tokens, averaged over steps; the model's, so every strategy
    # is priced at the median of the runs' figures (of two runs, their geometric mean)
    def per_token(name):
        records = [json.loads(line) for line in (bench / name / "steps.jsonl").read_text().splitlines()]
        return sum(max(c / (m * 4 * 32) for c, m in zip(r["per_rank"]["compute_s"], r["per_rank"]["micro_batches"]))
                   for r in records) / len(records)
    model = (per_token("ddp") * per_token("zero1")) ** 0.5
    assert [p["compute_s"] for p in out["ranked"]] == pytest.approx([2 * 4 * 32 / 2 * model] * 2, rel=1e-9)
    assert out["target_loss"] == max(summary(bench / n)["final_val_loss"] for n in ("ddp", "zero1"))
    assert all(p["time_to_target_s"] is not None and math.isfinite(p["time_to_target_s"]) for p in out["ranked"])
    assert out["recommendation"].startswith(f"use {out['ranked'][0]['label']}: predicted to reach the target loss")



def test_plan_says_a_calibration_transfers_loss_per_token_not_a_devices_speed(bench, capsys):
    """A 1e8-param plan calibrated on the bench's tiny model: speed and overhead are extrapolated
    (one warning line), the batch too; --tune ranks a measured setting by time to target and says
    which knob the calibration did not cover."""
    assert main(["plan", "--calibrate", str(bench), "--params", "1e8", "--strategies", "ddp,diloco", "--tune",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    warnings = out["assumptions"]["warnings"]
    assert any("a device's speed does not transfer from a calibration, only loss per token does" in w
               for w in warnings)
    assert any("give --tokens-per-step" in w for w in warnings)
    assert out["assumptions"]["loss_per_token_from"].startswith("measured by the bench")
    tuned = {t["strategy"]: t for t in out["tuned"]}
    assert tuned["ddp"]["basis"].startswith("time to the target loss")  # bucket size leaves loss per token as is
    assert any("does not cover sync_every=" in n for n in tuned["diloco"]["notes"])  # the bench ran no diloco

GROUPED = ["--workers", "4", "--replicas", "2", "--intra-link", "10gbit,50us"]


@pytest.fixture(scope="module")
def grouped_bench(tmp_path_factory):
    """ddp and zero1 as 2 replicas of 2 workers: every run of the bench gets the replica flags."""
    out = tmp_path_factory.mktemp("bench") / "grouped"
    flags = TINY[2:] + GROUPED  # TINY without its --workers 2
    assert main(["bench", "--strategies", "ddp,zero1", "--tokens", "2048", *flags, "--out", str(out)]) == 0
    return out


def test_bench_runs_every_strategy_as_replica_groups(grouped_bench):
    report = (grouped_bench / "report.md").read_text()
    assert "2 replicas of 2 (ddp inside), link 1gbit,1ms across replicas, intra-link 10gbit,50us inside" in report
    rows = table(report)
    for name in ("ddp", "zero1"):
        s = summary(grouped_bench / name)
        assert (s["replicas"], s["inside"], s["steps"]) == (2, "ddp", 2048 // (4 * 4 * 32))
        for level in ("intra", "cross"):
            counted = s["levels"][level]
            assert counted["wire_bytes"] == counted["planned_wire_bytes"] > 0, (name, level)
        headers = [h for _, h, _ in COLUMNS]
        assert rows[name][headers.index("wire MB/step/rank")] == f"{s['wire_bytes_per_rank_per_step'] / 1e6:.3f}"


def test_plan_of_the_grouped_bench_prices_the_bytes_each_level_counted(grouped_bench, capsys):
    steps = summary(grouped_bench / "ddp")["steps"]
    assert main(["plan", "--calibrate", str(grouped_bench), "--strategies", "ddp,zero1", "--steps", str(steps),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cluster"]["replicas"] == 2 and out["cluster"]["intra_link"]["bandwidth"] == "10gbit"
    for p in out["ranked"]:
        s = summary(grouped_bench / p["strategy"])
        for level in ("intra", "cross"):
            planned = p["levels"][level]["wire_bytes_per_rank_per_step"] * 4 * steps
            assert planned == pytest.approx(s["levels"][level]["wire_bytes"], rel=1e-9), (p["strategy"], level)
