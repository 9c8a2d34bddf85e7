"""FSDP2 step time per reduce-scatter, on a small decoder-only transformer.

Modes: ``fp32`` (FSDP2's own reduce-scatter in fp32), ``torch-bf16`` (FSDP2's own, with
``reduce_dtype=torch.bfloat16``), ``a2a-fp32`` (an fp32 all-to-all and sum: what fastddp does,
uncompressed, to tell the wire format's gain from the collective's), and fastddp's
``CompressedReduceScatter`` as ``fastddp-<preset>`` for each preset of :data:`fastddp.PRESETS`
that sets nothing but the wire dtype (``fastddp-fp16``, ``fastddp-bf16``, ``fastddp-int8``):
it always sums in fp32 and keeps no residuals, so the presets' other settings do not apply. Every
block and the root are ``fully_shard``-ed; a step is forward, backward and an AdamW update
(p50/p90 of the slowest rank, after warm-up). ``RS sent/step`` is what one rank's
reduce-scatters send: fastddp's own count, or for the others the collective's bytes (Gloo's
reduce-scatter is an all-reduce and a slice, NCCL's a ring reduce-scatter). ``grad err`` is the
relative L2 distance of the first step's sharded gradients to those of ``fp32``.
"""

import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from fastddp.bench.common import FASTDDP_MODES, settings_of
from fastddp.bench.models import Decoder
from fastddp.fsdp import compress_reduce_scatter

# The wire dtype of each fastddp mode whose preset sets nothing else.
WIRES = {m: settings_of(m)["dtype"] for m in FASTDDP_MODES if settings_of(m).keys() == {"dtype"}}
MODES = ["fp32", "torch-bf16", "a2a-fp32", *WIRES]


class AllToAllReduceScatter(ReduceScatter):
    """An fp32 reduce-scatter as one all-to-all and a local sum (the uncompressed baseline)."""

    def __init__(self) -> None:
        self.recv = None

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        world = dist.get_world_size(group)
        if self.recv is None or self.recv.numel() < input_tensor.numel():
            self.recv = torch.empty_like(input_tensor)
        recv = self.recv[: input_tensor.numel()]
        dist.all_to_all_single(recv, input_tensor, group=group)
        torch.sum(recv.view(world, -1), dim=0, out=output_tensor)
        kind = getattr(op, "op", op)
        if kind == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        elif kind == dist.ReduceOp.PREMUL_SUM:
            output_tensor.mul_(op.factor)
        return None


def _model(args, device, mode):
    torch.manual_seed(0)
    model = Decoder(width=args.width, heads=args.heads, layers=args.layers).to(device)
    param = torch.bfloat16 if args.param_dtype == "bf16" else None
    reduce = torch.bfloat16 if mode == "torch-bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    comm = None
    if mode in WIRES:
        comm = compress_reduce_scatter(model, WIRES[mode])
    elif mode == "a2a-fp32":
        for m in (*model.blocks, model):
            m.set_custom_reduce_scatter(AllToAllReduceScatter())
    return model, comm


def _percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_mode(env, args, mode, reference):
    model, comm = _model(args, env.device, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(env.rank)
    tokens = torch.randint(0, 96, (args.batch, args.seq + 1), generator=gen).to(env.device)
    times, first = [], None
    for _ in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        Decoder.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        if first is None:
            first = torch.cat([p.grad.to_local().reshape(-1).float() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    steps = torch.tensor(times[args.warmup :], dtype=torch.float64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    numel = sum(p.numel() for p in model.parameters())
    n = env.world_size
    if comm is not None:
        sent = comm.stats()["wire_bytes"] // (args.warmup + args.steps)
    else:
        per_elem = 2 if mode == "torch-bf16" else 4
        hops = (n - 1) / n if mode == "a2a-fp32" or env.backend == "nccl" else 2 * (n - 1) / n
        sent = int(numel * per_elem * hops)
    err = None
    if reference is not None:
        sums = torch.tensor(
            [(first - reference).double().square().sum(), reference.double().square().sum()]
        )
        dist.all_reduce(sums)
        err = (sums[0] / sums[1]).sqrt().item()
    row = {
        "mode": mode,
        "params": numel,
        "p50_ms": _percentile(steps.tolist(), 0.5) * 1e3,
        "p90_ms": _percentile(steps.tolist(), 0.9) * 1e3,
        "rs_sent_bytes": sent,
        "grad_rel_err": err,
        "steps": args.steps,
    }
    return row, first


def run(env, args):
    rows, reference = [], None
    modes = list(args.modes)
    if "fp32" in modes:  # first: the others' gradients are compared with its
        modes.remove("fp32")
        modes.insert(0, "fp32")
    for mode in modes:
        row, first = run_mode(env, args, mode, reference)
        if mode == "fp32":
            reference = first
        rows.append(row)
    base = next((r["p50_ms"] for r in rows if r["mode"] == "fp32"), None)
    for r in rows:
        r["vs_fp32"] = r["p50_ms"] / base if base else None
    return rows
