"""lowcomm.wrap(): your own loop, data and loss; the strategy decides when to communicate and step.

    torchrun --nproc-per-node 2 examples/your_loop.py            # acco over gloo, an emulated 100 Mbit/s link
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lowcomm

dist.init_process_group("gloo")                                # torchrun gives rank and world size
torch.manual_seed(0)                                           # the same θ0 on every rank
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))

with lowcomm.wrap(model, lambda params: torch.optim.AdamW(params, lr=1e-2), strategy="acco", accum=4,
                  link="100mbit,1ms") as run:                  # on the default process group
    rng = torch.Generator().manual_seed(dist.get_rank())
    while run.steps < 200:                                     # acco: 200 updates, each an estimate and a real round
        x = torch.randn(16, 32, generator=rng)                 # each rank reads its own data
        loss = F.mse_loss(run.model(x), x.sum(1, keepdim=True))
        run.backward(loss)                                     # accumulate / communicate / step
        if run.stepped and run.steps % 50 == 0 and dist.get_rank() == 0:
            r = run.result
            print(f"update {run.steps}: loss {r.loss:.4f} over {r.micro_batches} micro-batches, "
                  f"sent {r.wire_bytes / 1e3:.0f} kB, waited {1e3 * r.exposed_comm_s:.1f} ms on the network")
    with run.evaluating() as m, torch.no_grad():               # acco: the real θ, not the estimate
        x = torch.randn(256, 32, generator=rng)
        print(f"rank {dist.get_rank()}: eval loss {F.mse_loss(m(x), x.sum(1, keepdim=True)):.4f}")
dist.destroy_process_group()                                   # after close(): gloo's threads end here, not at exit
