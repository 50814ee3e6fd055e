"""`lowcomm plan --calibrate`: the model's compute per micro-batch, one figure for every strategy;
each strategy's own per-step work, split out of each rank's step; and a `caveat:` line where the
calibration's workers shared the cores. Benches written by hand (every number known), plus one
real bench (marked procs) that the calibration reads as it reads any."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from lowcomm.cli.main import main
from lowcomm.metrics.calibration import COMPUTE_SPREAD

TOKENS_PER_MICRO = 2 * 128  # micro_batch 2 x seq_len 128 (the tiny preset)


def _params() -> int:
    from lowcomm import config as C
    from lowcomm.plan.planner import model_layout
    return model_layout(C.RunConfig(model=C.ModelConfig(preset="tiny"))).numel


def _write_run(path, strategy: str, ranks: list[dict], steps: int = 4, params: int = 0) -> None:
    """A finished run of `steps` identical steps on len(ranks) workers of the tiny preset; each rank's
    step is given as {compute, exposed, optimizer, wall} seconds (one micro-batch each)."""
    path.mkdir(parents=True)
    W = len(ranks)
    (path / "config.toml").write_text(f'strategy = "{strategy}"\nworkers = {W}\nmicro_batch = 2\n'
                                      '[model]\npreset = "tiny"\nseq_len = 128\n'
                                      '[link]\nbandwidth = "1gbit"\nlatency = "1ms"\n')
    per_rank = {"compute_s": [r["compute"] for r in ranks], "exposed_comm_s": [r["exposed"] for r in ranks],
                "wall_s": [r["wall"] for r in ranks], "optimizer_s": [r["optimizer"] for r in ranks],
                "micro_batches": [1] * W}
    step = {"tokens": W * TOKENS_PER_MICRO, "wire_bytes": 0, "compute_s": max(per_rank["compute_s"]),
            "exposed_comm_s": max(per_rank["exposed_comm_s"]), "wall_s": max(per_rank["wall_s"]),
            "optimizer_s": max(per_rank["optimizer_s"]), "per_rank": per_rank}
    (path / "steps.jsonl").write_text("".join(json.dumps({**step, "step": i, **({"val_loss": 3.0} if i == steps
                                                                                 else {})}) + "\n"
                                              for i in range(1, steps + 1)))
    (path / "summary.json").write_text(json.dumps({
        "strategy": strategy, "params": params or _params(), "workers": W, "final_val_loss": 3.0, "slowdown": [],
        "compute_s_per_rank": [steps * c for c in per_rank["compute_s"]], "micro_batches_per_rank": [steps] * W}))


def _even(compute: float, work: float = 0.01, optimizer: float = 0.004, exposed: float = 0.0) -> list[dict]:
    return [{"compute": compute, "exposed": exposed, "optimizer": optimizer, "wall": compute + exposed + work}] * 2


def _bench(root, runs: dict, machine: dict | None = None, loads: tuple = ()) -> str:
    """A bench dir of `runs` (strategy -> ranks, as _write_run takes them) and its bench.json."""
    entries = []
    for i, (name, ranks) in enumerate(runs.items()):
        _write_run(root / name, name, ranks)
        entries.append({"strategy": name, "label": name, "dir": name, "status": "ok", "error": None,
                        **({"load": loads[i]} if i < len(loads) else {})})
    (root / "bench.json").write_text(json.dumps({"lowcomm_bench": 1, "strategies": list(runs), "runs": entries,
                                                 **({"machine": machine} if machine else {})}))
    return str(root)


QUIET = {"cores": 16, "threads": 2, "load_at_start": 0.5}


def _plan(capsys, bench: str, *extra) -> dict:
    assert main(["plan", "--calibrate", bench, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_strategy_is_priced_at_the_model_s_compute_and_a_run_far_from_it_is_named(capsys, tmp_path):
    """ddp, zero1 and quantized computed 100, 104 and 96 ms a micro-batch; diloco 160 ms (its
    workers competing for cores). The median of the four is 102 ms (of an even count, the geometric
    mean of the middle two); diloco is more than
    COMPUTE_SPREAD from it, so it is named in a caveat and left out: every strategy, diloco
    included, is priced at the median of the other three, 100 ms."""
    figures = {"ddp": 0.100, "zero1": 0.104, "quantized": 0.096, "diloco": 0.160}
    assert 0.160 / 0.102 > COMPUTE_SPREAD > max(0.104 / 0.102, 0.102 / 0.096)
    out = _plan(capsys, _bench(tmp_path, {k: _even(v) for k, v in figures.items()}, QUIET),
                "--strategies", ",".join(figures))
    assumed = out["assumptions"]
    assert assumed["compute_per_micro_batch_s"] == pytest.approx(0.100, rel=1e-9)
    assert assumed["compute_per_micro_batch_s_by_run"] == pytest.approx(figures, rel=1e-9)
    assert {p["strategy"]: p["compute_s"] for p in out["ranked"]} == pytest.approx(
        {k: 0.100 for k in figures}, rel=1e-9)  # one micro-batch a step on each worker
    assert assumed["caveats"] == [
        f"compute per micro-batch differs between the bench's runs by more than {COMPUTE_SPREAD:g}x: diloco 160 ms "
        f"against the median 102 ms: not the model's arithmetic (CPU contention?); every strategy is priced at "
        f"100 ms, the median of the others"]


def test_runs_that_agree_within_the_spread_are_priced_at_their_median_with_no_caveat(capsys, tmp_path):
    figures = {"ddp": 0.100, "zero1": 0.110, "diloco": 0.120}
    out = _plan(capsys, _bench(tmp_path, {k: _even(v) for k, v in figures.items()}, QUIET),
                "--strategies", ",".join(figures))
    assert [p["compute_s"] for p in out["ranked"]] == pytest.approx([0.110] * 3, rel=1e-9)
    assert out["assumptions"]["caveats"] == []


def test_runs_that_all_disagree_are_priced_at_the_median_of_them_all_and_each_is_named(capsys, tmp_path):
    """100 and 200 ms: both more than COMPUTE_SPREAD from their median (of two, their geometric
    mean: 141 ms, 1.41x from each); no run is left to trust over the other, so both are named and
    every strategy is priced at that median."""
    bench = _bench(tmp_path, {"ddp": _even(0.1), "diloco": _even(0.2)}, QUIET)
    out = _plan(capsys, bench, "--strategies", "ddp,diloco")
    assert [p["compute_s"] for p in out["ranked"]] == pytest.approx([(0.1 * 0.2) ** 0.5] * 2, rel=1e-9)
    assert out["assumptions"]["caveats"] == [
        f"compute per micro-batch differs between the bench's runs by more than {COMPUTE_SPREAD:g}x: ddp 100 ms, "
        f"diloco 200 ms against the median 141 ms: not the model's arithmetic (CPU contention?); every strategy is "
        f"priced at 141 ms, the median of them all"]


def test_per_step_work_is_each_rank_s_step_less_its_compute_and_waits_with_the_optimizer_split_out(capsys, tmp_path):
    """Rank 0 computes 100 ms, waits 50 ms, steps its optimizer 4 ms, its step lasts 160 ms: 10 ms
    of own work, 4 ms of it the optimizer. Rank 1 computes 120 ms, waits 20 ms, steps 6 ms in a
    step of 160 ms: 20 ms, 6 ms of it the optimizer. The strategy's work is their mean: 15 ms,
    5 ms optimizer and 10 ms the rest; the plan adds 15 ms to the step."""
    ranks = [{"compute": 0.10, "exposed": 0.05, "optimizer": 0.004, "wall": 0.16},
             {"compute": 0.12, "exposed": 0.02, "optimizer": 0.006, "wall": 0.16}]
    out = _plan(capsys, _bench(tmp_path, {"zero1": ranks}, QUIET), "--strategies", "zero1")
    assert out["assumptions"]["per_step_work_s"]["zero1"] == pytest.approx({"optimizer_s": 0.005, "other_s": 0.010},
                                                                           rel=1e-9)
    got = out["ranked"][0]
    assert got["overhead_s"] == pytest.approx(0.015, rel=1e-9)
    assert got["compute_s"] == pytest.approx(0.12, rel=1e-9)  # the slowest rank's, as the step waits for it
    assert got["step_s"] == pytest.approx(got["compute_s"] + 0.015 + got["exposed_comm_s"], rel=1e-9)
    assert "zero1 15 ms (optimizer 5 ms)" in out["assumptions"]["overhead_from"]


def test_a_strategy_the_bench_did_not_run_gets_the_model_s_compute_and_no_work(capsys, tmp_path):
    out = _plan(capsys, _bench(tmp_path, {"ddp": _even(0.1, work=0.02)}, QUIET), "--strategies", "ddp,zero1")
    by = {p["strategy"]: p for p in out["ranked"]}
    assert by["zero1"]["compute_s"] == by["ddp"]["compute_s"] == pytest.approx(0.1, rel=1e-9)
    assert by["zero1"]["overhead_s"] == 0.0 and by["ddp"]["overhead_s"] == pytest.approx(0.02, rel=1e-9)


@pytest.mark.parametrize("machine, loads, line", [
    ({"cores": 2, "threads": 3, "load_at_start": 1.2}, (2.5,),
     "caveat: the calibration ran 3 worker threads on 2 cores (load up to 2.5): its compute includes waiting for a "
     "core, so the step times below are not claimed accurate; calibrate with at most 2 worker threads on a quiet "
     "machine"),
    ({"cores": 8, "threads": 2, "load_at_start": 9.5}, (3.0,),
     "caveat: the calibration ran at a load up to 9.5, above its 8 cores: its compute includes waiting for a core, "
     "so the step times below are not claimed accurate; calibrate with at most 8 worker threads on a quiet machine"),
    (None, (), "caveat: the calibration recorded no core count or load (a bench or run of an older lowcomm): "
               "whether its workers shared cores, and so measured CPU contention as compute, is unknown"),
])
def test_a_calibration_whose_workers_shared_the_cores_says_so_in_one_caveat_line(capsys, tmp_path, machine, loads,
                                                                                 line):
    bench = _bench(tmp_path, {"ddp": _even(0.1)}, machine, loads)
    assert main(["plan", "--calibrate", bench, "--strategies", "ddp"]) == 0
    caveats = [x for x in capsys.readouterr().out.splitlines() if x.startswith("caveat:")]
    assert caveats == [line]


def test_a_quiet_calibration_has_no_caveat(capsys, tmp_path):
    bench = _bench(tmp_path, {"ddp": _even(0.1)}, {"cores": 4, "threads": 4, "load_at_start": 0.3}, (3.9,))
    assert main(["plan", "--calibrate", bench, "--strategies", "ddp"]) == 0
    assert "caveat:" not in capsys.readouterr().out


def test_a_bench_says_at_its_start_that_its_workers_will_share_the_cores(capsys, monkeypatch):
    from lowcomm.bench import machine
    monkeypatch.setattr(machine, "cpu_cores", lambda: 2)
    monkeypatch.setattr(machine, "load", lambda: 0.7)
    cpu = SimpleNamespace(workers=3, threads=1, device="cpu", backend="auto")
    assert machine.at_start([cpu]) == {"cores": 2, "load_at_start": 0.7, "threads": 3}
    assert capsys.readouterr().out == (
        "bench: 3 worker threads on 2 cores (load up to 0.7): the compute it measures will include waiting for a "
        "core, so `lowcomm plan --calibrate` on this bench does not claim its step times\n")
    assert machine.at_start([SimpleNamespace(workers=2, threads=1, device="cpu", backend="auto")])["threads"] == 2
    assert capsys.readouterr().out == ""


def test_each_rank_s_wall_time_and_optimizer_step_reach_the_step_record():
    import torch

    from lowcomm.metrics.runlog import FIELDS, LEVEL_FIELDS, step_record
    rows = torch.zeros(2, len(FIELDS) + len(LEVEL_FIELDS), dtype=torch.float64)
    for rank, (wall, opt) in enumerate(((0.25, 0.004), (0.30, 0.006))):
        rows[rank, FIELDS.index("wall_s")], rows[rank, FIELDS.index("optimizer_s")] = wall, opt
        rows[rank, FIELDS.index("lr")] = 1e-3
    record = step_record(1, rows)
    assert record["per_rank"]["wall_s"] == [0.25, 0.30] and record["per_rank"]["optimizer_s"] == [0.004, 0.006]
    assert record["wall_s"] == 0.30 and record["optimizer_s"] == 0.006


def test_the_flight_recorder_sums_the_main_thread_s_optimizer_steps_only():
    import threading

    import torch

    from lowcomm.comm.flight import FlightRecorder
    flight = FlightRecorder(0, capacity=16)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    flight.watch_optimizer(opt)
    p.grad = torch.ones(3)
    opt.step()
    on_main = flight.optimizer_s
    assert on_main > 0
    worker = threading.Thread(target=opt.step)
    worker.start()
    worker.join()
    assert flight.optimizer_s == on_main  # beside the main thread's work: the step does not wait for it
    assert [e.name for e in flight.events()] == ["optimizer", "optimizer"]


@pytest.mark.procs
def test_a_real_bench_prices_every_strategy_at_one_compute_and_names_any_run_off_it(capsys, tmp_path):
    """Three strategies benched on 2 workers: the plan prices all three at one compute per
    micro-batch, the median of the runs within COMPUTE_SPREAD of their median, and names in a
    caveat exactly the runs beyond it (on a loaded machine a run may be; it is then not used)."""
    out = tmp_path / "bench"
    assert main(["bench", "--strategies", "ddp,zero1,diloco", "--workers", "2", "--steps", "4", "--model", "tiny",
                 "--micro-batch", "2", "--eval-every", "0", "--link", "inf,0", "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    got = _plan(capsys, str(out), "--strategies", "ddp,zero1,diloco")
    assumed = got["assumptions"]
    by_run = assumed["compute_per_micro_batch_s_by_run"]
    assert set(by_run) == {"ddp", "zero1", "diloco"} and all(v > 0 for v in by_run.values())
    median = sorted(by_run.values())[1]
    apart = sorted(k for k, v in by_run.items() if max(v / median, median / v) > COMPUTE_SPREAD)
    kept = sorted(v for k, v in by_run.items() if k not in apart) or sorted(by_run.values())
    assert assumed["compute_per_micro_batch_s"] == pytest.approx(
        kept[len(kept) // 2] if len(kept) % 2 else (kept[0] * kept[1]) ** 0.5, rel=1e-9)
    assert [p["compute_s"] for p in got["ranked"]] == pytest.approx([assumed["compute_per_micro_batch_s"]] * 3,
                                                                    rel=1e-9)
    spread = [c for c in assumed["caveats"] if c.startswith("compute per micro-batch differs")]
    assert bool(spread) == bool(apart) and all(f"{k} " in spread[0] for k in apart)
    machine = json.loads((out / "bench.json").read_text())["machine"]
    assert machine["threads"] == 2 and machine["cores"] >= 1 and machine["load_at_start"] >= 0


@pytest.mark.parametrize("machine, said", [
    ({"cores": 2, "threads": 4, "load_at_end": 1.0},
     ["caveat: the calibration ran 4 worker threads on 2 cores (load up to 1): its compute includes waiting for a "
      "core, so the step times below are not claimed accurate; calibrate with at most 2 worker threads on a quiet "
      "machine"]),
    ({"cores": 2, "threads": 2, "load_at_end": 0.7}, []),
])
def test_a_run_dir_calibrates_with_the_machine_its_summary_recorded(capsys, tmp_path, machine, said):
    """`lowcomm train` records its host's cores, worker threads and load at its end (summary.json's
    "machine"), so a calibration from a run dir says whether its workers shared the cores, as a
    bench's does, instead of calling it unknown."""
    run = tmp_path / "ddp"
    _write_run(run, "ddp", _even(0.1))
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "machine": machine}))
    assert main(["plan", "--calibrate", str(run), "--strategies", "ddp"]) == 0
    assert [x for x in capsys.readouterr().out.splitlines() if x.startswith("caveat:")] == said


def test_a_run_records_the_machine_it_ran_on_at_its_end():
    from lowcomm.metrics.calibration import cpu_cores, machine_at_end
    m = machine_at_end(3)
    assert (m["cores"], m["threads"]) == (cpu_cores(), 3) and m["load_at_end"] >= 0
