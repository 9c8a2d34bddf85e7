"""All-reduce sweep: plain fp32 against compressed modes, in the manner of nccl-tests.

Every mode averages a float32 buffer across the ranks, as DDP does with gradients:

- ``fp32``: ``div_(world)`` then ``all_reduce`` in fp32 (DDP without a hook);
- ``torch-fp16``: what PyTorch's ``fp16_compress_hook`` does: ``to(fp16).div_(world)``,
  ``all_reduce``, ``copy_`` back;
- ``fastddp-<preset>``, one per preset of :data:`fastddp.PRESETS`: fastddp's hook worker.
  ``fastddp-fp16`` / ``fastddp-bf16``: fused compress, all_reduce of the 16-bit payload, fused
  decompress in place; ``fastddp-fp16-acc`` / ``fastddp-bf16-acc``: the same payloads summed
  in fp32 (all-to-all, fused fp32 sum, all-gather); ``fastddp-int8``: int8 with one fp32
  scale per 128 elements, summed in fp32. The presets with error feedback (``-ef``) run only
  when asked for: they carry a residual from step to step, which one message cannot show;
- ``noop``: the headroom row: fastddp bf16's local work with no communication at all.

Columns: time (µs, the slowest rank's median per call, on CUDA to a synchronisation), algbw
(fp32 bytes / time), wire busbw (bytes this rank sent / time, what to hold against the link
rate: 2(n-1)/n of the payload for a ring), the payload (the message as the wire carries it),
the bytes all ranks sent to other nodes, relative error (L2) against an fp64 sum rounded to
fp32, and #wrong (elements off by more than the mode's tolerance x the largest value, or not
finite). fastddp's byte counts are its own (``stats()``), so a two-level reduction
(``--topologies hierarchical``) shows what it sends within and across nodes.
"""

import time

import torch
import torch.distributed as dist

from fastddp.bench.common import (
    FASTDDP_MODES,
    fastddp_runs,
    fastddp_state,
    human,
    parse_size,
    pretend_nodes,
    settings_of,
)
from fastddp.hooks import _reduce
from fastddp.hooks.topology import Topology, node_hash, ring_bytes

CHOICES = ["fp32", "torch-fp16", *FASTDDP_MODES, "noop"]
MODES = [m for m in CHOICES if m not in FASTDDP_MODES or not settings_of(m).get("error_feedback")]
_WIRE = {
    "fp32": torch.float32,
    "torch-fp16": torch.float16,
    **{m: settings_of(m)["dtype"] for m in FASTDDP_MODES},
    "noop": None,
}
# #wrong tolerance relative to the largest |value|: a few roundings of the wire dtype.
_TOL = {"fp32": 1e-6, torch.float16: 2**-9, torch.bfloat16: 2**-6, torch.int8: 2**-5}
_TOL.update({torch.int4: 2**-1, torch.int2: 4.0})  # a step of their blocks is that coarse
CHECK_ELEMENTS = 1 << 22  # the error columns look at the first 4 Mi elements


def _data(rank, count, seed=1234):
    g = torch.Generator().manual_seed(seed + 7919 * rank)
    # Gradient-like: mostly small, a few large.
    return torch.randn(count, generator=g) * torch.exp(torch.randn(count, generator=g))


_NOOP_WIRES: dict[int, torch.Tensor] = {}


def _op(mode, buf, world, state):
    if mode == "fp32":
        buf.div_(world)
        dist.all_reduce(buf)
    elif mode == "torch-fp16":
        wire = buf.to(torch.float16).div_(world)
        dist.all_reduce(wire)
        buf.copy_(wire)
    elif mode == "noop":
        from fastddp import ops

        # A persistent wire buffer, as the hook keeps one per bucket.
        wire = _NOOP_WIRES.get(buf.numel())
        if wire is None:
            wire = _NOOP_WIRES[buf.numel()] = torch.empty_like(buf, dtype=torch.bfloat16)
        ops.compress(buf, wire, 1.0 / world)
        ops.decompress(wire, buf, 1.0)
    else:
        _reduce(state, buf, 0).wait()


def _timed(mode, buf, world, state):
    """Seconds of one call, to its end on the device: NCCL's wait returns once the collective
    is queued, so a CUDA call is timed to a synchronisation."""
    start = time.perf_counter()
    _op(mode, buf, world, state)
    if buf.is_cuda:
        torch.cuda.synchronize(buf.device)
    return time.perf_counter() - start


def _time(mode, buf, world, state, min_seconds, max_iters):
    _timed(mode, buf, world, state)  # warm-up (and buffer allocation)
    dist.barrier()
    one = torch.tensor([_timed(mode, buf, world, state)], dtype=torch.float64)
    dist.all_reduce(one, op=dist.ReduceOp.MAX)  # every rank must run the same number
    iters = int(min(max_iters, max(3, min_seconds / max(one.item(), 1e-6))))
    times = []
    for _ in range(iters):
        dist.barrier()
        times.append(_timed(mode, buf, world, state))
    median = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item(), iters


def _errors(mode, count, rank, world, state, device):
    n = min(count, CHECK_ELEMENTS)
    if mode == "noop":
        return None, None
    buf = _data(rank, n).to(device)
    _op(mode, buf, world, state)
    ref = sum(_data(r, n).double() for r in range(world)) / world
    ref = ref.float().double()  # the result is delivered in fp32
    got = buf.cpu().double()
    err = (got - ref).norm() / ref.norm().clamp_min(1e-300)
    bound = _TOL.get(mode, _TOL.get(_WIRE[mode])) * ref.abs().max()
    wrong = int(((got - ref).abs() > bound).sum() + (~torch.isfinite(got)).sum())
    return err.item(), wrong


def _bytes(mode, state, count, topo):
    """A call's payload (the message as the wire carries it), the bytes this rank sent, and
    those that crossed nodes: fastddp's own count per call, whatever the topology; for the
    others what a ring all-reduce in rank order sends."""
    if mode == "noop":
        return 0, 0, 0
    if state is None:
        size = _WIRE[mode].itemsize
        return count * size, ring_bytes(count, topo.world, size), topo.ring_cross_bytes(count, size)
    stats = state.stats()
    calls = stats["calls"]
    return tuple(stats[k] // calls for k in ("payload_bytes", "wire_bytes", "cross_node_bytes"))


def message_sizes(args):
    """The fp32 message sizes of the sweep: min, min x factor, ... up to max (each rounded
    down to whole float32 elements, which is what is reduced and timed)."""
    sizes, size = [], parse_size(args.min_size)
    while size <= parse_size(args.max_size):
        sizes.append(size - size % 4)
        size *= args.factor
    return sizes


def sweep(env, args, progress=None):
    """Run every mode at every size; return one row per (size, mode), on every rank."""
    pretend_nodes(env, args)
    world = env.world_size
    device = env.device
    sizes = message_sizes(args)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, node_hash())
    topo = Topology(everyone, env.rank)
    rows = []
    for size in sizes:
        count = size // 4
        for label, mode, topology in fastddp_runs(args.modes, args.topologies):
            state = check = None
            if mode in FASTDDP_MODES:
                state = fastddp_state(mode, topology=topology)
                # A state of its own for the error check: no residual of the timed calls.
                check = fastddp_state(mode, topology=topology)
            buf = _data(env.rank, count).to(device)
            seconds, iters = _time(mode, buf, world, state, args.min_seconds, args.max_iters)
            err, wrong = _errors(mode, count, env.rank, world, check, device)
            wire_dtype = _WIRE[mode]
            payload, sent, cross = _bytes(mode, state, count, topo)
            total = torch.tensor([cross], dtype=torch.int64)
            dist.all_reduce(total)  # every rank's: in a ring only some ranks send across
            rows.append(
                {
                    "size": size,
                    "size_h": human(size),
                    "count": count,
                    "mode": label,
                    "topology": None if state is None else state.stats()["topology_used"],
                    "type": "none"
                    if wire_dtype is None
                    else str(wire_dtype).removeprefix("torch."),
                    "time_us": seconds * 1e6,
                    "iters": iters,
                    "algbw_gbs": size / seconds / 1e9,
                    "busbw_gbs": sent / seconds / 1e9,
                    "payload_bytes": payload,
                    "sent_bytes": sent,
                    "cross_node_bytes": int(total.item()),
                    "rel_err": err,
                    "wrong": wrong,
                }
            )
            if progress is not None:
                progress()
            del buf
    return sizes, rows
