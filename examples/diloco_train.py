"""DiLoCo: DDP inside each node every step, a compressed outer step across nodes every H steps.

    python -m fastddp.launch --nproc-per-node 4 examples/diloco_train.py --pretend-nodes 2

On a cluster, launch it as any script (one launcher per node) and leave out ``--pretend-nodes``,
which splits one machine's ranks into nodes by ``FASTDDP_NODE_ID``, to try it there. The model
is DDP over its node's ranks; ``diloco.step()`` after each optimizer step does the rest.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sync-every", type=int, default=20, help="inner steps per outer round")
    p.add_argument("--compress", default="int8-ef", choices=["none", *fastddp.PRESETS])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--pretend-nodes", type=int, default=0, help="split this machine's ranks")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.pretend_nodes < 0:
        p.error("--pretend-nodes must be 0 (the real nodes) or more")
    if args.sync_every < 1:
        p.error("--sync-every must be at least 1")
    if args.sync_every > args.steps:
        p.error(f"--sync-every {args.sync_every} is more than --steps {args.steps}: no outer "
                "round would run, and the nodes would train apart")  # fmt: skip
    with fastddp.distributed_session() as env:
        if args.pretend_nodes and env.num_nodes > 1:
            raise SystemExit(  # every rank knows the nodes alike
                f"diloco_train: --pretend-nodes splits one machine's ranks into nodes, but this "
                f"job already runs on {env.num_nodes} nodes (their groups would cross them); "
                "leave it out"
            )
        if args.pretend_nodes and env.local_world_size % args.pretend_nodes:
            raise SystemExit(  # on every rank alike, before any collective
                f"diloco_train: --pretend-nodes {args.pretend_nodes} splits this machine's "
                f"{env.local_world_size} rank(s) unevenly; give a divisor of it"
            )
        if args.pretend_nodes:  # after init_distributed, which wants FASTDDP_* alike everywhere
            node = env.local_rank * args.pretend_nodes // env.local_world_size
            os.environ["FASTDDP_NODE_ID"] = f"pretend-node-{node}"
        device = env.device
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 8)).to(device)
        # fastddp: DDP inside the node, DiLoCo across nodes
        ids = [device.index] if device.type == "cuda" else None
        model = DDP(net, device_ids=ids, process_group=fastddp.DiLoCo.node_group())
        compress = None if args.compress == "none" else args.compress
        diloco = fastddp.DiLoCo(model, sync_every=args.sync_every, compress=compress)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        target = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)).to(device)
        data = torch.Generator().manual_seed(100 + env.rank)  # each rank its own batches
        for step in range(args.steps):
            x = torch.randn(64, 32, generator=data).to(device)
            loss = nn.functional.mse_loss(model(x), (x @ target).tanh())
            opt.zero_grad()
            loss.backward()  # DDP averages the gradients inside the node
            opt.step()
            synced = diloco.step()  # every --sync-every steps: the outer round across nodes
            if env.is_main and (step == 0 or synced):
                print(f"step {step:3d} round {diloco.round} loss {loss.item():.4f}", flush=True)
        flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(env.world_size)]
        dist.all_gather(everyone, flat)
        same = all(torch.equal(everyone[0], f) for f in everyone)
        if not same and args.steps % args.sync_every == 0:  # a round just made them equal
            raise SystemExit("diloco_train: the ranks' weights differ after the last round")
        stats = diloco.stats()
        left = args.steps % args.sync_every
        # Between rounds each node trains on its own: after a part round they differ.
        why = f" (the last {left} step(s) trained each node on its own)" if left else ""
        if env.is_main:
            print(f"{args.compress}: {stats['nodes']} node(s) x {stats['ranks_per_node']} "
                  f"rank(s), {stats['round']} rounds, {stats['cross_node_bytes']} bytes across "
                  f"nodes from rank 0, final loss {loss.item():.4f}, weights identical on every "
                  f"rank: {same}{why}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
    fastddp.distributed.exit_after_shutdown()
