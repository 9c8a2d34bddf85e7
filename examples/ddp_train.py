"""The script to copy: DDP with fastddp's compressing hook, under any torchrun-style launcher.

    python -m fastddp.launch --standalone --nproc-per-node 2 examples/ddp_train.py --preset bf16

``--preset`` is one of ``fastddp.PRESETS``, or ``auto`` (fastddp measures the modes on this job
and keeps the fastest), or ``none`` (plain DDP, for comparison).
Ranks use Gloo on the CPU and NCCL when each has a GPU. The two fastddp lines are marked; the
rest is an ordinary DDP loop. ``python -m fastddp.demo`` runs this comparison with timings.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="bf16", choices=["none", "auto", *fastddp.PRESETS])
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    # fastddp: set up this rank from any launcher's variables (torchrun, srun, mpirun)
    with fastddp.distributed_session() as env:
        device = env.device  # cuda:<local rank> with NCCL, else the CPU with Gloo
        torch.manual_seed(0)  # the same initial weights on every rank
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 8)).to(device)
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if args.preset != "none":  # fastddp: compress every gradient bucket on the wire
            if args.preset == "auto":
                state = fastddp.CompressState(dtype="auto")
            else:
                state = fastddp.CompressState.from_preset(args.preset)
            model.register_comm_hook(state, fastddp.compress_hook)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        teacher = torch.Generator().manual_seed(1)
        target = torch.randn(32, 8, generator=teacher).to(device)
        data = torch.Generator().manual_seed(100 + env.rank)  # each rank its own batches
        for step in range(args.steps):
            x = torch.randn(64, 32, generator=data).to(device)
            loss = nn.functional.mse_loss(model(x), (x @ target).tanh())
            opt.zero_grad()
            loss.backward()  # the hook averages the gradients across ranks here
            opt.step()
            if env.is_main and (step % 20 == 0 or step == args.steps - 1):
                print(f"step {step:3d} loss {loss.item():.4f}", flush=True)
        flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(env.world_size)]
        dist.all_gather(everyone, flat)
        if not all(torch.equal(everyone[0], f) for f in everyone):
            raise SystemExit("ddp_train: the ranks' weights differ")
        if env.is_main:
            print(f"{args.preset}: {env.world_size} rank(s), final loss {loss.item():.4f}, "
                  "weights identical on every rank", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
    fastddp.distributed.exit_after_shutdown()
