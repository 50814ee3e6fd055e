"""PowerSGD (Vogels et al., 2019) with torch's own `powerSGD_hook` on DDP.

torch's hook (rank r, warm start, error feedback, `start_powerSGD_iter`) runs unchanged;
its all-reduces go through lowcomm's Comm, so they are counted, timed and slowed by an
emulated link: the hook is handed a process group stand-in (`_CountedGroup`) and the two
torch modules that issue its collectives see a `torch.distributed` whose `all_reduce`
sends a `_CountedGroup`'s ops through its Comm (every other call goes to torch as is).

    steps 1..start:      plain all-reduce (mean) of each bucket         4·P bytes
    after:               per bucket, all-reduce of the tensors not worth compressing
                         (1-D, or (n+m)·r·2 >= n·m), then of P (n·r per n×m matrix),
                         then of Q (m·r per matrix)                     4·(U + Σ(n+m)·r)

It is ddp with another `comm_hook`. Two changes around torch's hook, for correctness with
several DDP buckets (`--bucket-mb`): buckets are reduced one after another (see comm_hook),
and the warm-started Qs start from values drawn per parameter rather than per bucket, so a
resumed run continues bit-identically although its fresh DDP lays buckets out anew.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as _default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _psgd

from .base import Strategy
from .ddp import DDP, DDPOptions
from .options import option
from .plan import PlannedOp
from .registry import register

MIN_COMPRESSION_RATE = 2  # torch's default: compress a matrix when (n+m)·r·2 < n·m


@dataclass
class PowerSGDOptions(DDPOptions):
    rank: int = option(4, "PowerSGD matrix approximation rank", flag="--powersgd-rank", min=1)
    start: int = option(10, "plain all-reduce for this many steps before PowerSGD starts (torch needs > 1)",
                        flag="--powersgd-start", min=2)


class _CountedGroup:
    """What the hook believes is its process group: the real one plus the Comm to use."""

    def __init__(self, comm):
        self.comm = comm
        self.group = comm.group if comm.group is not None else dist.group.WORLD

    def size(self):
        return self.comm.world

    def rank(self):
        return self.comm.rank


class _CountedWork:
    def __init__(self, handle):
        self._handle = handle

    def get_future(self):
        return self._handle.future

    def wait(self):
        self._handle.wait()
        return True

    def is_completed(self):
        return self._handle.is_completed()


class _RoutedDist:
    """torch.distributed, except that all_reduce on a _CountedGroup goes through its Comm."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not isinstance(group, _CountedGroup):
            return self._real.all_reduce(tensor, op=op, group=group, async_op=async_op)
        if op != dist.ReduceOp.SUM:
            raise NotImplementedError("only sum all-reduces are routed through Comm")
        handle = group.comm.all_reduce(tensor, op="sum", async_op=True)
        if not async_op:
            handle.wait()
            return None
        return _CountedWork(handle)


def _route_hook_collectives() -> None:
    for module in (_psgd, _default_hooks):
        if not isinstance(module.dist, _RoutedDist):
            module.dist = _RoutedDist(module.dist)


def powersgd_sizes(shapes, rank: int) -> tuple[int, int, int]:
    """(uncompressed, P, Q) element counts over all tensors, as torch's hook splits them."""
    unc = ps = qs = 0
    for shape in shapes:
        n = shape[0] if len(shape) else 1
        m = max(1, int(torch.Size(shape).numel()) // max(n, 1))
        r = min(n, m, rank)
        if (n + m) * r * MIN_COMPRESSION_RATE < n * m:
            ps, qs = ps + n * r, qs + m * r
        else:
            unc += n * m
    return unc, ps, qs


@register("powersgd")
class PowerSGD(DDP):
    Options = PowerSGDOptions
    checkpoint_replicated = False  # the hook's error feedback differs per rank

    def __init__(self, model, comm, make_optimizer, *args, **kwargs):
        super().__init__(model, comm, make_optimizer, *args, **kwargs)
        _route_hook_collectives()
        self.psgd = _psgd.PowerSGDState(process_group=_CountedGroup(comm),
                                        matrix_approximation_rank=self.options.rank,
                                        start_powerSGD_iter=self.options.start,
                                        min_compression_rate=MIN_COMPRESSION_RATE,
                                        use_error_feedback=True, warm_start=True, random_seed=0)
        params = [p for p in model.parameters() if p.requires_grad]
        self._pindex = {p.data_ptr(): i for i, p in enumerate(params)}
        self._numel = [p.numel() for p in params]
        self._matrix = [(p.shape[0], p.numel() // p.shape[0]) if p.dim() else (1, 1) for p in params]
        self._pending = None
        self._layout: dict[int, tuple] = {}  # bucket index -> parameter indices its hook state is laid out in
        self._chain: torch.futures.Future | None = None  # the latest bucket's reduction

    def comm_hook(self, bucket):
        """torch's powerSGD_hook, one bucket after another. Its three all-reduces per bucket
        are chained by future callbacks, which run on whichever thread completes the previous
        one; with several buckets in flight, bucket b's P all-reduce and bucket b+1's first
        all-reduce were issued in an order that differed between ranks (gloo: 'Received data
        size doesn't match', or a hang). So each bucket starts when the previous bucket's
        chain is done: every rank issues the same sequence, and backward still overlaps it."""
        done = torch.futures.Future()

        def start(_=None):
            try:
                self._align_state(bucket)
                _psgd.powerSGD_hook(self.psgd, bucket).add_done_callback(finish)
            except Exception as e:  # noqa: BLE001 -- handed to DDP, which raises it in backward
                done.set_exception(e)

        def finish(fut):
            try:
                done.set_result(fut.value())
            except Exception as e:  # noqa: BLE001
                done.set_exception(e)

        prev, self._chain = self._chain, done
        if prev is None or prev.done():
            start()
        else:
            prev.add_done_callback(start)
        return done

    # -- torch's hook state is laid out per DDP bucket; DDP lays buckets out anew in a fresh
    # process (and rebuilds them after its first step), so a loaded state is re-laid out
    # per parameter whenever a bucket's parameters change.
    def _rank_of(self, i):
        n, m = self._matrix[i]
        return min(n, m, self.options.rank)

    def _compressed(self, i):
        n, m = self._matrix[i]
        r = self._rank_of(i)
        return (n + m) * r * MIN_COMPRESSION_RATE < n * m

    def _q_order(self, ids):
        """Compressed parameters in the order the hook lays out P and Q (grouped by shape)."""
        groups: dict = {}
        for i in ids:
            if self._compressed(i):
                groups.setdefault(self._matrix[i], []).append(i)
        return [i for g in groups.values() for i in g]

    def _align_state(self, bucket) -> None:
        b = bucket.index()
        ids = tuple(self._pindex[p.data_ptr()] for p in bucket.parameters())
        if self._layout.get(b) != ids:
            self._relayout(b, ids)
        st = self.psgd
        if st.iter >= st.start_powerSGD_iter and b not in st.p_memory_dict:
            self._first_qs(b, ids, bucket.buffer().device)

    def _first_qs(self, b, ids, device) -> None:
        """The warm-started Qs' first values, drawn per parameter (seeded by its index), where
        torch's hook would draw them per bucket: a run resumed in a fresh process, whose DDP
        lays buckets out differently until it rebuilds them, then starts from the same Qs."""
        order = self._q_order(ids)
        qs = []
        for i in order:
            g = torch.Generator().manual_seed(1_000_003 + i)
            qs.append(torch.randn(self._matrix[i][1] * self._rank_of(i), generator=g))
        st = self.psgd
        st.q_memory_dict[b] = (torch.cat(qs) if qs else torch.empty(0)).to(device)
        st.p_memory_dict[b] = torch.empty(sum(self._matrix[i][0] * self._rank_of(i) for i in order), device=device)

    def _relayout(self, b, ids) -> None:
        st = self.psgd
        if self._pending is None and (st.error_dict or st.q_memory_dict):
            # Per parameter, from the old layout; then rebuilt bucket by bucket in the new one.
            err, qs = {}, {}
            for ob, oids in self._layout.items():
                if ob in st.error_dict:
                    off = 0
                    for i in oids:
                        err[i] = st.error_dict[ob][off:off + self._numel[i]].clone()
                        off += self._numel[i]
                if ob in st.q_memory_dict:
                    off = 0
                    for i in self._q_order(oids):
                        size = self._matrix[i][1] * self._rank_of(i)
                        qs[i] = st.q_memory_dict[ob][off:off + size].clone()
                        off += size
            self._pending = (err, qs, bool(st.q_memory_dict), set(range(len(self._numel))))
            st.error_dict.clear(), st.q_memory_dict.clear(), st.p_memory_dict.clear()
            self._layout = {}
        if self._pending is not None:
            err, qs, had_q, left = self._pending
            if ids and all(i in err for i in ids):
                st.error_dict[b] = torch.cat([err[i] for i in ids])
            order = self._q_order(ids)
            if had_q and all(i in qs for i in order):
                q = [qs[i] for i in order]
                st.q_memory_dict[b] = torch.cat(q) if q else torch.empty(0)
                st.p_memory_dict[b] = torch.empty(sum(self._matrix[i][0] * self._rank_of(i) for i in order))
            left.difference_update(ids)
            if not left:
                self._pending = None
        self._layout[b] = ids

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

    # torch's hook compresses a bucket, then all-reduces P and Q in turn: with few
    # buckets little of it overlaps the backward, so the planner counts it all as exposed.
    exposed_comm_s = classmethod(Strategy.exposed_comm_s.__func__)

    @classmethod
    def model_state_bytes(cls, num_params, world, options):
        return 20 * num_params  # DDP's, plus torch's error-feedback copy of the gradients

    @classmethod
    def plan_occurrences(cls, op, steps, options):
        if op.offset == 0:
            return min(steps, options.start)
        return op.occurrences(steps)

    def extra_state(self):
        """torch's hook state (step count, error feedback, warm-started P/Q, its RNG)
        without the process group."""
        state = {slot: getattr(self.psgd, slot) for slot in self.psgd.__slots__ if slot != "process_group"}
        return {"powersgd": {k: _clone(v) for k, v in state.items()}, 
                "layout": {b: list(ids) for b, ids in self._layout.items()}}

    def load_extra_state(self, sd):
        for k, v in sd["powersgd"].items():
            setattr(self.psgd, k, _clone(v))
        self._layout = {b: tuple(ids) for b, ids in sd["layout"].items()}
        self._pending = None

    def update(self, ctx):
        super().update(ctx)
        if ctx.skipped:
            self._forget()

    def _forget(self):
        """The hook's error feedback and warm-started factors took in the non-finite gradient:
        drop them (torch's hook starts them afresh, identically on every rank)."""
        for memory in (self.psgd.error_dict, self.psgd.q_memory_dict, self.psgd.p_memory_dict):
            memory.clear()
        self._layout, self._pending = {}, None

    def report(self):
        return {"powersgd_rank": self.options.rank, "powersgd_start": self.options.start}


def _clone(v):
    import copy
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _clone(x) for k, x in v.items()}
    return copy.deepcopy(v)
