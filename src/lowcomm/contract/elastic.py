"""How a strategy's state survives a change of membership (--elastic): what it declares.

The elastic runtime (elastic/, train/elastic.py) names no strategy: it reads these. What is
replicated, what is each worker's own and what a joiner starts from is declared once, with the
state itself, in the strategy's `state_parts()` (contract/parts.py: REPLICATED parts are hashed
and are what a joiner receives; LOCAL parts stay in the worker's snapshot and start fresh on a
joiner unless they say otherwise; SHARDED parts are gathered whole at a commit and cut anew for
each membership). Each strategy's docstring says where its reference does so.

Where its steps are kept is its rules, `Strategy.elastic` (a class, as `cost` is), in the style
of torchft's Manager.should_commit:

    commits_at(options, step)                 where every member agrees (default: every step)
    redoes_last_step(options)                 a failed commit redoes only its last step (rounds.py)
    refusal(options, across_replicas)         why these options cannot run elastically (None: they can)
    options(options)                          the options an elastic run runs (local SGD: token-weighted merges)
    require_contributors(strategy, n)         --min-workers as an outer step's quorum
    name_members(strategy, slots)             each rank's slot, stable across quorums (--attackers, --score)
    contribution(strategy)                    who contributed to the last merge (steps.jsonl's `outer`)

The local-SGD family's are engines/outer_contract.py's OuterSyncRules.
"""
from __future__ import annotations


class ElasticRules:
    """Every step a commit point, any options, no merge of what members trained (the module docstring)."""

    @classmethod
    def commits_at(cls, options, step: int) -> bool:
        return True

    @classmethod
    def redoes_last_step(cls, options) -> bool:
        return False

    @classmethod
    def refusal(cls, options, across_replicas: bool) -> str | None:
        return None

    @classmethod
    def options(cls, options):
        return options

    @classmethod
    def require_contributors(cls, strategy, n: int) -> None:
        """An update that merges what each member trained needs `n` members that trained."""

    @classmethod
    def name_members(cls, strategy, slots: tuple[int, ...]) -> None:
        """The slot of each rank of the strategy's group in this membership (the launcher's worker
        numbers: stable as members come and go, where ranks are not)."""

    @classmethod
    def contribution(cls, strategy) -> dict | None:
        """The last merge's contributors and tokens (steps.jsonl's `outer`), None without one."""
        return None
