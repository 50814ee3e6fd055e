"""One worker's life: join the group, build model, data and strategy, train, report."""
from __future__ import annotations

import gc
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .. import config as C
from . import faults, run_end
from ..comm import Comm
from ..comm.groups import ReplicaLayout
from ..data import VOCAB_SIZE, load_bytes, split, val_batches
from ..errors import RunError
from ..checkpoint.storage import disk_full, first_failure
from ..metrics.summary import Totals
from ..checkpoint import take_request as take_checkpoint_request
from .outputs import StepOutputs
from ..metrics.runlog import result_vector, step_record
from ..comm.flight import FlightRecorder, recorded
from ..diagnose.flight_cost import alternate
from ..diagnose.trace import Tracer
from ..data.loader import ShardedBatches
from ..models import GPT, build_hf_causal_lm, lm_loss
from ..models.layout import meta_layout
from .optim import adamw_factory, lr_schedule
from ..config.nodes import check_numbering, under_torchrun
from ..run.build import build as build_run, replica_groups, world_comm
from ..run.driver import RunDriver, make_pacer


START_TIMEOUT_S = 300.0  # collectives before training starts: ranks may start minutes apart


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
    # Tensor by tensor: a float64 copy of the whole model (and its weights) would be the run's
    # memory high-water mark at start-up, above what training itself holds.
    mine, offset = torch.zeros(2, dtype=torch.float64), 0
    for p in model.parameters():
        x = p.detach().reshape(-1).double().cpu()
        weights = torch.arange(offset + 1, offset + x.numel() + 1, dtype=torch.float64).remainder_(1009)
        mine += torch.stack([x.sum(), (x * weights).sum()])
        offset += x.numel()
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


def build_model(cfg: C.RunConfig, device: torch.device) -> torch.nn.Module:
    """lowcomm's GPT, or a transformers causal LM built from its config (`--model hf:<arch>`)."""
    torch.manual_seed(cfg.seed)
    n_layer, n_head, d_model = cfg.model.dims()
    if cfg.model.hf_architecture is not None:
        model = build_hf_causal_lm(cfg.model.hf_architecture, vocab_size=VOCAB_SIZE, seq_len=cfg.model.seq_len,
                                   n_layer=n_layer, n_head=n_head, d_model=d_model)
    else:
        model = GPT(VOCAB_SIZE, cfg.model.seq_len, n_layer, n_head, d_model)
    return model.to(device)


def check_model(cfg: C.RunConfig) -> None:
    """Build the model on the meta device (no memory, no compute) so a bad architecture or
    dimensions, or a strategy option this model cannot honour, fail as a usage error before
    any worker starts or any file is written."""
    layout = meta_layout(lambda: build_model(cfg, torch.device("meta")))
    cfg.strategy_options().check_model(layout)


@dataclass
class Trainer:
    """Everything one rank trains with, built once by `build`."""
    cfg: C.RunConfig
    rank: int
    world: int
    device: torch.device
    backend: str
    comm: Comm
    model: torch.nn.Module
    run: RunDriver
    loader: ShardedBatches
    val: list
    source: str
    tracer: Tracer | None
    flight: FlightRecorder | None  # None only when bench/always_on.py measures a run without it
    mem_before: int = 0  # peak memory before the model was built (the runtime's own: torch, the groups)
    step: int = 0  # trainer steps done
    wall_before: float = 0.0  # wall seconds of the run's earlier parts (a resumed run)

    def next_batch(self):
        x, y = self.loader.next()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def state_dict(self) -> dict:
        """The whole trainer-level state at a step boundary: the strategy's (parameters,
        optimizer, buffers), the data loader's reading position and the RNG states."""
        return {"step": self.step, "strategy": self.run.state_dict(),
                "loader": self.loader.state_dict(), "rng": _rng_state(self.device)}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]
        self.run.load_state_dict(sd["strategy"])
        self.loader.load_state_dict(sd["loader"])
        _set_rng_state(sd["rng"], self.device)


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def build(cfg: C.RunConfig, rank: int, world: int, local_rank: int) -> Trainer:
    """Model, data, strategy, emulation and tracing of one rank (group already initialised)."""
    backend = dist.get_backend()
    device = pick_device(cfg, backend, local_rank)
    mem_before = run_end.peak_memory_bytes(device)
    layout = ReplicaLayout(world, cfg.replicas or world)  # the world: a flat run's one level, else bookkeeping
    link, intra_link = C.link_factories(cfg)
    comm = world_comm(layout, rank, cfg.seed, link)
    flight = comm.flight = FlightRecorder.for_rank(rank)  # always on: the last events, for a post-mortem
    if under_torchrun():  # every rank's replica count agreed, and a node per replica where the nodes chose it
        check_numbering(comm, layout, cfg.replicas_by_node, device)
    levels = replica_groups(layout, rank, cfg.seed, link, intra_link)
    model = build_model(cfg, device)
    verify_identical_params(model, comm)

    tokens, source = load_bytes(cfg.data.source, quiet=rank != 0)
    train_tokens, val_tokens = split(tokens, cfg.data.val_fraction)
    loader = ShardedBatches(train_tokens, layout.replica(rank), layout.replicas, cfg.model.seq_len,
                            cfg.loader_micro_batch, cfg.seed, layout.position(rank), layout.size)
    val = val_batches(val_tokens, rank, world, cfg.model.seq_len, cfg.micro_batch, cfg.eval_batches)

    pacer = make_pacer(rank, world, cfg.slowdown[rank] if cfg.slowdown else 1.0, cfg.stragglers, cfg.seed)
    run = build_run(cfg.strategy, model, adamw_factory(cfg.optim), comm, levels, accum=cfg.accum,
                    schedule=lr_schedule(cfg.optim, cfg.steps), total_steps=cfg.steps, pacer=pacer,
                    options=cfg.strategy_options(),  # resolved and validated once, at launch
                    inside=cfg.inside)
    for c in run.levels:
        c.flight = flight
    for opt in run.optimizers() if flight is not None else ():
        flight.watch_optimizer(opt)
    tracer = Tracer(rank) if cfg.trace else None
    if tracer is not None:
        for opt in run.optimizers():
            tracer.watch_optimizer(opt)
        tracer.align(comm, device)
        for c in {id(c): c for c in [comm, *run.levels]}.values():
            c.tracer = tracer
    run = alternate(faults.inject(run, rank), flight, [comm, *run.levels], cfg.out, rank)  # test faults; bench switch
    return Trainer(cfg, rank, world, device, backend, comm, model, run, loader, val, source, tracer, flight,
                   mem_before=mem_before)


@dataclass
class LoopResult:
    totals: Totals
    train_loss: float
    val_loss: float
    wall_s: float
    stopped: bool = False  # ended before cfg.steps (--stop-at, or a stop asked for): no summary yet


def loop(t: Trainer, out_dir: Path | None, quiet: bool) -> LoopResult:
    """Train up to cfg.steps (or --stop-at) steps; rank 0 logs every step and shows progress.
    Checkpoints (every --checkpoint-every steps, at the end, at --stop-at, or when asked
    through checkpoint.request()) are written at log gathers, after the steps' records."""
    cfg, run = t.cfg, t.run
    outputs = StepOutputs(t, out_dir, quiet)
    if outputs.lead and not quiet:
        announce(t)
    totals, loss, val_loss = outputs.kept_totals(t.world)
    end = min(cfg.stop_at, cfg.steps) if cfg.stop_at else cfg.steps
    every = cfg.checkpoint_every
    if (every or cfg.stop_at or cfg.checkpoint_on_signal) and not cfg.out:
        raise RunError("checkpoints need the output directory on every rank: pass --out (under torchrun too)")
    bad_in_row, stopped = 0, False
    # Start the clocks together: a rank that finished set-up early must not count
    # its wait for the others in step 1 as exposed communication.
    t.comm.barrier()
    use_training_timeout(cfg)
    t_start = time.perf_counter() - t.wall_before
    pending: list[torch.Tensor] = []  # this rank's results not yet gathered
    try:
        while t.step < end:
            pending.append(result_vector(run.step(t.next_batch, lm_loss)))
            t.step += 1
            step = t.step
            evaluate_now = (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps
            checkpoint_now = bool(every and step % every == 0) or (step == end and bool(every or cfg.stop_at))
            if not (evaluate_now or checkpoint_now or step == end or step % cfg.log_every == 0):
                continue
            records, asked, stop_asked = gather_records(t, pending)
            bad_in_row = check_steps(records, bad_in_row, cfg.max_bad_steps, outputs.lead, outputs.log)
            if evaluate_now:
                with recorded(t.flight, "evaluate"), run.evaluating() as eval_model:
                    val_loss = records[-1]["val_loss"] = evaluate(eval_model, t.val, t.comm, t.device)
            outputs.write(records, totals)
            loss = records[-1]["loss"]
            if checkpoint_now or asked:
                from ..checkpoint import save
                with recorded(t.flight, "checkpoint"):
                    save(t, Path(cfg.out), cfg.keep, wall_s=time.perf_counter() - t_start)
            outputs.show(step, totals, records[-1], time.perf_counter() - t_start)
            if stop_asked and step < cfg.steps:
                stopped = True
                break
    finally:
        outputs.close()
    stopped = stopped or t.step < cfg.steps
    if outputs.lead and stopped and not quiet:
        print(f"lowcomm: stopped after step {t.step} of {cfg.steps} with a checkpoint; continue with: "
              f"lowcomm train --resume {cfg.out}", flush=True)
    return LoopResult(totals, loss, val_loss, time.perf_counter() - t_start, stopped)


def announce(t: Trainer) -> None:
    cfg = t.cfg
    print(f"lowcomm: {cfg.strategy} on {t.world} worker(s) ({t.backend}), "
          f"{model_name(cfg)} {num_params(t.model) / 1e6:.2f}M params, data {t.source}"
          + (f", resumed after step {t.step}" if cfg.resume_from else ""), flush=True)


def gather_records(t: Trainer, pending: list[torch.Tensor]) -> tuple[list[dict], bool, bool]:
    """Every rank's results of the steps since the last gather, merged into step records;
    with them every rank's checkpoint and stop requests, so all ranks agree on them.
    Gathering is a sync point, so it happens every --log-every steps, not every step: a fast
    worker of an adaptive strategy must not idle waiting for a slow one's log line."""
    flags = torch.zeros(len(pending[0]), dtype=torch.float64)
    flags[0], flags[1] = take_checkpoint_request()
    every_rank = t.comm.meta_all_gather(torch.stack(pending + [flags]).to(t.device)).cpu()
    asked, stop_asked = (bool(every_rank[:, -1, i].any()) for i in (0, 1))
    first = t.step - len(pending) + 1
    leveled = len(t.run.levels) > 1
    records = [step_record(first + i, every_rank[:, i], leveled) for i in range(len(pending))]
    pending.clear()
    return records, asked, stop_asked


def check_steps(records: list[dict], bad_in_row: int, max_bad: int, lead: bool, log) -> int:
    """Bad steps -- skipped by the strategy, or with a non-finite loss (an overlapped strategy
    skips the update that carries that loss's gradient a step later) -- are reported on stderr;
    --max-bad-steps of them in a row stop the run. Every rank sees the same gathered records,
    so all stop at the same step. Returns the new count of consecutive bad steps."""
    for i, r in enumerate(records):
        if not (r.get("skipped_ranks") or not math.isfinite(r["loss"])):
            bad_in_row = 0
            continue
        bad_in_row += 1
        if lead:
            what = (f"skipped (non-finite loss or gradient on rank(s) {', '.join(map(str, r['skipped_ranks']))})"
                    if r.get("skipped_ranks") else f"had loss {r['loss']}")
            print(f"warning: step {r['step']} {what}", file=sys.stderr, flush=True)
        if bad_in_row >= max_bad:
            if lead:  # the log shows the steps up to the stop
                for done in records[:i + 1]:
                    log.write(done)
            raise RunError(f"{bad_in_row} consecutive steps had a non-finite loss or gradient (the last at "
                           f"step {r['step']}; --max-bad-steps {max_bad}); try a lower --lr")
    return bad_in_row


def train(cfg: C.RunConfig, rank: int, world: int, local_rank: int, out_dir: Path | None,
          quiet: bool = False) -> dict | None:
    """Train with an initialised process group. Returns the summary on rank 0."""
    t = build(cfg, rank, world, local_rank)
    try:
        if cfg.resume_from:
            from .. import checkpoint
            t.wall_before = checkpoint.load(t, checkpoint.read(Path(cfg.resume_from))).get("wall_s", 0.0)
        result = loop(t, out_dir, quiet)
    except BaseException:
        t.run.release()  # no communication thread left behind; no collective, a peer may be gone
        if t.flight is not None and not t.flight.shared and cfg.out:  # no launcher to read it (torchrun)
            from ..diagnose.postmortem import write_own
            try:
                write_own(t.flight, Path(cfg.out))
            except OSError:  # the run's own error is the one to report
                pass
        raise
    if result.stopped:  # a part of a run: summary.json is written by the part that reaches cfg.steps
        t.run.release()
        run_end.gather_trace(t, out_dir, stopped_after_step=t.step)
        return None
    t.run.close()  # collective: every rank ends on the same final parameters
    return run_end.summarize(t, result, out_dir, quiet)


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def model_name(cfg: C.RunConfig) -> str:
    return f"{cfg.model.hf_architecture} (transformers)" if cfg.model.hf_architecture else "GPT"


def spawned_entry(rank: int, world: int, cfg: C.RunConfig, store_port: int, out_dir: str | None,
                  quiet: bool) -> None:
    """Entry of a process started by `launch`: join the parent's TCP store, train."""
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=start_timeout(cfg))
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
    if cfg.checkpoint_on_signal and threading.current_thread() is threading.main_thread():
        # SIGTERM (from lowcomm's launcher, torchrun or a batch scheduler) asks for a checkpoint at
        # the next step boundary the ranks agree on, then a clean stop; SIGKILL still ends it at once.
        from ..checkpoint import request
        signal.signal(signal.SIGTERM, lambda _s, _f: request(stop=True))
    # Start-up (imports, model, data, a checkpoint to load) may take the ranks unequal
    # times, so collectives get a long timeout until training starts (see loop).
    if store is None:
        dist.init_process_group(backend, timeout=start_timeout(cfg))
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=start_timeout(cfg))
    try:
        train(cfg, rank, world, local_rank, out_dir, quiet)
    except Exception as e:  # its own line names what failed (checkpoint.save names the checkpoint)
        if isinstance(e, RuntimeError) and ("timed out" in str(e).lower() or "timeout" in str(e).lower()):
            raise RunError(f"a collective timed out after {cfg.timeout:g} s (--timeout): "
                           f"a peer stopped responding") from e
        raise disk_full(e) or e
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException: one line, not a raw dump
        raise disk_full(e) or RunError(first_failure(e)) from e
    finally:
        leave_group()


def start_timeout(cfg: C.RunConfig) -> timedelta:
    return timedelta(seconds=max(cfg.timeout, START_TIMEOUT_S))


def use_training_timeout(cfg: C.RunConfig) -> None:
    """From here on every collective fails after --timeout s (gloo and NCCL honour the
    group's timeout per op): a peer alive but stuck ends the run instead of hanging it.
    As torchtitan does after its first step, with torch's setter for the group's timeout."""
    from torch.distributed.distributed_c10d import _set_pg_timeout
    _set_pg_timeout(timedelta(seconds=cfg.timeout))


def leave_group() -> None:
    """Tear the process group down from this thread. Reference cycles that still
    hold c10d works are collected first, while their group is alive: collected
    later, on one of gloo's threads, they can abort the process at exit."""
    gc.collect()
    dist.destroy_process_group()
