"""report.md's answer (first to the target, fewest bytes, what to pick and why), runs of
other setups flagged as not comparable, and plots fit for a slide. Runs are written by
hand here (summary.json, steps.jsonl, config.toml), so every number is known and no
worker is started."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib.figure
import pytest

from lowcomm.cli.main import main
from lowcomm.bench.report import load_entries, write_report
from lowcomm.bench.report.plots import ABOVE_TARGET
from fake_runs import fake_run

@pytest.fixture(autouse=True)
def no_plots(request, monkeypatch):
    """Drawing four PNGs takes seconds; only the test about plots draws them."""
    if "plots" not in request.node.name:
        monkeypatch.setattr("lowcomm.bench.report.write_plots", lambda *a: [])


def report_of(tmp_path: Path, runs: list[Path], target: float | None = None) -> tuple[str, dict]:
    out = tmp_path / "report"
    write_report(load_entries([str(r) for r in runs]), out, target)
    return (out / "report.md").read_text(), json.loads((out / "report.json").read_text())


def answer_of(report_md: str) -> str:
    first = report_md.split("\n\n")[1]
    assert first.startswith("**Answer.**"), report_md[:300]
    return first


def test_answer_names_the_fastest_the_fewest_bytes_and_a_pick_with_its_reason(tmp_path):
    runs = [fake_run(tmp_path, "ddp", [(1, 100e6, 4.0), (2, 200e6, 3.0)]),
            fake_run(tmp_path, "diloco", [(2, 0, 4.5), (4, 10e6, 3.0)])]
    text = answer_of(report_of(tmp_path, runs)[0])
    assert "Target loss 3.0000, on 2 workers, link 100mbit,10ms, GPT 0.12M params (tiny, 2 layers, width 64)" in text
    assert "First to reach it: **ddp** (2.0 s; next diloco, 4.0 s)." in text
    assert "Fewest bytes to it: **diloco** (10.00 MB, 20.0x fewer than ddp)." in text
    assert "Pick **ddp** for this setting: it reaches the target first; diloco sends 20.0x fewer bytes but " \
           "takes 2.0x as long here" in text


def test_a_tie_in_time_is_decided_by_bytes_then_optimizer_memory(tmp_path):
    """ddp and zero1 reach the target 3% apart (noise): zero1, with half the optimizer state, is picked."""
    runs = [fake_run(tmp_path, "ddp", [(1, 100e6, 4.0), (2.0, 200e6, 3.0)], state_mb=8),
            fake_run(tmp_path, "zero1", [(1, 100e6, 4.0), (2.06, 200e6, 3.0)], state_mb=4)]
    text = answer_of(report_of(tmp_path, runs)[0])
    assert "First to reach it: **ddp**" in text
    assert "Pick **zero1** for this setting: within 3% of ddp's time" in text and "less optimizer state" in text


def test_a_pick_that_ends_well_above_the_lowest_final_loss_is_said_to(tmp_path):
    """The default target is the loss every run reached: the run that only just reached it at its
    end can be first to it, and the answer must not hide that it ends far above the others."""
    runs = [fake_run(tmp_path, "ddp", [(2, 100e6, 4.6), (4, 200e6, 3.3)]),
            fake_run(tmp_path, "onebit_adam", [(1, 10e6, 4.5), (3, 20e6, 4.5)])]
    text = answer_of(report_of(tmp_path, runs)[0])
    assert "Pick **onebit_adam**" in text
    assert "But mind where it ends: onebit_adam's final loss 4.5000 is 36% above ddp's 3.3000" in text
    close = [fake_run(tmp_path / "b", "ddp", [(2, 100e6, 4.6), (4, 200e6, 3.3)]),
             fake_run(tmp_path / "b", "zero1", [(1, 10e6, 4.0), (3, 20e6, 3.32)])]
    assert "mind where it ends" not in answer_of(report_of(tmp_path / "b", close)[0])


def test_a_run_that_ends_above_its_starting_loss_sets_no_target_and_is_named(tmp_path):
    """A diverged run's final loss as the target would make every run "reach" it at once."""
    def with_start(run: Path, start: float) -> Path:  # the first steps' training loss, as a run logs it
        records = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
        (run / "steps.jsonl").write_text("".join(json.dumps({**r, "loss": start}) + "\n" for r in records))
        return run
    runs = [with_start(fake_run(tmp_path, "ddp", [(1, 100e6, 4.0), (2, 200e6, 3.0)]), 5.5),
            with_start(fake_run(tmp_path, "zero1", [(1, 100e6, 4.2), (2, 200e6, 3.2)]), 5.5),
            with_start(fake_run(tmp_path, "onebit_adam", [(1, 10e6, 4.5), (2, 20e6, 10.1)]), 5.5)]
    report_md, report = report_of(tmp_path, runs)
    assert report["target_loss"] == 3.2  # not onebit_adam's 10.1
    text = answer_of(report_md)
    assert "First to reach it: **ddp**" in text and "**onebit_adam**" not in text
    assert ("Ended above the loss it started at (diverged), so left out of the target and this answer: "
            "onebit_adam (10.1000, from 5.5000).") in text


def test_a_run_that_got_worse_at_its_end_sets_no_target_and_is_named(tmp_path):
    """diloco's last validation (4.76) is far above its own best (3.97): as the target, every other
    run would "reach" it at its first validation point and the fastest at any load would win."""
    runs = [fake_run(tmp_path, "ddp", [(0.5, 50e6, 5.0), (1, 100e6, 4.6), (2, 200e6, 3.0)]),
            fake_run(tmp_path, "zero1", [(0.5, 50e6, 5.0), (1, 100e6, 4.6), (2.5, 200e6, 3.2)]),
            fake_run(tmp_path, "diloco", [(0.5, 0, 4.5), (1, 10e6, 3.97), (1.5, 20e6, 4.76)])]
    report_md, report = report_of(tmp_path, runs)
    assert report["target_loss"] == 3.2  # not diloco's 4.76, which ddp and zero1 pass at 1 s
    rows = {r["label"]: r for r in report["rows"]}
    assert (rows["diloco"]["regressed"], rows["diloco"]["best_val_loss"], rows["diloco"]["best_val_step"]) == \
        (True, 3.97, 2)
    assert [r["comparable"] for r in report["rows"]] == [True] * 3
    assert not rows["ddp"]["regressed"] and not rows["zero1"]["regressed"]
    text = answer_of(report_md)
    assert "First to reach it: **ddp**" in text and "**diloco**" not in text
    assert ("Got worse at its end (final loss over 5% above its own best), so left out of the target and this "
            "answer: diloco (4.7600 at its end, 3.9700 at step 2).") in text
    # a run that rises a little at its end (validation noise) still sets the target
    noisy = fake_run(tmp_path / "noisy", "diloco", [(0.5, 0, 4.5), (1, 10e6, 3.97), (1.5, 20e6, 4.05)])
    _, again = report_of(tmp_path / "noisy", [runs[0], noisy])
    assert again["target_loss"] == 4.05


def test_each_runs_load_is_in_the_table_and_a_timing_dependent_run_is_marked(tmp_path):
    """Adaptive acco's loss moves with the timing (the default bench: 3.04, 3.31, 3.30 on three
    days): its row says so; deterministic acco's does not."""
    runs = [fake_run(tmp_path, "ddp", [(1, 100e6, 4.0), (2, 200e6, 3.0)], load=3.14),
            fake_run(tmp_path, "acco", [(1, 100e6, 4.0), (2, 200e6, 3.1)], load=4.0,
                     options={"deterministic": False}),
            fake_run(tmp_path, "acco", [(1, 100e6, 4.0), (2, 200e6, 3.1)], load=4.0,
                     options={"deterministic": True}, name="acco-det")]
    report_md, report = report_of(tmp_path, runs)
    head = next(line for line in report_md.splitlines() if line.startswith("| strategy"))
    assert head.rstrip(" |").endswith("| load at end")
    lines = {line.split(" | ")[0]: line for line in report_md.splitlines() if line.startswith("| ")}
    assert lines["| ddp"].endswith("| 3.1 |") and lines["| acco (acco) ‡"].endswith("| 4.0 |")
    assert "| acco (acco-det) |" in report_md  # no mark
    assert "Load at end: the 1-minute load average when the run ended, on 2 cores" in report_md
    assert ("‡ acco (acco): its result moves with the timing, so with the load: it computes micro-batches while "
            "it communicates") in report_md
    assert [r["load"] for r in report["rows"]] == [3.14, 4.0, 4.0]


def test_runs_whose_loads_differ_more_than_their_times_are_not_ranked_by_time(tmp_path):
    """ddp timed at load 10.9 and diloco at 24.5 on 2 cores (as a default bench ran them):
    diloco's 1.8x longer time is less than the 2.25x contention it ran under, so no ranking."""
    def two(root, ddp_load, diloco_load):
        return report_of(root, [fake_run(root, "ddp", [(5, 100e6, 4.0), (10, 200e6, 3.0)], load=ddp_load),
                                fake_run(root, "diloco", [(9, 1e6, 4.0), (18, 2e6, 3.0)], load=diloco_load)])[0]
    text = answer_of(two(tmp_path / "a", 10.9, 24.5))
    assert ("Not ranked by time, nor picked: diloco took 1.80x ddp's time to the target but ran under 2.25x its "
            "contention (load 24.5 on 2 cores against load 10.9 on 2 cores), so the load alone could make it "
            "faster. Rerun on a quieter machine, or with --repeats 2") in text
    assert "First to reach it" not in text and "Pick" not in text
    assert "Fewest bytes to it, which the load does not move: **diloco** (2.00 MB)." in text
    # equal loads, or loads apart by less than the times are: ranked as before
    for root, loads in (("b", (10.9, 10.9)), ("c", (10.9, 12.0)), ("d", (24.5, 10.9))):
        text = answer_of(two(tmp_path / root, *loads))
        assert "First to reach it: **ddp** (10.0 s; next diloco, 18.0 s)." in text, loads
    # ddp's lead stands, but not the runner-up's: zero1 is 1.43x faster than diloco, whose load was 1.5x
    three = [fake_run(tmp_path / "f", "ddp", [(5, 100e6, 4.0), (10, 200e6, 3.0)], load=8.0),
             fake_run(tmp_path / "f", "zero1", [(7, 100e6, 4.0), (14, 200e6, 3.0)], load=8.0),
             fake_run(tmp_path / "f", "diloco", [(10, 1e6, 4.0), (20, 2e6, 3.0)], load=12.0)]
    assert "First to reach it: **ddp** (10.0 s). Fewest bytes" in answer_of(report_of(tmp_path / "f", three)[0])
    # a tie within the noise is no tie when the loads could hide a difference beyond it
    tied = [fake_run(tmp_path / "e", "ddp", [(5, 100e6, 4.0), (10, 200e6, 3.0)], load=2.0),
            fake_run(tmp_path / "e", "zero1", [(5, 100e6, 4.0), (10.2, 200e6, 3.0)], load=3.0)]
    assert "zero1 took 1.02x ddp's time to the target but ran under 1.50x its contention" in \
        answer_of(report_of(tmp_path / "e", tied)[0])


def test_repeated_runs_are_compared_round_by_round(tmp_path):
    """A bench of two interleaved rounds (ddp, diloco, then diloco, ddp) while the load climbs:
    the answer takes each strategy once, at the median of its rounds, and checks the load against
    the rounds' ratios, in which the climb cancels out."""
    bench = tmp_path / "bench"
    plan = [("ddp", 1, 4.0, 10.0), ("diloco", 1, 6.0, 15.0), ("diloco", 2, 8.0, 16.0), ("ddp", 2, 10.0, 13.0)]
    listed = []
    for strategy, i, load, seconds in plan:
        fake_run(bench, strategy, [(seconds / 2, 100e6, 4.0), (seconds, 200e6, 3.0)], load=load,
                 name=f"{strategy}/r{i}")
        listed.append({"label": f"{strategy} r{i}", "dir": f"{strategy}/r{i}", "status": "ok", "strategy": strategy,
                       "group": strategy, "round": i})
    (bench / "bench.json").write_text(json.dumps({"lowcomm_bench": 1, "runs": listed}))
    report_md, report = report_of(tmp_path, [bench])
    assert [r["label"] for r in report["rows"]] == ["ddp r1", "diloco r1", "diloco r2", "ddp r2"]
    text = answer_of(report_md)
    # time ratios 1.5 and 16/13, contention ratios 1.5 and 0.8: geometric means 1.36 and 1.10
    assert "First to reach it: **ddp** (11.5 s, median of 2 rounds; next diloco, 15.5 s, median of 2 rounds)." in text
    assert "Not ranked" not in text
    # the second round at loads apart by far more than the times (ddp at 4, diloco at 30): refused
    for r in listed[2:]:
        summary = json.loads((bench / r["dir"] / "summary.json").read_text())
        summary["machine"]["load_at_end"] = 4.0 if r["strategy"] == "ddp" else 30.0
        (bench / r["dir"] / "summary.json").write_text(json.dumps(summary))
    text = answer_of(report_of(tmp_path / "again", [bench])[0])
    assert ("Not ranked by time, nor picked: diloco took 1.36x ddp's time to the target but ran under 3.35x its "
            "contention (load 6.0/30.0 on 2 cores against load 4.0/4.0 on 2 cores; geometric means over 2 "
            "interleaved rounds), so the load alone could make it faster. Rerun on a quieter machine, or with more "
            "rounds (--repeats 3 or more).") in text


def test_no_run_reaching_the_target_says_so(tmp_path):
    runs = [fake_run(tmp_path, "ddp", [(1, 1e6, 4.0), (2, 2e6, 3.5)])]
    text = answer_of(report_of(tmp_path, runs, target=3.0)[0])
    assert "No run reached the target loss 3.0000; the lowest final loss is **ddp**'s (3.5000)" in text


def test_runs_of_another_setup_are_flagged_and_left_out_of_the_answer(tmp_path):
    a = fake_run(tmp_path / "a", "ddp", [(1, 1e6, 4.0), (2, 2e6, 3.0)])
    b = fake_run(tmp_path / "b", "zero1", [(1, 1e6, 4.0), (2, 2e6, 3.1)])
    small = fake_run(tmp_path / "c", "demo", [(0.5, 1e5, 3.5), (1, 2e5, 2.5)], params=45_000, steps=25)
    other_data = fake_run(tmp_path / "d", "acco", [(0.5, 1e5, 3.5), (1, 2e5, 2.9)], data="pydoc")
    more_workers = fake_run(tmp_path / "e", "diloco", [(0.5, 1e5, 3.5), (1, 2e5, 2.9)], workers=4)
    report_md, report = report_of(tmp_path, [a, b, small, other_data, more_workers])
    rows = {r["label"]: r for r in report["rows"]}
    assert [label for label, r in rows.items() if r["comparable"]] == ["ddp", "zero1"]
    assert rows["demo"]["not_comparable"] == ["model 0.045M, seq 32 (others: 0.12M, seq 32)",
                                              "6,400 tokens planned (others: 512)"]
    assert rows["acco"]["not_comparable"] == ["data pydoc (others: shakespeare)"]
    assert rows["diloco"]["not_comparable"][-1] == "4 workers (others: 2)"
    assert "| demo † |" in report_md and "| ddp |" in report_md
    assert "† Not comparable with the other runs" in report_md
    # the target and the answer come from the comparable runs only: demo's 2.5 would win otherwise
    assert report["target_loss"] == 3.1
    text = answer_of(report_md)
    assert "**ddp**" in text and "**demo**" not in text and "left out of this answer: demo, acco, diloco" in text


def test_tokens_beyond_the_plan_are_stated(tmp_path):
    runs = [fake_run(tmp_path, "zero1", [(1, 1e6, 4.0), (2, 2e6, 3.0)]),
            fake_run(tmp_path, "acco", [(1, 1e6, 4.0), (2, 2e6, 3.0)], extra_tokens=256)]
    report_md, report = report_of(tmp_path, runs)
    acco = next(r for r in report["rows"] if r["label"] == "acco")
    assert (acco["tokens"], acco["tokens_planned"]) == (512 + 256, 512)
    assert "acco 768 (+50%)" in answer_of(report_md)
    assert "| acco | 3.0000 | 768 |" in report_md


def test_plots_have_a_title_units_distinct_styles_and_target_marks(tmp_path, monkeypatch):
    figures = {}
    save = matplotlib.figure.Figure.savefig

    def keep(fig, path, *a, **k):
        figures[Path(path).name] = fig
        return save(fig, path, *a, **k)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    runs = [fake_run(tmp_path, "ddp", [(1, 100e6, 5.5), (2, 200e6, 3.2), (3, 300e6, 3.0)]),
            fake_run(tmp_path, "zero1", [(1, 100e6, 5.5), (2, 200e6, 3.2), (3, 300e6, 3.0)]),
            fake_run(tmp_path, "diloco", [(1, 0, 5.6), (2, 8e6, 3.1), (3, 16e6, 2.9)])]
    report_of(tmp_path, runs)
    for name in ("loss_vs_time.png", "loss_vs_bytes.png", "time_breakdown.png", "rank_breakdown.png",
                 "tokens_per_s.png"):
        title = figures[name]._suptitle.get_text()
        assert "2 workers, link 100mbit,10ms, GPT 0.12M params" in title, name
        ax = figures[name].axes[0]
        assert "(" in ax.get_ylabel(), (name, ax.get_ylabel())  # a unit
    by_bytes = figures["loss_vs_bytes.png"].axes[0]
    assert by_bytes.get_xscale() == "log" and "(MB)" in by_bytes.get_xlabel()
    curves = [line for line in by_bytes.get_lines() if line.get_marker() not in ("*", "None")]
    assert all(x > 0 for line in curves for x in line.get_xdata())  # diloco's 0-byte point is not drawn
    assert "diloco (1 points at 0 MB not shown)" in [t.get_text() for t in by_bytes.get_legend().get_texts()]
    ddp, zero1 = curves[0], curves[1]  # the same numbers, drawn so both can be told apart
    assert (ddp.get_linestyle(), ddp.get_marker()) != (zero1.get_linestyle(), zero1.get_marker())
    by_time = figures["loss_vs_time.png"].axes[0]
    assert by_time.get_xscale() == "linear"
    stars = [line for line in by_time.get_lines() if line.get_marker() == "*"]
    assert len(stars) == 3 and all(line.get_ydata()[0] == 3.0 for line in stars)  # target: the worst final loss
    low, high = by_time.get_ylim()
    assert low < 2.9 and high == pytest.approx(3.0 + ABOVE_TARGET * 0.1)  # not stretched to the first 5.5
    assert "(s" in by_time.get_xlabel()


def test_bench_style_report_from_the_cli_prints_the_answer_first(tmp_path, capsys):
    runs = [fake_run(tmp_path, "ddp", [(1, 100e6, 4.0), (2, 200e6, 3.0)])]
    assert main(["report", str(runs[0]), "--out", str(tmp_path / "r")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# lowcomm report\n\n**Answer.**")


def test_report_of_runs_is_written_under_runs_and_says_where(tmp_path, monkeypatch, capsys):
    """Not to ./report: run in a clone, that left a directory beside the sources that git did
    not ignore. An --out that cannot be written is one error line."""
    runs = [fake_run(tmp_path / "in", "ddp", [(1, 100e6, 4.0), (2, 200e6, 3.0)]),
            fake_run(tmp_path / "in", "diloco", [(2, 0, 4.5), (4, 10e6, 3.0)])]
    work = tmp_path / "clone"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["report", *map(str, runs)]) == 0
    (written,) = (work / "runs").iterdir()
    assert written.name.startswith("report-") and (written / "report.md").is_file()
    assert sorted(p.name for p in work.iterdir()) == ["runs"]
    assert capsys.readouterr().out.rstrip().endswith(f"report: {Path('runs') / written.name / 'report.md'} and "
                                                     f"plots in {Path('runs') / written.name}/")
    assert main(["report", *map(str, runs), "--out", "/proc/report"]) == 2
    assert capsys.readouterr().err.strip() == "error: --out '/proc/report' cannot be written ('/proc' is not writable)"


def test_a_run_with_outer_syncs_shows_what_each_sync_left_exposed(tmp_path):
    """diloco's 3 outer syncs left 0.9 s exposed in all (its steps' waits): 0.3 s each; ddp has no
    outer sync (a dash); a report of runs without any has no such column."""
    ddp = fake_run(tmp_path, "ddp", [(1, 100e6, 4.0), (2, 200e6, 3.0)])
    diloco = fake_run(tmp_path, "diloco", [(2, 0, 4.5), (4, 10e6, 3.0), (5, 10e6, 2.9)])
    steps = [json.loads(line) for line in (diloco / "steps.jsonl").read_text().splitlines()]
    for rec, waited in zip(steps, (0.0, 0.5, 0.4)):
        rec["exposed_comm_s"] = waited
    (diloco / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    summary = json.loads((diloco / "summary.json").read_text())
    (diloco / "summary.json").write_text(json.dumps({**summary, "outer_syncs": 3}))
    md, js = report_of(tmp_path, [ddp, diloco])
    by = {r["label"]: r for r in js["rows"]}
    assert by["diloco"]["exposed_s_per_outer_sync"] == pytest.approx(0.3)
    assert by["ddp"]["exposed_s_per_outer_sync"] is None
    assert "exposed s per outer sync" in next(line for line in md.splitlines() if line.startswith("| strategy"))
    assert "| 0.300 |" in md and "| - |" in md
    only_ddp, _ = report_of(tmp_path / "flat", [fake_run(tmp_path / "flat", "ddp", [(1, 100e6, 4.0)])])
    assert "exposed s per outer sync" not in only_ddp


def test_runs_with_a_delayed_or_eager_outer_step_are_named_so(tmp_path):
    runs = []
    for name, options in (("sync", {}), ("late", {"outer_delay": 1}), ("eager", {"outer_delay": 1, "eager": True})):
        run = fake_run(tmp_path / name, "diloco", [(2, 0, 4.5), (4, 10e6, 3.0)])
        summary = json.loads((run / "summary.json").read_text())
        (run / "summary.json").write_text(json.dumps({**summary, "strategy_options": {"outer_delay": 0, **options}}))
        runs.append(run)
    _, js = report_of(tmp_path, runs)
    assert [r["label"] for r in js["rows"]] == ["diloco", "diloco delayed", "diloco eager"]
