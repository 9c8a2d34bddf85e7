"""Time to a target loss: the decoder-only transformer trained with each method until it
reaches the validation loss that plain fp32 DDP reaches in ``--steps`` steps.

Text: the sources of a few modules of Python's standard library (they ship with every Python),
as printable-ASCII characters; the last tenth is the validation set. Every method starts from
the same weights and sees the same batches in the same order (drawn from (seed, step, rank)).
``fp32`` runs first and sets the target: its validation loss after ``--steps`` steps, plus
``--slack`` (relative); its own time to target is that of its first check at or below it.
Each other method then trains until its validation loss (checked every ``--eval-every``
steps, on the same fixed batches) is at or below the target, or ``--max-factor`` times
``--steps`` steps have passed. Wall time counts training only, not the validation passes;
bytes are what one rank's gradient reductions sent.
"""

import argparse
import inspect
import json
import time
import typing

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from fastddp.bench import common, ddp
from fastddp.bench.models import Decoder

MODES = [
    "fp32",
    "torch-fp16",
    "powersgd-r1",
    "powersgd-r4",
    "fastddp-bf16",
    "fastddp-bf16-acc",
    "fastddp-int8",
    "fastddp-int8-ef",
]


def corpus() -> torch.Tensor:
    """Printable-ASCII codes (0..95) of a few standard-library sources."""
    text = "".join(inspect.getsource(m) for m in (argparse, inspect, json.decoder, typing))
    return torch.tensor([min(max(ord(c), 32), 127) - 32 for c in text], dtype=torch.long)


def _batch(data, args, step, rank, gen_base):
    gen = torch.Generator().manual_seed(gen_base + step * 1009 + rank)
    at = torch.randint(0, len(data) - args.seq - 1, (args.batch, 1), generator=gen)
    return data[at + torch.arange(args.seq + 1)]


def _val_loss(model, val_batches, device, group=None) -> float:
    with torch.no_grad():
        total = sum(
            Decoder.loss(model(b[:, :-1].to(device)), b[:, 1:].to(device)) for b in val_batches
        )
    mean = torch.tensor([float(total) / len(val_batches)], dtype=torch.float64)
    dist.all_reduce(mean, group=group)
    return mean.item() / dist.get_world_size()


def run_mode(env, args, mode, data, val_batches, target, pacer=None):
    torch.manual_seed(args.seed)
    module = Decoder(width=args.width, heads=args.heads, layers=args.layers).to(env.device)
    model = DDP(module, bucket_cap_mb=ddp.bucket_cap_mb(args, mode, module, env.device))
    # PowerSGD's warm-up (plain all-reduce first): a tenth of the fp32 run, as PyTorch advises.
    hook_args = argparse.Namespace(warmup=max(2, args.steps // 10))
    state = ddp._register(model, mode, "auto", hook_args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    limit = args.steps if target is None else int(args.steps * args.max_factor)
    trained, curve, reached = 0.0, [], None
    for step in range(1, limit + 1):
        batch = _batch(data, args, step, env.rank, args.seed * 100_003).to(env.device)
        dist.barrier(group=pacer)
        start = time.perf_counter()
        Decoder.loss(model(batch[:, :-1]), batch[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        trained += time.perf_counter() - start
        if step % args.eval_every == 0 or step == limit:
            loss = _val_loss(model, val_batches, env.device, pacer)
            curve.append((step, trained, loss))
            if target is not None and loss <= target:
                reached = (step, trained)
                break
    slowest = torch.tensor([trained], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    numel = sum(p.numel() for p in model.parameters())
    steps_done = curve[-1][0]
    if mode == common.AUTO:  # what every candidate sent, fp32 steps included
        stats = state.stats()
        sent = sum(c["payload_bytes"] for c in stats["candidates"].values())
        per_step = (sent + stats["steps_in"].get("none", 0) * numel * 4) / steps_done
    elif state is not None:
        per_step = state.stats()["payload_bytes"] / steps_done
    elif mode in ddp.POWERSGD_RANKS:
        per_step = ddp._powersgd_bytes(model, ddp.POWERSGD_RANKS[mode])
    else:
        per_step = numel * (2 if mode == "torch-fp16" else 4)
    return {
        "mode": mode,
        "params": numel,
        "steps": steps_done,
        "seconds": slowest.item(),
        "reached": reached is not None,
        "steps_to_target": reached[0] if reached else None,
        "seconds_to_target": reached[1] if reached else None,
        "final_val_loss": curve[-1][2],
        "sent_mb": per_step * steps_done / 1e6,
        "curve": curve,
    }


def run(env, args):
    data = corpus()
    split = len(data) * 9 // 10
    train, val = data[:split], data[split:]
    val_batches = [_batch(val, args, -k, env.rank, 7) for k in range(1, args.val_batches + 1)]
    modes = ["fp32"] + [m for m in args.modes if m != "fp32"]
    rows, target = [], None
    pacer = common.pacing_group()
    for mode in modes:
        row = run_mode(env, args, mode, train, val_batches, target, pacer)
        if mode == "fp32":
            # fp32 itself is timed to the same target: its first check at or below it.
            target = row["final_val_loss"] * (1 + args.slack)
            step, seconds, _ = next(c for c in row["curve"] if c[2] <= target)
            row.update(reached=True, steps_to_target=step, seconds_to_target=seconds)
        row["target"] = target
        rows.append(row)
        if env.rank == 0:
            print(f"{mode}: {'reached' if row['reached'] else 'missed'} in {row['steps']} steps",
                  flush=True)  # fmt: skip
    base = rows[0]["seconds_to_target"]
    for r in rows:
        r["vs_fp32"] = r["seconds_to_target"] / base if r["reached"] else None
    return rows
