"""What an elastic run can take, in one line each, and what it reads of its strategy.

A strategy runs elastically by declaring how its state survives a change of membership: its state
parts (contract/parts.py: replicated, local, sharded) and its rules (contract/elastic.py: its commit
points); the runtime here names no strategy. One that cannot (yet) says why (`elastic.refusal`).
"""
from __future__ import annotations

from typing import Callable

from ..errors import UsageError
from ..strategies.registry import get


def strategy_class(cfg):
    """The class of the run's strategy: what it declares about elasticity."""
    return get(cfg.strategy)


def check(cfg) -> None:
    """UsageError, in one line, when cfg asks for --elastic (or --min-workers) where it cannot run."""
    if not cfg.elastic:
        changed = cfg.quorum_timeout != type(cfg).quorum_timeout  # its default is not 0 (a dataclass field)
        for flag, value in (("--min-workers", cfg.min_workers), ("--member-timeout", cfg.member_timeout),
                            ("--quorum-timeout", changed), ("--lighthouse", cfg.lighthouse)):
            if value:
                raise UsageError(f"{flag} applies only with --elastic")
        return
    from ..config.nodes import under_torchrun
    if under_torchrun():  # each torchrun job is one replica (replicas.py)
        check_torchrun(cfg)
    across = under_torchrun() or bool(cfg.replicas and cfg.replicas != cfg.workers)
    why = strategy_class(cfg).elastic.refusal(cfg.strategy_options(), across)
    if why:
        where = "" if not across else " under torchrun" if under_torchrun() else " with --replicas"
        raise UsageError(f"--elastic{where} does not run strategy '{cfg.strategy}': {why}")
    slots = cfg.replicas or cfg.workers  # what --min-workers counts: workers, or replicas with --replicas
    if cfg.min_workers < 0 or cfg.min_workers > slots and not under_torchrun():  # torchrun: replicas
        bound = f"--replicas ({slots}): it counts replicas" if cfg.replicas else f"--workers ({cfg.workers})"
        raise UsageError(f"--min-workers must be between 1 and {bound}, got {cfg.min_workers}")
    if not 0 <= cfg.member_timeout <= cfg.timeout:
        raise UsageError(f"--member-timeout must be positive and at most --timeout ({cfg.timeout:g} s), "
                         f"got {cfg.member_timeout:g}")
    if not cfg.quorum_timeout > 0:
        raise UsageError(f"--quorum-timeout must be a positive number of seconds, got {cfg.quorum_timeout:g}")
    from .checkpoints import check as check_checkpoints
    check_checkpoints(cfg, commit_points(cfg))
    from .lighthouse import require_torchft
    require_torchft()
    if cfg.lighthouse:  # refused before anything is written, not after the workers started
        from .address import check_lighthouse, parse_lighthouse
        check_lighthouse(parse_lighthouse(cfg.lighthouse), f"--lighthouse {cfg.lighthouse}",
                         None if under_torchrun() else slots)
    record_overrides(cfg)


def check_torchrun(cfg) -> None:
    """What an elastic run under torchrun cannot take, in one line each."""
    if not cfg.lighthouse:
        raise UsageError("--elastic under torchrun needs --lighthouse HOST:PORT, a lighthouse every replica reaches "
                         "(e.g. torchft_lighthouse --min_replicas 1 --join_timeout_ms 600000 --bind [::]:29510)")
    if cfg.replicas:
        raise UsageError("--elastic under torchrun makes each torchrun job one replica: drop --replicas")
    o = cfg.strategy_options()
    if getattr(o, "attackers", "") or getattr(o, "score", False) or getattr(o, "aggregate", "mean") != "mean":
        raise UsageError("--attack, --aggregate and --score do not run with --elastic under torchrun yet (each job "
                         "is a replica, as with --replicas under --elastic)")
    if cfg.max_restarts:
        raise UsageError("--max-restarts is torchrun's under torchrun (it restarts the whole replica): pass it to "
                         "torchrun, not to lowcomm train")


def commit_points(cfg) -> Callable[[int], bool]:
    """Is trainer step `step` (from 1) a commit point: one the strategy declares, or the last."""
    commits, options = strategy_class(cfg).elastic.commits_at, cfg.strategy_options()
    return lambda step: step == cfg.steps or commits(options, step)


def redoes_last_step(cfg) -> bool:
    """Does a failed commit redo only its last step (rounds.py), as the strategy declares?"""
    return strategy_class(cfg).elastic.redoes_last_step(cfg.strategy_options())


def min_workers(cfg) -> int:
    """The live slots (workers; replicas with --replicas or under torchrun) below which an elastic
    run fails, which its first quorum waits for and an outer step needs (the local-SGD family). When not given:
    every worker, every replica of `--replicas R`, under torchrun 1 (each job is one replica)."""
    from ..config.nodes import under_torchrun
    return cfg.min_workers or cfg.replicas or (1 if under_torchrun() else cfg.workers)


MEMBER_TIMEOUT_S = 10.0


def member_timeout(cfg) -> float:
    """Seconds a collective of a membership's group waits for a member before the others drop it
    (its gloo timeout): a frozen member (SIGSTOP, a hung host) is dropped this long after the
    others reach a collective it does not. Short, unlike --timeout, since dropping a member that
    was only slow costs one re-form and a state transfer, not the run."""
    return cfg.member_timeout or min(MEMBER_TIMEOUT_S, cfg.timeout)


def refuse_overridden(cfg, given: dict) -> None:
    """UsageError, one line, for a strategy option given by a flag (`given`: field -> its text)
    that an elastic run would override (strategy_options), instead of running with another value
    than the one asked for."""
    from ..strategies import registry
    if cfg.strategy not in registry.available():
        return  # named in validate's own line
    asked, ran = cfg.strategy_options(), strategy_options(cfg)
    for name, raw in given.items():
        value = getattr(ran, name, None)
        if value != getattr(asked, name, None) and str(raw) != str(value):
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {raw} does not run with --elastic: an elastic {cfg.strategy} run uses {flag} "
                             f"{value} (its members come and go; each counts for what it trained); drop {flag}")


def record_overrides(cfg) -> None:
    """The strategy's options as the elastic run runs them, so that config.toml records those."""
    cfg.options[cfg.strategy] = strategy_options(cfg)


def strategy_options(cfg):
    """The strategy's options as an elastic run uses them (the local-SGD family's outer merge
    weighted by the tokens each member trained since the last sync: token_weights.py)."""
    return strategy_class(cfg).elastic.options(cfg.strategy_options())


def configure(run, cfg, slots: tuple[int, ...]) -> None:
    """--min-workers is the quorum of an update that merges what the members trained; `slots`:
    the slot of each rank of the strategy's group (its replicas' numbers, across replica groups),
    by which --attackers names a worker: the strategy's engine (its Δ) and the driver (wrong-data)."""
    run.strategy.elastic.require_contributors(run.strategy, min_workers(cfg))
    run.strategy.elastic.name_members(run.strategy, slots)
    run.slots = tuple(slots)


def outer_record(run) -> dict | None:
    """steps.jsonl's `outer` at a commit: the workers that contributed to its merge, their tokens."""
    return run.strategy.elastic.contribution(run.strategy)
