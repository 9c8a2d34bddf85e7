"""FSDP2 step time per gradient reduction, on a small decoder-only transformer.

Sharded over every rank: ``fp32`` (FSDP2's own reduce-scatter in fp32), ``torch-bf16``
(FSDP2's own, with ``reduce_dtype=torch.bfloat16``), ``a2a-fp32`` (an fp32 all-to-all and sum:
what fastddp does, uncompressed, to tell the wire format's gain from the collective's), and
fastddp's ``CompressedReduceScatter`` as ``fastddp-<preset>`` for each preset of
:data:`fastddp.PRESETS` that sets nothing but the wire dtype (``fastddp-fp16``,
``fastddp-bf16``, ``fastddp-int8``): it always sums in fp32 and keeps no residuals.

Sharded inside each node (:func:`fastddp.fsdp.node_mesh`): ``hsdp`` (FSDP2's native HSDP, its
cross-node all-reduce in fp32), and ``hybrid-<preset>`` (:func:`fastddp.fsdp.hybrid`, the
cross-node all-reduce sent as ``bf16``, ``bf16-acc``, ``int8-ef`` or ``int4-ef``). On one
node these equal plain sharding: run them over ``--link`` with ``--nodes``. ``<mode>+qag``
all-gathers the parameters as int8 with block scales (:func:`fastddp.fsdp.quantize_all_gather`).

Every block and the root are ``fully_shard``-ed; a step is forward, backward and an AdamW update
on a batch of its own (p50/p90 of the slowest rank, after warm-up). ``sent/step`` is what one
rank's gradient reductions send (``hsdp`` and ``hybrid-*``: inside the node and across):
fastddp's own count, an estimate from the collectives' sizes for torch's; ``gathers/step``
what its parameter all-gathers send (counted). ``link/step`` is
what the nodes' ends of the link really sent per timed step (interface counters; over
``--link`` only): all-gathers, reductions and all. ``grad err`` is the relative L2 distance of
the first step's gradients to those of ``fp32``; ``loss`` the mean training loss of
the last 5 steps, over every rank.
"""

import os
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from fastddp.bench.common import FASTDDP_MODES, settings_of
from fastddp.bench.convergence import corpus
from fastddp.bench.models import Decoder
from fastddp.fsdp import compress_reduce_scatter, hybrid, node_mesh, quantize_all_gather
from fastddp.fsdp.all_gather import all_gather_single
from fastddp.fsdp.reduce_scatter import premul_factor

# The wire dtype of each fastddp mode whose preset sets nothing else.
WIRES = {m: settings_of(m)["dtype"] for m in FASTDDP_MODES if settings_of(m).keys() == {"dtype"}}
HSDP = "hsdp"
# fastddp's hybrid sharding, by the preset of its cross-node all-reduce.
HYBRID = {f"hybrid-{name}": name for name in ("bf16", "bf16-acc", "int8-ef", "int4-ef")}
# These modes with the parameters all-gathered as int8 (fastddp.fsdp.quantize_all_gather).
QAG = "+qag"
MODES = ["fp32", "torch-bf16", "a2a-fp32", *WIRES, HSDP, *HYBRID]
MODES += [m + QAG for m in ("fp32", HSDP, "hybrid-bf16-acc", "hybrid-int8-ef")]
LOSS_STEPS = 5  # the loss column averages this many last steps


class CountingAllGather(AllGather):
    """FSDP2's own all-gather (one ``all_gather_into_tensor``), counting what this rank sends."""

    def __init__(self) -> None:
        self.wire_bytes = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        world = dist.get_world_size(group)
        self.wire_bytes += (world - 1) * input_tensor.numel() * input_tensor.element_size()
        return all_gather_single(output_tensor, input_tensor, group, async_op=async_op)


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
            output_tensor.mul_(premul_factor(op))
        return None


def _model(args, device, mode, mesh):
    """The sharded model, its gradient comm (or None) and its all-gather comm."""
    base = mode.removesuffix(QAG)
    model, comm = _sharded(args, device, base, mesh)
    if mode != base:
        return model, comm, quantize_all_gather(model)
    gather = CountingAllGather()
    for m in (*model.blocks, model):
        m.set_custom_all_gather(gather)
    return model, comm, gather


def _sharded(args, device, mode, mesh):
    torch.manual_seed(0)
    model = Decoder(width=args.width, heads=args.heads, layers=args.layers).to(device)
    param = torch.bfloat16 if args.param_dtype == "bf16" else None
    reduce = torch.bfloat16 if mode == "torch-bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
    over = {HSDP: mesh}.get(mode, mesh["shard"] if mode in HYBRID else None)
    for block in model.blocks:
        fully_shard(block, mesh=over, mp_policy=mp)
    fully_shard(model, mesh=over, mp_policy=mp)
    comm = None
    if mode in HYBRID:
        comm = hybrid(model, mesh["replicate"], HYBRID[mode])
    elif mode in WIRES:
        comm = compress_reduce_scatter(model, WIRES[mode])
    elif mode == "a2a-fp32":
        for m in (*model.blocks, model):
            m.set_custom_reduce_scatter(AllToAllReduceScatter())
    return model, comm


def _percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _link_bytes(env) -> Optional[int]:
    """Bytes this node's end of the link has sent (local rank 0; None without a link)."""
    dev = os.environ.get("GLOO_SOCKET_IFNAME")
    path = f"/sys/class/net/{dev}/statistics/tx_bytes"
    if env.num_nodes < 2 or not dev or not os.path.exists(path):
        return None
    with open(path) as f:
        return int(f.read()) if env.local_rank == 0 else 0


def _sent_per_step(env, mode, comm, numel, mesh, total_steps) -> int:
    """What one rank's gradient reductions send per step: fastddp's own count, an estimate
    from the collectives' sizes for torch's."""
    if mode in WIRES:
        return comm.stats()["wire_bytes"] // total_steps
    hops = 1 if mode == "a2a-fp32" or env.backend == "nccl" else 2  # Gloo's RS is an all-reduce

    def reduce_scatter(group_size, per_elem):
        return int(numel * per_elem * hops * (group_size - 1) / group_size)

    if mode not in HYBRID and mode != HSDP:
        return reduce_scatter(env.world_size, 2 if mode == "torch-bf16" else 4)
    nodes, per_node = mesh.mesh.shape
    if mode in HYBRID:
        across = comm.stats()["all_reduce"]["wire_bytes"] // total_steps
    else:  # HSDP's fp32 ring all-reduce of each rank's shard across nodes
        across = int(numel / per_node * 4 * 2 * (nodes - 1) / nodes)
    return reduce_scatter(per_node, 4) + across


def _gathered(gather) -> int:
    if isinstance(gather, CountingAllGather):
        return gather.wire_bytes
    return gather.stats()["wire_bytes"]


def run_mode(env, args, mode, reference, data, mesh):
    model, comm, gather = _model(args, env.device, mode, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    times, losses, first, link = [], [], None, None
    for step in range(args.warmup + args.steps):
        gen = torch.Generator().manual_seed(step * 1009 + env.rank)
        at = torch.randint(0, len(data) - args.seq - 1, (args.batch, 1), generator=gen)
        tokens = data[at + torch.arange(args.seq + 1)].to(env.device)
        dist.barrier()
        if step == args.warmup:
            link = _link_bytes(env)
        start = time.perf_counter()
        loss = Decoder.loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        if first is None:
            # Whole gradients (an all-gather each): shards differ between the meshes.
            first = torch.cat(
                [p.grad.full_tensor().reshape(-1).float() for p in model.parameters()]
            )
        opt.step()
        opt.zero_grad()
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
    dist.barrier()
    if link is not None:
        link = torch.tensor([_link_bytes(env) - link], dtype=torch.float64)
        dist.all_reduce(link)
        link = int(link.item()) // args.steps
    steps = torch.tensor(times[args.warmup :], dtype=torch.float64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    loss = torch.stack(losses[-LOSS_STEPS:]).mean().double().cpu().reshape(1)
    dist.all_reduce(loss)
    numel = sum(p.numel() for p in model.parameters())
    sent = _sent_per_step(env, mode.removesuffix(QAG), comm, numel, mesh, args.warmup + args.steps)
    err = None
    if reference is not None:
        err = ((first - reference).double().norm() / reference.double().norm()).item()
    row = {
        "mode": mode,
        "params": numel,
        "p50_ms": _percentile(steps.tolist(), 0.5) * 1e3,
        "p90_ms": _percentile(steps.tolist(), 0.9) * 1e3,
        "rs_sent_bytes": sent,
        "ag_sent_bytes": _gathered(gather) // (args.warmup + args.steps),
        "link_bytes_per_step": link,
        "grad_rel_err": err,
        "loss": loss.item() / env.world_size,
        "steps": args.steps,
    }
    return row, first


def run(env, args):
    rows, reference = [], None
    modes = list(args.modes)
    if "fp32" in modes:  # first: the others' gradients are compared with its
        modes.remove("fp32")
        modes.insert(0, "fp32")
    mesh = None
    if any(m.removesuffix(QAG) == HSDP or m.removesuffix(QAG) in HYBRID for m in modes):
        mesh = node_mesh(env.device.type)
    data = corpus()
    for mode in modes:
        row, first = run_mode(env, args, mode, reference, data, mesh)
        if mode == "fp32":
            reference = first
        rows.append(row)
    for base_mode in ("fp32", HSDP):
        base = next((r["p50_ms"] for r in rows if r["mode"] == base_mode), None)
        for r in rows:
            r[f"vs_{base_mode}"] = r["p50_ms"] / base if base else None
    return rows
