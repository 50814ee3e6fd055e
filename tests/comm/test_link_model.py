"""LinkModel against the ring formulas of ALGORITHMS.md, and the --link parser."""
import math

import pytest

from lowcomm.comm.link import LinkModel, parse_bandwidth, parse_duration, split_link_spec
from lowcomm.errors import UsageError

MB = 10**6


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_durations_follow_the_ring_table(world):
    bw, lat = 12.5e6, 0.02  # 100 Mbit/s, 20 ms per hop
    link = LinkModel(bw, lat)
    S = 8 * MB
    # Written out from the table, not from wire.py, so a wrong formula there fails here.
    expected = {
        "all_reduce": 2 * (world - 1) * lat + 2 * (world - 1) / world * S / bw,
        "reduce_scatter": (world - 1) * lat + (world - 1) / world * S / bw,
        "all_gather": (world - 1) * lat + (world - 1) / world * S / bw,
        "broadcast": 1 * lat + S / bw,
        "all_to_all": 1 * lat + (world - 1) / world * S / bw,
    }
    for op, want in expected.items():
        # rel 1e-6: wire_bytes rounds down to whole bytes (S/3 is not one)
        assert link.duration(op, S, world) == pytest.approx(want, rel=1e-6), op


def test_one_rank_and_infinite_bandwidth():
    assert LinkModel(1e6, 0.01).duration("all_reduce", MB, 1) == 0.0
    inf = LinkModel(math.inf, 0.005)
    assert inf.duration("all_reduce", 64 * MB, 2) == pytest.approx(2 * 0.005)
    assert LinkModel(math.inf, 0.0).duration("all_gather", 64 * MB, 4) == 0.0


def test_back_to_back_ops_queue_on_the_nic():
    link = LinkModel(1e6, 0.001)
    d = link.duration("all_reduce", MB, 2)  # 2 ms latency + 1 s transfer
    s1, e1 = link.schedule("all_reduce", MB, 2, now=100.0)
    s2, e2 = link.schedule("all_reduce", MB, 2, now=100.0)   # issued together: waits for the first
    s3, e3 = link.schedule("all_gather", MB, 2, now=100.5)   # issued mid-way: still queued
    assert (s1, e1) == (100.0, pytest.approx(100.0 + d))
    assert s2 == pytest.approx(e1) and e2 == pytest.approx(100.0 + 2 * d)
    assert s3 == pytest.approx(e2)
    assert e3 == pytest.approx(e2 + link.duration("all_gather", MB, 2))
    # After an idle gap the NIC is free again: the op starts when issued.
    s4, e4 = link.schedule("broadcast", MB, 2, now=200.0)
    assert s4 == 200.0 and e4 == pytest.approx(200.0 + link.duration("broadcast", MB, 2))


def test_jitter_is_seeded_bounded_and_varies():
    def ends(seed):
        link = LinkModel(1e7, 0.01, jitter_s=0.004, seed=seed)
        out, t = [], 0.0
        for _ in range(200):
            s, e = link.schedule("all_reduce", MB, 2, now=t)
            out.append(e - s)
            t = e + 1.0
        return out
    a, b, c = ends(1), ends(1), ends(2)
    base = LinkModel(1e7, 0.01).duration("all_reduce", MB, 2)
    assert a == b and a != c
    assert all(base - 0.004 - 1e-12 <= d <= base + 0.004 + 1e-12 for d in a)
    assert max(a) - min(a) > 0.004  # it actually varies across most of its range
    assert sum(a) / len(a) == pytest.approx(base, abs=0.001)


@pytest.mark.parametrize("text,bytes_per_s", [
    ("100mbit", 12.5e6), ("1gbit", 125e6), ("1Gbit", 125e6), ("500kbit", 62.5e3), ("8bit", 1.0),
    ("12.5MB/s", 12.5e6), ("1GB/s", 1e9), ("2KiB/s", 2048.0), ("100Mb/s", 12.5e6), (" 10 mbit ", 1.25e6),
])
def test_bandwidth_units(text, bytes_per_s):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s)
    assert parse_bandwidth("inf") == math.inf


@pytest.mark.parametrize("text,seconds", [
    ("20ms", 0.02), ("500us", 5e-4), ("1s", 1.0), ("0", 0.0), ("0.5ms", 5e-4), ("1e3us", 1e-3),
])
def test_duration_units(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("parse,text,needle", [
    (parse_bandwidth, "fast", "'fast'"),
    (parse_bandwidth, "100", "needs a unit"),
    (parse_bandwidth, "100mbps", "ambiguous"),
    (parse_bandwidth, "100furlongs", "unknown unit"),
    (parse_bandwidth, "0mbit", "must be positive"),
    (parse_bandwidth, "-5mbit", "must be positive"),
    (parse_duration, "-5ms", "must not be negative"),
    (parse_duration, "20", "needs a unit"),
    (parse_duration, "soon", "'soon'"),
    (parse_duration, "3h", "unknown unit"),
])
def test_bad_values_name_the_value(parse, text, needle):
    with pytest.raises(UsageError) as e:
        parse(text)
    assert needle in str(e.value) and text.strip() in str(e.value)


def test_link_spec_split():
    assert split_link_spec("100mbit,20ms") == ("100mbit", "20ms", "0")
    assert split_link_spec("1gbit, 5ms, 1ms") == ("1gbit", "5ms", "1ms")
    for bad in ("fast", "1gbit,", "a,b,c,d"):
        with pytest.raises(UsageError, match="BANDWIDTH,LATENCY"):
            split_link_spec(bad)
