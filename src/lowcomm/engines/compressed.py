"""The two-stage compressed all-reduce of 1-bit Adam (Tang et al., arXiv 2102.02888, Section 3.3),
with error feedback at both compressions; `quantized` sends gradients through it, `onebit_adam`
Adam's momentum.

    x    <- every rank's flat fp32 vector, zero-padded to W shards of m (whole blocks)
    c_j  <- Q(x_j + e1_j) for each shard j;  e1 <- (x + e1) - deq(c)     (worker's EF)
    all_to_all(c): rank r receives every worker's c_r
    s_r  <- (1/W) sum_w deq(c_r from w)                                  (fp32)
    c'_r <- Q(s_r + e2);  e2 <- (s_r + e2) - deq(c'_r)                   (shard owner's EF)
    all_gather(c'): every rank decodes the same mean

Q is int8 / int4 with a per-block absmax scale or 1-bit sign with a per-block scale
(lowcomm.compress). Each collective moves W·nbytes(m) bytes (`payload_bytes`): about
2(W-1)/W · P · bits/8 plus 4 bytes per block per rank, the ring shape of DDP's all-reduce.

Across replica groups (`SplitByPosition`): every block is the one a single worker's flat
vector has, and position p of a replica runs the two stages across replicas on its piece of
whole blocks only; the pieces are all-gathered inside the replica. Each block is compressed,
summed and compressed again exactly as a single worker's would be, so R replicas of K equal R
workers (whole tensors per position, as the other strategies split, would cut other blocks).
"""
from __future__ import annotations

import time

import torch

from ..compress import Compressor, ErrorFeedback, quantizer_for_bits


def shard_len(num_params: int, world: int, block: int) -> int:
    """m: each rank's shard of the flat vector, a whole number of blocks."""
    per = -(-num_params // world)
    return -(-per // block) * block


def payload_bytes(num_params: int, world: int, bits: int, block: int) -> int:
    """S of the all_to_all and of the all_gather (Comm's count: the logical payload)."""
    return world * quantizer_for_bits(bits, block).nbytes(shard_len(num_params, world, block))


def residual_bytes(num_params: int, world: int, block: int) -> int:
    """The error-feedback state one rank keeps: its own residual (P) and its shard's (m), fp32."""
    return 4 * num_params + 4 * shard_len(num_params, world, block)


class CompressedAllReduce:
    """The mean over ranks of one flat vector laid out like `like` (the parameters), through
    the two stages above. `compress_s` adds up the CPU time spent compressing and decoding."""

    def __init__(self, comm, like: list[torch.Tensor], bits: int, block: int, error_feedback: bool = True):
        self.comm = comm
        self.shapes = [t.shape for t in like]
        self.numel = sum(t.numel() for t in like)
        self.device = like[0].device
        self.m = shard_len(self.numel, comm.world, block)
        self.q: Compressor = quantizer_for_bits(bits, block)
        self.ef = ErrorFeedback(self.q, enabled=error_feedback)
        self.compress_s = 0.0

    def flat(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """The tensors (None: zeros) as one fp32 vector of W·m values, zero-padded."""
        flat = torch.zeros(self.comm.world * self.m, dtype=torch.float32, device=self.device)
        for view, t in zip(self.views(flat), tensors):
            if t is not None:
                view.copy_(t)
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's part of a flat vector, shaped like it (views, not copies)."""
        out, at = [], 0
        for shape in self.shapes:
            n = shape.numel()
            out.append(flat[at:at + n].view(shape))
            at += n
        return out

    def mean(self, ctx, flat: torch.Tensor, reduced: bool = False) -> torch.Tensor | None:
        """The two-stage compressed mean of every rank's `flat` (W·m values; consumed; `reduced`
        matters across replica groups only, SplitByPosition). `ctx` is the step's StepContext: what each rank sends follows its non-finite protocol, so a
        NaN anywhere reaches every rank through the scales and all return None alike."""
        W, m, q = self.comm.world, self.m, self.q
        nb = q.nbytes(m)
        t0 = time.perf_counter()
        flat = flat.view(W, m)
        payload = self._compress("worker", flat, ctx.poison_nonfinite(flat))  # W rows: one per shard owner
        send = q.to_bytes(payload).reshape(-1)
        recv = torch.empty_like(send)
        self.compress_s += time.perf_counter() - t0
        self.comm.all_to_all(recv, send)

        t0 = time.perf_counter()
        mine = q.decompress(q.from_bytes(recv.view(W, nb), m))  # every worker's copy of my shard
        mean = mine.sum(0) / W
        own = q.to_bytes(self._compress("owner", mean, ctx.poison_nonfinite(mean)))
        gathered = torch.empty(W * nb, dtype=torch.uint8, device=own.device)
        self.compress_s += time.perf_counter() - t0
        self.comm.all_gather(gathered, own)

        t0 = time.perf_counter()
        mean = q.decompress(q.from_bytes(gathered.view(W, nb), m)).reshape(-1)
        self.compress_s += time.perf_counter() - t0
        return mean if ctx.received_finite(mean) else None

    def exact_mean(self, ctx, flat: torch.Tensor, reduced: bool = False) -> torch.Tensor | None:
        """The plain fp32 mean of every rank's `flat` (its first `numel` values; consumed), under
        the same non-finite protocol as `mean`."""
        values = flat[:self.numel]
        ctx.poison_nonfinite(values)
        self.comm.all_reduce(values)
        values /= self.comm.world
        return values if ctx.received_finite(values) else None

    def replica_mean(self, flat: torch.Tensor) -> None:
        """Within a replica group (SplitByPosition): the replica's mean; here nothing."""

    def _compress(self, key: str, x: torch.Tensor, bad: bool):
        """With error feedback; a non-finite input (NaN-filled: its scales carry the NaN to every
        rank) is sent without touching the residual, so the skipped step leaves no trace."""
        return self.q.compress(x) if bad else self.ef.compress(key, x)[0]

    def report(self, steps: int) -> dict:
        """summary.json's compression fields (`steps`: optimizer steps so far)."""
        return {"compress_s": self.compress_s, "compress_s_per_step": self.compress_s / max(steps, 1),
                "compressor": self.q.name, "error_feedback": self.ef.enabled}

    # Whether the flat vector is the parameters' (its first `numel` values each a parameter's,
    # whatever W): a residual of another membership's layout keeps them. SplitByPosition's piece
    # is not: another replica count cuts other values into it.
    parameter_aligned = True

    def state_dict(self) -> dict:
        """The two residuals, this rank's own as a checkpoint keeps them: the worker's ("worker")
        and the owner's, named by the shard it is of ("owner@RANK/W")."""
        sd = self.ef.state_dict()
        if "owner" in sd:
            sd[self._owner_key()] = sd.pop("owner")
        return sd

    def _owner_key(self) -> str:
        return f"owner@{self.comm.rank}/{self.comm.world}"

    def load_state_dict(self, sd: dict) -> None:
        """Residuals taken in another membership (--elastic: another W, or this worker at another
        rank) are fitted to this one: the worker's keeps each parameter's error, re-padded to W
        shards; the owner's was of a shard this rank no longer owns and starts at zero, as a new
        owner's (a joiner's: all zero, contract/elastic.py). A checkpoint of the same run loads as
        is (one written before residuals named their shard: "owner", taken as this rank's)."""
        sd = dict(sd)
        owners = [k for k in sd if k.startswith("owner")]
        mine = sd.pop(self._owner_key(), sd.pop("owner", None))
        for k in owners:
            sd.pop(k, None)
        if mine is not None:
            sd["owner"] = mine
        worker = sd.get("worker")
        if worker is not None and worker.shape != (self.comm.world, self.m):
            fitted = torch.zeros(self.comm.world * self.m, dtype=worker.dtype, device=worker.device)
            if self.parameter_aligned:
                fitted[:self.numel] = worker.reshape(-1)[:self.numel]
            sd["worker"] = fitted.view(self.comm.world, self.m)
        self.ef.load_state_dict(sd)


def split_piece(num_params: int, replicas: int, size: int, block: int) -> int:
    """Values of each position's piece: a single worker's flat vector (R shards of whole blocks)
    cut into `size` pieces of whole blocks."""
    length = replicas * shard_len(num_params, replicas, block)
    return -(-length // (size * block)) * block


class SplitByPosition:
    """CompressedAllReduce across replica groups (see the module docstring): the same `flat`,
    `views`, `mean` and `exact_mean`, with `inside` the engine inside this rank's replica and
    `comm` the group across replicas."""

    def __init__(self, inside, comm, like: list[torch.Tensor], bits: int, block: int, error_feedback: bool = True):
        self.inside = inside
        self.layout = CompressedAllReduce(comm, like, bits, block, error_feedback)  # a single worker's vector
        self.numel, self.length = self.layout.numel, comm.world * self.layout.m
        self.piece = split_piece(self.numel, comm.world, inside.comm.world, block)
        piece = torch.empty(self.piece, device=self.layout.device)
        self.part = CompressedAllReduce(comm, [piece], bits, block, error_feedback)  # this position's blocks
        self.part.parameter_aligned = False

    @property
    def comm(self):
        return self.part.comm

    @comm.setter
    def comm(self, comm) -> None:
        self.layout.comm = self.part.comm = comm

    @property
    def compress_s(self) -> float:
        return self.part.compress_s

    @compress_s.setter
    def compress_s(self, seconds: float) -> None:
        self.part.compress_s = seconds

    def flat(self, tensors):
        return self.layout.flat(tensors)

    def views(self, flat):
        return self.layout.views(flat)

    def replica_mean(self, flat: torch.Tensor) -> None:
        """In place: the mean of `flat` over the replica's ranks (fp32, one all-reduce)."""
        self.inside.comm.all_reduce(flat, op="avg")

    def _mine(self, flat: torch.Tensor, reduced: bool) -> torch.Tensor:
        """This position's piece of `flat`: the replica's mean of it (one reduce-scatter), or,
        when `flat` is the replica's mean already, a copy of it."""
        K = self.inside.comm.world
        padded = torch.cat([flat, flat.new_zeros(K * self.piece - flat.numel())])
        if not reduced:
            return self.inside.scatter(padded)
        p = self.inside.comm.rank
        return padded[p * self.piece:(p + 1) * self.piece].clone()

    def _whole(self, ctx, piece: torch.Tensor | None, numel: int) -> torch.Tensor | None:
        """Every position's piece, all-gathered inside the replica; a piece that came back not
        finite (None) goes as NaN, so every rank of every replica skips the step alike."""
        if piece is None:
            piece = torch.full((self.piece,), float("nan"), device=self.layout.device)
        whole = self.inside.gather(piece, numel)
        return whole if ctx.received_finite(whole) else None

    def mean(self, ctx, flat: torch.Tensor, reduced: bool = False) -> torch.Tensor | None:
        mean = self.part.mean(ctx, self.part.flat([self._mine(flat, reduced)]))
        return self._whole(ctx, None if mean is None else mean[:self.piece], self.length)

    def exact_mean(self, ctx, flat: torch.Tensor, reduced: bool = False) -> torch.Tensor | None:
        piece = self.part.flat([self._mine(flat, reduced)])
        return self._whole(ctx, self.part.exact_mean(ctx, piece), self.numel)

    def report(self, steps: int) -> dict:
        return self.part.report(steps)

    def state_dict(self) -> dict:
        return self.part.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.part.load_state_dict(sd)


def compressed_allreduce(comm, inside, like: list[torch.Tensor], bits: int, block: int,
                         error_feedback: bool = True) -> CompressedAllReduce | SplitByPosition:
    """The engine for a flat run, or a part of the model (fsdp's shards: `inside` None), or across
    replica groups where each position takes its blocks of the whole vector (SplitByPosition)."""
    if inside is None:
        return CompressedAllReduce(comm, like, bits, block, error_feedback)
    return SplitByPosition(inside, comm, like, bits, block, error_feedback)
