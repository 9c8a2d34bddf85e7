"""DiLoCo under ``fastddp.launch --max-restarts``: a job that checkpoints every round and kills
one of its ranks once, on cue.

    python -m fastddp.launch --standalone --nproc-per-node 4 --max-restarts 1 \\
        tests/diloco/_restart_worker.py --dir RUN --kill 13:1

Two "nodes" of two ranks on this machine (``FASTDDP_NODE_ID`` by local rank), ``sync_every``
4, int8 with error feedback across the nodes. After each round every rank saves its model,
inner optimizer and DiLoCo state (written, then renamed), and once all have, rank 0 records the
round; a (re)started attempt resumes from the last recorded round. Batches depend only on
(step, rank), so a run that finishes ends with the parameters of an uninterrupted one, bit for
bit. Rank 0 writes those to ``RUN/params.pt`` and one line per attempt to ``RUN/attempts``.
"""

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.testing.restart_worker import collector_paused

STEPS, EVERY = 24, 4


def args_of(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--kill", default=None, metavar="STEP:RANK", help="SIGKILL a rank, once")
    return p.parse_args(argv)


def main() -> None:
    args = args_of()
    with fastddp.distributed_session() as env:
        train(env, args)


def train(env, args: argparse.Namespace) -> None:
    """The job on the default process group; ``env`` gives ``rank``, ``local_rank`` and
    ``local_world_size`` (a :class:`fastddp.DistEnv`, or the caller's)."""
    os.environ["FASTDDP_NODE_ID"] = f"node-{env.local_rank * 2 // env.local_world_size}"
    torch.manual_seed(0)
    with collector_paused():  # the set-up imports torch._dynamo
        net = nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 3))
        model = DDP(net, process_group=fastddp.DiLoCo.node_group())
        diloco = fastddp.DiLoCo(model, sync_every=EVERY, compress="int8-ef")
        opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    latest = args.dir / "latest"
    start = 0
    if latest.exists():  # every rank saved this round's files before it was recorded
        saved = torch.load(args.dir / f"round{latest.read_text()}-rank{env.rank}.pt")
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        diloco.load_state_dict(saved["diloco"])
        start = diloco.inner_steps
    if env.rank == 0:
        with open(args.dir / "attempts", "a") as f:
            f.write(f"attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT')} from {start}\n")
    kill = tuple(map(int, args.kill.split(":"))) if args.kill else None
    for step in range(start, STEPS):
        marker = args.dir / "killed"
        if kill == (step, env.rank) and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        gen = torch.Generator().manual_seed(1000 * env.rank + step)
        x = torch.randn(16, 12, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), torch.sin(2 * x[:, :3])).backward()
        opt.step()
        if diloco.step():
            state = {"model": net.state_dict(), "opt": opt.state_dict()}
            state["diloco"] = diloco.state_dict()
            path = args.dir / f"round{diloco.round}-rank{env.rank}.pt"
            torch.save(state, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
            dist.barrier()
            if env.rank == 0:
                latest.with_suffix(".tmp").write_text(str(diloco.round))
                os.replace(latest.with_suffix(".tmp"), latest)
    if env.rank == 0:
        torch.save([q.detach().clone() for q in net.parameters()], args.dir / "params.pt")


if __name__ == "__main__":
    main()
    fastddp.distributed.exit_after_shutdown()
