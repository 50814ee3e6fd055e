#!/usr/bin/env python
"""Overhead of lowcomm's `ddp` strategy against a plain hand-written torch DDP loop.

    python bench/overhead.py                       # W=2, tiny GPT, ~1-2 min on 2 cores
    python bench/overhead.py --workers 4 --steps 40

Both loops train the same model (lowcomm's GPT, same seed, so the same θ0) on
the same data (lowcomm.data: byte corpus, one ShardedBatches per loop per
rank, same seed, so both loops see exactly the same batches in the same
order), with the same AdamW settings and the same warmup+cosine schedule, for
the same number of steps, inside ONE set of W spawned gloo processes (one
torch thread each):

  A  lowcomm: strategy = lowcomm.make_strategy("ddp", model, lowcomm.Comm(), ...);
     strategy.step(next_batch, lm_loss)
  B  plain:   DistributedDataParallel + torch.optim.AdamW, no_sync() for the
     first accum-1 micro-batches, lr set by hand each step; no lowcomm code
     in the step (the schedule is re-written here and checked equal to lowcomm's).

After `--warmup` untimed steps of each, the loops alternate in blocks of
`--block` steps (A B, B A, A B, ... so neither always goes first), with a
barrier before each block, so machine noise falls on both alike. A step's
time is the slowest rank's wall time of that step. Reported: the median step
time of each loop, their ratio lowcomm/plain (target <= 1.05), the median
of the per-round paired ratios (block mean A / block mean B), and the ratio of
median process CPU time per step (all threads, averaged over ranks), which
other jobs on a shared machine disturb far less than wall time. `--control`
replaces lowcomm by a second plain loop (an A/A run) to show the noise floor.

Equal work is checked: both loops must end at (nearly) the same parameters;
the relative L2 difference is printed and the script exits 1 if it exceeds
--param-tol. The timing targets are reported, not enforced (exit 0).

Also built: lowcomm `zero1` and `ddp` strategies on fresh copies of the model,
each stepped twice (AdamW creates its state lazily), and their
optimizer_state_bytes() per rank compared (target ~ 1/W).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import lowcomm
from lowcomm.config import MODEL_PRESETS, OptimConfig
from lowcomm.data import VOCAB_SIZE, ShardedBatches, check_sizes, load_bytes, split
from lowcomm.models import GPT, lm_loss
from lowcomm.train.optim import adamw_factory, lr_schedule

RESULT_KEY = "overhead_bench/result"


# --- the plain loop's own pieces (no lowcomm code) ---------------------------

def plain_schedule(lr: float, warmup: int, total: int, min_ratio: float):
    """Linear warmup then cosine to lr*min_ratio, written out by hand."""
    warmup = min(warmup, total)

    def at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        if total <= warmup:
            return lr
        p = min(1.0, (step - warmup) / max(1, total - warmup))
        return lr * min_ratio + 0.5 * (lr - lr * min_ratio) * (1 + math.cos(math.pi * p))
    return at


class PlainDDP:
    """A textbook torch DDP training step with gradient accumulation."""

    def __init__(self, model, opt_cfg: OptimConfig, accum: int, schedule, bucket_mb: float):
        self.ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        self.opt = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr,
                                     betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps,
                                     weight_decay=opt_cfg.weight_decay)
        self.accum, self.schedule, self.step_no = accum, schedule, 0

    def step(self, next_batch) -> float:
        for g in self.opt.param_groups:
            g["lr"] = self.schedule(self.step_no)
        total = 0.0
        for i in range(self.accum):
            x, y = next_batch()
            ctx = self.ddp.no_sync() if i < self.accum - 1 else _null()
            with ctx:
                logits = self.ddp(x)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                         y.reshape(-1))
                (loss / self.accum).backward()
            total += loss.item()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_no += 1
        return total / self.accum


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# --- one worker ----------------------------------------------------------------

def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def build_model(args) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    n_layer, n_head, d_model = MODEL_PRESETS[args.model]
    return GPT(VOCAB_SIZE, args.seq_len, n_layer, n_head, d_model)


def run_rank(rank: int, world: int, args, port: int) -> None:
    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        result = bench(rank, world, args)
        dist.barrier()
        if rank == 0:
            store.set(RESULT_KEY, json.dumps(result))
    finally:
        dist.destroy_process_group()


def bench(rank: int, world: int, args) -> dict:
    tokens, source = load_bytes(args.data, quiet=rank != 0)
    train_tokens, _ = split(tokens, args.val_fraction)

    def loader():
        return ShardedBatches(train_tokens, rank, world, args.seq_len, args.micro_batch, args.seed)

    opt_cfg = OptimConfig()
    lc_sched = lr_schedule(opt_cfg, args.steps)
    pl_sched = plain_schedule(opt_cfg.lr, opt_cfg.warmup_steps, args.steps, opt_cfg.min_lr_ratio)
    for s in range(args.steps):
        assert abs(lc_sched(s) - pl_sched(s)) <= 1e-12 * opt_cfg.lr, f"schedules differ at step {s}"

    # A: lowcomm ddp (or, with --control, a second plain loop: an A/A noise check).
    model_a = build_model(args)
    if args.control:
        plain_a = PlainDDP(model_a, opt_cfg, args.accum, pl_sched, args.bucket_mb)
    else:
        lc = lowcomm.make_strategy("ddp", model_a, lowcomm.Comm(), adamw_factory(opt_cfg),
                                   accum=args.accum, schedule=lc_sched, bucket_mb=args.bucket_mb)
    data_a = loader()
    # B: plain torch DDP.
    model_b = build_model(args)
    assert torch.equal(flat(model_a), flat(model_b)), "the two models start from different θ0"
    plain = PlainDDP(model_b, opt_cfg, args.accum, pl_sched, args.bucket_mb)
    data_b = loader()

    def step_a() -> float:
        if args.control:
            return plain_a.step(data_a.next)
        return lc.step(data_a.next, lm_loss).loss

    def step_b() -> float:
        return plain.step(data_b.next)

    times = {"lowcomm": [], "plain": []}
    cpu = {"lowcomm": [], "plain": []}  # process CPU seconds per step (all threads)
    losses = {"lowcomm": [], "plain": []}
    blocks = []  # per round: (mean step A, mean step B) of this rank
    loops = {"lowcomm": step_a, "plain": step_b}

    def run_block(name: str, n: int, timed: bool) -> float:
        dist.barrier()
        t_block = time.perf_counter()
        for _ in range(n):
            c0, t0 = time.process_time(), time.perf_counter()
            loss = loops[name]()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            losses[name].append(loss)
            if timed:
                times[name].append(dt)
                cpu[name].append(dc)
        return (time.perf_counter() - t_block) / max(n, 1)

    warm = min(args.warmup, args.steps)
    run_block("lowcomm", warm, False)
    run_block("plain", warm, False)
    left, rnd = args.steps - warm, 0
    while left > 0:
        n = min(args.block, left)
        order = ("lowcomm", "plain") if rnd % 2 == 0 else ("plain", "lowcomm")
        means = {name: run_block(name, n, True) for name in order}
        blocks.append((means["lowcomm"], means["plain"]))
        left -= n
        rnd += 1

    # Equal work: same parameters at the end (every rank holds the same θ in DDP).
    pa, pb = flat(model_a), flat(model_b)
    param_rel = float((pa - pb).norm() / pb.norm())
    param_max = float((pa - pb).abs().max())

    # Optimizer state: zero1 vs ddp on fresh models, two steps each (state is lazy).
    state = {}
    for name in ("ddp", "zero1"):
        m = build_model(args)
        options = {"bucket_mb": args.bucket_mb} if name == "ddp" else {}
        s = lowcomm.make_strategy(name, m, lowcomm.Comm(), adamw_factory(opt_cfg), accum=1,
                                  schedule=lc_sched, **options)
        d = loader()
        for _ in range(2):
            s.step(d.next, lm_loss)
        state[name] = s.optimizer_state_bytes()
        del s, m

    # Collect every rank's numbers on rank 0 (outside any timing).
    mine = {"times": times, "cpu": cpu, "blocks": blocks, "state": state, "param_rel": param_rel,
            "param_max": param_max, "final_loss": {k: v[-1] for k, v in losses.items()}}
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank != 0:
        return {}
    n_params = model_a.num_params()
    step_times = {k: [max(r["times"][k][i] for r in every) for i in range(len(every[0]["times"][k]))]
                  for k in times}
    step_cpu = {k: [sum(r["cpu"][k][i] for r in every) / world for i in range(len(every[0]["cpu"][k]))]
                for k in cpu}
    round_ratios = [statistics.mean(r["blocks"][i][0] for r in every) /
                    statistics.mean(r["blocks"][i][1] for r in every) for i in range(len(blocks))]
    return {
        "source": source, "params": n_params, "world": world,
        "step_times": step_times, "step_cpu": step_cpu, "round_ratios": round_ratios,
        "state_per_rank": {k: [r["state"][k] for r in every] for k in state},
        "param_rel": max(r["param_rel"] for r in every),
        "param_max": max(r["param_max"] for r in every),
        "final_loss": every[0]["final_loss"],
        "tokens_per_step": world * args.accum * args.micro_batch * args.seq_len,
    }


# --- the parent ----------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="W, local gloo processes")
    p.add_argument("--steps", type=int, default=64, help="optimizer steps per loop, warmup included")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps per loop before the ABAB blocks")
    p.add_argument("--block", type=int, default=2, help="steps per timed block")
    p.add_argument("--model", default="tiny", choices=sorted(MODEL_PRESETS), help="GPT size preset")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch per rank")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default="shakespeare", help="'shakespeare', 'pydoc' or a text file/dir")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size, both loops")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--param-tol", type=float, default=1e-5,
                   help="max relative L2 difference of the two loops' final parameters")
    p.add_argument("--timeout", type=float, default=900.0, help="kill the run after this many seconds")
    p.add_argument("--control", action="store_true",
                   help="A/A check: replace lowcomm ddp by a second plain loop (ratio should be ~1)")
    p.add_argument("--json", metavar="PATH", help="also write the raw figures here")
    args = p.parse_args(argv)
    for name in ("workers", "steps", "block", "micro_batch", "accum", "seq_len", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.warmup >= args.steps:
        p.error("--warmup must be >= 0 and below --steps (some steps must be timed)")
    return args


def spawn(args) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the children
    ctx = mp.start_processes(run_rank, args=(args.workers, args, store.port), nprocs=args.workers,
                             start_method="spawn", join=False)
    deadline = time.monotonic() + args.timeout
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the benchmark did not finish within {args.timeout:.0f} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join()
    return json.loads(store.get(RESULT_KEY))


def report(args, r: dict, wall: float) -> bool:
    W = r["world"]
    ta, tb = r["step_times"]["lowcomm"], r["step_times"]["plain"]
    med_a, med_b = statistics.median(ta), statistics.median(tb)
    ratio = med_a / med_b
    paired = statistics.median(r["round_ratios"])
    ddp_b, z1_b = max(r["state_per_rank"]["ddp"]), max(r["state_per_rank"]["zero1"])
    state_ratio = z1_b / ddp_b
    cores = os.cpu_count() or 1
    procs = W * args.threads

    print(f"lowcomm overhead benchmark: W={W} gloo, {args.threads} torch thread(s)/process, "
          f"{cores} CPU core(s)" + (f"  [OVERSUBSCRIBED: {procs} threads on {cores} cores]"
                                    if procs > cores else ""))
    print(f"GPT '{args.model}' {r['params'] / 1e6:.2f}M params, seq {args.seq_len}, micro-batch "
          f"{args.micro_batch} x accum {args.accum} per rank = {r['tokens_per_step']:,} tokens/step; "
          f"data {r['source']}")
    if args.control:
        print("CONTROL RUN: loop A is a second plain torch DDP loop, not lowcomm; the ratios show the noise floor")
    print(f"{args.steps} steps per loop: {args.warmup} untimed warmup, then {len(ta)} timed in "
          f"{len(r['round_ratios'])} alternating blocks of <= {args.block}; run wall {wall:.1f} s")
    print()
    print(f"  {'loop':<22}{'median step':>12}{'mean step':>11}{'p10':>9}{'p90':>9}{'tok/s':>9}")
    label_a = "plain DDP (A/A control)" if args.control else "lowcomm ddp"
    for name, label, t in (("lowcomm", label_a, ta), ("plain", "plain torch DDP", tb)):
        q = statistics.quantiles(t, n=10) if len(t) >= 2 else [t[0]] * 9
        print(f"  {label:<22}{1e3 * statistics.median(t):>10.1f}ms{1e3 * statistics.mean(t):>9.1f}ms"
              f"{1e3 * q[0]:>7.1f}ms{1e3 * q[-1]:>7.1f}ms{r['tokens_per_step'] / statistics.median(t):>9,.0f}")
    print()
    ok = lambda good: "ok" if good else "ABOVE TARGET"  # noqa: E731
    row = lambda label, value, rest="": print(f"  {label:<46}{value:>6.3f}   {rest}")  # noqa: E731
    ab = "A/B" if args.control else "lowcomm/plain"
    ca, cb = statistics.median(r["step_cpu"]["lowcomm"]), statistics.median(r["step_cpu"]["plain"])
    rr = sorted(r["round_ratios"])
    quart = statistics.quantiles(rr, n=4) if len(rr) >= 2 else [rr[0]] * 3
    row(f"step-time ratio {ab} (medians)", ratio, f"target <= 1.05  {ok(ratio <= 1.05)}")
    row(f"paired ratio (median of {len(rr)} block pairs)", paired,
        f"(pairs {rr[0]:.3f}..{rr[-1]:.3f}, quartiles {quart[0]:.3f}..{quart[2]:.3f})")
    row(f"CPU-time ratio {ab} (medians)", ca / cb,
        f"({1e3 * ca:.1f} vs {1e3 * cb:.1f} ms CPU/rank/step; robust to other load)")
    print()
    print(f"  optimizer state per rank: ddp {ddp_b:,} B, zero1 {z1_b:,} B "
          f"(AdamW m+v of {r['params']:,} fp32 params = {8 * r['params']:,} B)")
    row("state-bytes ratio zero1/ddp", state_ratio, f"target ~ 1/W = {1 / W:.3f}  "
        f"{ok(abs(state_ratio - 1 / W) <= 0.02)}")
    print()
    params_ok = r["param_rel"] <= args.param_tol
    print(f"  equal work: final params rel. L2 diff {r['param_rel']:.2e} (max abs {r['param_max']:.2e}), "
          f"tol {args.param_tol:.0e}  {'ok' if params_ok else 'FAILED'}; final loss lowcomm "
          f"{r['final_loss']['lowcomm']:.4f}, plain {r['final_loss']['plain']:.4f}")
    if procs > cores:
        print(f"\nnote: {procs} busy threads on {cores} cores: ranks time-share the CPUs, so step "
              "times are dominated by scheduling and the ratio is noisier.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**r, "args": vars(args), "median_ratio": ratio, "paired_ratio": paired, "cpu_ratio": ca / cb,
                       "state_ratio": state_ratio, "wall_s": wall}, f, indent=1)
    return params_ok


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        tokens, label = load_bytes(args.data, quiet=True)
        check_sizes(tokens, args.val_fraction, args.seq_len, args.workers, label)
    except lowcomm.UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = spawn(args)
    ok = report(args, result, time.perf_counter() - t0)
    if not ok:
        print("error: the two loops did not end at the same parameters, so they did not do "
              "equal work; the timing comparison is not valid", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
