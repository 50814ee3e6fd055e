"""`lowcomm plan`: step times worked out by hand from the ring formulas of ALGORITHMS.md,
the model it prices (built on the meta device, also from --params), and bad input refused
with one `error:` line. Pure Python, no worker is started."""
import json

import pytest

from lowcomm.cli.main import main

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
    count = 6 * LAT + (2 * 3 * 16 // 4) / BW  # ACCO's all-reduce of the count and votes (2 float64)
    acco_round = count + rs + ag
    # A step is one update of zero1's batch: two rounds (estimate, real), each behind half the
    # step's compute.
    assert got["acco"]["comm_s"] == pytest.approx(2 * acco_round, rel=1e-12)
    assert got["acco"]["exposed_comm_s"] == pytest.approx(2 * acco_round - COMPUTE, rel=1e-12)
    assert got["acco"]["step_s"] == pytest.approx(2 * acco_round, rel=1e-12)
    # While a round's communication runs, each worker keeps computing half micro-batches: the
    # round lasts acco_round, a half micro-batch COMPUTE / 2 (accum 1), so 4.9 of them, capped
    # at max_accum 4: 4 halves a round, 8 a step, four steps' worth of --micro-batch.
    assert 2 * acco_round / COMPUTE > 4
    assert got["acco"]["tokens_per_step"] == pytest.approx(4 * T, rel=1e-12)
    assert got["acco"]["tokens_per_s"] == pytest.approx(4 * T / (2 * acco_round), rel=1e-12)
    assert got["zero1"]["tokens_per_s"] == pytest.approx(T / got["zero1"]["step_s"], rel=1e-12)


def test_acco_extra_micro_batches_stop_at_max_accum_and_follow_slowdowns(capsys):
    got, _ = plan(capsys, "--strategies", "acco", "--max-accum", "2", "--slowdown", "1,1,1,6")
    # the slow worker's half micro-batch takes 3 COMPUTE = 0.071 s > a round's communication, so
    # the round lasts that long; the three others fit 6 half micro-batches, capped at 2
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


def test_a_one_step_delayed_outer_step_hides_its_reduction_behind_a_period(capsys):
    # H=2: the sync (0.052 s) runs behind the next period's two inner steps (0.047 s): 4.9 ms of
    # it is left exposed, once per period; at H=4 all of it is hidden.
    sync = 6 * LAT + 2 * 3 / 4 * 4 * N / BW
    got, _ = plan(capsys, "--strategies", "diloco", "--sync-every", "2", "--outer-delay", "1")
    assert got["diloco"]["exposed_comm_s"] == pytest.approx((sync - 2 * COMPUTE) / 2, rel=1e-12)
    assert got["diloco"]["step_s"] == pytest.approx(COMPUTE + (sync - 2 * COMPUTE) / 2, rel=1e-12)
    got, _ = plan(capsys, "--strategies", "diloco,streaming_diloco", "--sync-every", "4", "--outer-delay", "1")
    assert got["diloco"]["exposed_comm_s"] == 0.0 and got["diloco"]["step_s"] == pytest.approx(COMPUTE, rel=1e-12)
    assert got["streaming_diloco"]["exposed_comm_s"] == 0.0  # each fragment's behind its period too
    got, _ = plan(capsys, "--strategies", "diloco", "--sync-every", "4")
    assert got["diloco"]["exposed_comm_s"] == pytest.approx(sync / 4, rel=1e-12)  # synchronous: all of it


def test_steps_average_a_run_with_its_final_sync(capsys):
    # --steps 20 with H=16: one regular sync at step 16 and the final one at step 20
    got, _ = plan(capsys, "--strategies", "diloco", "--sync-every", "16", "--steps", "20")
    assert got["diloco"]["step_s"] == pytest.approx(COMPUTE + 2 * 0.052098432 / 20, rel=1e-12)


def test_a_runs_final_sync_hides_behind_nothing(capsys):
    # --steps 20, H=4, --outer-delay 1: the regular syncs at steps 4, 8, 12 and 16 hide behind the
    # next period (all of each: 4 inner steps, 0.094 s, against 0.052 s); the final one at step 20
    # has no step after it, so all of its 0.052 s is exposed, once in the run's 20 steps.
    sync = 6 * LAT + 2 * 3 / 4 * 4 * N / BW
    got, _ = plan(capsys, "--strategies", "diloco", "--sync-every", "4", "--outer-delay", "1", "--steps", "20")
    assert got["diloco"]["exposed_comm_s"] == pytest.approx(sync / 20, rel=1e-12)
    # streaming, one fragment with τ=1 step (0.0236 s) at H=4: the sync leaves 0.0285 s exposed at
    # each of its 4 regular syncs, and all of its 0.052 s at the final one
    got, _ = plan(capsys, "--strategies", "streaming_diloco", "--sync-every", "4", "--fragments", "1",
                  "--fragment-delay", "1", "--steps", "20")
    assert got["streaming_diloco"]["exposed_comm_s"] == pytest.approx((4 * (sync - COMPUTE) + sync) / 20, rel=1e-12)


def test_a_warm_ups_syncs_wait_in_full(capsys):
    # --steps 20, H=4, --outer-delay 1 --outer-delay-warmup 8: the syncs at steps 4 and 8 wait for
    # their mean (0.052 s each), those at 12 and 16 hide behind the next period, the final one at 20
    # hides behind nothing: three syncs' time exposed in the run's 20 steps
    sync = 6 * LAT + 2 * 3 / 4 * 4 * N / BW
    got, _ = plan(capsys, "--strategies", "diloco", "--sync-every", "4", "--outer-delay", "1",
                  "--outer-delay-warmup", "8", "--steps", "20")
    assert got["diloco"]["exposed_comm_s"] == pytest.approx(3 * sync / 20, rel=1e-12)


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
    """The memory check's count (launch/resources.py) and the plan's come from the model, not a formula."""
    import lowcomm
    from lowcomm import config as C
    from lowcomm.plan.planner import model_layout, model_params
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
    (["--replicas", "3"], "--replicas 3 does not divide --workers 4"),
    (["--replicas", "-1"], "replicas must be at least 1"),
    (["--replicas", "2", "--inside", "fsdp", "--strategies", "powersgd"],
     "strategy 'powersgd' does not run across replica groups with --inside fsdp (--replicas 2 of --workers 4; with --inside fsdp"),
    (["--replicas", "4", "--intra-link", "10gbit,50us"], "--intra-link needs replica groups"),
    (["--replicas", "2", "--intra-link", "fast"], "--intra-link 'fast' must be BANDWIDTH,LATENCY"),
    (["--workers", "1", "--intra-link", "10gbit,50us"], "--intra-link needs replica groups"),
    (["--inside", "fsdp"], "--inside fsdp needs replica groups: --replicas fewer than --workers (4)"),
    (["--workers", "64", "--replicas", "1", "--strategies", "zero1"], "more ranks than the model has tensors"),
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


# Replica groups: R = 2 replicas of K = 2 on the W = 4 cluster above, 10gbit and 50 us per hop inside.
GROUPED = ["--replicas", "2", "--intra-link", "10gbit,50us"]
IN_BW, IN_LAT = 1.25e9, 50e-6


def test_each_level_sends_what_level_plans_says_and_a_run_counts(capsys):
    """Bytes per level at (R, K) = (2, 2): the strategy's level_plans, counted as a run's summary.json
    counts them (metrics/levels.py, whose counts tests/engines/test_replicas.py checks against real runs)."""
    from lowcomm.metrics.levels import planned_bytes
    from lowcomm.plan.planner import model_layout
    from lowcomm.strategies import get
    steps = 8
    got, out = plan(capsys, *GROUPED, "--strategies", "ddp,zero1,diloco,demo", "--sync-every", "4",
                    "--steps", str(steps))
    assert out["cluster"]["replicas"] == 2 and out["cluster"]["inside"] == "ddp"
    layout = model_layout(_sized_config())
    for name, p in got.items():
        cls = get(name)
        options = cls.Options(**p["options"])
        plans = cls.cost.level_plans(cls, layout, 2, 2, options)
        intra = planned_bytes([plans.intra], 2, 2, lambda op: op.occurrences(steps))
        cross = planned_bytes(plans.cross, 2, 2, lambda op: cls.cost.plan_occurrences(op, steps, options))
        levels = p["levels"]
        assert (levels["intra"]["ranks_per_group"], levels["cross"]["ranks_per_group"]) == (2, 2)
        assert levels["intra"]["wire_bytes_per_rank_per_step"] * W * steps == pytest.approx(intra, rel=1e-12), name
        assert levels["cross"]["wire_bytes_per_rank_per_step"] * W * steps == pytest.approx(cross, rel=1e-12), name
        assert p["bytes_per_token"] == pytest.approx((intra + cross) / steps / T, rel=1e-12)
        assert intra > 0 and cross > 0
    # zero1 hides nothing: its step is compute, the inside reduce-scatter and all-gather of the
    # owners' parts (K = 2 ranks: one hop, half of S each), and the cross plan of the position that
    # sends the most, on R = 2 ranks over the 1gbit link
    zero1 = get("zero1")
    plans = zero1.cost.level_plans(zero1, layout, 2, 2, zero1.Options())
    inside = sum(IN_LAT + op.nbytes / 2 / IN_BW for op in plans.intra)
    across = sum(LAT + op.nbytes / 2 / BW for op in plans.slowest_cross(2))
    assert got["zero1"]["exposed_comm_s"] == pytest.approx(inside + across, rel=1e-12)
    assert got["zero1"]["step_s"] == pytest.approx(COMPUTE + inside + across, rel=1e-12)
    assert got["zero1"]["levels"]["intra"]["comm_s"] == pytest.approx(inside, rel=1e-12)


def _sized_config():
    """The config `--params 1e6` plans (the GPT of test_ddp_buckets_overlap_the_backward)."""
    from lowcomm import config as C
    return C.RunConfig(model=C.ModelConfig(n_layer=2, n_head=3, d_model=192))


def test_table_shows_bytes_at_each_level(capsys):
    assert main([a for a in ARGS if a != "--json"] + [*GROUPED, "--strategies", "ddp"]) == 0
    out = capsys.readouterr().out
    assert "on 4 workers as 2 replicas of 2 (ddp inside)" in out
    assert "link 1gbit,1ms across replicas, intra-link 10gbit,50us inside" in out
    head = next(line for line in out.splitlines() if line.startswith("#"))
    assert "intra MB/step/rank" in head and "cross MB/step/rank" in head and "wire MB/step/rank" not in head
    assert "\nuse ddp with --replicas 2:" in out


def test_a_fast_intra_link_without_replicas_recommends_replica_groups(capsys):
    """ddp on 4 workers over 100mbit, 20 ms, with 10gbit inside: (2, 2) sends a third of the flat
    cluster's cross-link bytes (each position all-reduces half the gradients on 2 ranks, against
    the whole on 4) and is the fastest; R = 1 (no level across) is not tried."""
    argv = ["plan", "--workers", "4", "--link", "100mbit,20ms", "--intra-link", "10gbit,50us", "--worker-tflops",
            "4", "--tokens-per-step", "65536", "--params", "1e6", "--strategies", "ddp"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    tried = {c["replicas"]: c["ranked"][0] for c in out["replica_counts"]}
    assert set(tried) == {4, 2}
    assert tried[2]["levels"]["cross"]["bytes_per_token"] == pytest.approx(
        tried[4]["levels"]["cross"]["bytes_per_token"] / 3, rel=1e-12)
    assert tried[4]["levels"]["cross"]["bytes_per_token"] == pytest.approx(4 * 6 * N / T, rel=1e-12)
    assert tried[2]["tokens_per_s"] > 2 * tried[4]["tokens_per_s"]
    assert out["cluster"]["replicas"] == 2 and out["ranked"][0]["replicas"] == 2
    ratio = tried[2]["tokens_per_s"] / tried[4]["tokens_per_s"]
    assert out["recommendation"].startswith(f"replica size: --replicas 2 (2 replicas of 2 workers each) is fastest, "
                                            f"ddp at {tried[2]['tokens_per_s']:,.0f} tokens/s, {ratio:.2f}x")
    assert "\nuse ddp with --replicas 2:" in out["recommendation"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "replica counts tried (R replicas of K = 4/R workers each; R = 4 is flat)" in table


def test_a_slow_intra_link_keeps_the_cluster_flat(capsys):
    got, out = plan(capsys, "--intra-link", "10mbit,50ms", "--strategies", "ddp")
    assert out["cluster"]["replicas"] == 4 and out["cluster"]["inside"] is None
    assert out["recommendation"].startswith("replica size: the flat cluster (--replicas 4: one worker a replica)")
    assert got["ddp"]["levels"]["intra"]["wire_bytes_per_rank_per_step"] == 0


# --tune: each strategy's knobs over a grid (plan/tune.py), and what the plan assumed (plan/assume.py).
SLOW = ["--link", "10mbit,20ms"]  # later flags win: the cluster above on a link where every byte counts


def tuned(capsys, *extra):
    got, out = plan(capsys, *SLOW, "--tune", *extra)
    return {t["strategy"]: t for t in out["tuned"]}, out


def test_tune_takes_the_largest_sync_every_allowed_on_a_slow_link(capsys):
    t, _ = tuned(capsys, "--strategies", "diloco")
    diloco = t["diloco"]
    assert diloco["knobs"]["sync_every"] == {"flag": "--sync-every", "default": 32, "tuned": 64}
    assert diloco["tuned"]["tokens_per_s"] > diloco["default"]["tokens_per_s"]
    assert "H <= 64" in diloco["basis"]  # throughput alone would take any larger H: the bound says where it stops
    t, _ = tuned(capsys, "--strategies", "diloco", "--max-sync-every", "256")
    assert t["diloco"]["knobs"]["sync_every"]["tuned"] == 256


def test_tune_keeps_a_small_sync_every_where_the_network_is_no_bottleneck(capsys):
    got, out = plan(capsys, "--link", "100gbit,10us", "--tune", "--strategies", "diloco")
    assert out["tuned"][0]["knobs"]["sync_every"]["tuned"] == 8  # H = 64 would buy < 5 % more tokens/s


def test_tune_picks_a_sane_ddp_bucket(capsys):
    t, _ = tuned(capsys, "--strategies", "ddp")
    ddp = t["ddp"]
    assert ddp["knobs"]["bucket_mb"]["tuned"] in (1, 5, 10, 25, 50, 100)
    assert ddp["tuned"]["tokens_per_s"] >= ddp["default"]["tokens_per_s"]
    assert "system knob" in ddp["basis"]


def test_tune_in_the_table_names_default_and_tuned_settings(capsys):
    assert main([a for a in ARGS if a != "--json"] + [*SLOW, "--tune", "--strategies", "diloco,ddp,quantized"]) == 0
    out = capsys.readouterr().out
    assert "Throughput alone cannot pick H" in out
    assert "--sync-every 32" in out and "--sync-every 64" in out and "--bits 8" in out


def test_max_sync_every_without_tune_is_refused(capsys):
    assert main([*ARGS, "--max-sync-every", "128"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "give --tune" in err[0]


def test_the_plan_says_what_it_assumed(capsys):
    _, out = plan(capsys, "--strategies", "ddp")
    assumed = out["assumptions"]
    assert assumed["tokens_per_step"] == 65536 and assumed["tokens_per_step_from"] == "--tokens-per-step"
    assert assumed["compute_from"].startswith("--worker-tflops 4")
    assert assumed["overhead_from"].startswith("0 (not measured")
    assert assumed["warnings"] == []  # --tokens-per-step given: nothing extrapolated
    assert main([a for a in ARGS if a != "--json"] + ["--strategies", "ddp"]) == 0
    text = capsys.readouterr().out
    assert "assumed: tokens per step 65,536 from --tokens-per-step" in text
    assert "assumed: compute speed per worker --worker-tflops 4" in text


def test_params_without_tokens_per_step_warns_that_the_batch_is_the_presets(capsys):
    args = ["plan", "--workers", "4", "--link", "1gbit,1ms", "--worker-tflops", "100", "--params", "1e9",
            "--strategies", "ddp"]
    assert main([*args, "--json"]) == 0
    assumed = json.loads(capsys.readouterr().out)["assumptions"]
    assert "(the config's batch, not --tokens-per-step)" in assumed["tokens_per_step_from"]
    assert len(assumed["warnings"]) == 1 and "give --tokens-per-step" in assumed["warnings"][0]
    assert main(args) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "8,192 tokens per step" in warnings[0]


def test_tune_recommends_the_tuned_setting_and_its_command_plans_the_same_step(capsys):
    """With --tune the recommendation names the tuned setting (diloco's H = 64 on the slow link,
    not the default 32 the table ranks by, and its outer step a period late, which hides a third
    of each sync, with the plain outer SGD PCCL runs it with and eager updates, which cost no
    time), the fastest of every strategy's tuned setting, and its command line, planned again,
    predicts the same step."""
    argv = [*CLUSTER, "--params", "1e6", *SLOW, "--strategies", "diloco,ddp,quantized"]
    assert main([*argv, "--tune"]) == 0
    out = json.loads(capsys.readouterr().out)
    rec = out["recommended"]
    assert (rec["strategy"], rec["replicas"], rec["knobs"]) == ("diloco", 4, {"sync_every": 64, "outer_delay": 1,
                                                                          "eager": True, "outer_momentum": 0.0})
    assert all(rec["step_s"] <= t["tuned"]["step_s"] for t in out["tuned"])
    assert out["ranked"][0]["label"] == "diloco H=32"  # the table: the options given
    assert out["recommendation"].startswith("use diloco H=64 eager (tuned; the command below): ")
    assert out["recommendation"].endswith("\ncommand: " + rec["command"])
    assert rec["command"] == ("lowcomm train --strategy diloco --workers 4 --sync-every 64 --outer-delay 1 --eager "
                              "--outer-momentum 0")
    words = rec["command"].split()[2:]
    words[0] = "--strategies"
    assert main([*argv, *words]) == 0
    again = json.loads(capsys.readouterr().out)["ranked"][0]
    assert again["step_s"] == pytest.approx(rec["step_s"], rel=1e-12)
    assert main([*argv]) == 0  # without --tune: the options given, no command
    assert "command:" not in json.loads(capsys.readouterr().out)["recommendation"]


def test_tune_searches_the_replica_count_with_the_knobs(capsys):
    """diloco on 4 workers over 10mbit, 20 ms, with 10gbit inside: flat, a sync is one all-reduce
    of 4N bytes on 4 ranks (4.73 s), 0.074 s a step at H = 64 against 0.024 s of compute, so H
    goes to its bound; 2 replicas of 2 send a position's part on 2 ranks and their step at
    H = 64 is faster still: the pick is (R = 2, H = 64), each R priced at that H."""
    argv = [*CLUSTER, "--params", "1e6", *SLOW, "--intra-link", "10gbit,50us", "--strategies", "diloco", "--tune"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    t = out["tuned"][0]
    by_r = {e["replicas"]: e for e in t["by_replicas"]}
    assert set(by_r) == {4, 2}
    sync = 6 * 0.02 + 2 * 3 / 4 * 4 * N / 1.25e6  # all_reduce(4N) on 4 ranks over 10mbit, 20 ms
    # the sync a period late: 64 inner steps (1.51 s) of it hidden
    assert by_r[4]["step_s"] == pytest.approx(COMPUTE + (sync - 64 * COMPUTE) / 64, rel=1e-12)
    assert by_r[2]["step_s"] < by_r[4]["step_s"]
    assert (t["knobs"]["sync_every"]["tuned"], t["knobs"]["outer_delay"]["tuned"], t["replicas"]) == (64, 1, 2)
    assert t["tuned"]["step_s"] == pytest.approx(by_r[2]["step_s"], rel=1e-12)
    rec = out["recommended"]
    assert (rec["replicas"], rec["knobs"]) == (2, {"sync_every": 64, "outer_delay": 1, "eager": True,
                                                   "outer_momentum": 0.0})
    assert rec["command"] == ("lowcomm train --strategy diloco --workers 4 --replicas 2 --inside ddp --sync-every 64 "
                              "--outer-delay 1 --eager --outer-momentum 0")
    assert out["recommendation"].startswith("replica size (searched with the knobs): --replicas 2 (2 replicas of 2 "
                                            "workers each) is fastest, diloco H=64 eager at ")
    assert f"{by_r[2]['tokens_per_s'] / by_r[4]['tokens_per_s']:.2f}x the tokens/s of the same setting on the flat " \
        "cluster." in out["recommendation"]


def _one_run(path, strategy: str, table: str = "") -> int:
    """A finished run of 4 steps on 2 workers of the tiny preset, written by hand: each step rank 0
    computes 0.1 s and rank 1 0.2 s, then 50 ms on the network and 10 ms of overhead; validation
    loss 3.5 after step 2 and 3.0 after step 4. Returns the model's parameter count."""
    from lowcomm import config as C
    from lowcomm.plan.planner import model_layout
    params = model_layout(C.RunConfig(model=C.ModelConfig(preset="tiny"))).numel
    comm = 0.05
    (path / "config.toml").write_text(f'strategy = "{strategy}"\nworkers = 2\nmicro_batch = 2\n'
                                      '[model]\npreset = "tiny"\nseq_len = 128\n'
                                      '[link]\nbandwidth = "1gbit"\nlatency = "1ms"\n' + table)
    step = {"tokens": 512, "wire_bytes": 0, "compute_s": 0.2, "exposed_comm_s": 0.1 + comm,
            "wall_s": 0.2 + comm + 0.01, "per_rank": {"compute_s": [0.1, 0.2], "exposed_comm_s": [0.1 + comm, comm],
                                                      "micro_batches": [1, 1]}}
    val = {2: {"val_loss": 3.5}, 4: {"val_loss": 3.0}}
    (path / "steps.jsonl").write_text("".join(json.dumps({**step, "step": i, **val.get(i, {})}) + "\n"
                                              for i in range(1, 5)))
    (path / "summary.json").write_text(json.dumps({
        "strategy": strategy, "params": params, "workers": 2, "final_val_loss": 3.0, "slowdown": [],
        "compute_s_per_rank": [0.4, 0.8], "micro_batches_per_rank": [4, 4]}))
    return params


def test_calibrate_from_one_run_takes_each_step_at_its_slowest_rank(capsys, tmp_path):
    """A run dir calibrates as a bench of that run. Its ranks computed 0.1 s and 0.2 s a step and
    zero1 waits for the slower one: the plan's compute is 0.2 s, not the mean 0.15 s, and the
    per-step overhead is what the slowest rank spent outside compute and network (10 ms; the
    faster rank's wait includes the slower one's compute and must not be subtracted)."""
    params = _one_run(tmp_path, "zero1")
    assert main(["plan", "--calibrate", str(tmp_path), "--strategies", "zero1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["ranked"][0]
    rs = LAT + 1 / 2 * 4 * params / BW  # reduce_scatter and all_gather on 2 ranks: one hop, half of 4N bytes
    assert got["compute_s"] == pytest.approx(0.2, rel=1e-9)
    assert got["overhead_s"] == pytest.approx(0.01, rel=1e-9)
    assert got["step_s"] == pytest.approx(0.2 + 0.01 + 2 * rs, rel=1e-9)


def test_tune_says_in_its_answer_which_settings_the_calibration_did_not_measure(capsys, tmp_path):
    """A diloco run at H = 8 calibrates the loss per token of H = 8 only: the answer is that
    setting, ranked by time to the target, and it says the larger H were not ranked so."""
    _one_run(tmp_path, "diloco", '[diloco]\nsync_every = 8\n')
    assert main(["plan", "--calibrate", str(tmp_path), "--tune", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"]["knobs"]["sync_every"] == 8 and out["recommended"]["time_to_target_s"] is not None
    untimed = ", ".join(f"sync_every={h} outer_delay={d} eager={e}" for h in (8, 16, 32, 64)
                        for d, e in ((0, False), (1, False), (1, True)) if (h, d) != (8, 0))
    assert (f"\ncaveat: the calibration measured sync_every=8 outer_delay=0 eager=False only; {untimed} not ranked "
            "by time to target"
            "\ncommand: lowcomm train --strategy diloco --workers 2 --sync-every 8") in out["recommendation"]


def test_tune_of_strategies_without_knobs_still_answers_with_a_command(capsys):
    assert main([a for a in ARGS if a != "--json"] + ["--strategies", "zero1", "--tune"]) == 0
    out = capsys.readouterr().out
    assert "none of the strategies planned has a knob to tune" in out
    assert out.rstrip().endswith("command: lowcomm train --strategy zero1 --workers 4")
