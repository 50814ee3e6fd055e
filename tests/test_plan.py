"""`lowcomm plan`: step times worked out by hand from the ring formulas of ALGORITHMS.md,
and bad input refused with one `error:` line. Pure Python, no worker is started."""
import json

import pytest

from lowcomm.cli import main

# N = 1e6 parameters on W = 4 workers, 1gbit (1.25e8 bytes/s) and 1 ms per hop,
# 65,536 tokens per step at 4 TFLOP/s per worker:
# compute = 65536/4 tokens * 6*1e6 FLOPs / 4e12 FLOP/s = 0.024576 s, backward 2/3 of it.
N, W, BW, LAT, T = 1_000_000, 4, 1.25e8, 1e-3, 65536
COMPUTE = 65536 / 4 * 6e6 / 4e12
ARGS = ["plan", "--params", "1e6", "--workers", "4", "--link", "1gbit,1ms", "--worker-tflops", "4",
        "--tokens-per-step", "65536", "--json"]


def plan(capsys, *extra):
    assert main([*ARGS, *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    return {p["strategy"]: p for p in out["ranked"]}, out


def test_ddp_buckets_overlap_the_backward(capsys):
    got, _ = plan(capsys, "--strategies", "ddp")
    ddp = got["ddp"]
    # DDP's buckets: torch's first holds 1 MiB, the rest (4e6 - 1048576 bytes) fits one 25 MB bucket.
    # all_reduce(S) on a ring: 2(W-1) hops, 2(W-1)/W * S bytes.
    b1 = 6 * LAT + 2 * 3 * 1048576 / 4 / BW               # 0.018582912
    b2 = 6 * LAT + 2 * 3 * (4_000_000 - 1048576) / 4 / BW  # 0.041417088
    backward = COMPUTE * 2 / 3                             # 0.016384
    end1 = backward * 1048576 / 4e6 + b1                   # bucket 1 is ready a quarter into the backward
    end2 = max(backward, end1) + b2                        # bucket 2 at its end, after bucket 1 leaves the NIC
    assert end1 > backward  # the NIC, not the backward, holds bucket 2 back: the case is not trivial
    assert ddp["compute_s"] == pytest.approx(0.024576, rel=1e-12)
    assert ddp["exposed_comm_s"] == pytest.approx(end2 - backward, rel=1e-12)
    assert ddp["step_s"] == pytest.approx(0.024576 + 0.047910967296, rel=1e-12)
    assert ddp["wire_bytes_per_rank_per_step"] == 6_000_000
    assert ddp["bytes_per_token"] == pytest.approx(4 * 6e6 / 65536, rel=1e-12)
    assert ddp["model_state_bytes"] == 16 * N  # fp32 θ, ∇θ, Adam m and v
    assert ddp["tokens_per_s"] == pytest.approx(T / ddp["step_s"], rel=1e-12)


def test_zero1_exposes_everything_and_acco_hides_a_step_of_compute(capsys):
    got, _ = plan(capsys, "--strategies", "zero1,acco")
    rs = ag = 3 * LAT + 3 / 4 * 4e6 / BW      # reduce_scatter / all_gather: W-1 hops, (W-1)/W * S bytes
    assert rs == pytest.approx(0.027)
    assert got["zero1"]["step_s"] == pytest.approx(COMPUTE + rs + ag, rel=1e-12)  # 0.078576
    assert got["zero1"]["model_state_bytes"] == 2 * 4 * N + 8 * N // W  # flat θ, ∇θ; Adam of the own shard
    count = 6 * LAT + (2 * 3 * 8 // 4) / BW  # ACCO's all-reduce of the float64 micro-batch count
    acco_comm = count + rs + ag
    assert got["acco"]["exposed_comm_s"] == pytest.approx(acco_comm - COMPUTE, rel=1e-12)
    assert got["acco"]["step_s"] == pytest.approx(acco_comm, rel=1e-12)  # 0.060000096
    # While the round's communication runs, each worker keeps computing micro-batches: the
    # round lasts acco_comm, a micro-batch COMPUTE (accum 1), so 2.44 of them (at most 4).
    assert got["acco"]["tokens_per_step"] == pytest.approx(T * acco_comm / COMPUTE, rel=1e-12)
    assert got["acco"]["tokens_per_s"] == pytest.approx(T * acco_comm / COMPUTE / acco_comm, rel=1e-12)
    assert got["zero1"]["tokens_per_s"] == pytest.approx(T / got["zero1"]["step_s"], rel=1e-12)


def test_acco_extra_micro_batches_stop_at_max_accum_and_follow_slowdowns(capsys):
    got, _ = plan(capsys, "--strategies", "acco", "--max-accum", "2", "--slowdown", "1,1,1,4")
    # the slow worker's micro-batch takes 4 COMPUTE = 0.098 s > the round's communication, so
    # the round lasts that long; the three others fit 4 micro-batches, capped at 2
    assert got["acco"]["tokens_per_step"] == pytest.approx(T * (2 + 2 + 2 + 1) / 4, rel=1e-12)
    got, _ = plan(capsys, "--strategies", "acco", "--deterministic")
    assert got["acco"]["tokens_per_step"] == T  # exactly accum per round


def test_diloco_pays_one_all_reduce_per_period(capsys):
    got, out = plan(capsys, "--strategies", "diloco,ddp", "--sync-every", "16")
    sync = 6 * LAT + 2 * 3 / 4 * 4e6 / BW  # 0.054 s, once per H = 16 inner steps
    assert got["diloco"]["step_s"] == pytest.approx(COMPUTE + sync / 16, rel=1e-12)  # 0.027951
    assert got["diloco"]["label"] == "diloco H=16"
    assert got["diloco"]["bytes_per_token"] == pytest.approx(4 * 6e6 / 16 / 65536, rel=1e-12)
    assert out["ranked"][0]["strategy"] == "diloco"
    assert out["recommendation"].startswith("use diloco H=16")
    # communication = one fp32 all-reduce (0.054 s, in two buckets for ddp) against 0.024576 s of compute
    assert "2.2x compute" in out["recommendation"]


def test_steps_average_a_run_with_its_final_sync(capsys):
    # --steps 20 with H=16: one regular sync at step 16 and the final one at step 20
    got, _ = plan(capsys, "--strategies", "diloco", "--sync-every", "16", "--steps", "20")
    assert got["diloco"]["step_s"] == pytest.approx(COMPUTE + 2 * 0.054 / 20, rel=1e-12)


def test_slowdown_sets_compute_by_the_slowest_worker(capsys):
    got, _ = plan(capsys, "--strategies", "zero1", "--slowdown", "1,1,1,2")
    assert got["zero1"]["compute_s"] == pytest.approx(2 * COMPUTE, rel=1e-12)
    assert got["zero1"]["idle_s"] == pytest.approx(3 / 4 * COMPUTE, rel=1e-12)  # three workers wait 1x


def test_table_names_every_registered_strategy(capsys):
    from lowcomm.strategies import available
    assert main([a for a in ARGS if a != "--json"]) == 0
    out = capsys.readouterr().out
    for name in available():
        assert name in out
    assert "\nuse " in out


@pytest.mark.parametrize("extra,message", [
    (["--link=-10gbit,5ms"], "must be positive"),
    (["--strategies", "ddp,nosuch"], "unknown strategy 'nosuch'"),
    (["--workers", "0"], "workers must be at least 1"),
    (["--worker-tflops", "-3"], "--worker-tflops must be positive"),
    (["--lr", "0.1"], "--lr does not apply to lowcomm plan"),
    (["--max-accum", "4", "--strategies", "ddp"], "--max-accum applies to none of the strategies planned"),
])
def test_bad_input_exits_2_with_one_error_line(capsys, extra, message):
    assert main([*ARGS, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], captured.err


def test_calibrate_refuses_a_dir_that_is_not_a_bench(capsys, tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    assert main(["plan", "--calibrate", str(tmp_path), "--workers", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "is not a lowcomm bench" in err[0]
