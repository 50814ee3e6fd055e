"""Which strategies run with --elastic, and why the others are refused (one line each).

A strategy runs elastically when, at its commit points, the whole state that must agree across
workers can be rolled back to the last commit and sent to a joiner: ddp (every step; all of its
state is replicated), zero1 (every step, its sharded optimizer state gathered whole: reshard.py)
and diloco (every outer sync, when every worker is reset to θ_global).
"""
from __future__ import annotations

import dataclasses

from ..errors import UsageError

SUPPORTED = ("ddp", "zero1", "diloco")
WHY_NOT = {
    "acco": "its rounds run beside the next step's compute and its optimizer state is sharded, so no step "
            "boundary is a point every worker can roll back to",
    "dpu": "each step applies the previous step's gradient, in flight across the boundary, and its optimizer "
           "state is sharded",
    "streaming_diloco": "its fragments sync at different steps, so no step has every worker on the same state",
    "sparseloco": "each worker keeps its own error-feedback residual, which a joiner cannot take from a peer",
    "demo": "each worker keeps its own momentum residual, which a joiner cannot take from a peer",
    "quantized": "each worker keeps its own error-feedback residuals, which a joiner cannot take from a peer",
    "onebit_adam": "each worker keeps its own error-feedback residuals, which a joiner cannot take from a peer",
    "powersgd": "its compressor keeps per-worker error feedback inside torch's DDP hook state",
}


def check(cfg) -> None:
    """UsageError, in one line, when cfg asks for --elastic (or --min-workers) where it cannot run."""
    if not cfg.elastic:
        for flag, value in (("--min-workers", cfg.min_workers), ("--member-timeout", cfg.member_timeout),
                            ("--lighthouse", cfg.lighthouse)):
            if value:
                raise UsageError(f"{flag} applies only with --elastic")
        return
    from ..config.nodes import under_torchrun
    if under_torchrun():  # each torchrun job is one replica (replicas.py)
        check_torchrun(cfg)
    if cfg.strategy not in SUPPORTED:
        why = WHY_NOT.get(cfg.strategy, "it does not declare how its state survives a change of the group")
        raise UsageError(f"--elastic does not run strategy '{cfg.strategy}': {why} "
                         f"(elastic strategies: {', '.join(SUPPORTED)})")
    slots = cfg.replicas or cfg.workers  # what --min-workers counts: workers, or replicas with --replicas
    if cfg.min_workers < 0 or cfg.min_workers > slots and not under_torchrun():  # torchrun: replicas
        bound = f"--replicas ({slots}): it counts replicas" if cfg.replicas else f"--workers ({cfg.workers})"
        raise UsageError(f"--min-workers must be between 1 and {bound}, got {cfg.min_workers}")
    if not 0 <= cfg.member_timeout <= cfg.timeout:
        raise UsageError(f"--member-timeout must be positive and at most --timeout ({cfg.timeout:g} s), "
                         f"got {cfg.member_timeout:g}")
    if cfg.replicas and cfg.replicas != cfg.workers and not under_torchrun():  # a slot: a replica of W/R processes
        check_replicas(cfg, "with --replicas")
    if cfg.strategy == "diloco":
        o = cfg.strategy_options()
        if o.sync_by != "steps":
            raise UsageError("--elastic needs diloco's --sync-by steps: its commit points are the outer syncs, "
                             "which must fall on the same step on every worker")
    from .checkpoints import check as check_checkpoints
    check_checkpoints(cfg, commit_every(cfg))
    for flag, value in (("--checkpoint-on-signal", cfg.checkpoint_on_signal), ("--trace", cfg.trace), ("--slowdown", cfg.slowdown), ("--stragglers", cfg.stragglers)):
        if value:
            raise UsageError(f"{flag} does not run with --elastic yet")
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
    if cfg.max_restarts:
        raise UsageError("--max-restarts is torchrun's under torchrun (it restarts the whole replica): pass it to "
                         "torchrun, not to lowcomm train")
    check_replicas(cfg, "under torchrun")


def check_replicas(cfg, where: str) -> None:
    """What elastic replica groups cannot take (`where`: under torchrun, or with --replicas)."""
    if cfg.inside != "ddp":
        raise UsageError(f"--elastic {where} runs --inside ddp, not '{cfg.inside}': its commit points keep "
                         f"each process's whole part of the state, which an fsdp replica shards")
    if cfg.strategy == "zero1":
        raise UsageError(f"--elastic {where} runs ddp and diloco across replicas; zero1's commit points gather "
                         f"its shards over one worker a replica (run it with one worker a replica)")
    for flag, value in (("--checkpoint-every", cfg.checkpoint_every), ("--stop-at", cfg.stop_at),
                        ("--resume", cfg.resume_from)):
        if value:
            raise UsageError(f"{flag} does not run with --elastic {where} yet")


def commit_every(cfg) -> int:
    """Steps between commit points: ddp every step, diloco every outer sync (H)."""
    return cfg.strategy_options().sync_every if cfg.strategy == "diloco" else 1


def min_workers(cfg) -> int:
    """The live slots (workers; replicas with --replicas or under torchrun) below which an elastic
    run fails, which its first quorum waits for and an outer step needs (diloco). When not given:
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


def replicated(strategy: str, state: dict) -> dict:
    """The tensors of a commit point's state (reshard.snapshot) that every member holds alike:
    all of ddp's and of zero1's whole state; diloco's parameters (= θ_global after a sync),
    θ_global and the outer optimizer (each worker's inner optimizer is its own)."""
    out = {f"model.{k}": v for k, v in state["model"].items()}
    optimizers = state["optimizers"][1:] if strategy == "diloco" else state["optimizers"]
    for i, osd in enumerate(optimizers):
        for p, st in osd["state"].items():
            for k, v in st.items():
                if hasattr(v, "dtype"):
                    out[f"opt{i}.{p}.{k}"] = v
    if strategy != "ddp":
        for k, v in _tensors(state["extra"]).items():
            out[f"extra.{k}"] = v
    return out


def _tensors(obj, prefix: str = "") -> dict:
    if hasattr(obj, "dtype"):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in _tensors(v, f"{prefix}.{k}").items()}
    if isinstance(obj, (list, tuple)):
        return {k2: v2 for i, v in enumerate(obj) for k2, v2 in _tensors(v, f"{prefix}.{i}").items()}
    return {}


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
    """The strategy's options as an elastic run uses them: the local-SGD family's outer merge
    weighted by the tokens each member trained since the last sync (token_weights.py)."""
    options = cfg.strategy_options()
    return dataclasses.replace(options, outer_weights="tokens") if hasattr(options, "outer_weights") else options


def configure(run, cfg) -> None:
    """--min-workers is the quorum of an outer step too: members that trained (diloco)."""
    if hasattr(run.strategy, "min_contributors"):
        run.strategy.min_contributors = min_workers(cfg)


def outer_record(run) -> dict | None:
    """steps.jsonl's `outer` at an outer sync: the workers that contributed, their tokens."""
    contribution = getattr(run.strategy, "contribution", None)
    return contribution() if contribution is not None else None
