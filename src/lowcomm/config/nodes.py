"""One replica per node under torchrun: the default --replicas there, and the check that
torchrun's rank numbering fits it.

Across nodes the slow link is between the nodes, so a node is the natural replica: its
processes average gradients over the node's fast links (--inside), the strategy runs
across nodes. torchrun numbers ranks node by node (node n's LOCAL_WORLD_SIZE processes are
ranks n·K .. n·K + K−1, GROUP_RANK = n), which is ReplicaLayout's numbering with K = the
processes per node, so replica r is node r. `--replicas W` still asks for one replica per
process; a strategy that cannot run across replicas stays flat, and the start-up line says so.
"""
from __future__ import annotations

import copy
import os
from typing import Mapping

from .. import config as C
from ..comm.groups import ReplicaLayout
from ..errors import UsageError


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def per_replica(cfg: C.RunConfig) -> int:
    """Processes a replica (K): W/R, 1 in a flat run. Under torchrun an elastic run's job is one
    replica of its WORLD_SIZE processes (cfg.workers there: launcher.prepare)."""
    if cfg.elastic and under_torchrun():
        return cfg.workers
    return cfg.workers // (cfg.replicas or cfg.workers)


def node_shape(env: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """(nodes, processes per node) of a torchrun world spanning more than one node, else None.
    None too when the world is not a whole number of equal nodes (no replica per node then)."""
    world, per_node = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", "0") or 0)
    if per_node <= 0 or per_node >= world or world % per_node:
        return None
    return world // per_node, per_node


def default_replicas(cfg: C.RunConfig, strategies: list[str], env: Mapping[str, str] = os.environ) -> str | None:
    """Under torchrun with --replicas not given (0) and more than one node: one replica per node
    (cfg.replicas set) when the run allows it, else one per process. Returns the line that says
    which (None: nothing was decided here). cfg.workers must already be the world size."""
    if cfg.replicas:
        return None  # given: --replicas W is one per process, as asked
    shape = node_shape(env)
    if shape is None:
        per_node = int(env.get("LOCAL_WORLD_SIZE", "0") or 0)
        if 0 < per_node < cfg.workers:  # several nodes, but not all of one size
            return (f"replicas: {cfg.workers}, one per process (the world of {cfg.workers} is not a whole number "
                    f"of nodes of {per_node} processes)")
        return None
    nodes, per_node = shape
    trial = copy.deepcopy(cfg)  # validate() resolves options in place: try it on a copy
    trial.replicas = nodes
    try:
        C.validate(trial, strategies)
    except UsageError as e:
        return f"replicas: {cfg.workers}, one per process ({_why_flat(cfg, nodes, per_node, e)})"
    cfg.replicas, cfg.replicas_by_node = nodes, True
    return f"replicas: {nodes} nodes x {per_node} processes (--replicas {cfg.workers} for one per process)"


def _why_flat(cfg: C.RunConfig, nodes: int, per_node: int, refused: UsageError) -> str:
    from ..strategies import registry
    if not registry.get(cfg.strategy).runs_inside(cfg.inside):
        return (f"strategy '{cfg.strategy}' does not run across replicas; one per node, {nodes} x {per_node}, "
                f"needs one that does")
    return f"one per node, {nodes} x {per_node}, does not fit: {refused}"


def numbering_problem(layout: ReplicaLayout, every: list[list[int]], by_node: bool) -> str | None:
    """What is wrong with the ranks' [replicas, node, local rank] for `layout`, or None (the ranks'
    rows gathered where the run starts: train/worker.py's check_numbering)."""
    counts = sorted({r for r, _, _ in every})
    if len(counts) > 1:
        return (f"the ranks chose different replica counts ({', '.join(map(str, counts))}): give every node "
                f"the same --nproc-per-node, or pass --replicas")
    if by_node:
        for rank, (_, node, local) in enumerate(every):
            if (node, local) != (layout.replica(rank), layout.position(rank)):
                return (f"rank {rank} is process {local} of node {node}, but one replica per node puts it at "
                        f"position {layout.position(rank)} of replica {layout.replica(rank)}: torchrun did not "
                        f"number the ranks node by node; pass --replicas")
    return None
