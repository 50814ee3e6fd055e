"""The flags of untrusted workers, as options of a strategy whose outer step aggregates one
contribution per worker (the local-SGD family: `class DiLoCoOptions(RobustOptions, ...)`):

    --attack KIND       an emulated attack (attacks.py), on the ranks of --attackers
    --attackers RANKS   which workers attack ('3', '5,6'): ranks of the group the outer step
                        runs on (with --replicas: replica indices; with --elastic: the launcher's
                        worker slots, which a worker keeps across quorums)
    --aggregate NAME    how the outer step combines the contributions (aggregators.py)
    --score             score every contribution and leave out the bad (scoring.py), with
                        --score-patience and --score-batches
    --validators RANKS  with --score: only these workers run the scoring forwards (default: all)

Every other strategy lacks these options, so the CLI refuses them there in one line naming
the strategies that take them (a ddp step averages gradients inside the all-reduce: there is
no per-worker contribution to aggregate robustly).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..contract.options import Options, option
from ..errors import UsageError
from .aggregators import Aggregator, parse_aggregator
from .attacks import Attack, parse_attack, parse_ranks

SCORE_EVERY = 10  # a per-step strategy's (DeMo's) default --score-every: docs/untrusted.md says what it costs
# The options that only --score reads, and why each needs it.
NEEDS_SCORE = {"score_patience": "it counts rounds of scores", "score_batches": "it sizes what is scored on",
               "validators": "validators run the scoring", "score_every": "it says how often to score"}


def needs_score(name: str, given) -> UsageError:
    """The one-line refusal of scoring option `name` given as `given` without --score."""
    return UsageError(f"--{name.replace('_', '-')} {given} needs --score: {NEEDS_SCORE[name]}")


@dataclass
class RobustOptions(Options):
    """A mixin of dataclass options (name it first among the bases: its checks call on)."""
    attack: str = option("none", "emulate bad workers: sign-flip, scale:K, noise:SIGMA, zero, copy, stale:N, "
                         "alie[:Z] (what the --attackers send in place of their outer gradient), or wrong-data "
                         "(they train on their windows read backwards)")
    attackers: str = option("", "the workers that run --attack: ranks, comma-separated (e.g. 3 or 5,6)")
    aggregate: str = option("mean", "how the outer step combines the workers' outer gradients: mean, median, "
                            "trimmed:BETA, centered-clip:TAU, median-norm-clip (all but mean all-gather "
                            "every worker's)")
    score: bool = option(False, "score every worker's outer gradient by the loss change it causes (Covenant's "
                         "rule) and leave out a worker whose score stays negative; names copies and stale ones")
    score_patience: int = option(3, "with --score: rounds in a row of negative scores before a worker is left out",
                                 min=1)
    score_batches: int = option(4, "with --score: sequences of each worker's own data its contribution is scored "
                                "on (at most --micro-batch)", min=1)
    validators: str = option("", "with --score: the workers that run the scoring forwards, ranks comma-separated "
                             "(default: every worker); no validator scores its own contribution")

    def emulated_attack(self) -> Attack:
        return parse_attack(self.attack)

    def attacking_ranks(self) -> tuple[int, ...]:
        return parse_ranks(self.attackers)

    def aggregator(self) -> Aggregator:
        return parse_aggregator(self.aggregate)

    def validator_ranks(self, world: int) -> tuple[int, ...]:
        """The workers that score (--validators; every one of `world` by default)."""
        return parse_ranks(self.validators, "--validators") or tuple(range(world))

    def check(self) -> None:
        super().check()
        attack, ranks = self.emulated_attack(), self.attacking_ranks()
        self.aggregator()
        if attack.kind != "none" and not ranks:
            raise UsageError(f"--attack {self.attack} needs --attackers RANKS: which workers attack")
        if ranks and attack.kind == "none":
            raise UsageError(f"--attackers {self.attackers} needs --attack KIND: what they send")
        if parse_ranks(self.validators, "--validators") and not self.score:
            raise needs_score("validators", self.validators)

    def check_given(self, given: dict[str, str]) -> None:
        """A scoring flag given without --score would do nothing (its default value too)."""
        super().check_given(given)
        for name in NEEDS_SCORE:
            if name in given and not self.score:
                raise needs_score(name, given[name])

    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        world, ranks = cfg.replicas or cfg.workers, self.attacking_ranks()
        group = "replicas" if world < cfg.workers else "workers"
        if ranks and ranks[-1] >= world:
            raise UsageError(f"--attackers {self.attackers}: rank {ranks[-1]} is out of range for {world} {group} "
                             f"(ranks 0 to {world - 1})")
        if ranks and len(ranks) == world:
            raise UsageError(f"--attackers {self.attackers} leaves no honest worker of {world}")
        aggregator = self.aggregator()
        aggregator.check_world(world)
        if aggregator.robust and world < cfg.workers:
            self.check_replicas(cfg, aggregator)
        if getattr(cfg, "elastic", False) and (ranks or aggregator.robust or self.score):
            self.check_elastic(cfg, aggregator)
        micro_batch = getattr(cfg, "micro_batch", None)  # (wrap() does not know its batches: not checked there)
        if self.score and micro_batch and self.score_batches > micro_batch:
            raise UsageError(f"--score-batches {self.score_batches} is more than --micro-batch {micro_batch}: a worker "
                             f"holds the first sequences of one micro-batch, so it would score on {micro_batch}")
        if self.score and world < cfg.workers and cfg.inside == "ddp" and getattr(self, "fragments", 1) > 1:
            raise UsageError(f"--score does not run across replica groups with --inside ddp and --fragments "
                             f"{self.fragments}: a position may own no tensor of a fragment, and a probe moves "
                             f"every position's")
        self._check_validators(world, group)

    def _check_validators(self, world: int, group: str) -> None:
        validators = parse_ranks(self.validators, "--validators")
        if validators and validators[-1] >= world:
            raise UsageError(f"--validators {self.validators}: rank {validators[-1]} is out of range for {world} "
                             f"{group} (ranks 0 to {world - 1})")
        if validators and world == 1:
            raise UsageError(f"--validators {self.validators}: the only worker would score only its own "
                             f"contribution, and no validator scores its own")

    def check_replicas(self, cfg, aggregator: Aggregator) -> None:
        """A robust aggregate across replica groups, each rank on its part of the rows: the
        outer-sync engine sums a norm's partial squares inside the replica (aggregators.Spread),
        which needs every position to sync each fragment: centered clipping's whole-row norm is
        refused where --inside ddp cuts Streaming DiLoCo's fragments position by position."""
        if aggregator.rule == "centered-clip" and cfg.inside == "ddp" and getattr(self, "fragments", 1) > 1:
            raise UsageError(f"--aggregate {self.aggregate} does not run across replica groups with --inside ddp "
                             f"and --fragments {self.fragments}: a position may own no tensor of a fragment, and "
                             f"a row's norm needs every position")

    def check_elastic(self, cfg, aggregator: Aggregator) -> None:
        """--elastic with --attack, --aggregate or --score (attackers and scores by the launcher's
        slot, or replica, docs/untrusted.md): an aggregate that still means
        something on the fewest members the run goes on with (--min-workers)."""
        if self.validators:
            raise UsageError(f"--validators {self.validators} does not run with --elastic yet: it names ranks, and "
                             f"ranks change as members come and go (every member scores instead)")
        slots = cfg.replicas or cfg.workers
        fewest = cfg.min_workers or slots
        if fewest < slots:
            aggregator.check_world(fewest, f"--aggregate (with --min-workers {fewest})")


@dataclass
class GatheredRobustOptions(RobustOptions):
    """RobustOptions of a strategy that gathers every worker's payload itself at every step (DeMo):
    --attack and --aggregate apply, --score every --score-every steps (engines/step_scoring.py);
    under --elastic its attackers and scores name workers by slot (robust/gathered.py)."""
    score_every: int = option(SCORE_EVERY, "with --score: optimizer steps from one scored step to the next (a "
                              "scored step costs each validator three forwards; between them the last round's "
                              "decision holds)", min=1)

    def check_replicas(self, cfg, aggregator: Aggregator) -> None:
        """Its payloads are aggregated per position with no sum inside the replica: the rules whose
        norms span positions are refused (median-norm-clip's per-tensor norms are whole with ddp
        inside, where a position owns whole tensors)."""
        if aggregator.rule == "centered-clip" or aggregator.rule == "median-norm-clip" and cfg.inside != "ddp":
            raise UsageError(f"--aggregate {self.aggregate} does not run on strategy '{cfg.strategy}' across replica "
                             f"groups with --inside {cfg.inside}: each rank holds part of every norm it clips by")

    def check(self) -> None:
        super().check()
        if self.score_every != SCORE_EVERY and not self.score:
            raise needs_score("score_every", self.score_every)
