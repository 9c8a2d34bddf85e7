"""Native HSDP and fastddp's hybrid, 3 steps each, on 2 nodes (in _two_nodes_worker.py).

Every rank trains the same small decoder (tests/fsdp/_hybrid_worker.py) natively and with
each hybrid mode, counting the bytes its node's end of the link sent. Rank 0 writes, per mode,
the first-step gradients' worst relative error against native HSDP's, whether every node ends
with the same parameters, and the link bytes, as JSON to ``argv[1]``.
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.*

import fastddp  # noqa: E402
import fastddp.fsdp  # noqa: E402
from tests.fsdp import _hybrid_worker as w  # noqa: E402

MODES = (w.NATIVE, "bf16-acc", "int8-ef")


def _tx_bytes() -> int:
    with open(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes") as f:
        return int(f.read())


def main(out: str) -> None:
    with fastddp.distributed_session(backend="gloo", timeout=timedelta(seconds=120)) as env:
        mesh = fastddp.fsdp.node_mesh()
        report = {"mesh": mesh.mesh.tolist(), "modes": {}}
        ref = None
        for mode in MODES:
            model, opt, _ = w.build(mesh, mode, width=64)
            dist.barrier()
            before = _tx_bytes()
            grads, _ = w.steps(model, opt, env.rank, 0, 3)
            dist.barrier()
            sent = torch.tensor([_tx_bytes() - before if env.local_rank == 0 else 0])
            dist.all_reduce(sent)
            ref = grads if ref is None else ref
            worst = max(
                ((grads[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)).item() for n in ref
            )
            worst_t = torch.tensor([worst])
            dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
            same = torch.tensor([int(w.same_across_nodes(mesh, w.params_of(model)))])
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
            report["modes"][mode] = {
                "grad_error": worst_t.item(),
                "same_across_nodes": bool(same.item()),
                "link_bytes": int(sent.item()),
            }
        if env.rank == 0:
            with open(out, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
    fastddp.distributed.exit_after_shutdown()  # as examples/resume.py
