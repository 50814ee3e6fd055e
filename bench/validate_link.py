"""Check LinkModel against a real shaped network: two ranks in two network
namespaces joined by a veth pair whose two directions are capped with tc tbf
(netem is not available here, so added latency is not emulated: the model's
latency is calibrated from a 4-byte all-reduce instead).

For all_reduce, reduce_scatter and all_gather of 1-64 MB at two rates it
prints measured time / LinkModel prediction. Needs root (network namespaces);
elsewhere it prints why and exits 0 without measuring.

Next to the model it prints what explains each gap, from evidence measured
in the same run:
- wire MB: bytes that really left rank 0's veth per op (tx_bytes), against
  the ring count the model charges;
- goodput: a raw TCP transfer in both directions at once (a ring step) over
  the same shaped link gives the payload rate TCP really gets (headers and
  ACKs cost ~5-8% of the tc rate);
- lag: how long after the first rank started sending the second one did
  (each rank samples its own veth's tx_bytes during the op). A ring step
  sends in both directions at once, so lag should be ~0;
- explained = hops*latency + lag + (bytes gloo really moves - the tbf
  bucket, sent at line rate) / goodput.
measured s is the slower rank's time per op (median over reps): a rank's op
returns once its own sends are in the socket buffer, so the other rank may
still be receiving.

What it shows (torch 2.13, gloo TCP transport): all_reduce fits the model
within TCP/IP overhead; reduce_scatter is a full all-reduce in gloo (2x the
ring bytes); all_gather sends exactly the ring bytes but at W=2 often not in
both directions at once. gloo's allgather (gloo/allgather.cc) sends each
rank's block as two half-chunks with send() posted before recv(); a send
only starts once the peer's "recv ready" notice arrives, and those notices
travel in-band on the pair's single TCP stream, FIFO behind payload already
queued there. When one rank finds the peer's notice already in (it left the
barrier later), it queues its chunk (S/4) and only then its own "recv ready",
so the peer cannot start sending until that whole chunk has crossed: the
directions serialise for one chunk each, and the op takes up to
3/4 * S / bandwidth instead of 1/2 * S / bandwidth (1.5x the ring time, more
with header overhead), depending on which rank wins the race. That is a
property of gloo's transport, not of the shaping or the link model; NCCL and
the planner's ring pay the model's time.

    sudo python bench/validate_link.py [--rates 1gbit,200mbit] [--sizes-mb 1,4,16,64] [--reps 2]

The same namespaces host a two-node torchrun cluster in tests/launch/test_netns_cluster.py
(`two_namespaces` below is shared with it). Only addresses inside the
namespaces made here (10.77.0.1 and 10.77.0.2 on our own veth pair) are used.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ADDR = ("10.77.0.1", "10.77.0.2")
# tbf bucket: one 64 KiB GSO segment. A link idle long enough to refill it
# sends its first TBF_BURST_BYTES at line rate (~5 ms saved at 100mbit).
TBF_BURST, TBF_BURST_BYTES = "64kb", 64 * 1024
OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, as CI does)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    probe = f"lcprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"'ip netns add' is not permitted here: {r.stderr.strip() or r.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Pair:
    """Two namespaces a, b joined by veth ends va (10.77.0.1) and vb (10.77.0.2)."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.ns = (f"lc{tag}a", f"lc{tag}b")
        self.dev = (f"lv{tag}a", f"lv{tag}b")
        self.procs: list[subprocess.Popen] = []

    def up(self) -> None:
        for ns in self.ns:
            _ip("ip", "netns", "add", ns)
        _ip("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for ns, dev, addr in zip(self.ns, self.dev, ADDR):
            _ip("ip", "link", "set", dev, "netns", ns)
            _ip("ip", "addr", "add", f"{addr}/24", "dev", dev, ns=ns)
            _ip("ip", "link", "set", dev, "up", ns=ns)
            _ip("ip", "link", "set", "lo", "up", ns=ns)

    def shape(self, rate: str | None) -> None:
        """Cap each end's egress at `rate` (tc syntax, e.g. 1gbit); None removes the cap."""
        for ns, dev in zip(self.ns, self.dev):
            _ip("tc", "qdisc", "del", "dev", dev, "root", ns=ns, check=False)
            if rate:
                # burst: one 64 KiB GSO segment (a larger bucket lets the head of
                # each message through at line rate); limit: deep enough that TCP
                # never sees a drop.
                _ip("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", TBF_BURST, "limit", "32mb", ns=ns)

    def spawn(self, i: int, cmd: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        """Start cmd inside namespace i; it is killed on cleanup if still running."""
        e = {**os.environ, "GLOO_SOCKET_IFNAME": self.dev[i], **(env or {})}
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[i], *cmd], env=e,
                             start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def down(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for ns in self.ns:  # deleting a namespace deletes the veth end inside it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextmanager
def two_namespaces():
    pair = Pair()
    try:
        pair.up()
        yield pair
    finally:
        pair.down()


# -- the measuring side (runs inside a namespace) ---------------------------------

class TxSampler:
    """Samples this namespace's veth tx_bytes every ~1 ms on a thread while an op
    runs (the collective releases the GIL), so each rank knows when its own
    payload actually left."""

    def __init__(self, dev: str):
        self.fd = os.open(f"/sys/class/net/{dev}/statistics/tx_bytes", os.O_RDONLY)
        self.samples: list[tuple[float, int]] = []
        self._stop = False
        self._thread = None

    def read(self) -> int:
        return int(os.pread(self.fd, 32, 0))

    def __enter__(self):
        import threading

        self.samples = [(time.perf_counter(), self.read())]
        self._stop = False

        def loop():
            while not self._stop:
                time.sleep(0.001)
                self.samples.append((time.perf_counter(), self.read()))

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.samples.append((time.perf_counter(), self.read()))

    def summary(self, after: int) -> dict:
        """Bytes sent (up to the counter value `after`), and when 10% of them had
        gone: the send's start, shifted by the same 10% of its duration on every
        rank, so rank-to-rank lags are exact."""
        base = self.samples[0][1]
        sent = after - base
        start = next((t for t, b in self.samples if b - base >= 0.1 * sent), self.samples[0][0])
        return {"sent": sent, "start": start}


def child(rank: int, port: int, sizes_mb: list[float], reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from lowcomm.comm import Comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{ADDR[0]}:{port}", rank=rank, world_size=2)
    comm = Comm()  # the code path training uses, without emulation: the link is real here
    sampler = TxSampler(os.environ["GLOO_SOCKET_IFNAME"])

    def op_fn(op, n):
        t = torch.ones(n)
        if op == "all_reduce":
            return lambda: comm.all_reduce(t)
        if op == "reduce_scatter":
            o = torch.empty(n // 2)
            return lambda: comm.reduce_scatter(o, t)
        o = torch.empty(n)
        s = torch.ones(n // 2)
        return lambda: comm.all_gather(o, s)

    def timed(fn, k, details=None):
        times = []
        for _ in range(k):
            comm.barrier()
            with sampler:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            # An op returns once its sends are in the socket buffer, not on the
            # wire: count the bytes only after the peer has everything too.
            comm.barrier()
            if details is not None:
                details.append({"t0": t0, "s": times[-1], **sampler.summary(sampler.read())})
        return statistics.median(times)

    results = {"tiny_all_reduce_s": timed(op_fn("all_reduce", 2), 20), "cases": []}
    for op in OPS:
        timed(op_fn(op, 2**18), 1)  # warm up connections and buffers
        for mb in sizes_mb:
            n = int(mb * 1e6) // 4 // 2 * 2  # S bytes of fp32, even so it splits in two
            reps_detail: list[dict] = []
            results["cases"].append({"op": op, "bytes": n * 4, "s": timed(op_fn(op, n), reps, reps_detail),
                                     "reps": reps_detail})
    dist.destroy_process_group()
    Path(f"{out}.{rank}").write_text(json.dumps(results))


def tcp_child(rank: int, port: int, nbytes: int, reps: int, out: str) -> None:
    """Raw TCP over the same link: both ranks send nbytes to each other at once on
    one connection (what one ring step does), `reps` times; rank 0 writes the
    fastest (other loads on the machine only ever slow a run down)."""
    import socket
    import threading

    if rank == 0:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((ADDR[0], port))
        ls.listen(1)
        ls.settimeout(60)
        s, _ = ls.accept()
        ls.close()
    else:
        deadline = time.monotonic() + 60
        while True:
            try:
                s = socket.create_connection((ADDR[0], port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    s.settimeout(120)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def exchange(n):
        if rank == 0:  # line the two ranks up: a 1-byte ping-pong
            s.sendall(b"g")
            s.recv(1)
        else:
            s.recv(1)
            s.sendall(b"g")
        t0 = time.perf_counter()
        th = threading.Thread(target=s.sendall, args=(b"\0" * n,))
        th.start()
        got = 0
        while got < n:
            d = s.recv(min(1 << 20, n - got))
            if not d:
                raise RuntimeError("peer closed the connection")
            got += len(d)
        th.join()
        return time.perf_counter() - t0

    exchange(1 << 20)  # warm up (slow start, buffer autotuning)
    times = [exchange(nbytes) for _ in range(reps)]
    s.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"bytes": nbytes, "s": min(times)}))


def _run_children(pair: Pair, args: list[str], timeout: float) -> None:
    procs = [pair.spawn(i, [sys.executable, __file__, "--child", str(i), *args]) for i in (0, 1)]
    for p in procs:
        if p.wait(timeout=timeout) != 0:
            raise RuntimeError(f"a measuring process failed (exit {p.returncode})")


def duplex_goodput(pair: Pair, nbytes: int, port: int) -> float:
    """Payload bytes/s raw TCP gets in each direction with both directions busy."""
    with tempfile.TemporaryDirectory(prefix="lowcomm-validate-") as tmp:
        out = str(Path(tmp) / "tcp.json")
        _run_children(pair, ["--tcp", str(nbytes), "--reps", "3", "--port", str(port), "--child-out", out], 300)
        r = json.loads(Path(out).read_text())
    return (r["bytes"] - TBF_BURST_BYTES) / r["s"]


def measure(pair: Pair, rate: str, sizes_mb, reps, port) -> dict:
    pair.shape(rate)
    with tempfile.TemporaryDirectory(prefix="lowcomm-validate-") as tmp:
        out = str(Path(tmp) / "r.json")
        _run_children(pair, ["--sizes-mb", ",".join(map(str, sizes_mb)), "--reps", str(reps),
                             "--port", str(port), "--child-out", out], 900)
        res = [json.loads(Path(f"{out}.{i}").read_text()) for i in (0, 1)]
    # Both ranks merged (one clock: perf_counter is CLOCK_MONOTONIC, shared by
    # every namespace). An op's time is the slower rank's: a rank returns once
    # its own sends sit in the socket buffer, so with gloo's all_gather the rank
    # that sends last can return before its payload has crossed, and rank 0
    # alone would sometimes time only half of the op.
    for c0, c1 in zip(res[0]["cases"], res[1]["cases"]):
        c0["s"] = statistics.median(max(a["s"], b["s"]) for a, b in zip(c0["reps"], c1["reps"]))
        c0["lag_s"] = statistics.median(abs(a["start"] - b["start"]) for a, b in zip(c0["reps"], c1["reps"]))
        c0["wire_bytes"] = statistics.median(a["sent"] for a in c0["reps"])
    return res[0]


# What gloo (torch 2.13, W=2) really runs for each op: reduce_scatter is a full
# all-reduce. all_gather does move the ring's bytes; its extra time is the lag.
GLOO_RUNS_AS = {"all_reduce": "all_reduce", "reduce_scatter": "all_reduce", "all_gather": "all_gather"}


def main() -> int:
    ap = argparse.ArgumentParser(description="LinkModel vs a tc-shaped veth link (W=2)")
    ap.add_argument("--rates", default="1gbit,200mbit", help="tc rates, comma-separated")
    ap.add_argument("--sizes-mb", default="1,4,16,64")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--tcp", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = [float(x) for x in a.sizes_mb.split(",")]
    if a.child is not None:
        if a.tcp:
            tcp_child(a.child, a.port, a.tcp, a.reps, a.child_out)
        else:
            child(a.child, a.port, sizes, a.reps, a.child_out)
        return 0
    reason = netns_unavailable()
    if reason:
        print(f"validate_link: skipped: {reason}")
        return 0

    from lowcomm.comm.link import LinkModel, parse_bandwidth
    from lowcomm.comm.wire import latency_hops, wire_bytes

    gap_model = dict.fromkeys(OPS, 0.0)  # largest |measured/x - 1| per op
    gap_expl = dict.fromkeys(OPS, 0.0)
    ag_lag_chunks: list[float] = []
    with two_namespaces() as pair:
        for k, rate in enumerate(a.rates.split(",")):
            res = measure(pair, rate, sizes, a.reps, a.port + 2 * k)
            bw = parse_bandwidth(rate)
            goodput = duplex_goodput(pair, int(min(max(sizes), 16) * 1e6 / 2), a.port + 2 * k + 1)
            lat = res["tiny_all_reduce_s"] / latency_hops("all_reduce", 2)
            model = LinkModel(bw, lat)
            print(f"\n{rate} per direction (tc tbf), latency calibrated from a 4-byte all_reduce: "
                  f"{lat * 1e3:.3f} ms per hop; raw TCP goodput, both directions at once: "
                  f"{goodput * 8 / 1e6:.1f} Mbit/s = {goodput / bw:.3f} of the tc rate")
            print(f"{'op':<15}{'S (MB)':>7}{'measured s':>11}{'model s':>9}{'meas/model':>11}"
                  f"{'wire MB':>9}{'ring MB':>9}{'lag s':>8}{'explained s':>12}{'meas/expl':>10}")
            for c in res["cases"]:
                op, S = c["op"], c["bytes"]
                pred = model.duration(op, S, 2)
                ratio = c["s"] / pred
                gap_model[op] = max(gap_model[op], abs(ratio - 1))
                real = GLOO_RUNS_AS[op]
                expl = (latency_hops(real, 2) * lat + c["lag_s"]
                        + max(0, wire_bytes(real, S, 2) - TBF_BURST_BYTES) / goodput)
                gap_expl[op] = max(gap_expl[op], abs(c["s"] / expl - 1))
                if op == "all_gather":  # lag in units of one gloo half-chunk (S/4) at goodput
                    ag_lag_chunks.append(c["lag_s"] / (S / 4 / goodput))
                print(f"{op:<15}{S / 1e6:>7.1f}{c['s']:>11.4f}{pred:>9.4f}{ratio:>11.3f}"
                      f"{c['wire_bytes'] / 1e6:>9.2f}{wire_bytes(op, S, 2) / 1e6:>9.2f}{c['lag_s']:>8.3f}"
                      f"{expl:>12.4f}{c['s'] / expl:>10.3f}")
    print(f"""
largest gap to the model (target 15%, or explained): {', '.join(f'{op} {100 * g:.1f}%' for op, g in gap_model.items())}.
largest gap to 'explained': {', '.join(f'{op} {100 * g:.1f}%' for op, g in gap_expl.items())}.
Columns: wire MB = bytes that left rank 0's veth per op (payload + TCP/IP/Ethernet
headers and ACKs); ring MB = what the model charges; lag = time between the two
ranks starting to send (a ring step sends both ways at once: ~0); explained =
hops*latency + lag + (bytes gloo moves - tbf burst) / raw-TCP duplex goodput.
measured s is the slower rank's time (median over reps).
- all_reduce: the model's bytes; the rest is TCP/IP header overhead (goodput < tc rate).
- reduce_scatter: gloo has no ring reduce-scatter; torch runs a full all-reduce, so it
  moves twice the ring bytes (wire MB ~ 2x ring MB) and measures ~2x the model; the
  model keeps the ring count, which is what NCCL (and the planner) pay.
- all_gather: wire MB ~ ring MB, so no extra bytes; the gap is the lag, a property of
  gloo's TCP transport at W=2: allgather sends two half-chunks (S/4) with send posted
  before recv, a send starts only after the peer's in-band "recv ready" notice, and that
  notice queues behind payload already written on the same TCP stream. The rank that
  finds the peer ready first sends a whole S/4 chunk before the peer may start, so the
  directions serialise for a chunk each: up to 1.5x the ring time. Measured lag here:
  {', '.join(f'{x:.2f}' for x in ag_lag_chunks)} chunk(s) of S/4 (0 = no serialisation, 1 = a whole chunk).""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
