"""The pull style: the run pulls micro-batches from next_batch(). torchrun --nproc-per-node 2 examples/pull_step.py"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lowcomm

dist.init_process_group("gloo")                      # torchrun gives rank and world size
torch.manual_seed(0)                                 # every rank builds the same θ0
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
run = lowcomm.make_run("acco", model, lowcomm.Comm(), lambda params: torch.optim.AdamW(params, lr=1e-2),
                       accum=4, total_steps=200)
rng = torch.Generator().manual_seed(dist.get_rank())  # each rank reads its own data
def next_batch():
    x = torch.randn(16, 32, generator=rng)
    return x, x.sum(1, keepdim=True)
def loss_fn(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])
for step in range(200):
    result = run.step(next_batch, loss_fn)           # loss, wire_bytes, exposed_comm_s, ...
    if dist.get_rank() == 0 and step % 50 == 49:
        print(f"step {step + 1}: loss {result.loss:.4f}, sent {result.wire_bytes / 1e3:.0f} kB, "
              f"waited {1e3 * result.exposed_comm_s:.1f} ms on the network")
run.close()                                          # every rank ends on the same parameters
dist.destroy_process_group()                         # after close(): gloo's threads end here, not at exit
