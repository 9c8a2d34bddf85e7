"""A plain training script, no launcher: start one process per rank with the variables set.

    export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511
    RANK=0 LOCAL_RANK=0 python examples/plain_script.py &
    RANK=1 LOCAL_RANK=1 python examples/plain_script.py

No DDP either: after each backward the gradients are averaged with ``fastddp.all_reduce``
(bf16 on the wire, summed in fp32), the way small training scripts often sync by hand.
"""

import argparse
import sys

import torch
import torch.distributed as dist
from torch import nn

import fastddp


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    with fastddp.distributed_session() as env:
        torch.manual_seed(0)  # the same initial weights on every rank
        # On the rank's device: where there are GPUs, init_distributed picks NCCL, which
        # reduces CUDA tensors only.
        model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 1)).to(env.device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        grads = [p.grad for p in model.parameters()]
        gen = torch.Generator().manual_seed(100 + env.rank)  # each rank its own data
        for step in range(args.steps):
            x = torch.randn(128, 16, generator=gen).to(env.device)
            y = (x[:, :4].sum(1, keepdim=True)).tanh()
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            if step == 0:
                grads = [p.grad for p in model.parameters()]
            fastddp.all_reduce(grads)  # average across ranks, in place
            opt.step()
            if env.is_main and step % 10 == 0:
                print(f"step {step:3d} loss {loss.item():.4f}", flush=True)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(env.world_size)]
        dist.all_gather(everyone, flat)
        same = all(torch.equal(everyone[0], f) for f in everyone)
        # One write a line: the ranks share the launcher's output, and print() writes the
        # text and its newline apart.
        line = f"rank {env.rank}/{env.world_size} ({env.launcher}): final loss {loss.item():.4f}"
        sys.stdout.write(f"{line}, weights identical on all ranks: {same}\n")
        sys.stdout.flush()
        if not same:
            raise SystemExit("ranks diverged")


if __name__ == "__main__":
    main()
    fastddp.distributed.exit_after_shutdown()
