"""Streaming DiLoCo (Douillard et al., arXiv 2501.18512): DiLoCo one fragment at a time, overlapped.

The parameters are split into F fragments. Fragment f syncs at the trainer
steps t with (t − ⌊f·H/F⌋) mod H = 0 (t ≥ 1), so its period is still H but
the F syncs are spread over it and one sync carries about 1/F of the model:
    Δ_f,r = θ_f,global − θ_f,r  (snapshot at t)
    async collectives, issued at t:  Δ_f = mean_r Δ_f,r
    meanwhile τ = --fragment-delay further inner steps run on the stale local θ
    at the end of trainer step t+τ: wait; θ_f,global ← outer SGD(θ_f,global, Δ_f)
        (per-fragment momentum);  θ_f,local ← α·θ_f,local + (1−α)·θ_f,global
τ=0 waits at once; F=1, τ=0, α=0 is DiLoCo exactly.

Fragments (the model's layout, models/layout.py): strided over transformer blocks as in
the paper, block i in fragment i mod F; the embeddings (lowcomm's GPT: token, tied with
the output head, and position) and the final norm are in fragment 0. A model without
known blocks: contiguous groups of parameters (in `parameters()` order) of nearly equal
size, a parameter never split. Fragments left empty (fewer blocks than F) never sync.

The step is DiLoCo's (diloco.py: inner step; for each mean that landed, the outer step;
merge), and so are the outer optimizer and the evaluation of θ_global. When each fragment
syncs, lands and merges, the final sync of every fragment at the run's last step, the wire
formats and --sync-by time are the outer-sync engine's (engines/outer_schedule.py;
outer_sync.py says why the collectives are issued asynchronously from the compute thread
rather than on a communication thread).
Under --sync-by time τ counts trainer steps (slots), and the step-time exchange rides on
each fragment's sync.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from ..errors import UsageError
from .diloco import DiLoCo, DiLoCoOptions
from ..contract.options import option
from .registry import register


@dataclass
class StreamingOptions(DiLoCoOptions):
    fragments: int = option(4, "model fragments F; fragment f syncs at steps f*H/F + k*H", min=1)
    fragment_delay: int = option(2, "inner steps (tau) that overlap a fragment's all-reduce before it merges",
                                 min=0)
    merge_alpha: float = option(0.5, "merge: theta_local <- alpha*theta_local + (1-alpha)*theta_global",
                                min=0, max=1)

    def check(self) -> None:
        super().check()
        if self.fragments > self.sync_every:
            raise UsageError(f"--fragments ({self.fragments}) must be at most --sync-every ({self.sync_every})")
        if self.fragment_delay >= self.sync_every:
            raise UsageError(f"--fragment-delay ({self.fragment_delay}) must be less than --sync-every "
                             f"({self.sync_every}): a fragment must land before its next sync")

    def check_model(self, layout) -> None:
        """Fragments are strided over the transformer blocks: with fewer blocks than F, some
        hold nothing and never sync (the paper's schedule is kept); said in one line, and
        summary.json records each fragment's size."""
        sizes = layout.fragment_numels(self.fragments)
        if 0 in sizes:
            print(f"warning: --fragments {self.fragments}: {sizes.count(0)} of them hold no parameter of this "
                  f"model (fewer transformer blocks than fragments) and never sync", file=sys.stderr, flush=True)

    def streaming(self) -> tuple[int, int, float]:
        return self.fragments, self.fragment_delay, self.merge_alpha

    def run_note(self, cfg) -> str | None:
        if not self.outer_delay:
            return None
        said = ("--outer-delay 1: each fragment's mean takes its outer step at the fragment's next sync, a period "
                "later, and the next period starts from θ_global: --fragment-delay and --merge-alpha do not apply")
        momentum = super().run_note(cfg)
        return said if momentum is None else f"{said}; {momentum}"


@register("streaming_diloco")
class StreamingDiLoCo(DiLoCo):
    Options = StreamingOptions
    inside_replica = ("ddp", "fsdp")  # across replica groups: on the tensors each position owns (fsdp: its shards)

    def report(self) -> dict:
        o = self.options
        return {**super().report(), "fragments": o.fragments, "fragment_delay": o.fragment_delay,
                "merge_alpha": o.merge_alpha, "fragment_numels": [g.numel() for g in self.sync.globals],
                "bytes_per_full_round_per_rank": sum(self.sync.bytes_per_sync())}
