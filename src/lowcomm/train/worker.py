"""One worker's life: join the group, build model, data and strategy, train, report."""
from __future__ import annotations

import gc
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from .. import config as C
from . import run_end
from ..comm import Comm
from ..comm.groups import ReplicaLayout
from ..data import load_tokens, val_batches
from ..errors import RunError
from ..storage.files import disk_full, first_failure
from .outputs import StepOutputs
from ..comm.flight import FlightRecorder
from ..diagnose.trace import Tracer
from .member_data import plain_loader
from ..models import build_run_model
from ..models.layout import meta_layout
from ..config.nodes import numbering_problem, under_torchrun
from .assemble import Seat, Trainer, build_trainer
from .loop import FixedMembers, LoopResult, Progress, evaluate, loop  # noqa: F401 (evaluate: callers import it here)


START_TIMEOUT_S = 300.0  # collectives before training starts: ranks may start minutes apart


def pick_backend(cfg: C.RunConfig) -> str:
    """--backend auto: nccl where each of this machine's workers has a GPU of its own (NCCL takes
    one GPU a rank: two ranks on one fail with "Duplicate GPU detected"), else gloo."""
    if cfg.backend != "auto":
        return cfg.backend
    if cfg.device == "cpu" or not (torch.cuda.is_available() and dist.is_nccl_available()):
        return "gloo"
    return "nccl" if cfg.local_workers <= torch.cuda.device_count() else "gloo"


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


def check_numbering(comm: Comm, layout: ReplicaLayout, by_node: bool, device: torch.device,
                    env: Mapping[str, str] = os.environ) -> None:
    """Collective over the world, before any replica group is formed: every rank must have
    chosen the same replica count (a node with another --nproc-per-node would not), and with
    one replica per node (`by_node`) each rank's replica and position must be its node
    (GROUP_RANK) and local rank (config/nodes.py's numbering_problem). Raises RunError on every
    rank alike, so none waits forever in a group the others never form."""
    mine = torch.tensor([layout.replicas, int(env.get("GROUP_RANK", "-1")), int(env.get("LOCAL_RANK", "-1"))],
                        dtype=torch.float64, device=device)
    every = comm.meta_all_gather(mine).cpu().long().tolist()
    problem = numbering_problem(layout, every, by_node)
    if problem:
        raise RunError(problem)


def check_model(cfg: C.RunConfig) -> None:
    """Build the model on the meta device (no memory, no compute) so a bad architecture or
    dimensions, or a strategy option this model cannot honour, fail as a usage error before
    any worker starts or any file is written."""
    layout = meta_layout(lambda: build_run_model(cfg, torch.device("meta")))
    cfg.strategy_options().check_model(layout)


def build(cfg: C.RunConfig, rank: int, world: int, local_rank: int) -> Trainer:
    """A plain run's rank (group already initialised): its seat in the world, θ0 built and checked
    alike on every rank, its shard of the data (assemble.build_trainer)."""
    backend = dist.get_backend()
    device = pick_device(cfg, backend, local_rank)
    mem_before = run_end.peak_memory_bytes(device)
    # the world: a flat run's one level, else bookkeeping beside the replica groups
    seat = Seat(rank, ReplicaLayout(world, cfg.replicas or world), rank)
    # under torchrun every rank's replica count agreed, and a node per replica where the nodes chose it
    numbering = (lambda comm: check_numbering(comm, seat.layout, cfg.replicas_by_node, device)) if under_torchrun() else None

    def data():  # this rank's draws of the run's stream (its shard's), its share of the validation windows
        tokens = load_tokens(cfg.data.source, cfg.data.val_fraction, cfg.data.vocab_size, quiet=rank != 0)
        val = val_batches(tokens.val, rank, world, cfg.model.seq_len, cfg.micro_batch, cfg.eval_batches)
        return plain_loader(cfg, tokens.train, seat.layout, rank), val, tokens.label
    # the flight recorder always on (the last events, for a post-mortem)
    return build_trainer(cfg, seat, device, backend, lambda: build_run_model(cfg, device), data, FlightRecorder.for_rank(rank),
                         Tracer(rank) if cfg.trace else None, check=verify_identical_params, before_groups=numbering,
                         mem_before=mem_before)


def announce(t: Trainer) -> None:
    cfg = t.cfg
    print(f"lowcomm: {cfg.strategy} on {t.world} worker(s) ({t.backend}), "
          f"{model_name(cfg)} {num_params(t.model) / 1e6:.2f}M params, data {t.source}"
          + (f", {cfg.precision} autocast" if cfg.precision != "fp32" else "")
          + (f", resumed after step {t.step}" if cfg.resume_from else ""), flush=True)


def train(cfg: C.RunConfig, rank: int, world: int, local_rank: int, out_dir: Path | None,
          quiet: bool = False) -> dict | None:
    """Train with an initialised process group. Returns the summary on rank 0."""
    t = build(cfg, rank, world, local_rank)
    try:
        if cfg.resume_from:
            from .. import checkpoint
            t.wall_before = checkpoint.load(t, checkpoint.read(Path(cfg.resume_from))).get("wall_s", 0.0)
        result = run_plain(t, out_dir, quiet)
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
        run_end.stop(t, out_dir)
        return None
    return run_end.finish(t, result, out_dir, quiet)


def run_plain(t: Trainer, out_dir: Path | None, quiet: bool) -> LoopResult:
    """The training loop (loop.py) with a plain run's fixed membership and rank 0's outputs."""
    outputs = StepOutputs(t, out_dir, quiet)
    if outputs.lead and not quiet:
        announce(t)
    totals, loss, val_loss = outputs.kept_totals(t.world)
    progress = Progress(totals, loss, val_loss, t_start=time.perf_counter() - t.wall_before)
    return loop(t, outputs, FixedMembers(t.cfg), progress)


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
    ask_checkpoint_on_sigterm(cfg)
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


def ask_checkpoint_on_sigterm(cfg: C.RunConfig) -> None:
    """--checkpoint-on-signal: SIGTERM (from lowcomm's launcher, torchrun or a batch scheduler)
    asks for a checkpoint at the next gather the ranks agree on (an elastic run's: its next
    commit point), then a clean stop; SIGKILL still ends it at once."""
    if cfg.checkpoint_on_signal and threading.current_thread() is threading.main_thread():
        from ..checkpoint import request
        signal.signal(signal.SIGTERM, lambda _s, _f: request(stop=True))


def start_timeout(cfg: C.RunConfig) -> timedelta:
    return timedelta(seconds=max(cfg.timeout, START_TIMEOUT_S))


def leave_group() -> None:
    """Tear the process group down from this thread. Reference cycles that still
    hold c10d works are collected first, while their group is alive: collected
    later, on one of gloo's threads, they can abort the process at exit."""
    gc.collect()
    dist.destroy_process_group()
