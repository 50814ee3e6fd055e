"""How the local-SGD family's outer gradient Δ_r travels: one wire format per run.

    fp32, bf16   one all_reduce (sum) of w_r·Δ_r in that precision
    int8, int4   blockwise-absmax quantized (lowcomm.compress.IntQuantizer, blocks of 64
                 values, an fp32 scale each, bit-packed). A ring all-reduce cannot sum
                 packed integers, so every rank all_gathers every rank's packed payload
                 (values + fp32 scales + 16 bytes of step info) and sums the dequantized
                 values locally in rank order (every rank gets the same bits): (W−1)·s
                 bytes per rank for a payload of s bytes.
    a SPEC       any lowcomm.compress compressor (e.g. topk:0.02,bits:2), with error
                 feedback on Δ_r (a residual per fragment, in the state):
                     e_r ← β·e_r + Δ_r;   send C(e_r);   e_r ← e_r − decode(C(e_r))
                 all_gathered like int8/int4 (payload + step info); every rank decodes
                 every payload and averages in rank order; a value only some ranks sent
                 (top-k) is averaged over the ranks that sent it, as DeMo and SparseLoCo
                 decode (Compressor.combine).

A compressor (int8/int4 or a SPEC) runs on each tensor of a fragment alone
(compress.PerTensor): its blocks, chunks and statistics never mix tensors, as in
SparseLoCo's reference (per parameter), so a replica whose ranks own whole tensors sends
exactly what one worker holding them all would.

--aggregate other than mean (robust/aggregators.py) needs every rank's Δ_r, not their sum: an
fp32/bf16 wire then all_gathers Δ_r in that precision ((W−1)·n·itemsize bytes per rank), a
compressed one decodes each rank's payload alone, and every rank aggregates the rows in rank
order (the same bits everywhere). A robust aggregate takes no weights (outer_options.py); under
--elastic (--outer-weights tokens) each rank's tokens still travel beside its Δ_r, and a rank
that trained none since the last sync (a joiner's empty part of a re-issued reduction, a rank
whose inner steps were all skipped) is left out of the aggregate: its Δ_r is no evidence, and a
zero row would pull a median to 0. (--score still sees it, and names it a zero contribution.)

w_r is 1/W, FedNova's weight under --sync-by time (sync_by_time.py), or with --outer-weights
tokens each rank's share of the tokens trained since the last sync (token_weights.py). Collectives are
issued asynchronously on the calling (compute) thread, so every rank issues them in the
same order; `complete` waits for them and combines.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..comm import Comm
from ..compress import Compressor, ErrorFeedback, IntQuantizer, parse_spec, per_tensor
from ..errors import UsageError
from ..contract.plan import PlannedOp
from ..robust import Aggregator, parse_aggregator
from .sync_by_time import INFO_BYTES, fednova_factor, fednova_scale, fednova_weights, step_info
from .token_weights import TOKEN_BYTES, token_weights, trained_rows

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": 8, "int4": 4}
OUTER_BLOCK = 64  # values per quantization scale of an outer gradient


def outer_quantizer(bits: int) -> IntQuantizer:
    return IntQuantizer(bits, OUTER_BLOCK)


@dataclass(frozen=True)
class WireFormat:
    """A run's wire format: a precision (fp32, bf16, int8, int4), or a compressor SPEC with
    error feedback decaying by `ef_decay` (0: none)."""
    precision: str = "fp32"
    compress: str = "none"
    ef_decay: float = 1.0
    weights: str = "equal"  # or "tokens": each Δ_r weighted by the tokens its rank trained (token_weights.py)
    aggregate: str = "mean"  # or a robust aggregator over every rank's Δ_r (robust/aggregators.py)
    scored: bool = False     # --score: every rank's Δ_r scored, and the aggregate over those admitted

    @property
    def gathers(self) -> bool:
        """Does every rank receive every rank's Δ_r (a robust aggregate, or scoring)?"""
        return self.aggregator.robust or self.scored

    @property
    def aggregator(self) -> Aggregator:
        return parse_aggregator(self.aggregate)

    def check(self) -> None:
        if self.compress == "none":
            return
        try:
            parse_spec(self.compress)
        except ValueError as e:
            raise UsageError(f"--outer-compress: {e}") from None
        if self.precision != "fp32":
            raise UsageError(f"--outer-compress ({self.compress}) and --outer-precision "
                             f"({self.precision}) both set the wire format: give one")

    def compressor(self, sizes: list[int] | None = None) -> Compressor | None:
        """What a rank all-gathers in place of the all-reduce; None for fp32/bf16. With `sizes`
        (a fragment's tensor sizes): the compressor on each tensor alone."""
        if self.compress != "none":
            comp = parse_spec(self.compress)
        else:
            prec = PRECISIONS[self.precision]
            comp = outer_quantizer(prec) if isinstance(prec, int) else None
        return per_tensor(comp, sizes) if comp is not None and sizes else comp

    def plan(self, sizes: list[int], world: int, every: int, offset: int, f: int, fednova: bool) -> list[PlannedOp]:
        """What one rank sends for one sync of fragment f (tensors of `sizes` values)."""
        comp, numel = self.compressor(sizes), sum(sizes)
        if comp is not None:
            return [PlannedOp("all_gather", world * (comp.nbytes(numel) + INFO_BYTES), every, offset,
                              what=f"fragment {f}: {comp.name} outer gradient + step info, every rank's")]
        itemsize = torch.empty((), dtype=PRECISIONS[self.precision]).element_size()
        if self.gathers:  # every rank's Δ_r, aggregated where it lands (and who trained, under --elastic)
            return [PlannedOp("all_gather", world * numel * itemsize, every, offset,
                              what=f"fragment {f}: {self.precision} outer gradient, every rank's "
                                   f"({self.aggregator.spec})")] + self._token_plan(world, every, offset, f)
        ops = [PlannedOp("all_reduce", numel * itemsize, every, offset,
                         what=f"fragment {f}: {self.precision} outer gradient")]
        if fednova:  # the τ_r travel beside the all-reduce
            ops.append(PlannedOp("all_gather", world * INFO_BYTES, every, offset,
                                 what=f"fragment {f}: inner steps and step time"))
        else:  # with --outer-weights tokens each rank's weight is known before it scales its Δ_r
            ops += self._token_plan(world, every, offset, f)
        return ops

    def _token_plan(self, world: int, every: int, offset: int, f: int) -> list[PlannedOp]:
        return [PlannedOp("all_gather", world * TOKEN_BYTES, every, offset,
                          what=f"fragment {f}: tokens trained since the last sync")] if self.weights == "tokens" else []


@dataclass
class Outgoing:
    """One rank's contribution to a fragment's reduction, ready to send: the packed compressed
    payload (error feedback already applied) or Δ_r itself, and its step info (tokens, or τ and
    step cost). Kept while the reduction is in flight, so that it can be sent again on another
    group (--outer-delay 1 under --elastic: the survivors re-issue a reduction a lost member broke)."""
    data: torch.Tensor                     # uint8 packed payload, or Δ_r in fp32
    info: torch.Tensor                     # float64 (tokens or τ, c)
    key: str = ""                          # the fragment's compressor (all-gathered formats)
    sizes: tuple[int, ...] = ()            # its tensors' sizes

    def state(self) -> dict:
        return {"data": self.data, "info": self.info}


@dataclass
class Ticket:
    """One fragment's reduction in flight."""
    handles: list
    buf: torch.Tensor                      # the all-reduced Σ w_r·Δ_r, or every rank's payload
    world: int
    infos: torch.Tensor | None = None      # all-reduce under FedNova: every rank's (τ, c)
    sizes: tuple[int, int] | None = None   # all-gather: (payload bytes, Δ's numel)
    compressor: Compressor | None = None   # all-gather: the fragment's compressor
    sent: Outgoing | None = None           # this rank's contribution (to send it again)
    rows: tuple[int, ...] | None = None    # robust all-gather of Δ_r: the fragment's tensor sizes
    tokens: torch.Tensor | None = None     # robust all-gather of Δ_r, --outer-weights tokens: every rank's


class OuterWire:
    """One rank's end of the wire: issues and completes reductions, keeps the residuals."""

    def __init__(self, fmt: WireFormat, fednova: bool = False):
        self.fmt, self.fednova = fmt, fednova
        self.compressor = fmt.compressor()
        # Error feedback only for a SPEC (int8/int4 precisions never had it).
        use_ef = fmt.compress != "none" and fmt.ef_decay > 0
        self.ef = ErrorFeedback(self.compressor, enabled=use_ef, decay=fmt.ef_decay) \
            if self.compressor is not None else None
        self.per_fragment: dict[str, Compressor] = {}  # key -> the compressor on its tensors
        self.compress_s = 0.0  # CPU time spent compressing and decoding outer gradients
        self.by_tokens = fmt.weights == "tokens"
        self.last_tokens: torch.Tensor | None = None  # --outer-weights tokens: every rank's, at the last sync
        self.aggregator = fmt.aggregator
        self.admit = None  # --score: (key, rows [W, n], sizes, clipped) -> the rows the aggregate takes (bool [W])
        self.spread = None  # across replica groups: robust.Spread, how a row is spread over the replica

    def issue(self, comm: Comm, key: str, delta: torch.Tensor, tau: int, c: float, sizes: list[int],
              tokens: int = 0) -> Ticket:
        """Start reducing Δ_r (async) of a fragment of tensors of `sizes` values; `tau`, `c`:
        this rank's step info (see sync_by_time); `tokens`: what it trained since the last sync
        (its weight with --outer-weights tokens)."""
        return self.send(comm, self.prepare(key, delta, tau, c, sizes, tokens))

    def prepare(self, key: str, delta: torch.Tensor, tau: int, c: float, sizes: list[int],
                tokens: int = 0) -> Outgoing:
        """This rank's contribution (compressed, its error feedback updated, where the format
        compresses); nothing is sent yet."""
        info = step_info(tokens, 0.0) if self.by_tokens else step_info(tau, c)
        if self.compressor is None:
            return Outgoing(delta, info, key, tuple(sizes))
        t0 = time.perf_counter()
        payload, _ = self.ef.compress(key, delta.reshape(-1), self._compressor(key, sizes))
        packed = self._compressor(key, sizes).to_bytes(payload)  # e.g. codes and scales, bit-packed
        self.compress_s += time.perf_counter() - t0
        return Outgoing(packed, info, key, tuple(sizes))

    def resume(self, state: dict, key: str, sizes: list[int]) -> Outgoing:
        """A contribution kept in a state (Outgoing.state), to send again."""
        return Outgoing(state["data"], state["info"], key, tuple(sizes))

    def _compressor(self, key: str, sizes) -> Compressor:
        comp = self.per_fragment.get(key)
        if comp is None:  # built once per fragment, not at every sync
            comp = self.per_fragment[key] = self.fmt.compressor(list(sizes))
        return comp

    def send(self, comm: Comm, out: Outgoing) -> Ticket:
        """Start the collectives that reduce `out` with every rank's (async)."""
        W = comm.world
        if self.compressor is not None:
            payload = torch.cat([out.data, out.info.view(torch.uint8)])
            every = torch.empty(W * payload.numel(), dtype=torch.uint8)
            handle = comm.all_gather(every, payload, async_op=True)
            return Ticket([handle], every, W, sizes=(out.data.numel(), sum(out.sizes)),
                          compressor=self._compressor(out.key, out.sizes), sent=out)
        if self.fmt.gathers:  # every rank's Δ_r, no weights (--outer-weights tokens: who trained, beside)
            mine = out.data.to(PRECISIONS[self.fmt.precision])
            every = torch.empty(W * mine.numel(), dtype=mine.dtype, device=mine.device)
            handles = [comm.all_gather(every, mine, async_op=True)]
            tokens = torch.empty(W, dtype=torch.float64) if self.by_tokens else None  # who trained (module docstring)
            if tokens is not None:
                handles.append(comm.all_gather(tokens, out.info[:1].clone(), async_op=True))
            return Ticket(handles, every, W, sent=out, rows=out.sizes, tokens=tokens)
        handles, infos = [], None
        if self.fednova:  # every rank sends Δ_r/τ_r, the τ_r travel beside it
            infos = torch.empty(W * 2, dtype=torch.float64)
            handles.append(comm.all_gather(infos, out.info, async_op=True))
            scale = fednova_scale(int(out.info[0]))
        elif self.by_tokens:  # blocking: this rank's weight needs every rank's tokens
            self.last_tokens = torch.empty(W, dtype=torch.float64)
            comm.all_gather(self.last_tokens, out.info[:1].clone())
            scale = float(token_weights(self.last_tokens)[comm.rank])
        else:
            scale = 1.0 / W
        buf = (out.data * scale).to(PRECISIONS[self.fmt.precision])
        handles.append(comm.all_reduce(buf, op="sum", async_op=True))
        return Ticket(handles, buf, W, infos=infos, sent=out)

    def complete(self, ticket: Ticket) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Wait -> (the combined Δ in fp32, every rank's (τ, c) under FedNova, else None)."""
        for h in ticket.handles:
            h.wait()
        if ticket.sizes is not None:
            return self._decode(ticket)
        if ticket.rows is not None:  # gathered Δ_r, rank by rank
            if ticket.tokens is not None:
                self.last_tokens = ticket.tokens
            rows = ticket.buf.view(ticket.world, -1).float()
            return self._aggregate(ticket.sent.key, rows, list(ticket.rows), tokens=ticket.tokens), None
        total = ticket.buf.float()
        if ticket.infos is None:
            return total, None
        infos = ticket.infos.view(ticket.world, 2)
        return total.mul_(fednova_factor(infos[:, 0])), infos

    def _decode(self, ticket: Ticket) -> tuple[torch.Tensor, torch.Tensor | None]:
        (nq, numel), W = ticket.sizes, ticket.world
        every = ticket.buf.view(W, -1)
        infos = torch.stack([every[r, nq:].clone().view(torch.float64) for r in range(W)])
        if self.by_tokens:
            self.last_tokens = infos[:, 0].clone()
        weights = fednova_weights(infos[:, 0]) if self.fednova else token_weights(infos[:, 0]) if self.by_tokens \
            else torch.full((W,), 1.0 / W, dtype=torch.float64)
        # rank order: every rank combines the same values the same way
        t0 = time.perf_counter()
        comp = ticket.compressor
        payloads = [comp.from_bytes(every[r, :nq], numel) for r in range(W)]
        if self.fmt.gathers:  # each payload decoded alone; where top-k sent a value: its senders
            total = self._aggregate(ticket.sent.key, *decoded_rows(comp, payloads),
                                    tokens=infos[:, 0] if self.by_tokens else None, clipped_probe=True)
        else:
            total = comp.combine(payloads, [float(w) for w in weights])
        self.compress_s += time.perf_counter() - t0
        return total, (infos if self.fednova else None)

    def _aggregate(self, key: str, rows: torch.Tensor, sizes, support=None, tokens=None,
                   clipped_probe=False) -> torch.Tensor:
        """The aggregate of the gathered rows: those --score admits (outer_scoring.py; `clipped_probe`:
        a compressed wire's rows scored as median-norm-clip takes them), of the ranks that trained
        (`tokens`, under --elastic: the module docstring)."""
        trained = trained_rows(tokens, rows.shape[0])
        keep = trained if self.admit is None else trained & self.admit(key, rows, sizes, clipped_probe).cpu()
        keep = keep if keep.any() else trained  # scores left out every rank that trained: those that trained
        if not keep.all():
            rows, support = rows[keep], (support[keep] if support is not None else None)
        return self.aggregator(rows, sizes, support, self.spread)

    def state_dict(self) -> dict:
        return self.ef.state_dict() if self.ef else {}

    def load_state_dict(self, sd: dict) -> None:
        if self.ef is not None:
            self.ef.load_state_dict(sd)


def decoded_rows(comp: Compressor, payloads: list) -> tuple[torch.Tensor, list[int] | None, torch.Tensor | None]:
    """Every rank's payload decoded alone: (rows [W, n], the tensor sizes, which values each sent
    [W, n] or None where every payload carries every value)."""
    rows = torch.stack([comp.decompress(p).reshape(-1) for p in payloads])
    masks = [comp.support(p) for p in payloads]
    support = None if all(m is None for m in masks) else \
        torch.stack([torch.ones_like(rows[0]) if m is None else m.reshape(-1).to(rows.dtype) for m in masks])
    return rows, getattr(comp, "sizes", None), support
