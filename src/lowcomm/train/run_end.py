"""The end of a run: every rank's measurements gathered, summary.json (and trace.json) written."""
from __future__ import annotations

import resource
from pathlib import Path
from typing import Callable

import torch

from .. import config as C
from ..comm.groups import combined
from ..comm import Comm
from ..engines.inside import run_level_plans
from ..metrics.levels import LEVELS, level_summary
from ..metrics.runlog import write_json_atomic
from ..metrics.calibration import machine_at_end
from ..metrics.summary import build_summary, describe
from ..diagnose.trace import write_trace
from ..models.layout import layout_of
from ..models.load import MODEL_DIR
from ..models.save import full_state, save_model
from ..data.info import describe as describe_data
from ..data.tokenizer import BYTES, byte_level_tokenizer


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def gather_trace(t, out_dir: Path | None, **metadata) -> None:
    """Collective with --trace: every rank's spans to rank 0, which writes trace.json (at the end,
    or when a run stops early to be resumed: what ran so far)."""
    if t.tracer is None:
        return
    events = t.tracer.gather(t.comm, t.device)
    if t.rank == 0 and out_dir is not None:
        write_trace(out_dir / "trace.json", events, {"strategy": t.cfg.strategy, "workers": t.world,
                                                     "link": C.to_dict(t.cfg)["link"], **metadata})


def stop(t, out_dir: Path | None) -> None:
    """A part of a run stopped with a checkpoint (--stop-at, a signal): no communication thread
    left behind, the trace so far; summary.json is written by the part that reaches --steps."""
    t.run.release()
    gather_trace(t, out_dir, stopped_after_step=t.step)


def finish(t, result, out_dir: Path | None, quiet: bool, extra: Callable[[], dict] | None = None) -> dict | None:
    """The run's end, for a plain run and an elastic one alike: every rank closes its strategy
    (collective: all end on the same final parameters), then `summarize`, with `extra()`'s keys
    (collective where the caller's is: every rank calls it) in summary.json."""
    t.run.close()
    return summarize(t, result, out_dir, quiet, extra() if extra is not None else None)


def gather_levels(world_comm: Comm, levels: list[Comm], device) -> torch.Tensor:
    """(W, levels, 3) of every rank's wire bytes, exposed and busy seconds per level (collective)."""
    mine = torch.zeros(len(LEVELS), 3, dtype=torch.float64)
    for comm in levels:
        s = comm.snapshot()
        mine[LEVELS.index(comm.level)] = torch.tensor([s.wire_bytes, s.exposed_s, s.busy_s], dtype=torch.float64)
    return world_comm.meta_all_gather(mine.to(device)).cpu()


def summarize(t, run, out_dir: Path | None, quiet: bool, extra: dict | None = None) -> dict | None:
    """Gather every rank's measurements; rank 0 writes summary.json (with `extra`'s keys) and trace.json."""
    comm, strategy = t.comm, t.run.strategy
    now = peak_memory_bytes(t.device)
    peaks = comm.meta_all_gather(torch.tensor([float(now), float(now - t.mem_before)], device=t.device)).cpu()
    peak, added = peaks[:, 0].max(), peaks[:, 1].max()
    mine = combined(t.run.levels)  # every level's (a flat run: the world's)
    slept = t.run.pacer.slept_s if t.run.pacer is not None else 0.0
    link_times = comm.meta_all_gather(torch.tensor(
        [mine.busy_s, mine.emulated_s, slept], dtype=torch.float64, device=t.device)).cpu()
    every_level = gather_levels(comm, t.run.levels, t.device)
    gather_trace(t, out_dir)
    lead = t.rank == 0 and out_dir is not None
    save_final_model(t, out_dir if lead else None)
    if not lead:
        return None
    replicas, layout = t.cfg.replicas or t.world, layout_of(t.model)
    plans = run_level_plans(strategy, layout, replicas)
    plan = plans.slowest_cross(replicas)  # across (a flat run's only level)
    links = {c.level: c.link.describe() for c in t.run.levels if c.link is not None}
    levels = level_summary(every_level, strategy, plans, t.world, replicas, t.cfg.steps, links)
    planned = sum(level["planned_wire_bytes"] for level in levels.values())
    summary = build_summary(
        t.cfg, world=t.world, backend=t.backend, params=sum(p.numel() for p in t.model.parameters()), source=t.source,
        totals=run.totals, train_loss=run.train_loss, val_loss=run.val_loss, wall_s=run.wall_s,
        optimizer_state_bytes=strategy.optimizer_state_bytes(), peak_mem_bytes=int(peak),
        link=comm.link.describe() if comm.link is not None else None, link_times=link_times,
        traced=t.tracer is not None, strategy_report=strategy.report(), plan=plan, planned_wire_bytes=planned)
    summary.update(replicas=replicas, inside=t.cfg.inside if replicas < t.world else None, levels=levels,
                   peak_mem_added_bytes=int(added),
                   machine=machine_at_end(0 if t.device.type == "cuda" else t.cfg.local_workers * t.cfg.threads),
                   **(extra or {}))
    write_json_atomic(out_dir / "summary.json", summary)
    if not quiet:
        print(describe(summary), flush=True)
    return summary


def save_final_model(t, out_dir: Path | None) -> None:
    """OUT/model/: the final weights (gathered from every rank where FSDP shards them: every rank
    calls this), written by the rank given `out_dir`, with the data's tokenizer beside them."""
    state = full_state(t.model, keep=out_dir is not None)
    if out_dir is not None:
        write_model(t, t.model, state, out_dir / MODEL_DIR)


def write_model(t, model, state: dict, directory: Path) -> None:
    """`model` with the weights `state` (full_state's) in `directory`, as a run leaves OUT/model/:
    the weights, their config and the data's tokenizer beside them."""
    save_model(model, state, directory, t.cfg.model.seq_len, tokenizer_files(t.cfg))


def tokenizer_files(cfg: C.RunConfig) -> dict:
    """The tokenizer to put beside the final model: the data's tokenizer.json; for byte text, the
    byte-level tokenizer.json (id = byte value; its end-of-text id, 256, is beyond a byte model's
    vocabulary and never comes out of text); none where the data came without one."""
    tokenizer = describe_data(cfg.data.source, cfg.data.vocab_size).tokenizer
    if tokenizer is None:
        return {}
    if str(tokenizer) == BYTES:
        return {"tokenizer.json": byte_level_tokenizer().to_str().encode()}
    return {"tokenizer.json": Path(tokenizer)}
