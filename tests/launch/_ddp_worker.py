"""A training job started by the launcher tests: ``_ddp_worker.py [STEPS] [--ddp]``.

By default the gradients are averaged by :func:`fastddp.all_reduce` and applied by SGD written
out here; with ``--ddp``, by DDP with fastddp.compress_hook and ``torch.optim.SGD``. DDP's
constructor and ``torch.optim`` each import ``torch._dynamo`` (a second of CPU), which most of
these tests' workers, there to show what the launcher set up, need not pay.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

import fastddp
from fastddp.testing.restart_worker import collector_paused


def _ddp(model, state):
    from torch.nn.parallel import DistributedDataParallel as DDP

    with collector_paused():  # the set-up imports torch._dynamo
        model = DDP(model)
        model.register_comm_hook(state, fastddp.compress_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt.zero_grad, opt.step


def _written_out(model, state):
    params = list(model.parameters())

    def zero_grad():
        for p in params:
            p.grad = None

    def step():
        grads = [p.grad for p in params]
        fastddp.all_reduce(grads, state=state)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(g, alpha=0.1)

    return model, zero_grad, step


def train(env, steps, ddp):
    # The model lives in this function so that it is freed before the group is destroyed.
    torch.manual_seed(0)
    state = fastddp.CompressState()
    net = nn.Sequential(nn.Linear(64, 257), nn.GELU(), nn.Linear(257, 8))
    model, zero_grad, step = (_ddp if ddp else _written_out)(net, state)
    gen = torch.Generator().manual_seed(env.rank)
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 8, generator=gen)
        zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        step()
    # Every rank must hold the same weights after the averaged updates.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(env.world_size)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(everyone[0], f) for f in everyone), "ranks diverged"
    assert state.stats()["calls"] > 0


def main():
    args = sys.argv[1:]
    ddp = "--ddp" in args
    steps = [a for a in args if a != "--ddp"]
    torch.set_num_threads(1)
    with fastddp.distributed_session() as env:
        train(env, int(steps[0]) if steps else 5, ddp)
        print(
            f"worker ok rank={env.rank}/{env.world_size} local_rank={env.local_rank} "
            f"node_rank={env.node_rank} nodes={env.num_nodes} launcher={env.launcher}"
            f"{' ddp' if ddp else ''}",
            flush=True,
        )


if __name__ == "__main__":
    main()
    fastddp.distributed.exit_after_shutdown()
