"""What `lowcomm plan` assumed: the inputs its step model rests on, where each came from, and
a one-line warning wherever it extrapolates beyond what it was told or measured.

A plan is only as good as three inputs: tokens per step (T), one worker's compute speed and
the per-step overhead outside forward/backward. Each may be given (a flag), measured (a
`--calibrate` bench) or defaulted (the config's batch), and a default that fits the tiny
preset silently misleads at a billion parameters, so the plan names every one of them.

A calibration measures two different things: the loss per token of each variant (a property
of the algorithm and its settings, which is what carries over to another cluster) and the
seconds per token and overhead of the bench's model on the bench's device (which do not
carry over to another device, nor scale linearly to a model a thousand times larger).
"""
from __future__ import annotations

# A calibrated model this many times larger or smaller than the bench's is an extrapolation:
# compute per token grows about linearly with N, but kernel efficiency, memory traffic and
# per-step overhead (optimizer, compression) do not, and on another device nothing carries over.
SCALE_TOLERANCE = 2.0


def assumptions(args, cfg, cluster, dims: dict, per_token: float | None, runs: dict, calibration=None) -> dict:
    """The plan's inputs with their sources, its warnings and the calibration's caveats (one line each)."""
    from ..config.flags import given
    from .planner import format_seconds

    params, warnings = cluster.params, []
    if args.tokens_per_step is not None:
        tokens_from = "--tokens-per-step"
    else:
        parts = [f"{k} {getattr(cfg, a)}" for k, a in (("workers", "workers"), ("accum", "accum"),
                                                      ("micro-batch", "micro_batch"))]
        from_bench = args.calibrate is not None and not given(args, "--micro-batch")
        tokens_from = (" x ".join(parts) + f" x seq-len {cfg.model.seq_len}"
                       + (" (the bench's batch)" if from_bench else " (the config's batch, not --tokens-per-step)"))
        if dims.get("sized_from_params") is not None or _scale(params, runs) > SCALE_TOLERANCE:
            warnings.append(f"{cluster.tokens_per_step:,} tokens per step is the batch of the config, kept for a "
                            f"{params / 1e6:,.4g}M-param model: give --tokens-per-step (the batch you would train "
                            f"it with); step time, bytes/token and the ranking depend on it")
    bench_params = _bench_params(runs)
    if per_token is not None:
        compute_from = (f"--worker-tflops {args.worker_tflops}: 6 N FLOPs per token, "
                        f"{format_seconds(per_token * cluster.tokens_per_step / cluster.workers)} per step's compute")
    else:
        c = calibration
        compute_from = (f"the model's forward/backward, {format_seconds(c.per_micro_s)} per micro-batch of "
                        f"{c.tokens_per_micro:,} tokens (the median of the bench's {len(c.per_run)} run(s), every "
                        f"strategy alike) on its {bench_params / 1e6:,.4g}M-param model and device, scaled by N "
                        f"({params / bench_params:.3g}x)")
    if runs:
        work = ", ".join(f"{name} {format_seconds(w.total_s)} (optimizer {format_seconds(w.optimizer_s)})"
                         for name, w in calibration.work.items())
        overhead_from = (f"each strategy's own work a step (optimizer step, compression, outer step: each rank's "
                         f"step less its compute and network waits), measured by the bench: {work}; scaled by N "
                         f"({params / bench_params:.3g}x)")
        loss_from = "measured by the bench (each strategy's loss curve at the settings it ran)"
    else:
        overhead_from = "0 (not measured: give --calibrate for the optimizer step and compression)"
        loss_from = "not modeled (throughput only; --calibrate gives each strategy's loss per token)"
    if runs and _scale(params, runs) > SCALE_TOLERANCE:
        what = "compute speed and per-step overhead are" if per_token is None else "per-step overhead is"
        warnings.append(f"{what} extrapolated from the bench's {bench_params / 1e6:,.4g}M-param model on the bench's "
                        f"device to {params / 1e6:,.4g}M params: a device's speed does not transfer from a "
                        f"calibration, only loss per token does"
                        + ("; give --worker-tflops for the planned workers" if per_token is None else ""))
    measured = {} if calibration is None else {
        "compute_per_micro_batch_s": calibration.per_micro_s, "tokens_per_micro_batch": calibration.tokens_per_micro,
        "compute_per_micro_batch_s_by_run": {k: v * calibration.tokens_per_micro
                                             for k, v in calibration.per_run.items()},
        "per_step_work_s": {k: {"optimizer_s": w.optimizer_s, "other_s": w.other_s}
                            for k, w in calibration.work.items()}}
    return {"tokens_per_step": cluster.tokens_per_step, "tokens_per_step_from": tokens_from,
            "compute_from": compute_from, "overhead_from": overhead_from, "loss_per_token_from": loss_from,
            **measured, "warnings": warnings, "caveats": list(calibration.caveats) if calibration else []}


def describe(assumed: dict) -> str:
    """The assumptions as the table prints them: one line each, warnings and caveats last."""
    lines = [f"assumed: tokens per step {assumed['tokens_per_step']:,} from {assumed['tokens_per_step_from']}",
             f"assumed: compute speed per worker {assumed['compute_from']}",
             f"assumed: per-step overhead {assumed['overhead_from']}",
             f"assumed: loss per token {assumed['loss_per_token_from']}"]
    return "\n".join(lines + [f"warning: {w}" for w in assumed["warnings"]]
                     + [f"caveat: {c}" for c in assumed["caveats"]])


def _bench_params(runs: dict) -> int:
    """The bench's model size (its runs share one model)."""
    return next(iter(runs.values())).summary["params"] if runs else 0


def _scale(params: int, runs: dict) -> float:
    """How many times larger (or smaller) the planned model is than the calibrating bench's; 1 without one."""
    bench = _bench_params(runs)
    return max(params / bench, bench / params) if bench else 1.0
