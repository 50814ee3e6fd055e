"""Start a run: validate everything first, then spawn W local workers or join torchrun's world.

Nothing touches the output directory until the config and the data have been
checked, so bad input never leaves a half-written run behind.
"""
from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from .. import config as C
from . import rundir
from ..data import check_data
from ..errors import DiskFull, Interrupted, RunError, UsageError
from ..comm.flight import ENV_DIR as FLIGHT_ENV_DIR
from ..diagnose.stalls import StallWatch
from ..config.nodes import default_replicas, under_torchrun
from .resources import check_fits, device_type
from ..storage.files import remove_partial, write_text_atomic
from ..elastic.support import check as check_elastic
from ..strategies import available
from .supervise import run_workers
from ..train.worker import check_model, pick_backend, run_rank, spawned_entry


def prepare(cfg: C.RunConfig, create: bool = True, overwrite: bool = False, resume: bool = False) -> Path:
    """Validate config and data; create the output dir and write config.toml (`resume`: pick
    the checkpoint to continue from in the existing --out instead, checkpoint.prepare_resume).
    Raises UsageError (before writing anything) on bad input."""
    chosen = None
    if under_torchrun():
        cfg.workers = int(os.environ["WORLD_SIZE"])
        # One replica per node, unless --replicas; elastic: the job is one replica (elastic/replicas.py).
        chosen = None if cfg.elastic else default_replicas(cfg, available())
    C.validate(cfg, available())
    check_elastic(cfg)  # the elastic component's own checks, after the config's
    if chosen and os.environ.get("RANK", "0") == "0":
        print(f"lowcomm: {chosen}", flush=True)
    if (note := cfg.strategy_options().run_note(cfg)) and os.environ.get("RANK", "0") == "0":
        print(f"note: {note}", file=sys.stderr, flush=True)
    backend = pick_backend(cfg)
    if (backend == "nccl" or cfg.device == "cuda") and not torch.cuda.is_available():
        raise UsageError(f"backend '{backend}' on device '{cfg.device}' needs CUDA, and no GPU is visible")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and cfg.local_workers > gpus:
        raise UsageError(f"--backend nccl takes a GPU per worker: {cfg.local_workers} workers on {gpus} GPU(s) "
                         f"here; use --backend gloo (--device cuda to share the GPUs) or at most {gpus} --workers")
    if cfg.backend == "auto" and cfg.device == "auto" and backend == "gloo" and gpus and os.environ.get("RANK", "0") == "0":
        print(f"note: {cfg.local_workers} workers on {gpus} GPU(s): NCCL takes a GPU per worker, so they run gloo "
              f"on the CPU (--backend gloo --device cuda shares the GPUs)", file=sys.stderr, flush=True)
    check_fits(cfg, device_type(cfg))
    check_model(cfg)
    if cfg.tensorboard or cfg.wandb:  # optional packages: missing, the run is refused before it starts
        from ..metrics.scalars import require
        require(cfg)
    cfg.data.vocab_size = check_data(cfg.data.source, cfg.data.vocab_size, cfg.data.val_fraction, cfg.model.seq_len,
                                     cfg.workers, quiet=os.environ.get("RANK", "0") != "0")
    default = not cfg.out
    if cfg.elastic and not default and under_torchrun() and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return Path(cfg.out)  # a replica torchrun restarted: it rejoins with the live state, not a checkpoint
    if resume:
        from ..checkpoint import prepare_resume
        out = prepare_resume(cfg, create)
        if out is not None:
            return out
        overwrite = True  # a torchrun restart before the first checkpoint: the run starts over
    out = Path(cfg.out or rundir.default_name(cfg.strategy, cfg.workers))
    rundir.check(out, overwrite, default)
    if create:
        fresh = default or not out.exists()
        out = rundir.create(out, overwrite, default)
        cfg.out = str(out)
        try:  # atomic: an empty or half config.toml would make the directory look like a run
            write_text_atomic(out / "config.toml", C.to_toml(cfg))
        except BaseException:
            if fresh:  # the directory is this run's alone: leave nothing behind
                shutil.rmtree(out, ignore_errors=True)
            raise
    return out


def launch(cfg: C.RunConfig, out: Path | None, quiet: bool = False) -> str | None:
    """Run training on cfg.workers local processes, or as one rank of torchrun's world. Returns
    where the records are when that may not be `out` ('HOST:PATH' of steps.jsonl, see results_line)."""
    if under_torchrun() and cfg.elastic:  # this job is one replica of an elastic run
        from ..train.replica_run import run_job
        return run_job(cfg, out, quiet)
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        run_rank(cfg, rank, world, local_rank, out if rank == 0 else None, quiet)
        return

    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.threads))
    if cfg.elastic:  # survivors go on; dead workers rejoin (lowcomm/elastic)
        from .elastic import launch_elastic
        launch_elastic(cfg, out, quiet)
        return
    # --max-restarts: a failed attempt is relaunched, all workers, from the last good checkpoint.
    for attempt in range(cfg.max_restarts + 1):
        os.environ["LOWCOMM_ATTEMPT"] = str(attempt)
        # The parent hosts the rendezvous store on a free port the OS picks: no port races.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        with flight_rings() as rings:
            stalls = StallWatch(rings, cfg.workers, quiet)  # stalled collectives flagged as they happen
            try:
                run_workers(spawned_entry, (cfg.workers, cfg, store.port, str(out) if out else None, quiet),
                            cfg.workers, ask_first=cfg.checkpoint_on_signal, watch=stalls.poll)
                return
            except Interrupted as e:
                explain_failure(e, rings, cfg, out)
                raise
            except RunError as e:
                if out is not None:  # a checkpoint half-written, a temporary file: they may fill the disk
                    remove_partial(out)
                final = attempt == cfg.max_restarts or out is None or isinstance(e, DiskFull)  # a relaunch onto a full disk would fill it again
                explain_failure(e, rings, cfg, out, annotate=final)  # a restarted run's line stays as it was
                if final:
                    raise
                from ..checkpoint import restart_from
                restart_from(cfg, out, e, attempt + 1)
            finally:
                stalls.close()
                del store
                os.environ.pop("LOWCOMM_ATTEMPT", None)


def results_line(out: Path, records: str | None) -> str:
    """The run's last line: where its results are. Under torchrun each job of an elastic run has
    its own --out, and the records (steps.jsonl, summary.json) are in the --out of the job that
    led the last quorum (`records`, 'HOST:PATH' of its steps.jsonl): this job's may hold only its config."""
    if records:
        host, _, path = records.partition(":")
        folder = Path(path).parent
        if folder != Path(out).resolve() or host != socket.gethostname():
            return (f"lowcomm: the run's records are in {folder} on {host} (the --out of the job that led it "
                    f"at its end); this job's {out} holds its config.toml")
    return f"lowcomm: results in {out}"


STUCK_S = 10.0  # an interrupted run whose collective had waited this long was hung, not just busy


@contextmanager
def flight_rings():
    """A fresh directory for the workers' flight recorders (comm/flight.py), named to the workers
    through the environment while the run lasts (a plain attempt's, or an elastic run's), then removed."""
    rings = os.environ[FLIGHT_ENV_DIR] = ring_dir()
    try:
        yield rings
    finally:
        os.environ.pop(FLIGHT_ENV_DIR, None)
        shutil.rmtree(rings, ignore_errors=True)


def ring_dir() -> str:
    """A fresh directory for the workers' rings: in shared memory where the host has it, as the
    rings are written on every collective and only read after a failure."""
    shm = "/dev/shm"
    return tempfile.mkdtemp(prefix="lowcomm-flight-",
                            dir=shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None)


def explain_failure(error: RunError | Interrupted, rings: str, cfg: C.RunConfig, out: Path | None,
                    annotate: bool = True) -> None:
    """Write every rank's flight record (and with --trace the trace of their last events) to the
    run directory, and put the stuck rank and its collective at the head of the error's one line
    when a rank alive but stuck caused it (a dead rank's own failure says more: it stays first)."""
    from ..diagnose.postmortem import record_failure

    if out is None:
        return
    try:
        where, stall = record_failure(rings, out, cfg.workers, cfg.trace, getattr(error, "at", None),
                                      {"strategy": cfg.strategy, "workers": cfg.workers})
    except OSError:  # the run's own error is the one to report
        return
    if where is None or not annotate:
        return
    message, note = str(error), f"flight records in {where}"
    if stall is not None and isinstance(error, RunError) and not set(stall.culprits) & set(getattr(error, "exit_codes", {})):
        message = f"{stall.line()} ({message}; {note})"
    elif stall is not None and isinstance(error, Interrupted) and stall.waited_s >= STUCK_S:
        message = f"{message}; {stall.line()} ({note})"
    else:
        message = f"{message} ({note})"
    error.args = (message,)
