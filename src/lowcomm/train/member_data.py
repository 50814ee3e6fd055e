"""What a rank reads: its draws of the run's training data stream (one loader, StreamBatches, for a
plain rank and an elastic member: a plain rank's draws are those of its shard), its loader's state
in a checkpoint, and an elastic member's share of the run's validation batches, the same whatever
the membership."""
from __future__ import annotations

import torch

from .. import config as C
from ..comm import Comm
from ..comm.groups import ReplicaLayout
from ..data import val_batches
from ..data.loader import StreamBatches
from ..elastic.membership import View


def loader_for(cfg: C.RunConfig, train, view: View, start: int) -> StreamBatches:
    """The data of rank `view.rank` of `view.world` from draw `start` of the run's stream on
    (loader.StreamBatches): the draws of a plain run of the run's --workers (or --replicas)
    ranks laid end to end, dealt round-robin to the members. So a membership that began at
    step 0 with the run's size reads what a plain run reads, and one formed later goes on from
    the position the last commit recorded (ElasticWorker's snapshot): the steps a failure
    discarded are trained again on the same part of the stream, by the new membership, and no
    window is read twice within an epoch, however often the membership changes."""
    rank, world, position, positions = view.shard()  # a replica of K processes: its shard, split K ways
    return StreamBatches(train, cfg.replicas or cfg.workers, cfg.model.seq_len, cfg.loader_micro_batch,
                         cfg.seed, start, rank, world, position, positions)


def plain_loader(cfg: C.RunConfig, train, layout: ReplicaLayout, rank: int) -> StreamBatches:
    """A plain run's rank `rank` of `layout`: the stream's draws of its replica's shard, from the
    start (the stream of a membership of the run's size: what its shard's reader reads alone)."""
    replica = layout.replica(rank)
    return StreamBatches(train, layout.replicas, cfg.model.seq_len, cfg.loader_micro_batch, cfg.seed, 0, replica,
                         layout.replicas, layout.position(rank), layout.size)


def loader_state(loader: StreamBatches) -> dict:
    """The loader's state in a checkpoint: the stream's position and the seed its epochs' orders
    are drawn from (a resumed run reads on in the saved order)."""
    return {**loader.state_dict(), "seed": loader.readers[0].seed}


def load_loader_state(loader: StreamBatches, sd: dict) -> None:
    """Read on from a saved state: a stream's, or the position in its one shard that a plain run's
    loader saved before it was the stream (epoch, index: windows read, a draw's worth at a time)."""
    if "epoch" in sd:
        reader = loader.readers[loader.member]
        read = int(sd["epoch"]) * len(reader.starts) + int(sd["index"])
        sd = {**loader.state_dict(), "drawn": read // (reader.micro_batch * reader.positions), **sd}
    loader.load_state_dict(sd)
    for reader in loader.readers if "seed" in sd else ():
        reader.load_state_dict({**reader.state_dict(), "seed": sd["seed"]})


def commit_position(loader: StreamBatches, comm: Comm) -> None:
    """At a commit point: the stream's position, as far as the member that drew most (acco's
    rounds can draw unevenly; the draws the others are short of it are skipped, never read
    twice). A collective over the members' `comm` (bookkeeping: not the steps' wire bytes)."""
    drawn = torch.tensor([loader.drawn], dtype=torch.int64)
    comm.meta_all_reduce(drawn, "max")
    loader.committed = loader.frontier(int(drawn))


def val_for(cfg: C.RunConfig, val_tokens, view: View) -> list:
    """This member's share of the run's validation batches, which are the same whatever the
    membership: those a run of --workers ranks evaluates, dealt round-robin to the members (a
    member beyond them evaluates none). So validation losses compare across memberships and with
    a fault-free run; each member's share of a W-member quorum's set would be another sample."""
    ranks = cfg.workers
    return [batch for r in range(view.rank, ranks, view.world)
            for batch in val_batches(val_tokens, r, ranks, cfg.model.seq_len, cfg.micro_batch, cfg.eval_batches)]
