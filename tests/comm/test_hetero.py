"""Slow and straggling workers (Pacer), and the bad-input contract of the new flags.
(The multi-process effect of --slowdown on waiting time is in test_link_train.py.)"""
import time

import pytest

from lowcomm import config as C
from lowcomm.cli.main import main
from lowcomm.comm.pacer import Pacer


def test_pacer_sleeps_f_minus_one_times_the_compute():
    p = Pacer(rank=0, world=2, slowdown=3.0)
    began = time.perf_counter()
    p.start(began)
    time.sleep(0.05)  # "compute", as long as this sleep really took (later under load)
    t0 = time.perf_counter()
    compute = t0 - began
    extra = p.pay(step=0)
    slept = time.perf_counter() - t0
    assert extra == pytest.approx(2 * compute, rel=0.1)  # (3 - 1) x the compute
    late = compute - 0.05  # how late a sleep wakes right now: the bound's slack, whatever the load
    assert extra <= slept <= extra + 0.05 + 3 * late  # sleeps never end early
    assert p.slept_s == pytest.approx(slept, abs=1e-3)
    assert Pacer(0, 2, 1.0).pay(0) == 0.0


def test_stragglers_are_seeded_shared_and_as_frequent_as_asked():
    steps = range(4000)
    ranks = [Pacer(r, 4, 1.0, straggler_prob=0.25, straggler_factor=5.0, seed=7) for r in range(4)]
    picks = [ranks[0].straggler(s) for s in steps]
    # Every rank draws the same straggler without communicating.
    assert all([p.straggler(s) for s in steps] == picks for p in ranks)
    hit = [s for s in steps if picks[s] is not None]
    assert abs(len(hit) / len(picks) - 0.25) < 0.03   # ~5 sigma for n=4000
    for r in range(4):
        mine = [s for s in hit if picks[s] == r]
        assert abs(len(mine) / len(hit) - 0.25) < 0.06
        assert all(ranks[r].factor(s) == 5.0 for s in mine)
        assert all(ranks[r].factor(s) == 1.0 for s in steps if picks[s] != r)
    other_seed = Pacer(0, 4, 1.0, 0.25, 5.0, seed=8)
    assert [other_seed.straggler(s) for s in steps] != picks
    # A slow rank that straggles is slower still.
    assert Pacer(picks[hit[0]], 4, 2.0, 0.25, 5.0, seed=7).factor(hit[0]) == 10.0


def test_config_parses_link_slowdown_and_stragglers():
    cfg = C.RunConfig(workers=2)
    C.set_link(cfg, "100mbit,20ms,1ms")
    # parsed once, when set: nothing downstream sees the strings
    assert (cfg.link.bandwidth, cfg.link.latency, cfg.link.jitter) == (12.5e6, 0.02, 0.001)
    assert C.to_dict(cfg)["link"] == {"bandwidth": "100mbit", "latency": "20ms", "jitter": "1ms"}
    link = C.make_link(cfg)
    assert (link.bandwidth, link.latency, link.jitter) == (12.5e6, 0.02, 0.001)
    C.set_value(cfg, "slowdown", "1,2.5", "--slowdown")
    C.set_value(cfg, "stragglers", "0.1,3", "--stragglers")
    C.validate(cfg)
    assert cfg.slowdown == (1.0, 2.5) and cfg.stragglers == (0.1, 3.0)
    assert C.to_dict(cfg)["slowdown"] == "1,2.5" and C.to_dict(cfg)["stragglers"] == "0.1,3"
    assert C.make_link(C.RunConfig()) is None


def test_link_table_in_toml(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('slowdown = "1,3"\n[link]\nbandwidth = "1gbit"\nlatency = "5ms"\n')
    cfg = C.load_toml(f)
    assert C.make_link(cfg).bandwidth == 125e6 and cfg.slowdown == (1.0, 3.0)
    again = tmp_path / "again.toml"
    again.write_text(C.to_toml(cfg))  # config.toml of a run reads back the same link
    assert C.load_toml(again).link == cfg.link
    f.write_text('[link]\nbandwidth = "1gbit"\nspeed = "fast"\n')
    with pytest.raises(C.UsageError, match="unknown config key 'link.speed'"):
        C.load_toml(f)
    # the one-line spelling of --link and --intra-link sets the same tables
    f.write_text('slowdown = "1,3"\nlink = "1gbit,5ms"\nintra_link = "10gbit,50us,1us"\n')
    line = C.load_toml(f)
    assert line.link == cfg.link and (line.intra_link.bandwidth, line.intra_link.jitter) == (10e9 / 8, 1e-6)
    f.write_text('link = "fast"\n')
    with pytest.raises(C.UsageError, match="'fast' must be BANDWIDTH,LATENCY"):
        C.load_toml(f)


@pytest.mark.parametrize("flags,needle", [
    (["--link", "fast"], "'fast'"),
    (["--link", "fast,10ms"], "'fast'"),
    (["--link", "100mbit,-5ms"], "'-5ms'"),
    (["--link", "100mbit,20ms,soon"], "'soon'"),
    (["--slowdown", "1,2,3"], "'1,2,3'"),
    (["--slowdown", "1,0.5"], "'0.5'"),
    (["--slowdown", "1,x"], "'x'"),
    (["--stragglers", "2,3"], "'2,3'"),
    (["--stragglers", "0.1"], "'0.1'"),
])
def test_bad_values_exit_2_naming_the_value_and_write_nothing(tmp_path, capsys, flags, needle):
    out = tmp_path / "run"
    rc = main(["train", "--workers", "2", "--steps", "1", "--out", str(out), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not out.exists()
