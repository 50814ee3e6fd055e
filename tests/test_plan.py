"""`lowcomm plan`: step times worked out by hand from the ring formulas of ALGORITHMS.md,
the model it prices (built on the meta device, also from --params), and bad input refused
with one `error:` line. Pure Python, no worker is started."""
import json

import pytest

from lowcomm.cli import main

# --params 1e6 prices the GPT of about that size (models/size.py): 2 layers of d_model 192 at
# seq_len 128, N = 386*192 + 2*(12*192^2 + 4*192) = 960,384 parameters, 3,841,536 fp32 bytes.
# On W = 4 workers, 1gbit (1.25e8 bytes/s) and 1 ms per hop, 65,536 tokens per step at
# 4 TFLOP/s per worker: compute = 65536/4 tokens * 6*N FLOPs / 4e12 FLOP/s = 0.023602397184 s,
# backward 2/3 of it.
N, W, BW, LAT, T = 960_384, 4, 1.25e8, 1e-3, 65536
COMPUTE = 65536 / 4 * 6 * N / 4e12
CLUSTER = ["plan", "--workers", "4", "--link", "1gbit,1ms", "--worker-tflops", "4", "--tokens-per-step", "65536",
           "--json"]
ARGS = [*CLUSTER, "--params", "1e6"]


def plan(capsys, *extra, model=("--params", "1e6")):
    assert main([*CLUSTER, *model, *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    return {p["strategy"]: p for p in out["ranked"]}, out


def test_ddp_buckets_overlap_the_backward(capsys):
    got, _ = plan(capsys, "--strategies", "ddp")
    ddp = got["ddp"]
    # DDP's buckets: torch's first holds 1 MiB, the rest (4N - 1048576 bytes) fits one 25 MB bucket.
    # all_reduce(S) on a ring: 2(W-1) hops, 2(W-1)/W * S bytes.
    b1 = 6 * LAT + 2 * 3 * 1048576 / 4 / BW           # 0.018582912
    b2 = 6 * LAT + 2 * 3 * (4 * N - 1048576) / 4 / BW  # 0.03951552
    backward = COMPUTE * 2 / 3                         # 0.015734931456
    end1 = backward * 1048576 / (4 * N) + b1           # bucket 1 is ready 27% into the backward
    end2 = max(backward, end1) + b2                    # bucket 2 at its end, after bucket 1 leaves the NIC
    assert end1 > backward  # the NIC, not the backward, holds bucket 2 back: the case is not trivial
    assert ddp["compute_s"] == pytest.approx(0.023602397184, rel=1e-12)
    assert ddp["exposed_comm_s"] == pytest.approx(end2 - backward, rel=1e-12)
    assert ddp["step_s"] == pytest.approx(0.023602397184 + 0.04665846784, rel=1e-12)
    assert ddp["wire_bytes_per_rank_per_step"] == 6 * N  # 2(W-1)/W of 4N bytes
    assert ddp["bytes_per_token"] == pytest.approx(4 * 6 * N / 65536, rel=1e-12)
    assert ddp["model_state_bytes"] == 16 * N  # fp32 θ, ∇θ, Adam m and v
    assert ddp["tokens_per_s"] == pytest.approx(T / ddp["step_s"], rel=1e-12)


def test_zero1_exposes_everything_and_acco_hides_a_step_of_compute(capsys):
    got, _ = plan(capsys, "--strategies", "zero1,acco")
    rs = ag = 3 * LAT + 3 / 4 * 4 * N / BW      # reduce_scatter / all_gather: W-1 hops, (W-1)/W * S bytes
    assert rs == pytest.approx(0.026049216)
    assert got["zero1"]["step_s"] == pytest.approx(COMPUTE + rs + ag, rel=1e-12)  # 0.075700829184
    assert got["zero1"]["model_state_bytes"] == 2 * 4 * N + 8 * N // W  # flat θ, ∇θ; Adam of the own shard
    count = 6 * LAT + (2 * 3 * 8 // 4) / BW  # ACCO's all-reduce of the float64 micro-batch count
    acco_comm = count + rs + ag
    assert got["acco"]["exposed_comm_s"] == pytest.approx(acco_comm - COMPUTE, rel=1e-12)
    assert got["acco"]["step_s"] == pytest.approx(acco_comm, rel=1e-12)  # 0.058098528
    # While the round's communication runs, each worker keeps computing micro-batches: the
    # round lasts acco_comm, a micro-batch COMPUTE (accum 1), so 2.46 of them (at most 4).
    assert got["acco"]["tokens_per_step"] == pytest.approx(T * acco_comm / COMPUTE, rel=1e-12)
    assert got["acco"]["tokens_per_s"] == pytest.approx(T * acco_comm / COMPUTE / acco_comm, rel=1e-12)
    assert got["zero1"]["tokens_per_s"] == pytest.approx(T / got["zero1"]["step_s"], rel=1e-12)


def test_acco_extra_micro_batches_stop_at_max_accum_and_follow_slowdowns(capsys):
    got, _ = plan(capsys, "--strategies", "acco", "--max-accum", "2", "--slowdown", "1,1,1,4")
    # the slow worker's micro-batch takes 4 COMPUTE = 0.094 s > the round's communication, so
    # the round lasts that long; the three others fit 4 micro-batches, capped at 2
    assert got["acco"]["tokens_per_step"] == pytest.approx(T * (2 + 2 + 2 + 1) / 4, rel=1e-12)
    got, _ = plan(capsys, "--strategies", "acco", "--deterministic")
    assert got["acco"]["tokens_per_step"] == T  # exactly accum per round


def test_diloco_pays_one_all_reduce_per_period(capsys):
    got, out = plan(capsys, "--strategies", "diloco,ddp", "--sync-every", "16")
    sync = 6 * LAT + 2 * 3 / 4 * 4 * N / BW  # 0.052098432 s, once per H = 16 inner steps
    assert got["diloco"]["step_s"] == pytest.approx(COMPUTE + sync / 16, rel=1e-12)  # 0.026858549
    assert got["diloco"]["label"] == "diloco H=16"
    assert got["diloco"]["bytes_per_token"] == pytest.approx(4 * 6 * N / 16 / 65536, rel=1e-12)
    assert out["ranked"][0]["strategy"] == "diloco"
    assert out["recommendation"].startswith("use diloco H=16")
    # communication = one fp32 all-reduce (0.052 s, in two buckets for ddp) against 0.0236 s of compute
    assert "2.2x compute" in out["recommendation"]


def test_steps_average_a_run_with_its_final_sync(capsys):
    # --steps 20 with H=16: one regular sync at step 16 and the final one at step 20
    got, _ = plan(capsys, "--strategies", "diloco", "--sync-every", "16", "--steps", "20")
    assert got["diloco"]["step_s"] == pytest.approx(COMPUTE + 2 * 0.052098432 / 20, rel=1e-12)


def test_slowdown_sets_compute_by_the_slowest_worker(capsys):
    got, _ = plan(capsys, "--strategies", "zero1", "--slowdown", "1,1,1,2")
    assert got["zero1"]["compute_s"] == pytest.approx(2 * COMPUTE, rel=1e-12)
    assert got["zero1"]["idle_s"] == pytest.approx(3 / 4 * COMPUTE, rel=1e-12)  # three workers wait 1x


def test_table_names_every_registered_strategy_and_the_model_it_priced(capsys):
    from lowcomm.strategies import available
    assert main([a for a in ARGS if a != "--json"]) == 0
    out = capsys.readouterr().out
    for name in available():
        assert name in out
    assert "\nuse " in out
    assert out.startswith("model: GPT --n-layer 2 --n-head 3 --d-model 192 --seq-len 128, 960,384 params; "
                          "sized from --params 1,000,000")


# The 454M-parameter GPT of `--model small --n-layer 16 --n-head 12 --d-model 1536`.
GPT_454M = ["--model", "small", "--n-layer", "16", "--n-head", "12", "--d-model", "1536"]


def test_params_and_the_model_of_that_size_plan_the_same_bytes(capsys):
    """--params builds a GPT of that size on the meta device, so every strategy's traffic is
    priced from real shapes: within 2% of the same-size --model's for every strategy."""
    by_model, out = plan(capsys, model=GPT_454M)
    count = out["cluster"]["params"]
    assert count == 453_676_032 and out["cluster"]["model"]["sized_from_params"] is None
    for asked in (str(count), "454M", "450M"):
        by_params, sized = plan(capsys, model=("--params", asked))
        model = sized["cluster"]["model"]
        assert (model["n_layer"], model["d_model"], model["n_head"]) == (16, 1536, 24)  # d_model/n_layer = 96
        assert set(by_params) == set(by_model)
        for name, p in by_params.items():
            want = by_model[name]["wire_bytes_per_rank_per_step"]
            assert p["wire_bytes_per_rank_per_step"] == pytest.approx(want, rel=0.02), (asked, name)


def test_params_keeps_the_dimensions_given_with_it(capsys):
    _, out = plan(capsys, "--strategies", "ddp", model=("--params", "7e9", "--n-layer", "32"))
    model = out["cluster"]["model"]
    assert model["n_layer"] == 32 and model["d_model"] % 64 == 0 and model["n_head"] == model["d_model"] // 64
    assert out["cluster"]["params"] == pytest.approx(7e9, rel=0.02)
    _, out = plan(capsys, "--strategies", "ddp", model=("--params", "1e9", "--d-model", "2048", "--n-head", "16"))
    assert out["cluster"]["model"] == {"architecture": "gpt", "n_layer": 20, "n_head": 16, "d_model": 2048,
                                       "seq_len": 128, "params": 1_007_587_328, "sized_from_params": 10**9}


def test_model_params_counts_the_model_itself_at_any_depth():
    """The memory check's count (resources.py) and the plan's come from the model, not a formula."""
    import lowcomm
    from lowcomm import config as C
    from lowcomm.planner import model_layout, model_params
    cfg = C.RunConfig(model=C.ModelConfig(n_layer=5, n_head=2, d_model=32, seq_len=16))
    built = lowcomm.GPT(vocab_size=256, seq_len=16, n_layer=5, n_head=2, d_model=32).num_params()
    assert model_params(cfg) == model_layout(cfg).numel == built


@pytest.mark.parametrize("extra,message", [
    (["--link=-10gbit,5ms"], "must be positive"),
    (["--strategies", "ddp,nosuch"], "unknown strategy 'nosuch'"),
    (["--workers", "0"], "workers must be at least 1"),
    (["--worker-tflops", "-3"], "--worker-tflops must be positive"),
    (["--lr", "0.1"], "--lr does not apply to lowcomm plan"),
    (["--max-accum", "4", "--strategies", "ddp"], "--max-accum applies to none of the strategies planned"),
    (["--params", "1e30"], "--params 1e30: 1e+30 parameters is more than the plan builds"),
    (["--params", "1000"], "--params 1000: the nearest model has 74,112 parameters"),
    (["--params", "1e9", "--model", "small"], "--params and --model small both set the model's size"),
    (["--params", "1e9", "--n-layer", "2", "--d-model", "64"], "n_layer and d_model are both given"),
])
def test_bad_input_exits_2_with_one_error_line(capsys, extra, message):
    assert main([*ARGS, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], captured.err


def test_a_model_too_large_to_build_is_refused(capsys):
    assert main([*CLUSTER, "--n-layer", "1000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the model has 2.49e+11 parameters in 1000000 layers")


def test_calibrate_refuses_a_dir_that_is_not_a_bench(capsys, tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    assert main(["plan", "--calibrate", str(tmp_path), "--workers", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "is not a lowcomm bench" in err[0]
