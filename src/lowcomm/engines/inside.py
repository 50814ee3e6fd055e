"""What runs inside a replica group (--inside), below the strategy that runs across replicas.

With --replicas R of --workers W, each replica's K = W/R processes act as one worker of the
strategy (comm/groups.py forms the groups). `ddp` inside: every step the replica's gradients
are averaged and every rank of a replica ends the step with the same parameters. The strategy
runs across replicas on the part each rank holds, so the K cross-replica groups together send
what R single workers would:

    position p of a replica owns whole tensors (ModelLayout.positions: balanced by size)
    G_p  <- mean over the replica of the owned gradients    (reduce_to_owners: one reduce-scatter)
    the strategy's step on the owned tensors, across the R ranks at position p (its optimizer
         state, error feedback, outer state: for the owned tensors only, 1/K of a worker's)
    θ    <- every owner's tensors                            (share: one all-gather)

Whole tensors, not HSDP's flat slices, because DeMo's DCT, PowerSGD's matrices and Streaming
DiLoCo's blocks need a tensor's shape. ddp splits its buckets by position instead (`scatter` /
`gather`): a bucket of gradients has no shape to keep.
A strategy declares what it runs under (Strategy.inside_replica); the rest are refused at
start-up in one line. `fsdp` (parameters, gradients and optimizer state sharded inside a
replica by torch's FSDP2) is engines/inside_fsdp.py.
"""
from __future__ import annotations

import torch

from ..comm import Comm
from ..contract.plan import LevelPlans
from ..errors import UsageError
from ..models.layout import ModelLayout, layout_of, owned_tensors, trainable

INSIDE = ("ddp", "fsdp")   # what --inside may name
BUILT = ("ddp", "fsdp")    # what runs today


class InsideDDP:
    """Data parallel inside a replica: the replica's gradients averaged, its parameters shared."""

    name = "ddp"
    reshapes_model = False  # the model stays the user's: another run may be built on it

    def __init__(self, comm: Comm):
        self.comm = comm
        self._split = None  # (tensor sizes, each position's indices, the largest position's values)

    def strategy_class(self, cls: type) -> type:
        """The class that runs strategy `cls` with this engine inside (here: `cls` itself)."""
        return cls

    def optimizer_factory(self, make_optimizer):
        """make_optimizer as the strategy calls it on its part: here the tensors it owns are the
        model's own parameters, so the user's function as it is (fsdp maps groups to shards)."""
        return make_optimizer

    def part(self, model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], ModelLayout]:
        """The tensors this rank's position owns and their layout (what the strategy runs on)."""
        params = trainable(model)
        owned = self.positions(params)[self.comm.rank]
        if not owned:
            raise UsageError(f"a replica of {self.comm.world} ranks has more ranks than the model has tensors "
                             f"({len(params)}): each rank must own one; use fewer ranks per replica")
        return [params[j] for j in owned], layout_of(model).subset(owned)

    def take_waited(self) -> float:
        """Seconds waited on this engine's collectives inside the compute: none, they run in update."""
        return 0.0

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's piece (its position's 1/K, `flat` zero-padded to a multiple of K) of
        the mean of `flat` over the replica's ranks (one reduce-scatter)."""
        K, n = self.comm.world, flat.numel()
        padded = flat if n % K == 0 else torch.cat([flat, flat.new_zeros(K - n % K)])
        piece = flat.new_empty(padded.numel() // K)
        self.comm.reduce_scatter(piece, padded, op="avg")
        return piece

    def gather(self, piece: torch.Tensor, numel: int) -> torch.Tensor:
        """Every rank's `piece` of the replica put together (one all-gather), padding cut off."""
        out = piece.new_empty(piece.numel() * self.comm.world)
        self.comm.all_gather(out, piece)
        return out[:numel]

    # -- whole tensors owned by position ------------------------------------------------
    def positions(self, params: list[torch.nn.Parameter]) -> list[list[int]]:
        """Indices of the tensors each position owns (the planner's ModelLayout.positions);
        worked out once: the split depends only on the tensors' sizes, which a run keeps."""
        sizes = tuple(p.numel() for p in params)
        if self._split is None or self._split[0] != sizes:
            groups = owned_tensors(list(sizes), self.comm.world)
            self._split = (sizes, groups, max(sum(sizes[j] for j in g) for g in groups))
        return self._split[1]

    def _spans(self, params, q: int, at: int = 0):
        """(index, its values' slice) of each tensor position q owns, laid end to end from `at`."""
        for j in self.positions(params)[q]:
            n = params[j].numel()
            yield j, slice(at, at + n)
            at += n

    def _by_position(self, tensors: list[torch.Tensor | None], params) -> tuple[torch.Tensor, int]:
        """Every position's tensors end to end in one fp32 buffer, each position's part padded
        to the largest (`part` elements), so a reduce-scatter hands each its own part."""
        K = self.comm.world
        self.positions(params)
        part = self._split[2]
        flat = torch.zeros(part * K, dtype=torch.float32, device=params[0].device)
        for q in range(K):
            for j, span in self._spans(params, q, q * part):
                if tensors[j] is not None:
                    flat[span].copy_(tensors[j].reshape(-1))
        return flat, part

    @torch.no_grad()
    def reduce_to_owners(self, params: list[torch.nn.Parameter], op: str = "avg") -> None:
        """Each owned gradient <- its mean (op "avg") or sum over the replica's ranks (one
        reduce-scatter); the gradients this rank does not own are dropped (set to None)."""
        flat, part = self._by_position([p.grad for p in params], params)
        piece = flat.new_empty(part)
        self.comm.reduce_scatter(piece, flat, op=op)
        mine = set()
        for j, span in self._spans(params, self.comm.rank):
            p = params[j]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(piece[span].view_as(p))
            mine.add(j)
        for j, p in enumerate(params):
            if j not in mine:
                p.grad = None

    @torch.no_grad()
    def share(self, params: list[torch.nn.Parameter], counted: bool = True) -> None:
        """Every parameter <- its owner's value (one all-gather of the owned parts; not counted
        as the run's traffic with `counted=False`)."""
        rank = self.comm.rank
        mine = set(self.positions(params)[rank])
        flat, part = self._by_position([p if j in mine else None for j, p in enumerate(params)], params)
        own = flat[rank * part:(rank + 1) * part].clone()
        if counted:
            self.comm.all_gather(flat, own)
        else:
            flat = self.comm.meta_all_gather(own).reshape(-1)
        for q in range(self.comm.world):
            if q != rank:
                for j, span in self._spans(params, q, q * part):
                    params[j].copy_(flat[span].view_as(params[j]))


def replica_sum(comm: Comm, counts: tuple[int, ...], device: torch.device, counted: bool = True) -> tuple[int, ...]:
    """`counts` summed over the ranks of a replica's `comm`, whichever engine runs inside (one
    float64 all-reduce; bookkeeping with `counted=False`)."""
    n = torch.tensor([float(c) for c in counts], dtype=torch.float64, device=device)
    comm.all_reduce(n, op="sum") if counted else comm.meta_all_reduce(n, op="sum")
    return tuple(int(v) for v in n.tolist())


def make_inside(kind: str, comm: Comm | None):
    """The engine inside this rank's replica (None: a flat run, no replica group)."""
    if comm is None:
        return None
    if kind not in BUILT:
        raise UsageError(f"--inside {kind} is not supported yet (choose from: {', '.join(BUILT)})")
    if kind == "fsdp":
        from .inside_fsdp import InsideFSDP  # torch's FSDP2 is imported only by runs that use it
        return InsideFSDP(comm)
    return InsideDDP(comm)


def _flag(name: str, value=None) -> str:
    """A setting as the command line spells it: `--replicas 3`."""
    flag = "--" + name.replace("_", "-")
    return flag if value is None else f"{flag} {value}"


def check_layout(workers: int, replicas: int, inside: str, strategy: str, supported: list[str], *,
                 intra_link: bool, spell=_flag, one_replica: bool = False) -> None:
    """UsageError (one line) unless `replicas` replicas of `workers` processes, `inside` inside
    each and `strategy` across them fit together; `spell(name, value)` names a setting as the
    caller's user wrote it (the CLI's flags, or lowcomm.wrap's keywords). `one_replica`: the
    processes are one replica of an elastic run (a torchrun job), `inside` inside it."""
    if replicas < 0:
        raise UsageError(f"{spell('replicas')} must be at least 1 (0: one per worker), got {replicas}")
    R = replicas or workers
    if workers % R:
        raise UsageError(f"{spell('replicas', R)} does not divide {spell('workers', workers)} (each replica "
                         f"holds workers/replicas processes)")
    if inside not in INSIDE:
        raise UsageError(f"unknown {spell('inside')} '{inside}' (choose from: {', '.join(INSIDE)})")
    if inside not in BUILT:
        raise UsageError(f"{spell('inside', inside)} is not supported yet (strategy '{strategy}'; "
                         f"choose from: {', '.join(BUILT)})")
    if R < workers and strategy not in supported:
        # "with --inside X": a strategy refused with fsdp inside may run with ddp inside (powersgd)
        raise UsageError(f"strategy '{strategy}' does not run across replica groups with {spell('inside', inside)} "
                         f"({spell('replicas', R)} of {spell('workers', workers)}; with {spell('inside', inside)}: "
                         f"{', '.join(supported)}; docs/strategies.md says why)")
    if one_replica and workers > 1 and strategy not in supported:
        raise UsageError(f"strategy '{strategy}' does not run with {spell('inside', inside)} inside a replica (with "
                         f"it: {', '.join(supported)})")
    if R == workers and (intra_link or inside != "ddp" and not one_replica):  # else ignored without a word
        what = spell("intra_link") if intra_link else spell("inside", inside)
        raise UsageError(f"{what} needs replica groups: {spell('replicas')} fewer than {spell('workers')} ({workers})")


def inside_level_plans(inside: str, cls, layout, replicas: int, size: int, options, accum: int) -> LevelPlans:
    """What one rank of strategy `cls` sends inside replicas of `size` ranks running engine
    `inside` ("ddp": the strategy's cost model's `level_plans`; "fsdp": every unit's shards, whose
    all-gathers run once per micro-batch, hence `accum`), and across. The one place both a
    run's summary (metrics/levels.py) and the planner (plan/levels.py) price a replica."""
    if inside == "fsdp":
        from ..engines.inside_fsdp import fsdp_level_plans  # imports torch's FSDP: only when asked

        def fsdp_plans(micro_batches: int) -> LevelPlans:
            return fsdp_level_plans(cls, layout, replicas, size, options, micro_batches)
        plans = fsdp_plans(accum * cls.micro_batch_parts)  # acco computes a step's batch in two halves
        return LevelPlans(plans.intra + cls.cost.fsdp_intra_extra(lambda: fsdp_plans(1).intra, options), plans.cross)
    return cls.cost.level_plans(cls, layout, replicas, size, options)


def run_level_plans(strategy, layout, replicas: int) -> LevelPlans:
    """What one rank of a built run sends inside its replica and across (a flat run: nothing
    inside), as its summary sets the counted bytes beside."""
    cls = type(strategy)
    if strategy.inside is None:
        return LevelPlans([], [cls.comm_plan(layout, replicas, strategy.options)])
    return inside_level_plans(strategy.inside.name, cls, layout, replicas, strategy.inside.comm.world,
                              strategy.options, strategy.accum)
