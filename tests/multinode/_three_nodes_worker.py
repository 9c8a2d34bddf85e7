"""Worker of test_topology_netns.py: 3 nodes (namespaces) x 2 ranks, every codec two-level.

Each rank all-reduces a known vector with ``fastddp.all_reduce`` for every codec and checks
the average against the exact one; the nodes must be found from the namespaces alone (no
``FASTDDP_NODE_ID``). Rank 0 prints one line per codec.
"""

from datetime import timedelta

import torch
import torch.distributed as dist

import fastddp

# Presets, and how far each may be from the exact average (relative to its largest value).
TOLERANCES = {"bf16": 2**-7, "bf16-acc": 2**-7, "int8": 2**-5}


def main():
    with fastddp.distributed_session(backend="gloo", timeout=timedelta(seconds=120)) as env:
        x = torch.randn(100_003, generator=torch.Generator().manual_seed(env.rank))
        everyone = [torch.empty_like(x) for _ in range(env.world_size)]
        dist.all_gather(everyone, x)
        want = torch.stack(everyone).double().mean(0)
        for name, tol in TOLERANCES.items():
            state = fastddp.CompressState.from_preset(name)
            got = x.clone()
            fastddp.all_reduce(got, state=state)
            stats = state.stats()
            assert stats["topology_used"] == "hierarchical", stats["topology_used"]
            assert stats["nodes"] == [[0, 1], [2, 3], [4, 5]], stats["nodes"]
            err = (got.double() - want).abs().max().item()
            assert err <= tol * want.abs().max().item(), f"{name}: off by {err:.3e}"
            if env.rank == 0:
                print(f"{name}: {stats['path']} ok, cross-node bytes {stats['cross_node_bytes']}")


if __name__ == "__main__":
    main()
    fastddp.distributed.exit_after_shutdown()  # as examples/resume.py
