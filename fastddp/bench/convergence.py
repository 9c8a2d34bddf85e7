"""Time to a target loss: the decoder-only transformer trained with each method until it
reaches the validation loss that plain fp32 DDP reaches in ``--steps`` steps.

Text: the sources of a few modules of Python's standard library (they ship with every Python),
as printable-ASCII characters; the last tenth is the validation set. Every method starts from
the same weights and sees the same batches in the same order (drawn from (seed, step, rank)).
``fp32`` runs first and sets the target: its validation loss after ``--steps`` steps, plus
``--slack`` (relative); its own time to target is that of its first check at or below it.
Each other method then trains until its validation loss (checked every ``--eval-every``
steps, on the same fixed batches) is at or below the target, or ``--max-factor`` times
``--steps`` steps have passed. Three untimed fp32 steps come first, so that the process's own
start-up is not charged to fp32. Wall time counts training only, not the validation passes.
Bytes are what one rank put on the wire (``wire_mb``) and of that what went to other nodes
(``cross_node_mb``), each the mean over the ranks: an all-reduce of m bytes over n ranks in a
ring counts the 2(n-1)/n m each rank sends, not m, so that DDP's per-step rows and the periodic
ones, whose reductions span a node or every rank, read alike.

Besides the DDP benchmark's per-step modes, the periodic ones of :mod:`fastddp.bench.peers`:
DiLoCo (``diloco-<preset>-H<n>``, outer ``--outer-lr`` and ``--outer-momentum``) and PyTorch's
post-local SGD (``postlocal-H<n>``); their wall time includes the rounds, and their checks fall
right after a round. ``--pretend-nodes`` splits spawned ranks into nodes. ``--fp32-from`` takes
fp32's curve from an earlier run (of the same options) and times a few fp32 steps on this
link instead, the mean step after the first.
"""

import argparse
import inspect
import json
import math
import time
import typing

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from fastddp.bench import common, ddp, peers
from fastddp.bench.models import Decoder
from fastddp.hooks.topology import Topology, node_hash, ring_bytes

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


def _slowest(seconds: float, group) -> float:
    most = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    return most.item()


def _warmup(args) -> int:
    # PowerSGD's and post-local SGD's warm-up (plain all-reduce first): a tenth of the fp32
    # run, as PyTorch advises.
    return max(2, args.steps // 10)


def run_mode(env, args, mode, data, val_batches, target, pacer=None, topo=None):
    torch.manual_seed(args.seed)
    module = Decoder(width=args.width, heads=args.heads, layers=args.layers).to(env.device)
    numel = sum(p.numel() for p in module.parameters())
    topo = topo or _topology(env)
    state = periodic = None
    if peers.parse(mode) is not None:
        periodic = peers.Periodic(module, mode, args, _warmup(args), topo)
        model = periodic.model
        every = periodic.eval_interval(args.eval_every)
    else:
        model = DDP(module, bucket_cap_mb=ddp.bucket_cap_mb(args, mode, module, env.device))
        state = ddp._register(model, mode, "auto", argparse.Namespace(warmup=_warmup(args)))
        every = args.eval_every
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    limit = args.steps if target is None else int(args.steps * args.max_factor)
    if periodic is not None:  # end on a round, so that the last check sees shared parameters
        limit = -(-limit // every) * every
    trained, rounds_s, curve, reached = 0.0, 0.0, [], None
    for step in range(1, limit + 1):
        batch = _batch(data, args, step, env.rank, args.seed * 100_003).to(env.device)
        dist.barrier(group=pacer)
        start = time.perf_counter()
        Decoder.loss(model(batch[:, :-1]), batch[:, 1:]).backward()
        opt.step()
        if periodic is not None:  # before zero_grad: the averager skips parameters without grad
            inner = time.perf_counter()
            periodic.after_step()  # DiLoCo's outer round, post-local SGD's average
            rounds_s += time.perf_counter() - inner
        opt.zero_grad()
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        trained += time.perf_counter() - start
        if step % every == 0 or step == limit:
            loss = _val_loss(model, val_batches, env.device, pacer)
            at = _slowest(trained, pacer)  # the slowest rank sets the pace, as for "seconds"
            curve.append((step, at, loss))
            if target is not None and loss <= target:
                reached = (step, at)
                break
    slowest = torch.tensor([trained, rounds_s], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    steps_done = curve[-1][0]
    mean = torch.tensor(
        _bytes(mode, model, state, periodic, topo, numel, steps_done), dtype=torch.float64
    )
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    if periodic is not None:
        periodic.close()
    plan = state.stats()["plan"] if mode == common.AUTO else None
    return {
        "mode": mode,
        # auto's plan (None where its trial had not ended); its trial's steps count in the times
        "chose": None if plan is None else plan["summary" if plan["mode"] == "mixed" else "mode"],
        "params": numel,
        "steps": steps_done,
        "seconds": slowest[0].item(),
        "rounds_seconds": slowest[1].item() if periodic is not None else None,
        "reached": reached is not None,
        "steps_to_target": reached[0] if reached else None,
        "seconds_to_target": reached[1] if reached else None,
        "final_val_loss": curve[-1][2],
        # what one rank put on the wire, and of that what went to other nodes (means over ranks)
        "wire_mb": mean[0].item() / 1e6,
        "cross_node_mb": mean[1].item() / 1e6,
        "eval_every": every,
        "curve": curve,
    }


def _topology(env) -> Topology:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, node_hash())
    return Topology(everyone, env.rank)


def _bytes(mode, model, state, periodic, topo, numel, steps):
    """Bytes this rank put on the wire in ``steps`` steps, and of them what went to other nodes:
    fastddp's and the periodic methods' own counts; for the others, rings in rank order over
    every rank (:func:`~fastddp.hooks.topology.ring_bytes`)."""

    def ring(elements, size=4):  # (wire, cross) of one all-reduce over every rank
        return ring_bytes(elements, topo.world, size), topo.ring_cross_bytes(elements, size)

    if periodic is not None:
        return periodic.wire_bytes(), periodic.cross_node_bytes()
    if mode == common.AUTO:  # what every candidate sent, fp32 steps included
        stats = state.stats()
        fp32_steps = stats["steps_in"].get("none", 0)
        wire, cross = (fp32_steps * b for b in ring(numel))
        wire += sum(c["wire_bytes"] for c in stats["candidates"].values())
        return wire, cross + sum(c["cross_node_bytes"] for c in stats["candidates"].values())
    if mode in ddp.POWERSGD_RANKS:  # fp32 in its warm-up, P and Q (fp32) after
        warm = min(steps, state.start_powerSGD_iter)
        payload = ddp._powersgd_bytes(model, ddp.POWERSGD_RANKS[mode])
        (w0, c0), (w1, c1) = ring(numel), ring(payload // 4)
        return warm * w0 + (steps - warm) * w1, warm * c0 + (steps - warm) * c1
    if state is not None:
        stats = state.stats()
        return stats["wire_bytes"], stats["cross_node_bytes"]
    wire, cross = ring(numel, 2 if mode == "torch-fp16" else 4)
    return steps * wire, steps * cross


def _probe_fp32(env, args, data, val_batches, pacer):
    """fp32's row from an earlier run's JSON (its curve and target do not depend on the link),
    with its time here: ``--fp32-probe`` steps timed on this link, the mean step after the
    first times the earlier run's steps; its bytes, the probe's per step times those steps."""
    with open(args.fp32_from) as f:
        row = next(r for r in json.load(f)["rows"] if r["mode"] == "fp32")
    # A check after every step, for the time of each (the checks themselves are not timed).
    probe = argparse.Namespace(**{**vars(args), "steps": args.fp32_probe, "eval_every": 1})
    timed = run_mode(env, probe, "fp32", data, val_batches[:1], None, pacer)
    (first, at_first, _), (last, at_last, _) = timed["curve"][0], timed["curve"][-1]
    per_step = (at_last - at_first) / (last - first)
    scale = lambda n: n * per_step  # noqa: E731
    row = {**row, "curve": [(s, scale(s), loss) for s, _, loss in row["curve"]]}
    row.pop("sent_mb", None)  # an older run's count of messages, not of what the wire carried
    per = {f"{k}_per_step": timed[k] / timed["steps"] for k in ("wire_mb", "cross_node_mb")}
    row.update(
        seconds=scale(row["steps"]),
        seconds_to_target=scale(row["steps_to_target"]),
        fp32_estimated={"from": args.fp32_from, "probe_steps": timed["steps"],
                        "seconds_per_step": per_step, **per},
        **{k: per[f"{k}_per_step"] * row["steps"] for k in ("wire_mb", "cross_node_mb")},
    )  # fmt: skip
    return row


def run(env, args):
    common.pretend_nodes(env, args)
    data = corpus()
    split = len(data) * 9 // 10
    train, val = data[:split], data[split:]
    val_batches = [_batch(val, args, -k, env.rank, 7) for k in range(1, args.val_batches + 1)]
    modes = ["fp32"] + [m for m in args.modes if m != "fp32"]
    rows, target = [], None
    pacer = common.pacing_group()
    topo = _topology(env)
    # A few untimed steps first: the process's first steps (thread pools, allocator, lazy
    # initialisation) would otherwise be charged to whichever mode runs first, fp32.
    warm = argparse.Namespace(**{**vars(args), "steps": 3, "eval_every": 10**9})
    run_mode(env, warm, "fp32", train, val_batches[:1], None, pacer, topo)
    for mode in modes:
        if mode == "fp32" and getattr(args, "fp32_from", None):
            row = _probe_fp32(env, args, train, val_batches, pacer)
        else:
            row = run_mode(env, args, mode, train, val_batches, target, pacer, topo)
        if mode == "fp32":
            # fp32 itself is timed to the same target: its first check at or below it.
            target = row["final_val_loss"] * (1 + args.slack)
            if not math.isfinite(target):
                raise SystemExit(
                    f"fastddp.bench convergence: fp32 diverged (validation loss {target}) at "
                    f"--lr {args.lr}: lower --lr, or take fewer --steps"
                )
            step, seconds, _ = next(c for c in row["curve"] if c[2] <= target)
            row.update(reached=True, steps_to_target=step, seconds_to_target=seconds)
        row["target"] = target
        rows.append(row)
        if env.rank == 0:
            print(f"{mode}: {'reached' if row['reached'] else 'missed'} in {row['steps']} steps",
                  flush=True)  # fmt: skip
    fp32 = rows[0]
    for r in rows:
        r["loss_vs_fp32"] = r["final_val_loss"] / fp32["final_val_loss"] - 1
        for key, base in (("vs_fp32", "fp32"), ("vs_powersgd", "powersgd-r4"),
                          ("vs_postlocal", "postlocal-H")):  # fmt: skip
            # the first row of that method that reached the target (postlocal-H<n>: any n)
            ref = next((b for b in rows if _is(b["mode"], base) and b["reached"]), None)
            ok = ref is not None and r["reached"]
            r[key] = r["seconds_to_target"] / ref["seconds_to_target"] if ok else None
    return rows


def _is(mode: str, base: str) -> bool:
    return mode.startswith(base) if base.endswith("-H") else mode == base
