"""One worker's life: join the group, build model, data and strategy, train, report."""
from __future__ import annotations

import gc
import math
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from . import config as C
from .comm import Comm
from .data import VOCAB_SIZE, ShardedBatches, load_bytes, split, val_batches
from .errors import RunError
from .metrics.progress import ProgressView
from .metrics.summary import Totals, describe
from .metrics.runlog import StepLog, result_vector, step_record, write_json_atomic
from .metrics.trace import Tracer, write_trace
from .models import GPT, lm_loss
from .optim import adamw_factory, lr_schedule
from .strategies import make_strategy
from .strategies.base import Pacer


def pick_backend(cfg: C.RunConfig) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    if cfg.device == "cpu":
        return "gloo"
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def pick_device(cfg: C.RunConfig, backend: str, local_rank: int) -> torch.device:
    """cuda with nccl (or when asked for), else cpu; ranks share GPUs round-robin."""
    if cfg.device == "cuda" or (cfg.device == "auto" and backend == "nccl"):
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    return torch.device("cpu")


def verify_identical_params(model: torch.nn.Module, comm: Comm) -> None:
    """Every rank must start from the same θ0: compare two checksums across ranks."""
    flat = torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64).remainder_(1009)
    mine = torch.stack([flat.sum(), (flat * weights).sum()])
    device = next(model.parameters()).device
    every = comm.meta_all_gather(mine.to(device)).cpu()
    if not torch.equal(every, mine.expand_as(every)):
        raise RunError(f"initial parameters differ across ranks (checksums {every[:, 0].tolist()})")


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, comm: Comm, device) -> float:
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        total[0] += float(lm_loss(model, (x.to(device), y.to(device)))) * x.shape[0]
        total[1] += x.shape[0]
    model.train(was_training)
    comm.meta_all_reduce(total)
    return float(total[0] / total[1])


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def train(cfg: C.RunConfig, rank: int, world: int, local_rank: int, out_dir: Path | None,
          quiet: bool = False) -> dict | None:
    """Train with an initialised process group. Returns the summary on rank 0."""
    backend = dist.get_backend()
    device = pick_device(cfg, backend, local_rank)
    comm = Comm(link=C.make_link(cfg, seed=cfg.seed * 7919 + rank))  # each NIC jitters on its own

    torch.manual_seed(cfg.seed)
    n_layer, n_head, d_model = cfg.model.dims()
    model = GPT(VOCAB_SIZE, cfg.model.seq_len, n_layer, n_head, d_model).to(device)
    verify_identical_params(model, comm)

    tokens, source = load_bytes(cfg.data.source, quiet=rank != 0)
    train_tokens, val_tokens = split(tokens, cfg.data.val_fraction)
    loader = ShardedBatches(train_tokens, rank, world, cfg.model.seq_len, cfg.micro_batch, cfg.seed)
    val = val_batches(val_tokens, rank, world, cfg.model.seq_len, cfg.micro_batch, cfg.eval_batches)

    def next_batch():
        x, y = loader.next()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    strategy = make_strategy(cfg.strategy, model, comm, adamw_factory(cfg.optim), accum=cfg.accum,
                             schedule=lr_schedule(cfg.optim, cfg.steps), **strategy_options(cfg))
    slowdown, (straggle_p, straggle_f) = C.slowdown_factors(cfg), C.straggler_settings(cfg)
    if slowdown[rank] != 1.0 or straggle_p > 0:
        strategy.pacer = Pacer(rank, world, slowdown[rank], straggle_p, straggle_f, cfg.seed)
    tracer = Tracer(rank) if cfg.trace else None
    if tracer is not None:
        for opt in strategy.optimizers():
            tracer.watch_optimizer(opt)
        tracer.align(comm, device)
        comm.tracer = tracer

    lead = rank == 0 and out_dir is not None
    log = StepLog(out_dir) if lead else None
    view = ProgressView(cfg.steps, f"{cfg.strategy} W={world}", enabled=lead and not quiet)
    if lead and not quiet:
        print(f"lowcomm: {cfg.strategy} on {world} worker(s) ({backend}), "
              f"GPT {model.num_params() / 1e6:.2f}M params, data {source}", flush=True)

    totals = Totals(world)
    loss = val_loss = float("nan")
    # Start the clocks together: a rank that finished set-up early must not count
    # its wait for the others in step 1 as exposed communication.
    comm.barrier()
    t_start = time.perf_counter()
    pending: list[torch.Tensor] = []  # this rank's results not yet gathered
    try:
        for step in range(1, cfg.steps + 1):
            pending.append(result_vector(strategy.step(next_batch, lm_loss)))
            evaluate_now = (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps
            if not (evaluate_now or step % cfg.log_every == 0):
                continue
            # Gathering is a sync point, so it happens every log_every steps, not every
            # step: a fast ACCO worker must not idle waiting for a slow one's log line.
            every_rank = comm.meta_all_gather(torch.stack(pending).to(device)).cpu()
            first = step - len(pending) + 1
            records = [step_record(first + i, every_rank[:, i]) for i in range(len(pending))]
            pending.clear()
            if not all(math.isfinite(r["loss"]) for r in records):
                bad = next(r for r in records if not math.isfinite(r["loss"]))
                raise RunError(f"loss became {bad['loss']} at step {bad['step']}; try a lower --lr")
            if evaluate_now:
                with strategy.evaluating() as eval_model:
                    val_loss = evaluate(eval_model, val, comm, device)
                records[-1]["val_loss"] = val_loss
            for record in records:
                totals.add(record)
                if lead:
                    log.write(record)
            loss = records[-1]["loss"]
            if lead:
                elapsed = time.perf_counter() - t_start
                view.update(step, loss, totals.tokens / elapsed, totals.wire / 1e6,
                            totals.exposed / elapsed, records[-1].get("val_loss"))
    finally:
        view.close()
        if log is not None:
            log.close()
    wall = time.perf_counter() - t_start
    strategy.close()

    peak = comm.meta_all_gather(torch.tensor([float(peak_memory_bytes(device))], device=device)).max()
    opt_bytes = strategy.optimizer_state_bytes()
    mine = comm.snapshot()
    slept = strategy.pacer.slept_s if strategy.pacer is not None else 0.0
    link_times = comm.meta_all_gather(torch.tensor(
        [mine.busy_s, mine.emulated_s, slept], dtype=torch.float64, device=device)).cpu()
    events = tracer.gather(comm, device) if tracer is not None else None
    if lead and events is not None:
        write_trace(out_dir / "trace.json", events, {"strategy": cfg.strategy, "workers": world,
                                                     "link": C.to_dict(cfg)["link"]})
    if not lead:
        return None
    summary = {
        "strategy": cfg.strategy,
        "workers": world,
        "backend": backend,
        "steps": cfg.steps,
        "params": model.num_params(),
        "tokens": totals.tokens,
        "final_train_loss": loss,
        "final_val_loss": val_loss,
        "wall_s": wall,
        "tokens_per_s": totals.tokens / wall,
        "wire_bytes_total": totals.wire,
        "wire_bytes_per_step": totals.wire / cfg.steps,
        "wire_bytes_per_rank_per_step": totals.wire / cfg.steps / world,
        "exposed_comm_s": totals.exposed,
        "exposed_comm_fraction": totals.exposed / wall,
        "compute_s_per_rank": totals.compute_per_rank,
        "micro_batches_per_rank": totals.micro_per_rank,
        "optimizer_state_bytes_per_rank": opt_bytes,
        "peak_mem_bytes": int(peak),
        "data": source,
        # -- emulated network and workers (issue 3) --
        "link": ({**C.to_dict(cfg)["link"], **comm.link.describe()} if comm.link is not None else None),
        "slowdown": slowdown,
        "stragglers": {"prob": straggle_p, "factor": straggle_f} if straggle_p > 0 else None,
        "slowdown_sleep_s_per_rank": link_times[:, 2].tolist(),
        "exposed_comm_s_per_rank": totals.exposed_per_rank,
        "exposed_comm_fraction_per_rank": [e / wall for e in totals.exposed_per_rank],
        "comm_s_per_rank": link_times[:, 0].tolist(),
        "comm_emulated_s_per_rank": link_times[:, 1].tolist(),
        # share of communication time (ops in flight, all ranks) that only the emulator added
        "comm_modeled_share": float(link_times[:, 1].sum() / link_times[:, 0].sum())
        if float(link_times[:, 0].sum()) > 0 else 0.0,
        "trace": "trace.json" if tracer is not None else None,
        **strategy.report(),
        "notes": ["wire bytes follow the ring model of ALGORITHMS.md; on gloo a reduce_scatter "
                  "runs as a full all-reduce, so its real transport is twice the counted bytes"]
                 if backend == "gloo" and cfg.strategy != "ddp" else [],
    }
    write_json_atomic(out_dir / "summary.json", summary)
    if not quiet:
        print(describe(summary), flush=True)
    return summary


def strategy_options(cfg: C.RunConfig) -> dict:
    """The config values each strategy takes beyond the common ones."""
    dtype = {"fp32": None, "bf16": torch.bfloat16}[cfg.param_dtype]
    if cfg.strategy == "ddp":
        return {"bucket_mb": cfg.bucket_mb}
    if cfg.strategy == "zero1":
        return {"param_dtype": dtype}
    if cfg.strategy == "acco":
        return {"deterministic": cfg.acco.deterministic, "max_accum": cfg.acco.max_accum or None,
                "param_dtype": dtype}
    if cfg.strategy == "dpu":
        return {"warmup_steps": cfg.dpu.warmup_steps, "param_dtype": dtype}
    return {}


def spawned_entry(rank: int, world: int, cfg: C.RunConfig, store_port: int, out_dir: str | None,
                  quiet: bool) -> None:
    """Entry of a process started by `launch`: join the parent's TCP store, train."""
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    run_rank(cfg, rank, world, rank, Path(out_dir) if out_dir else None, quiet, store)


def run_rank(cfg: C.RunConfig, rank: int, world: int, local_rank: int, out_dir: Path | None,
             quiet: bool, store: dist.Store | None = None) -> None:
    """One rank's life: join the group (through `store`, or torchrun's environment
    when None), train, leave. The device is set before the group exists, as NCCL wants."""
    torch.set_num_threads(cfg.threads)
    backend = pick_backend(cfg)
    device = pick_device(cfg, backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if store is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        train(cfg, rank, world, local_rank, out_dir, quiet)
    finally:
        leave_group()


def leave_group() -> None:
    """Tear the process group down from this thread. Reference cycles that still
    hold c10d works are collected first, while their group is alive: collected
    later, on one of gloo's threads, they can abort the process at exit."""
    gc.collect()
    dist.destroy_process_group()
