"""A job of _two_nodes_worker.py (test_topology_netns.py), run on every rank of every node.

For each codec: plain DDP and DDP with fastddp's hook (``topology="auto"``) train the same
steps; the hooked gradients must match within the codec's tolerance, and the bytes the node's
link really sent (its interface counters) are held against what ``stats()`` says the node's
ranks sent across nodes. Rank 0 writes the figures as JSON to ``argv[1]``.
"""

import copy
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp

# Presets, and how far each may be from plain DDP (relative to the step's largest gradient).
TOLERANCES = {"bf16": 2**-7, "bf16-acc": 2**-7, "int8": 2**-5}
STEPS = 3


def _tx_bytes(dev):
    # Bytes this namespace's end of the link has sent (the node's upload).
    with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
        return int(f.read())


def _train(model, gen, width):
    grads = []
    for _ in range(STEPS):
        x = torch.randn(8, width, generator=gen)
        model.zero_grad()
        model(x).square().mean().backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
    return grads


def _measured(env, dev, model, width):
    """Train ``model`` between barriers; return its gradients and the bytes all nodes sent."""
    dist.barrier()
    before = _tx_bytes(dev)
    out = _train(model, torch.Generator().manual_seed(env.rank), width)
    dist.barrier()
    sent = torch.tensor([_tx_bytes(dev) - before if env.local_rank == 0 else 0])
    dist.all_reduce(sent)
    return out, int(sent.item())


def main(out_path):
    with fastddp.distributed_session(backend="gloo", timeout=timedelta(seconds=120)) as env:
        dev = os.environ["GLOO_SOCKET_IFNAME"]
        torch.manual_seed(0)
        width = 256
        base = nn.Sequential(*[nn.Linear(width, width) for _ in range(6)])
        report = {"world": env.world_size, "nodes": env.num_nodes, "codecs": {}}
        for name, tol in TOLERANCES.items():
            ref = DDP(copy.deepcopy(base), bucket_cap_mb=0.5)
            want, plain_sent = _measured(env, dev, ref, width)
            model = DDP(copy.deepcopy(base), bucket_cap_mb=0.5)
            state = fastddp.CompressState.from_preset(name)
            model.register_comm_hook(state, fastddp.compress_hook)
            got, sent = _measured(env, dev, model, width)
            for w_step, g_step in zip(want, got):
                bound = tol * max(w.abs().max().item() for w in w_step)
                worst = max((w - g).abs().max().item() for w, g in zip(w_step, g_step))
                assert worst <= bound, f"{name}: off by {worst:.2e} (bound {bound:.2e})"
            stats = state.stats()
            counted = torch.tensor([stats["cross_node_bytes"], stats["fp32_ring_cross_node_bytes"]])
            dist.all_reduce(counted)
            report["codecs"][name] = {
                "topology_used": stats["topology_used"],
                "path": stats["path"],
                "nodes": stats["nodes"],
                "counted_cross_node_bytes": int(counted[0]),
                "counted_fp32_ring_cross_node_bytes": int(counted[1]),
                "link_bytes": sent,
                "plain_ddp_link_bytes": plain_sent,
            }
        if env.rank == 0:
            with open(out_path, "w") as f:
                json.dump(report, f, indent=1)
            print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
    fastddp.distributed.exit_after_shutdown()  # as examples/resume.py
