"""A trainer written as most are: the DDP model lives at module level, past
destroy_process_group(), and the interpreter exits normally. Started by fastddp.launch."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp

torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)), bucket_cap_mb=0.02)
mode = sys.argv[1]  # a preset name, or "none" for no hook
if mode != "none":
    model.register_comm_hook(fastddp.CompressState.from_preset(mode), fastddp.compress_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(dist.get_rank())
for _ in range(8):
    opt.zero_grad()
    model(torch.randn(16, 64, generator=gen)).square().mean().backward()
    opt.step()
dist.destroy_process_group()
print("trained", flush=True)
