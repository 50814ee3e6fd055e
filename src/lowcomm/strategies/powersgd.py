"""PowerSGD (Vogels, Karimireddy, Jaggi; NeurIPS 2019), Algorithm 1, as torch's own
`powerSGD_hook` on DDP does it: per n×m gradient matrix M of a bucket, at rank r,

    M  <- M + e                                   error feedback (local)
    P  <- M·Q;   all_reduce(P);  P <- orthogonalize(P)       Q: last step's (warm start)
    Q  <- Mᵀ·P;  all_reduce(Q)                    (mean over workers)
    e  <- M - P·Qᵀ;   M <- P·Qᵀ                   what is applied, and what is left for later
    θ  <- opt(θ; M)                               the run's optimizer, replicated as in DDP

Tensors not worth compressing (1-D, or (n+m)·r·2 >= n·m) are all-reduced as they are, and the
first `start` steps all-reduce plain gradients. Bytes per step: 4·P before, then 4·(U + Σ(n+m)·r)
(U: the uncompressed tensors' values).

It is ddp with another `comm_hook`: torch's hook runs unchanged, with its all-reduces through
Comm (comm.torch_hooks), buckets reduced one after another (BucketChain: several DDP
buckets, --bucket-mb, otherwise issued their collectives in an order that differed between
ranks), and its state kept per parameter (engines/powersgd_state.py), so that a resumed run
continues bit-identically although its fresh DDP lays buckets out anew.

Across replica groups (--replicas), and in a process without a group, there is no DDP
wrapper: the hook runs once the step's gradients are in, on one bucket (across replicas: of
the tensors this rank's position owns, after the replica's mean of them, Strategy.reduce_inside;
its first Qs are drawn per parameter, so the K groups together compute what R single workers
would).

Not with --inside fsdp (refused at start-up, in one line): FSDP2 shards dim 0, so a position
holds whole rows of each gradient matrix M (n x m, as torch's hook views a tensor). P = M·Q goes
row by row, so a position could compute its rows of P; but orthogonalize(P) (Gram-Schmidt over
P's columns) needs every row of P, and Q = Mᵀ·P sums over every row of M: both would need
collectives inside the replica between the hook's steps (P's rows gathered, Q's partial sums
reduced), which torch's hook, run unchanged, does not issue. Each shard compressed as a matrix of
its own would be another compression (rank r per shard, K·r per matrix, (n + K·m)·r values sent
instead of (n + m)·r), not PowerSGD's; --inside ddp runs it exactly.

Under --elastic (contract/elastic.py) θ, the optimizer state and torch's hook state but the error
feedback are replicated (P and Q are all-reduced, so the warm-started Q is every rank's); the
error feedback is each rank's own, and a joiner starts it at zero: torch's hook creates a zero
error tensor for a bucket it holds none for, as at the step PowerSGD starts. Commit point: every step.
"""
from dataclasses import dataclass

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as _default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _psgd

from ..engines.powersgd_state import (MIN_COMPRESSION_RATE, HookStateLayout, compresses, hook_state_dict,
                                   load_hook_state, matrix_shape)
from ..comm.torch_hooks import BucketChain, CountedGroup, route_collectives
from ..errors import UsageError
from ..contract.base import Strategy
from .ddp import DDP, DDPOptions
from ..contract.options import option
from ..contract.parts import LOCAL, REPLICATED, Part
from ..contract.plan import PlannedOp
from ..engines.costs import PowerSGDCost
from .registry import register


@dataclass
class PowerSGDOptions(DDPOptions):
    rank: int = option(4, "PowerSGD matrix approximation rank", flag="--powersgd-rank", min=1)
    start: int = option(10, "plain all-reduce for this many steps before PowerSGD starts (torch needs > 1)",
                        flag="--powersgd-start", min=2)

    def check_model(self, layout) -> None:
        if powersgd_sizes(layout.shapes, self.rank)[1] == 0:
            raise UsageError(f"--powersgd-rank {self.rank} compresses no tensor of this model (an n x m matrix is "
                             f"compressed when (n+m)*rank*{MIN_COMPRESSION_RATE} < n*m); use a lower rank")


def powersgd_sizes(shapes, rank: int) -> tuple[int, int, int]:
    """(uncompressed, P, Q) element counts over all tensors, as torch's hook splits them."""
    unc = ps = qs = 0
    for shape in shapes:
        n, m = matrix_shape(shape)
        if compresses(n, m, rank):
            r = min(n, m, rank)
            ps, qs = ps + n * r, qs + m * r
        else:
            unc += n * m
    return unc, ps, qs


@register("powersgd")
class PowerSGD(DDP):
    Options = PowerSGDOptions
    inside_replica = ("ddp",)  # across replica groups: on the tensors each position owns, without DDP
    owns_tensors = True
    cost = PowerSGDCost  # plain until `start`, then P and Q, all exposed; across replicas the owned tensors'

    def __init__(self, model, comm, make_optimizer, *args, **kwargs):
        Strategy.__init__(self, model, comm, make_optimizer, *args, **kwargs)
        # Across replica groups (and in a single process) without DDP: the hook runs in update(),
        # on one bucket of the (owned) gradients (DDP._update_unwrapped).
        self.wrap_in_ddp(model, comm, make_optimizer)
        route_collectives(_psgd, _default_hooks)
        self.psgd = _psgd.PowerSGDState(process_group=CountedGroup(comm),
                                        matrix_approximation_rank=self.options.rank,
                                        start_powerSGD_iter=self.options.start,
                                        min_compression_rate=MIN_COMPRESSION_RATE,
                                        use_error_feedback=True, warm_start=True, random_seed=0)
        self.layout = HookStateLayout(self.psgd, [p for p in model.parameters() if p.requires_grad],
                                      self.options.rank)
        self.chain = BucketChain()

    def use_comm(self, comm):
        super().use_comm(comm)
        self.psgd.process_group = CountedGroup(comm)  # the hook's next collectives go through it

    def comm_hook(self, bucket):
        """torch's powerSGD_hook on one bucket, after the previous bucket's (see BucketChain)."""
        def reduce():
            self.layout.align(bucket)
            return _psgd.powerSGD_hook(self.psgd, bucket)
        return self.chain.run(reduce)

    @classmethod
    def comm_plan(cls, layout, world, options):
        """Plain all-reduce for the first `start` steps, then torch's three all-reduces per
        bucket, sized by each tensor's shape. (As for ddp, each bucket's op is rounded on its
        own, so at W=3 the count can be a few bytes under this plan.)"""
        num_params = layout.numel
        unc, ps, qs = powersgd_sizes(layout.shapes, options.rank)
        after = [PlannedOp("all_reduce", 4 * unc, offset=options.start + 1, what="uncompressed tensors"),
                 PlannedOp("all_reduce", 4 * ps, offset=options.start + 1, what="PowerSGD P factors"),
                 PlannedOp("all_reduce", 4 * qs, offset=options.start + 1, what="PowerSGD Q factors")]
        # torch still issues an all-reduce of 0 elements where a part is empty; a plan lists bytes
        return [PlannedOp("all_reduce", 4 * num_params, what="gradients before PowerSGD starts")] + \
            [op for op in after if op.nbytes > 0]

    def state_parts(self):
        """θ and the optimizer (ddp's); torch's hook state (step count, warm-started P/Q, its RNG) and
        which parameters each bucket's part of it is laid out in; the hook's error feedback, which
        differs per rank (a joiner's is zero)."""
        def hook(error_feedback: bool, kind: str) -> Part:
            return Part(lambda: hook_state_dict(self.psgd, error_feedback), lambda sd: load_hook_state(self.psgd, sd), kind)
        return {**super().state_parts(), "powersgd": hook(False, REPLICATED), "error_feedback": hook(True, LOCAL),
                "layout": Part(self.layout.state_dict, self.layout.load_state_dict)}

    def update(self, ctx):
        super().update(ctx)
        if ctx.skipped:  # the hook's error feedback and factors took in the non-finite gradient
            self.layout.forget()

    def report(self):
        return {"powersgd_rank": self.options.rank, "powersgd_start": self.options.start}
