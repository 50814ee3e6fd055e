"""A two-node cluster on one machine: two network namespaces joined by a veth
pair, `torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d` started
once in each, training `ddp` and `zero1` across them. lowcomm only joins the
world torchrun made (launch.under_torchrun); the two ranks can reach each
other only over the veth, whose byte counters must show the training traffic.

Needs root for the namespaces (CI runs as root); skips with the reason elsewhere.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from validate_link import ADDR, netns_unavailable, two_namespaces  # noqa: E402

REASON = netns_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"two-node cluster: {REASON}")

TRAIN = ["--steps", "3", "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32",
         "--micro-batch", "4", "--eval-every", "0", "--eval-batches", "1", "--log-every", "1", "--quiet"]


def _tx_bytes(pair, i):
    r = subprocess.run(["ip", "netns", "exec", pair.ns[i], "cat",
                        f"/sys/class/net/{pair.dev[i]}/statistics/tx_bytes"],
                       capture_output=True, text=True, check=True)
    return int(r.stdout)


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_two_node_torchrun_in_namespaces(tmp_path, strategy):
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    out = tmp_path / strategy
    with two_namespaces() as pair:
        before = [_tx_bytes(pair, i) for i in (0, 1)]
        procs = []
        for i in (0, 1):
            cmd = [*launcher, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"{ADDR[0]}:29400", "--rdzv-id", f"lowcomm-{strategy}",
                   "--local-addr", ADDR[i], "--max-restarts", "0",
                   # The namespace's address is not the machine's hostname, so torchrun
                   # cannot tell which agent hosts the rendezvous store: say so.
                   "--rdzv-conf", f"is_host={int(i == 0)},join_timeout=60",
                   "-m", "lowcomm", "train", "--strategy", strategy, "--out", str(out), *TRAIN]
            procs.append(pair.spawn(i, cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=120)[0])
            except subprocess.TimeoutExpired:
                logs.append("(no output: timed out)")
        codes = [p.returncode for p in procs]
        sent = [_tx_bytes(pair, i) - before[i] for i in (0, 1)]
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)  # None: timed out after 120 s
    s = json.loads((out / "summary.json").read_text())
    assert s["workers"] == 2 and s["backend"] == "gloo" and s["steps"] == 3
    grad_bytes = s["params"] * 4
    # ddp: all-reduce 2(W-1)/W P b; zero1: reduce-scatter + all-gather, the same ring total.
    assert s["wire_bytes_total"] == 3 * 2 * grad_bytes
    # Everything the ranks said to each other crossed the veth. gloo moves at
    # least the ring bytes each way (its reduce-scatter twice that).
    for i in (0, 1):
        assert sent[i] >= 3 * grad_bytes, (sent, grad_bytes)
