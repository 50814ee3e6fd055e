"""A plain rank reads the run's stream (the loader an elastic member reads): the draws of its shard,
window for window what the shard's own reader gives; its checkpointed state reads on in the saved
order (seed included), and a state saved when a plain rank's loader was its shard's reader
(epoch, index) reads on from the same window. No process: the loaders alone."""
from __future__ import annotations

import numpy as np
import torch

from lowcomm import config as C
from lowcomm.comm.groups import ReplicaLayout
from lowcomm.data.loader import ShardedBatches
from lowcomm.train.member_data import load_loader_state, loader_state, plain_loader

SEQ, MICRO, SEED = 8, 2, 3
TRAIN = np.arange(2000, dtype=np.int64) % 251  # 2 shards of 1000 tokens: 124 windows each, 31 draws of 2x2
DRAWS = 70  # past two epochs of a shard


def config(seed: int = SEED) -> C.RunConfig:
    return C.RunConfig(workers=4, replicas=2, micro_batch=MICRO, seed=seed, model=C.ModelConfig(seq_len=SEQ))


def draws(loader, n: int) -> list[torch.Tensor]:
    return [loader.next()[0] for _ in range(n)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_plain_rank_reads_its_shard_as_its_shards_reader_does_and_resumes_in_the_saved_order():
    layout = ReplicaLayout(4, 2)  # 2 replicas of 2 processes: rank 3 is replica 1, position 1
    stream = plain_loader(config(), TRAIN, layout, 3)
    shard = ShardedBatches(TRAIN, 1, 2, SEQ, MICRO, SEED, position=1, positions=2)
    assert same(draws(stream, DRAWS), draws(shard, DRAWS))

    saved, later = loader_state(stream), draws(stream, 5)
    resumed = plain_loader(config(seed=5), TRAIN, layout, 3)  # another seed: the saved one must win
    load_loader_state(resumed, saved)
    assert same(draws(resumed, 5), later)


def test_a_plain_loaders_state_from_before_the_stream_reads_on_from_the_same_window():
    layout = ReplicaLayout(4, 2)
    shard = ShardedBatches(TRAIN, 1, 2, SEQ, MICRO, SEED, position=1, positions=2)
    draws(shard, DRAWS)
    saved, later = shard.state_dict(), draws(shard, 5)  # {"epoch", "index", "seed"}
    assert saved["epoch"] == 2
    resumed = plain_loader(config(seed=5), TRAIN, layout, 3)
    load_loader_state(resumed, saved)
    assert same(draws(resumed, 5), later)
