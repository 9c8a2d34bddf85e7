"""Train with fastddp, checkpoint, and resume from the latest checkpoint after a failure.

    python -m fastddp.launch --standalone --nproc-per-node 2 --max-restarts 3 \\
        examples/resume.py --ckpt-dir ckpt --resume latest

Every ``--ckpt-every`` steps the job saves the model and optimizer (rank 0), each rank's
fastddp hook state (its error-feedback residuals), and the step, into ``ckpt-dir/step-N``;
the directory appears under its final name only once every rank has written its part, so a
crash during a save leaves the previous checkpoint as the latest. With ``--resume latest`` a
(re)started job continues from there; ``--resume none`` starts over, first
removing the earlier run's. Batches depend only on (seed, step, rank), so a resumed
run sees exactly the data the uninterrupted run would have, and with the 16-bit modes (the
default bf16-acc-ef, fp16, bf16) ends with the same parameters, bit for bit. The block codes
(int8, int4, int2) come within their rounding, not bit for bit: a fresh DDP's first step
lays its buckets out in another order than the steps after, and blocks of other elements
share a scale (docs/hooks.md, on state dicts).

A job resumed on another number of ranks (an elastic job, ``--nnodes MIN:MAX``, that lost or
gained a node) regroups the saved hook states with ``CompressState.reshard``, which keeps
every error-feedback residual.
"""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp


def _grow_at(spec: str) -> tuple[int, int]:
    step, _, ranks = spec.partition(":")
    if not (step.isdigit() and ranks.isdigit()):
        raise argparse.ArgumentTypeError(f"{spec!r}: expected STEP:RANKS, e.g. 20:4")
    return int(step), int(ranks)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt-dir", required=True, type=Path)
    p.add_argument("--resume", choices=["latest", "none"], default="latest")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="rank 0 saves the final parameters here")
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (demos)")
    p.add_argument("--progress", type=Path, help="each rank writes 'pid step' here per step")
    p.add_argument(
        "--grow-at",
        type=_grow_at,
        metavar="STEP:RANKS",
        help="at STEP, wait until a node has joined and the job has RANKS ranks (its launcher "
        "restarts the workers for the new member): elastic growth at a known step (tests)",
    )
    # The default, bf16 summed in fp32 with error feedback, has residuals to checkpoint.
    p.add_argument(
        "--mode",
        choices=list(fastddp.PRESETS),
        default="bf16-acc-ef",
        help="the hook's preset (fastddp.PRESETS; default bf16-acc-ef)",
    )
    args = p.parse_args(argv)
    for name in ("steps", "ckpt_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.ckpt_dir.exists() and not args.ckpt_dir.is_dir():
        p.error(f"--ckpt-dir {args.ckpt_dir} is a file; name a folder (made if missing)")
    if args.out is not None and not args.out.absolute().parent.is_dir():
        p.error(f"--out {args.out}: its folder does not exist; make it first")
    if args.out is not None and args.out.is_dir():
        p.error(f"--out {args.out} is a folder; name a file in it")
    try:
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # on every rank alike, before any collective
        p.error(f"cannot make --ckpt-dir {args.ckpt_dir}: {e.strerror}")
    return args


def latest_checkpoint(ckpt_dir: Path):
    """The newest complete ``step-N`` directory, or None."""
    done = [d for d in ckpt_dir.glob("step-*") if d.is_dir() and d.name[5:].isdigit()]
    return max(done, key=lambda d: int(d.name[5:]), default=None)


def _write(obj, path: Path) -> None:
    """``torch.save`` to ``path``, on the disk before it returns."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    """Put ``path``'s entries (names made, renamed) on the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(ckpt_dir: Path, step: int, model, opt, state, rank: int, mode: str, seed: int) -> None:
    # Each part reaches the disk before the rename publishes it, and the rename before the
    # next save: after a power loss the latest checkpoint is whole, not names over empty files.
    tmp = ckpt_dir / f"step-{step}.partial"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a crash during a save
        tmp.mkdir(parents=True)
    dist.barrier()
    if rank == 0:
        train = {"model": model.module.state_dict(), "opt": opt.state_dict()}
        run = {"world_size": dist.get_world_size(), "mode": mode, "seed": seed}
        _write({**train, **run}, tmp / "train.pt")
    _write(state.state_dict(), tmp / f"hook-rank{rank}.pt")
    dist.barrier()  # every part is written: publish the checkpoint in one rename
    if rank == 0:
        final = ckpt_dir / f"step-{step}"
        if final.exists():  # (an earlier attempt's)
            shutil.rmtree(final)
        _sync_dir(tmp)
        os.replace(tmp, final)
        _sync_dir(ckpt_dir)
    dist.barrier()


def load_hook_state(ckpt: Path, saved_world: int, env) -> dict:
    """This rank's hook state from ``ckpt``, regrouped if the job now has another size."""
    if saved_world == env.world_size:
        return torch.load(ckpt / f"hook-rank{env.rank}.pt")
    saved = [torch.load(ckpt / f"hook-rank{r}.pt") for r in range(saved_world)]
    if env.rank == 0:
        print(f"rank 0: {ckpt.name} was saved by {saved_world} ranks and this job has "
              f"{env.world_size}: resharding the hook state", flush=True)  # fmt: skip
    return fastddp.CompressState.reshard(saved, env.world_size)[env.rank]


def train(env, args) -> None:
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(32, 257), nn.GELU(), nn.Linear(257, 257), nn.GELU(),
                        nn.Linear(257, 8))  # fmt: skip
    opt_state, hook_state, start = None, None, 0
    ckpt = None
    if args.resume == "none":
        # Starting over: an earlier run's checkpoints, later steps than this run may reach,
        # would be the latest for the next --resume latest.
        if env.rank == 0:
            old = [d for d in args.ckpt_dir.glob("step-*") if d.is_dir()]
            for d in old:
                shutil.rmtree(d)
            if old:
                print(f"rank 0: --resume none: removed {len(old)} earlier checkpoint(s) from "
                      f"{args.ckpt_dir}", flush=True)  # fmt: skip
        dist.barrier()
    if args.resume == "latest":
        # Rank 0 picks for everyone: a shared filesystem's cache may show some nodes an older
        # listing, and ranks resuming from different steps would wait for one another.
        chosen = [latest_checkpoint(args.ckpt_dir) if env.rank == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        ckpt = chosen[0]
    if ckpt is not None:
        saved = torch.load(ckpt / "train.pt", map_location="cpu")
        # Every rank reads the same file, so each refuses alike.
        for name in ("mode", "seed"):  # the seed picks every step's batches
            given = getattr(args, name)
            if saved.get(name, given) != given:
                raise SystemExit(f"resume.py: {ckpt} was saved with --{name} {saved[name]}; "
                                 f"resume with the same --{name} (here {given})")  # fmt: skip
        start = int(ckpt.name[5:])
        if start > args.steps:
            raise SystemExit(
                f"resume.py: {ckpt} is at step {start}, past --steps {args.steps}; give "
                f"--steps {start} or more, or --resume none to start over"
            )
        net.load_state_dict(saved["model"])
        opt_state = saved["opt"]
        saved_world = saved.get("world_size", len(list(ckpt.glob("hook-rank*.pt"))))
        hook_state = load_hook_state(ckpt, saved_world, env)
    # On the rank's device: init_distributed picks NCCL where there are GPUs, which reduces
    # CUDA tensors only.
    cuda = env.device.type == "cuda"
    model = DDP(net.to(env.device), device_ids=[env.device] if cuda else None)
    state = fastddp.CompressState.from_preset(args.mode)
    model.register_comm_hook(state, fastddp.compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
        state.load_state_dict(hook_state)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    where = f"step {start} ({ckpt})" if ckpt is not None else "scratch"
    # One write per line, so that the ranks' lines do not interleave in the launcher's output.
    sys.stdout.write(f"rank {env.rank}: attempt {restart}, starting from {where}\n")
    sys.stdout.flush()
    for step in range(start, args.steps):
        if args.grow_at is not None and step == args.grow_at[0]:
            _wait_to_grow(env, *args.grow_at)
        gen = torch.Generator().manual_seed((args.seed * 100_003 + step) * 1009 + env.rank)
        x = torch.randn(64, 32, generator=gen).to(env.device)
        y = torch.sin(x[:, :8] * 3) + x[:, 8:16] ** 2
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if (step + 1) % args.ckpt_every == 0:
            save(args.ckpt_dir, step + 1, model, opt, state, env.rank, args.mode, args.seed)
        if args.progress is not None:
            args.progress.with_suffix(f".rank{env.rank}").write_text(f"{os.getpid()} {step + 1}")
        time.sleep(args.step_seconds)
    if env.rank == 0:
        # A job restarted after its last checkpoint (a node that joined as it ended) has no
        # step left to run.
        last = f"final loss {loss.item():.5f}" if start < args.steps else "none left to run"
        print(f"rank 0: done, {args.steps} steps, {last}", flush=True)
        if args.out is not None:
            torch.save([p.detach() for p in model.parameters()], args.out)


def _wait_to_grow(env, step: int, ranks: int, limit: float = 300.0) -> None:
    """Hold the job at ``step`` until it has ``ranks`` ranks: a joining node makes the launcher
    stop these workers and start the grown job, which passes."""
    if env.world_size >= ranks:
        return
    if env.rank == 0:
        print(f"rank 0: at step {step}, waiting for {ranks} ranks", flush=True)
    time.sleep(limit)
    raise SystemExit(f"--grow-at {step}:{ranks}: no node joined within {limit:.0f} s")


def main(argv=None) -> None:
    args = _args(argv)
    with fastddp.distributed_session() as env:
        train(env, args)


if __name__ == "__main__":
    main()
    fastddp.distributed.exit_after_shutdown()
