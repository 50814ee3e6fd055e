"""torch's PowerSGD hook state (error feedback, warm-started Q and P) kept per parameter across
DDP bucket layouts, so that a run resumed in a fresh process continues bit-identically.

torch's `powerSGD_hook` keeps its state per DDP bucket index, laid out in the bucket's
parameter order, with P and Q grouped by matrix shape. DDP lays buckets out anew in a fresh
process (and rebuilds them after its first step), so a loaded state would land on other
parameters. `HookStateLayout.align(bucket)`, called before the hook sees a bucket, re-lays the
state out per parameter whenever a bucket's parameters change, and draws the warm-started Qs'
first values per parameter (seeded by its index) where torch draws them per bucket.
"""
from __future__ import annotations

import copy

import torch

MIN_COMPRESSION_RATE = 2  # torch's default: compress a matrix when (n+m)·r·2 < n·m


def matrix_shape(shape) -> tuple[int, int]:
    """(n, m): the matrix torch's hook sees a tensor as (n = its first dim)."""
    n = shape[0] if len(shape) else 1
    return n, max(1, int(torch.Size(shape).numel()) // max(n, 1))


def compresses(n: int, m: int, rank: int) -> bool:
    """Whether torch's hook compresses an n×m matrix at this rank (else all-reduces it as is)."""
    r = min(n, m, rank)
    return (n + m) * r * MIN_COMPRESSION_RATE < n * m


def hook_state_dict(state, error_feedback: bool = False) -> dict:
    """A PowerSGDState's slots without the process group: its error feedback alone (`error_feedback`,
    each rank's own), or the rest (step count, P/Q, its RNG)."""
    return {slot: _clone(getattr(state, slot)) for slot in state.__slots__
            if slot != "process_group" and (slot == "error_dict") == error_feedback}


def load_hook_state(state, sd: dict) -> None:
    for k, v in sd.items():
        setattr(state, k, _clone(v))


class HookStateLayout:
    """Which parameters each bucket's hook state is laid out in, and the re-layout (see above)."""

    def __init__(self, state, params, rank: int):
        self.state, self.rank = state, rank
        self.index = {p.data_ptr(): i for i, p in enumerate(params)}
        self.numel = [p.numel() for p in params]
        self.matrix = [matrix_shape(p.shape) for p in params]
        self.layout: dict[int, tuple] = {}  # bucket index -> parameter indices its state is laid out in
        self.pending = None  # per-parameter state of the old layout, until every bucket took its part

    def _rank(self, i) -> int:
        n, m = self.matrix[i]
        return min(n, m, self.rank)

    def _q_order(self, ids):
        """Compressed parameters in the order the hook lays out P and Q (grouped by shape)."""
        groups: dict = {}
        for i in ids:
            if compresses(*self.matrix[i], self.rank):
                groups.setdefault(self.matrix[i], []).append(i)
        return [i for g in groups.values() for i in g]

    def align(self, bucket) -> None:
        b = bucket.index()
        ids = tuple(self.index[p.data_ptr()] for p in bucket.parameters())
        if self.layout.get(b) != ids:
            self._relayout(b, ids)
        st = self.state
        if st.iter >= st.start_powerSGD_iter and b not in st.p_memory_dict:
            self._first_qs(b, ids, bucket.buffer().device)

    def _first_qs(self, b, ids, device) -> None:
        order = self._q_order(ids)
        qs = []
        for i in order:
            g = torch.Generator().manual_seed(1_000_003 + i)
            qs.append(torch.randn(self.matrix[i][1] * self._rank(i), generator=g))
        self.state.q_memory_dict[b] = (torch.cat(qs) if qs else torch.empty(0)).to(device)
        self.state.p_memory_dict[b] = torch.empty(sum(self.matrix[i][0] * self._rank(i) for i in order),
                                                  device=device)

    def _per_parameter(self):
        """The state of the current layout, per parameter: (error feedback, Q) by index."""
        st, err, qs = self.state, {}, {}
        for ob, oids in self.layout.items():
            if ob in st.error_dict:
                off = 0
                for i in oids:
                    err[i] = st.error_dict[ob][off:off + self.numel[i]].clone()
                    off += self.numel[i]
            if ob in st.q_memory_dict:
                off = 0
                for i in self._q_order(oids):
                    size = self.matrix[i][1] * self._rank(i)
                    qs[i] = st.q_memory_dict[ob][off:off + size].clone()
                    off += size
        return err, qs

    def _relayout(self, b, ids) -> None:
        st = self.state
        if self.pending is None and (st.error_dict or st.q_memory_dict):
            # Per parameter, from the old layout; then rebuilt bucket by bucket in the new one.
            err, qs = self._per_parameter()
            self.pending = (err, qs, bool(st.q_memory_dict), set(range(len(self.numel))))
            st.error_dict.clear(), st.q_memory_dict.clear(), st.p_memory_dict.clear()
            self.layout = {}
        if self.pending is not None:
            err, qs, had_q, left = self.pending
            if ids and all(i in err for i in ids):
                st.error_dict[b] = torch.cat([err[i] for i in ids])
            order = self._q_order(ids)
            if had_q and all(i in qs for i in order):
                q = [qs[i] for i in order]
                st.q_memory_dict[b] = torch.cat(q) if q else torch.empty(0)
                st.p_memory_dict[b] = torch.empty(sum(self.matrix[i][0] * self._rank(i) for i in order))
            left.difference_update(ids)
            if not left:
                self.pending = None
        self.layout[b] = ids

    def state_dict(self) -> dict:
        return {b: list(ids) for b, ids in self.layout.items()}

    def load_state_dict(self, layout: dict) -> None:
        self.layout = {b: tuple(ids) for b, ids in layout.items()}
        self.pending = None

    def forget(self) -> None:
        """Drop the hook's error feedback and factors (torch's hook starts them afresh)."""
        for memory in (self.state.error_dict, self.state.q_memory_dict, self.state.p_memory_dict):
            memory.clear()
        self.layout, self.pending = {}, None


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _clone(x) for k, x in v.items()}
    return copy.deepcopy(v)
