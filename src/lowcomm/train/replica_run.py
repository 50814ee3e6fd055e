"""The entries of an elastic run's processes: a worker the launcher starts (`elastic_entry`), and a
torchrun job (or a launcher's slot of K processes) as one replica of an elastic run (replicas.py). The run on each quorum's group is assembled as a plain run's is
(assemble.py, from ElasticWorker._build), with the replica machinery of a plain run (for every
elastic run: a flat one's workers are replicas of one process).

On a quorum of R replicas of K processes the world is R·K ranks, numbered replica by replica,
which is comm/groups.py's ReplicaLayout(R·K, R): so the groups, the strategy across replicas on
the cross groups and `--inside ddp` inside each replica are exactly a plain `--replicas R` run's.
Each process reads the data a plain run's process at its replica and position would
(View.shard); the state at a commit point is 1/K of the optimizer state a process, so a replica
behind takes it position by position from a replica at the newest step (transfer.heal over the
cross group of its position).
"""
from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ..elastic import support
from ..elastic.address import parse_lighthouse

RESTARTED = "TORCHELASTIC_RESTART_COUNT"


def restart_count() -> int:
    return int(os.environ.get(RESTARTED) or 0)


def run_job(cfg, out: Path | None, quiet: bool) -> str | None:
    """This process's life in a torchrun job that is one replica of an elastic run. Returns where
    the run's records are ('HOST:PATH' of steps.jsonl): the --out of the job that led the last quorum."""
    local, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=300)))
    job = dist.PrefixStore(f"lowcomm/replica/{restart_count()}/", store)  # the agent's store outlives a restart
    # a restarted job (torchrun --max-restarts) comes back as a joiner
    return run_replica(cfg, local, size, job, parse_lighthouse(cfg.lighthouse), out, quiet, restart_count() > 0,
                       local).lead_log


def slot_entry(local: int, slot: int, cfg, store_port: int, lighthouse: str, out_dir: str | None, quiet: bool,
               joining: bool, attempt: int, store_host: str = "127.0.0.1") -> None:
    """Entry of a process of a replica slot that the launcher started (`lowcomm train --elastic
    --replicas R`), or `lowcomm join` (launch/join_replica.py, from the store's `store_host`): the
    launcher's store is the replica's job store, under this launch's prefix."""
    size = cfg.workers // cfg.replicas
    store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timedelta(seconds=300))
    job = slot_store(store, slot, attempt)
    run_replica(cfg, local, size, job, lighthouse, Path(out_dir) if out_dir else None, quiet, joining,
                slot * size + local, name=f"{slot:05d}")


def slot_store(store: dist.Store, slot: int, attempt: int) -> dist.Store:
    """A launch of a replica slot's job store, on the launcher's store (its process 0 puts its
    replica id there: ReplicaLeader)."""
    return dist.PrefixStore(f"lowcomm/elastic/slot{slot}.{attempt}/", store)


def run_replica(cfg, local: int, size: int, job: dist.Store, lighthouse: str, out: Path | None, quiet: bool,
                joining: bool, fault_rank: int, name: str | None = None):
    """Process `local` of a replica of `size`: its rank 0 the member at the lighthouse (ids sort by
    `name`, else by start time), the others told each quorum through `job`."""
    from .elastic import run_elastic
    from .worker import ask_checkpoint_on_sigterm
    from ..elastic.replicas import MatesWatch, ReplicaLeader, ReplicaPeer

    timeout = support.member_timeout(cfg)
    m = (ReplicaLeader(lighthouse, job, size, timeout, support.min_workers(cfg), name, cfg.quorum_timeout) if local == 0
         else ReplicaPeer(job, local, timeout))
    watch = MatesWatch(job, local, size, timeout, m.alive)
    ask_checkpoint_on_sigterm(cfg)
    try:
        return run_elastic(cfg, fault_rank, m, out, quiet, joining)
    finally:
        watch.done()
        m.close()


def elastic_entry(_i: int, slot: int, cfg, store_port: int, lighthouse_address: str, out_dir: str | None,
                  quiet: bool, joining: bool) -> None:
    """Entry of an elastic worker the launcher started (or restarted, `joining`): one process a replica."""
    from .elastic import run_elastic
    from .worker import ask_checkpoint_on_sigterm
    from ..elastic.membership import Membership

    m = Membership(lighthouse_address, "127.0.0.1", store_port, slot, support.member_timeout(cfg),
                   speaks=slot == 0, quorum_timeout_s=cfg.quorum_timeout)  # speaks: one line, not one a worker
    ask_checkpoint_on_sigterm(cfg)
    try:
        run_elastic(cfg, slot, m, Path(out_dir) if out_dir else None, quiet, joining)
    finally:
        m.close()
