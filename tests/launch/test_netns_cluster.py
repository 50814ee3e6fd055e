"""A two-node cluster on one machine: two network namespaces joined by a veth
pair, `torchrun --nnodes 2 --rdzv-backend c10d` started once in each, training
across them. lowcomm only joins the world torchrun made (nodes.under_torchrun);
the nodes can reach each other only over the veth, whose byte counters must show
the training traffic. With one process per node, `ddp` and `zero1` run flat; with
two, each node is one replica by default (nodes.default_replicas) and only the
cross-replica traffic has to cross the veth.

The namespace tests need root (CI runs as root) and skip with the reason elsewhere;
the default-replica rule's unit tests below run anywhere.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from validate_link import ADDR, netns_unavailable, two_namespaces  # noqa: E402

REASON = netns_unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"two-node cluster: {REASON}")

TRAIN = ["--steps", "3", "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32",
         "--micro-batch", "4", "--eval-every", "0", "--eval-batches", "1", "--log-every", "1", "--quiet"]


def _tx_bytes(pair, i):
    r = subprocess.run(["ip", "netns", "exec", pair.ns[i], "cat",
                        f"/sys/class/net/{pair.dev[i]}/statistics/tx_bytes"],
                       capture_output=True, text=True, check=True)
    return int(r.stdout)


def _two_nodes(tmp_path, name: str, per_node: int, flags: list[str]) -> tuple[dict, list[int], list[str]]:
    """torchrun on two namespace nodes of `per_node` processes each, `lowcomm train *flags`:
    (summary.json, bytes each node sent over the veth, each node's output)."""
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    out = tmp_path / name
    with two_namespaces() as pair:
        before = [_tx_bytes(pair, i) for i in (0, 1)]
        procs = []
        for i in (0, 1):
            cmd = [*launcher, "--nnodes", "2", "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"{ADDR[0]}:29400", "--rdzv-id", f"lowcomm-{name}",
                   "--local-addr", ADDR[i], "--max-restarts", "0",
                   # The namespace's address is not the machine's hostname, so torchrun
                   # cannot tell which agent hosts the rendezvous store: say so.
                   "--rdzv-conf", f"is_host={int(i == 0)},join_timeout=60",
                   "-m", "lowcomm", "train", "--out", str(out), *flags, *TRAIN]
            procs.append(pair.spawn(i, cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=180)[0])
            except subprocess.TimeoutExpired:
                logs.append("(no output: timed out)")
        codes = [p.returncode for p in procs]
        sent = [_tx_bytes(pair, i) - before[i] for i in (0, 1)]
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)  # None: timed out
    return json.loads((out / "summary.json").read_text()), sent, logs


@pytest.mark.procs
@needs_netns
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_two_node_torchrun_in_namespaces(tmp_path, strategy):
    s, sent, _ = _two_nodes(tmp_path, strategy, 1, ["--strategy", strategy])
    assert s["replicas"] == 2 and s["inside"] is None  # one process a node: flat, as before
    assert s["workers"] == 2 and s["backend"] == "gloo" and s["steps"] == 3
    grad_bytes = s["params"] * 4
    # ddp: all-reduce 2(W-1)/W P b; zero1: reduce-scatter + all-gather, the same ring total.
    assert s["wire_bytes_total"] == 3 * 2 * grad_bytes
    # Everything the ranks said to each other crossed the veth. gloo moves at
    # least the ring bytes each way (its reduce-scatter twice that).
    for i in (0, 1):
        assert sent[i] >= 3 * grad_bytes, (sent, grad_bytes)


@pytest.mark.procs
@needs_netns
def test_two_nodes_of_two_are_two_replicas_by_default(tmp_path):
    """No --replicas: torchrun's two nodes of two processes run as 2 replicas of 2 (ddp inside
    each node, the strategy across nodes), and the bytes counted at each level equal the plan."""
    s, sent, logs = _two_nodes(tmp_path, "nodes", 2, ["--strategy", "ddp"])
    assert "lowcomm: replicas: 2 nodes x 2 processes (--replicas 4 for one per process)" in logs[0], logs[0][-3000:]
    assert s["workers"] == 4 and s["replicas"] == 2 and s["inside"] == "ddp"
    levels = s["levels"]
    assert levels["cross"]["groups"] == 2 and levels["cross"]["ranks_per_group"] == 2
    for level in ("intra", "cross"):
        assert levels[level]["wire_bytes"] == levels[level]["planned_wire_bytes"] > 0, (level, levels[level])
    # Each node's two ranks send their cross-replica bytes over the veth (gloo at least the ring bytes).
    for i in (0, 1):
        assert sent[i] >= levels["cross"]["wire_bytes"] / 2, (sent, levels)


# -- the default-replica rule, without namespaces ------------------------------------------

def _torchrun_env(world: int, per_node: int) -> dict:
    return {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(per_node), "RANK": "0", "LOCAL_RANK": "0",
            "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "test"}


def _cfg(*flags: str):
    from lowcomm.cli.main import build_parser
    from lowcomm.cli.flags import config_from_args
    return config_from_args(build_parser(only="train").parse_args(["train", *flags]))


def _decide(env: dict, *flags: str):
    from lowcomm.config.nodes import default_replicas
    from lowcomm.strategies import available
    cfg = _cfg(*flags)
    cfg.workers = int(env["WORLD_SIZE"])  # as launch.prepare sets it under torchrun
    return cfg, default_replicas(cfg, available(), env)


def test_two_nodes_of_two_default_to_a_replica_per_node():
    cfg, line = _decide(_torchrun_env(4, 2), "--strategy", "zero1", "--intra-link", "10gbit,50us")
    assert (cfg.replicas, cfg.replicas_by_node) == (2, True)
    assert line == "replicas: 2 nodes x 2 processes (--replicas 4 for one per process)"


@pytest.mark.parametrize("flags,needle", [
    (["--strategy", "diloco", "--sync-by", "time"], "--sync-by time"),
])
def test_a_strategy_that_cannot_run_across_replicas_stays_flat_and_says_so(flags, needle):
    cfg, line = _decide(_torchrun_env(4, 2), *flags)
    assert cfg.replicas == 0 and not cfg.replicas_by_node
    assert line.startswith("replicas: 4, one per process (") and needle in line and "\n" not in line, line


@pytest.mark.parametrize("env,flags", [
    (_torchrun_env(4, 4), []),                  # one node: nothing to decide
    (_torchrun_env(4, 2), ["--replicas", "4"]),  # given: one per process, as asked
    (_torchrun_env(4, 2), ["--replicas", "2"]),
])
def test_nothing_is_decided_for_one_node_or_given_replicas(env, flags):
    cfg, line = _decide(env, *flags)
    assert line is None and not cfg.replicas_by_node and cfg.replicas == (int(flags[1]) if flags else 0)


def test_nodes_of_unequal_size_stay_flat():
    cfg, line = _decide(_torchrun_env(6, 4))
    assert cfg.replicas == 0 and "not a whole number of nodes of 4 processes" in line


def test_torchruns_node_major_numbering_is_the_replica_layout():
    """torchrun gives node n's process l the rank n·K + l (K processes a node): replica n, position l."""
    from lowcomm.comm.groups import ReplicaLayout
    from lowcomm.config.nodes import numbering_problem
    layout = ReplicaLayout(world=6, replicas=3)
    torchrun = [[3, rank // 2, rank % 2] for rank in range(6)]  # [replicas, GROUP_RANK, LOCAL_RANK]
    assert numbering_problem(layout, torchrun, by_node=True) is None
    swapped = [torchrun[1], torchrun[0], *torchrun[2:]]
    assert "rank 0 is process 1 of node 0" in numbering_problem(layout, swapped, by_node=True)
    assert numbering_problem(layout, swapped, by_node=False) is None  # --replicas given: replicas need not be nodes
    uneven = [[3, 0, 0], [3, 0, 1], [6, 1, 0], [6, 1, 1], [6, 1, 2], [6, 1, 3]]
    assert "different replica counts (3, 6)" in numbering_problem(layout, uneven, by_node=False)


def test_prepare_under_torchrun_says_so_on_rank_0(monkeypatch, capsys):
    from lowcomm.launch.launcher import prepare
    for key, value in _torchrun_env(4, 2).items():
        monkeypatch.setenv(key, value)
    cfg = _cfg("--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32")
    prepare(cfg, create=False)
    assert cfg.replicas == 2 and cfg.workers == 4
    assert capsys.readouterr().out == "lowcomm: replicas: 2 nodes x 2 processes (--replicas 4 for one per process)\n"
