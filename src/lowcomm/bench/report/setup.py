"""What a run measured (model, data, tokens, workers, link), in words, and which runs of a
report can be compared: a table that sets a 0.45M-parameter model at 200 steps beside
1M-parameter runs at 60 steps must say so."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ...metrics.runs import RecordedRun


@dataclass(frozen=True)
class Setup:
    """The inputs that make two runs' losses, times and bytes comparable."""
    params: int
    seq_len: int
    data: str
    tokens: int           # the budget: steps x tokens per step (adaptive strategies train more)
    tokens_per_step: int  # the budget's rounding: benches round each strategy's steps up
    workers: int


def setup_of(run: RecordedRun) -> Setup:
    c, s = run.config, run.summary
    seq_len = c.get("model", {}).get("seq_len", 128)
    per_step = s["workers"] * c.get("accum", 1) * c.get("micro_batch", 16) * seq_len
    budget = c["steps"] * per_step if "steps" in c else s["tokens"]
    data = c.get("data", {}).get("source") or str(s.get("data", "?")).split(" (")[0]
    return Setup(s.get("params") or 0, seq_len, data, budget, per_step, s["workers"])


def differences(setup: Setup, reference: Setup) -> list[str]:
    """How `setup` differs from `reference`, one phrase per input; [] when comparable."""
    out = []
    known = setup.params and reference.params  # 0: not counted (a run that did not finish)
    if (known and setup.params != reference.params) or setup.seq_len != reference.seq_len:
        out.append(f"model {_params(setup.params)}, seq {setup.seq_len} (others: {_params(reference.params)}, "
                   f"seq {reference.seq_len})")
    if setup.data != reference.data:
        out.append(f"data {setup.data} (others: {reference.data})")
    if abs(setup.tokens - reference.tokens) >= max(setup.tokens_per_step, reference.tokens_per_step):
        out.append(f"{setup.tokens:,} tokens planned (others: {reference.tokens:,})")
    if setup.workers != reference.workers:
        out.append(f"{setup.workers} workers (others: {reference.workers})")
    return out


def not_comparable(runs: list[RecordedRun]) -> dict[str, list[str]]:
    """label -> how the run differs from the setup most runs share (ties: the first run's).
    Runs that share it are absent."""
    if not runs:
        return {}
    setups = [setup_of(r) for r in runs]
    matches = Counter(i for i, a in enumerate(setups) for b in setups if not differences(b, a))
    reference = setups[max(range(len(setups)), key=lambda i: (matches[i], -i))]
    return {r.label: why for r, s in zip(runs, setups) if (why := differences(s, reference))}


DIMS = {"n_layer": "{} layers", "n_head": "{} heads", "d_model": "width {}"}  # a preset's dims, overridden


def describe(run: RecordedRun) -> str:
    """'2 workers, link 100mbit,10ms, GPT 1.05M params (tiny), 300,000 tokens': a plot title's words."""
    c, s = run.config, run.summary
    where = _link(c.get("link", {}))
    replicas = c.get("replicas") or s.get("replicas") or s["workers"]
    if replicas < s["workers"]:  # replica groups: each level's link, the slow one first
        where = (f" as {replicas} replicas of {s['workers'] // replicas}, {where} across replicas, "
                 f"{_link(c.get('intra_link', {}))} inside")
    else:
        where = ", " + where
    slow = [f for f in s.get("slowdown") or [] if f != 1]
    model = c.get("model", {})
    preset = model.get("preset", s.get("model", "?"))
    dims = ", ".join([preset] + [text.format(model[k]) for k, text in DIMS.items() if model.get(k)])
    return (f"{s['workers']} workers{where}" + (", uneven workers" if slow else "")
            + f", GPT {_params(s.get('params', 0))} params ({dims}), {setup_of(run).tokens:,} tokens")


def _link(link: dict) -> str:
    """'link 100mbit,10ms' (as --link spells it), or 'no link emulation'."""
    return f"link {link['bandwidth']},{link.get('latency') or '0'}" if link.get("bandwidth") else "no link emulation"


def _params(n: int | None) -> str:
    if not n:  # a run that did not finish: its summary.json would have counted them
        return "?"
    return f"{n / 1e6:.3g}M" if n >= 1e4 else f"{n:,}"
