"""The rules of the local-SGD family's options that are the outer-sync engine's, not a paper's.

A strategy of the family (diloco.py, streaming_diloco.py, sparseloco.py) declares its flags
as dataclass fields on a subclass of `OuterSyncOptions`: the outer optimizer's (its paper's)
and the engine's -- the period H (`sync_every`), the wire (`outer_precision`, `outer_compress`,
`outer_ef_decay`, `outer_weights`), the phases (`sync_by`), one period late (`outer_delay`,
`outer_delay_warmup`) and `eager`. The rules below are read off those fields: which settings
go together, when a sync's mean is applied, how long its reduction may hide, where the
commit points fall under --elastic. The annotations say which fields they read.
"""
from __future__ import annotations

from ..contract.options import Options
from ..errors import UsageError
from .outer_sync import merges_at, sync_offset
from .outer_wire import WireFormat


def outer_step_suffix(outer_delay: int, eager: bool) -> str:
    """How a plan or a report names the outer step: ' eager', ' delayed' (one period late) or ''."""
    return " eager" if eager else " delayed" if outer_delay else ""


class OuterSyncOptions(Options):
    """The engine's rules over the fields its strategy declares (a dataclass subclass)."""

    sync_every: int
    outer_momentum: float
    outer_precision: str
    sync_by: str
    outer_compress: str
    outer_ef_decay: float
    outer_weights: str
    outer_delay: int
    eager: bool
    outer_delay_warmup: int
    aggregate: str  # robust/options.py's RobustOptions: how the outer step combines the workers' Δ_r
    score: bool     # and whether it scores them first (--score)

    def robust_wire(self) -> bool:
        """Does the outer step aggregate every worker's Δ_r itself (not only their mean)?"""
        return self.wire().gathers

    def check(self) -> None:
        self.wire().check()
        if self.eager and not self.outer_delay:
            raise UsageError("--eager needs --outer-delay 1: the worker's own pseudo-gradient stands in for a mean "
                             "in flight, and with --outer-delay 0 none is")
        if self.outer_delay_warmup and not self.outer_delay:
            raise UsageError(f"--outer-delay-warmup {self.outer_delay_warmup} needs --outer-delay 1: with --outer-delay "
                             f"0 every sync waits for its mean already")
        if self.eager and self.sync_by == "time":
            raise UsageError("--eager does not run with --sync-by time: a worker's share of a FedNova mean is known "
                             "only when the mean lands")
        if self.sync_by == "time" and self.outer_weights == "tokens":
            raise UsageError("--outer-weights tokens does not run with --sync-by time, whose FedNova averaging "
                             "already weights each worker by its inner steps")
        if self.robust_wire() and (self.sync_by == "time" or self.outer_weights == "tokens"):
            weighted = "--sync-by time" if self.sync_by == "time" else "--outer-weights tokens"
            raise UsageError(f"--aggregate {self.aggregate}{' --score' * self.score} does not run with {weighted}: "
                             f"a robust aggregate trusts every worker alike, it takes no weights")

    def check_run(self, cfg) -> None:
        if self.sync_by == "time" and (cfg.replicas or cfg.workers) < cfg.workers:
            raise UsageError(f"--sync-by time does not run across replica groups (--replicas {cfg.replicas}) yet")

    def check_length(self, steps: int) -> None:
        if self.outer_delay_warmup and self.first_late_sync() >= steps:
            raise UsageError(f"--outer-delay-warmup {self.outer_delay_warmup} leaves no sync of --steps {steps} a "
                             f"period late (the first after it would be at step {self.first_late_sync()}, and the "
                             f"run's final sync waits for its mean): drop --outer-delay 1 for a synchronous run, or "
                             f"shorten the warm-up")

    def first_late_sync(self) -> int:
        """The first trainer step past the warm-up at which some fragment's sync is issued: the
        first mean a period late, unless it is the run's final sync (which waits for it)."""
        start, every, fragments = self.outer_delay_warmup + 1, self.sync_every, self.streaming()[0]
        return min(start + (sync_offset(f, every, fragments) - start) % every for f in range(fragments))

    def run_note(self, cfg) -> str | None:
        if not (self.outer_delay and self.outer_momentum > 0) or self.first_late_sync() >= cfg.steps:
            return None  # (the latter: a run too short for a regular sync; no mean is late)
        if self.eager:
            return (f"--eager with outer momentum {self.outer_momentum:g}: measured here, eager updates learned more "
                    f"with --outer-momentum 0 (docs/strategies.md)")
        return (f"--outer-delay 1 with outer momentum {self.outer_momentum:g}: a mean a period stale through "
                f"momentum overshoots; PCCL's async DiLoCo runs it with --outer-momentum 0 (docs/strategies.md)")

    def wire(self) -> WireFormat:
        return WireFormat(self.outer_precision, self.outer_compress, self.outer_ef_decay, self.outer_weights,
                          self.aggregate, self.score)

    def streaming(self) -> tuple[int, int, float]:
        """(fragments F, merge delay τ, merge weight α): one, none, θ_global (Streaming DiLoCo's vary)."""
        return 1, 0, 0.0

    def delayed_at(self, t: int) -> bool:
        """Is the sync at trainer step t (from 1) a period late: --outer-delay 1, past the warm-up?"""
        return bool(self.outer_delay) and t > self.outer_delay_warmup

    def hidden_steps(self) -> int:
        """Inner steps whose compute a sync's reduction runs behind before it is waited for."""
        return self.sync_every if self.outer_delay else self.streaming()[1]

    def merge_delay(self) -> int:
        """Trainer steps from a fragment's sync to its merge (its commit point under --elastic):
        τ, or none with --outer-delay 1, whose syncs merge the mean of the period before at once."""
        return 0 if self.outer_delay else self.streaming()[1]

    def commits_at(self, step: int) -> bool:
        """--elastic's commit points: where some fragment merges (every member holds θ_global)."""
        return merges_at(step, self.sync_every, self.streaming()[0], self.merge_delay())

    def redoes_last_step(self) -> bool:
        # before a commit's step no merge is pending (τ = 0, or --outer-delay 1: a mean in flight
        # is kept as each member's part and re-issued); H = 1 commits every step anyway
        return self.merge_delay() == 0 and self.sync_every > 1
