"""How a strategy's state survives a change of membership (--elastic): what it declares.

The elastic runtime (elastic/, train/elastic.py) names no strategy: it reads these. What is
replicated, what is each worker's own and what a joiner starts from is declared once, with the
state itself, in the strategy's `state_parts()` (contract/parts.py: REPLICATED parts are hashed
and are what a joiner receives; LOCAL parts stay in the worker's snapshot and start fresh on a
joiner unless they say otherwise; SHARDED parts are gathered whole at a commit and cut anew for
each membership). Each strategy's docstring says where its reference does so.

In the style of torchft's Manager.should_commit (where a step is kept):

    commits_at(options, step)                   where every member agrees (default: every step)
    redoes_last_step(options)                   a failed commit redoes only its last step (rounds.py)
    elastic_refusal(options, across_replicas)   why these options cannot run elastically (None: they can)
    elastic_options(options)                    the options an elastic run runs (local SGD: token-weighted merges)
    require_contributors(n) / contribution()    --min-workers as an outer step's quorum; who contributed to it
"""
from __future__ import annotations


class ElasticPart:
    """The elastic side of Strategy (see the module docstring)."""

    @classmethod
    def commits_at(cls, options, step: int) -> bool:
        return True

    @classmethod
    def redoes_last_step(cls, options) -> bool:
        return False

    @classmethod
    def elastic_refusal(cls, options, across_replicas: bool) -> str | None:
        return None

    @classmethod
    def elastic_options(cls, options):
        return options

    def require_contributors(self, n: int) -> None:
        """An update that merges what each member trained needs `n` members that trained."""

    def contribution(self) -> dict | None:
        """The last merge's contributors and tokens (steps.jsonl's `outer`), None without one."""
        return None
