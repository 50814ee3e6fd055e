"""What a member of an elastic run reads: its training data from the step its membership began,
and its share of the run's validation batches, the same whatever the membership."""
from __future__ import annotations

from .. import config as C
from ..data import val_batches
from ..data.loader import ShardedBatches
from ..elastic.membership import View


def loader_for(cfg: C.RunConfig, train, view: View, step: int) -> ShardedBatches:
    """The data of rank `view.rank` of `view.world` from `step` on: the training split is cut in
    world shards, each read in an order drawn from (seed, step the membership began, rank). So
    what a worker trains on is a function of the step and the live membership (membership.jsonl
    records both); the steps a failure discarded are trained again by the new membership on its
    own data (re-assigned, not skipped). A membership that began at step 0 reads what a plain run
    of its workers reads, at any seed (its order seed is then the plain run's, --seed)."""
    rank, world, position, positions = view.shard()  # a replica of K processes: its shard, split K ways
    return ShardedBatches(train, rank, world, cfg.model.seq_len, cfg.loader_micro_batch,
                          cfg.seed + 1_000_003 * step, position, positions)


def val_for(cfg: C.RunConfig, val_tokens, view: View) -> list:
    """This member's share of the run's validation batches, which are the same whatever the
    membership: those a run of --workers ranks evaluates, dealt round-robin to the members (a
    member beyond them evaluates none). So validation losses compare across memberships and with
    a fault-free run; each member's share of a W-member quorum's set would be another sample."""
    ranks = cfg.workers
    return [batch for r in range(view.rank, ranks, view.world)
            for batch in val_batches(val_tokens, r, ranks, cfg.model.seq_len, cfg.micro_batch, cfg.eval_batches)]
