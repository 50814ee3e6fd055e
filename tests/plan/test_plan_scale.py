"""`lowcomm plan` at a cluster's real sizes (a million workers, 1e13 parameters): what it prices
per bucket or per tensor and rank is worked out in closed form or with a heap, and gives what
the one-at-a-time loops it replaces gave (those loops, here, are the reference). Pure Python,
no worker is started."""
import random

import pytest

N = 960_384  # the GPT of --params 1e6 (test_plan.py)


def _last_bucket_sent_one_by_one(nbytes, first, size, backward, price):
    """The NIC's recursion bucket by bucket: each sent when filled and the NIC is free."""
    sizes, left = [], nbytes
    while left > 0:
        sizes.append(min(left, size if sizes else first))
        left -= sizes[-1]
    nic_free, done = 0.0, 0
    for bucket in sizes:
        done += bucket
        nic_free = max(backward * done / nbytes, nic_free) + price(bucket)
    return nic_free


@pytest.mark.parametrize("nbytes,first,size", [(10, 20, 4), (20, 20, 4), (23, 4, 4), (24, 4, 4),
                                               (1_000_003, 1024, 997), (4 * N, 1048576, 25 * 2**20)])
def test_ddp_buckets_priced_in_runs_finish_when_priced_one_by_one(nbytes, first, size):
    """The plan prices DDP's equal buckets a run at a time (a 1e13-parameter model has 1.6
    million of them, which took minutes one by one): the same end, whichever of the NIC and
    the backward holds the buckets back."""
    from lowcomm.engines.costs import bucket_runs, last_bucket_sent

    for latency, per_byte in ((1e-3, 1e-6), (1e-6, 1e-9), (0.0, 1e-4), (0.0, 0.0)):
        for backward in (1e-3, 1.0, 100.0):
            def price(b):
                return latency + per_byte * b
            runs = bucket_runs(nbytes, first, size)
            assert sum(b * n for b, n in runs) == nbytes
            assert last_bucket_sent(runs, nbytes, backward, price) == pytest.approx(
                _last_bucket_sent_one_by_one(nbytes, first, size, backward, price), rel=1e-9, abs=1e-15)


def test_ddp_buckets_of_a_huge_model_are_priced_a_run_at_a_time():
    from lowcomm.engines.costs import bucket_runs, last_bucket_sent

    asked = []
    runs = bucket_runs(4 * 10**13, 1048576, 25 * 2**20)
    last_bucket_sent(runs, 4 * 10**13, 1.0, lambda b: asked.append(b) or 1e-3)
    assert sum(n for _, n in runs) == 1 + 1_525_878 + 1 and len(asked) == 3


def _owned_by_scanning(numels, K):
    """Each tensor, largest first, to the least loaded of the K positions found by a scan."""
    load, out = [0] * K, [[] for _ in range(K)]
    for j in sorted(range(len(numels)), key=lambda j: (-numels[j], j)):
        p = min(range(K), key=lambda q: (load[q], q))
        out[p].append(j)
        load[p] += numels[j]
    return [sorted(group) for group in out]


@pytest.mark.parametrize("seed", range(6))
def test_tensors_owned_by_the_positions_of_a_replica_are_those_a_scan_assigns(seed):
    """Ties of load included (equal tensors: a GPT's blocks), and more positions than tensors."""
    from lowcomm.models.layout import owned_tensors

    rng = random.Random(seed)
    numels = [rng.choice([1, 4, 4, 16, 64, 64, 1000]) for _ in range(rng.randint(1, 60))]
    for K in (1, 2, 3, 7, len(numels), len(numels) + 5):
        assert owned_tensors(numels, K) == _owned_by_scanning(numels, K), (seed, K)


def test_tuning_a_huge_cluster_says_at_once_that_it_takes_a_while(capsys):
    """--tune prices every rank position of a replica for each setting it tries: at tens of
    thousands of ranks a replica it says so before it starts and names each strategy as it is
    done, instead of minutes of silence; a small cluster's plan says nothing of it."""
    from lowcomm.cli.main import main

    def tune(workers):
        assert main(["plan", "--params", "1e9", "--workers", str(workers), "--link", "1gbit,10ms",
                     "--worker-tflops", "300", "--tune", "--intra-link", "100gbit,5us",
                     "--strategies", "diloco,ddp"]) == 0
        return capsys.readouterr().err.splitlines()

    said = tune(20_000)
    assert said[0].startswith("lowcomm plan: --tune prices each of up to 10,000 ranks of a replica"), said
    assert [line.split(" (")[0].strip() for line in said[1:]] == ["tuned diloco", "tuned ddp"], said
    assert not [line for line in tune(64) if "tune" in line]
