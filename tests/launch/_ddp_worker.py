"""A DDP job with fastddp.compress_hook, started by the launcher tests."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.testing.restart_worker import collector_paused


def train(env, steps):
    # The model lives in this function so that it is freed before the group is destroyed.
    torch.manual_seed(0)
    with collector_paused():  # the set-up imports torch._dynamo
        model = DDP(nn.Sequential(nn.Linear(64, 257), nn.GELU(), nn.Linear(257, 8)))
        state = fastddp.CompressState()
        model.register_comm_hook(state, fastddp.compress_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(env.rank)
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 8, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    # Every rank must hold the same weights after the averaged updates.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(env.world_size)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(everyone[0], f) for f in everyone), "ranks diverged"
    assert state.stats()["calls"] > 0


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    torch.set_num_threads(1)
    with fastddp.distributed_session() as env:
        train(env, steps)
        print(
            f"worker ok rank={env.rank}/{env.world_size} local_rank={env.local_rank} "
            f"node_rank={env.node_rank} nodes={env.num_nodes} launcher={env.launcher}",
            flush=True,
        )


if __name__ == "__main__":
    main()
    fastddp.distributed.exit_after_shutdown()
