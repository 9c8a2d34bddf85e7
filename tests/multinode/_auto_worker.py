"""Worker of test_auto_netns.py: ``dtype="auto"`` on every rank of every node, until the link
slows down and a plan is made after that.

Each step every rank learns (one all-reduce) whether ``argv[2]`` exists: the test creates it
once it has lowered the link's rate. Rank 0 writes each plan, and the step at which the
slowdown was seen, as JSON to ``argv[1]``; it creates ``argv[1] + ".planned"`` after the first
plan, which the test waits for.
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp

# Steps before the link slows, and again after it: the test slows it by the wall clock, so the
# budget for the new plan counts from there.
MAX_STEPS = 150


def main(out: str, slowed_marker: str) -> None:
    with fastddp.distributed_session(backend="gloo", timeout=timedelta(seconds=120)) as env:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 256)))
        state = fastddp.CompressState(dtype="auto", allow=["none", "int8-ef"])
        model.register_comm_hook(state, fastddp.compress_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(env.rank)
        plans, slowed_at, step = [], None, -1
        while step + 1 - (slowed_at or 0) < MAX_STEPS:
            step += 1
            opt.zero_grad()
            model(torch.randn(16, 256, generator=gen)).square().mean().backward()
            opt.step()
            plan = state.stats()["plan"]
            if plan is not None and not plan["trial"] and plan["plans"] > len(plans):
                plans.append(plan)
                if env.rank == 0 and len(plans) == 1:
                    open(out + ".planned", "w").close()
            seen = torch.tensor([int(os.path.exists(slowed_marker))])
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
            if seen.item() and slowed_at is None:
                slowed_at = step
            if slowed_at is not None and plans and plans[-1]["made_at_step"] > slowed_at:
                break
        if env.rank == 0:
            with open(out, "w") as f:
                json.dump({"plans": plans, "slowed_at": slowed_at, "steps": step + 1}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    fastddp.distributed.exit_after_shutdown()  # as examples/resume.py
