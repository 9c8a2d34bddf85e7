"""A tiny training job that checkpoints every step and kills its own ranks on cue.

    python -m fastddp.launch --standalone --nproc-per-node 2 --max-restarts 2 \\
        -m fastddp.testing.restart_worker --dir RUN --kill 5:1 --kill 8:0

Each ``--kill STEP:RANK`` fires once per run (a marker file in ``--dir`` remembers it): the
rank SIGKILLs itself when it reaches that step, as a crashed worker would, so the second kill
lands in the restarted attempt. Rank 0 saves the model and SGD's momentum after every step
(written to a temporary file, then renamed, so a kill never leaves half a checkpoint), and a
(re)started attempt resumes from the latest. Batches depend only on (step, rank), so every run that
finishes ends with the parameters of an uninterrupted run, whatever was killed when.

The gradients are averaged by :func:`fastddp.all_reduce` (bf16 on the wire) and applied by a
momentum SGD written out here: neither DDP's constructor nor ``torch.optim`` runs, for each
imports ``torch._dynamo``, a second of CPU in each of the hundred-odd workers the restart tests
start. (DDP with the hook under a restart: ``examples/resume.py``, which the fault tests kill.)

``--init plain`` calls ``torch.distributed.init_process_group`` as most scripts do;
``--init fastddp`` calls :func:`fastddp.init_distributed`. Rank 0 appends one line per attempt
to ``DIR/attempts`` (``attempt N resumed-from S``) and saves the final parameters to
``DIR/params.pt``; ``DIR/step`` holds the last checkpointed step.
"""

import argparse
import contextlib
import gc
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fastddp


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, required=True, help="checkpoints, markers and results")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--init", choices=["plain", "fastddp"], default="plain")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--kill", action="append", default=[], metavar="STEP:RANK")
    p.add_argument("--timeout", type=float, default=60.0, help="process group timeout, s")
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep after each step")
    return p.parse_args(argv)


def _kills(specs: list[str]) -> list[tuple[int, int]]:
    out = []
    for spec in specs:
        step, _, rank = spec.partition(":")
        if not (step.isdigit() and rank.isdigit()):
            raise SystemExit(f"--kill {spec!r}: expected STEP:RANK, e.g. --kill 5:1")
        out.append((int(step), int(rank)))
    return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the block; on again after it (unless it was
    off before), also when the block raises.

    A fresh worker's first optimizer imports ``torch._dynamo`` (``Optimizer``'s methods are
    wrapped by ``torch._disable_dynamo``), as DDP's constructor would: a second of CPU, of which
    the collector's passes over the objects the import makes were a third (a model and its SGD
    after ``import fastddp``: 2.43 -> 2.09 CPU s, mean of 6). The launcher tests' DDP workers
    and DiLoCo's restart worker pause the collector over their set-up alone.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(8, 16, generator=gen)
    return x, x[:, :4].sin()


def _maybe_die(run: Path, kills: list[tuple[int, int]], step: int, rank: int) -> None:
    for k, (at, who) in enumerate(kills):
        marker = run / f"killed-{k}"
        if (at, who) == (step, rank) and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


def _say(what: str) -> None:
    """One timed line, so that a slow run's log shows where its time went."""
    now = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
    print(f"restart_worker {stamp} {what}", flush=True)


def main(argv=None) -> None:
    args = _args(argv)
    _kills(args.kill)  # a bad --kill ends every rank before the group waits for its peers
    _say(f"rank {os.environ.get('RANK', '?')}: started, joining the group")
    timeout = timedelta(seconds=args.timeout)
    if args.init == "plain":
        dist.init_process_group(args.backend, timeout=timeout)
    else:
        fastddp.init_distributed(backend=args.backend, timeout=timeout)
    _say(f"rank {dist.get_rank()}: in the group, building the model")
    train(args)
    dist.barrier()
    dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    """The job, on the default process group (made by :func:`main`, or by the caller)."""
    kills = _kills(args.kill)
    rank = dist.get_rank()
    ckpt = args.dir / "ckpt.pt"
    start = 0
    net = _model()
    params = list(net.parameters())
    momentum = [torch.zeros_like(p) for p in params]
    if ckpt.exists():
        saved = torch.load(ckpt)
        net.load_state_dict(saved["model"])
        momentum = saved["momentum"]
        start = saved["step"]
    state = fastddp.CompressState()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    _say(f"rank {rank}: attempt {attempt}, from step {start}")
    if rank == 0:
        with open(args.dir / "attempts", "a") as f:
            f.write(f"attempt {attempt} resumed-from {start}\n")
    for step in range(start, args.steps):
        _maybe_die(args.dir, kills, step, rank)
        x, y = _batch(step, rank)
        for p in params:
            p.grad = None
        nn.functional.mse_loss(net(x), y).backward()
        grads = [p.grad for p in params]
        fastddp.all_reduce(grads, state=state)
        with torch.no_grad():  # SGD(lr=0.1, momentum=0.9)'s update
            for p, g, m in zip(params, grads, momentum):
                p.sub_(m.mul_(0.9).add_(g), alpha=0.1)
        if rank == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": net.state_dict(), "momentum": momentum, "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
            (args.dir / "step").write_text(str(step + 1))  # for a harness that kills nodes
        time.sleep(args.step_seconds)
    if rank == 0:
        torch.save([p.detach() for p in net.parameters()], args.dir / "params.pt")
    _say(f"rank {rank}: done, {args.steps} steps")


if __name__ == "__main__":
    main()
    # A Gloo worker can abort in interpreter shutdown after a clean destroy (docs/launch.md):
    # its agent would take that for a failure and start one attempt more.
    fastddp.distributed.exit_after_shutdown()
