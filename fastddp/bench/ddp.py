"""End-to-end DDP step time per communication hook.

Modes: ``fp32`` (no hook), ``torch-fp16`` (PyTorch's ``fp16_compress_hook``),
``powersgd-r1|r2|r4`` (PyTorch's ``powerSGD_hook`` at rank 1, 2, 4, with error feedback and warm
start; plain all-reduce during the warm-up steps, compressed in every timed step),
``fastddp-<preset>`` for each of :data:`fastddp.PRESETS` (``fastddp-bf16``, ``fastddp-bf16-acc``
for bf16 summed in fp32, ``fastddp-int8-ef`` with error feedback, ...), each also as
``fastddp-<preset>-delay`` (``delay=1``: one-step delayed reduction), ``fastddp-auto``
(``dtype="auto"``, timed after its plan; the row names the mode it chose), and ``noop`` (PyTorch's
``noop_hook``: no communication, the floor). PyTorch's ``bf16_compress_hook`` is not among them:
it refuses to run without CUDA and NCCL. ``--model`` picks a stack of square linear layers
(``mlp``, sized by ``--params``) or a decoder-only transformer (``transformer``, ``--width`` and
``--layers``, character-level tokens). A step is forward, backward (with the hook's collectives)
and an SGD update; p50/p90 are over the slowest rank's step times after warm-up. Exposed
communication = (p50 - p50 of noop) / p50. Cross-node bytes per step are summed over all ranks:
fastddp's own count (``stats()["cross_node_bytes"]``), and for the others what a ring all-reduce
in rank order sends between nodes. CPU/step is the CPU time of all ranks' processes (every
thread) per step, summed over ranks: held against the cores times the step time, it shows
whether a run is bound by the CPU rather than the link. ``--topologies`` runs each fastddp mode
with each ``CompressState(topology=...)``.
"""

import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.bench.common import (
    AUTO,
    DELAYED_MODES,
    FASTDDP_MODES,
    auto_bytes,
    fastddp_runs,
    fastddp_state,
    pacing_group,
    pretend_nodes,
)
from fastddp.bench.models import Decoder, mlp, mlp_width
from fastddp.hooks.topology import Topology, node_hash

POWERSGD_RANKS = {"powersgd-r1": 1, "powersgd-r2": 2, "powersgd-r4": 4}
# Every mode --modes takes; the default is a few (the table in RESULTS.md keeps its columns).
CHOICES = ["fp32", "torch-fp16", *FASTDDP_MODES, *DELAYED_MODES, AUTO, *POWERSGD_RANKS, "noop"]
MODES = ["fp32", "torch-fp16", "fastddp-bf16", "fastddp-fp16", "noop"]


def _mlp(params, device, width=None):
    # A stack of square layers sized to land near `params` parameters (2048 wide when large).
    if width is None:
        width = mlp_width(params)
    depth = max(1, round(params / (width * width + width)))
    return mlp([width] * (depth + 1), seed=0).to(device), width


def _model_and_batch(args, device, rank):
    """The model and a loss function of it over this rank's fixed batch."""
    gen = torch.Generator().manual_seed(rank)
    if args.model == "transformer":
        torch.manual_seed(0)
        width = args.width or 512
        module = Decoder(width=width, heads=args.heads, layers=args.layers).to(device)
        tokens = torch.randint(0, 96, (args.batch, args.seq + 1), generator=gen).to(device)
        return module, lambda m: Decoder.loss(m(tokens[:, :-1]), tokens[:, 1:])
    module, width = _mlp(args.params, device, args.width)
    x = torch.randn(args.batch, width, generator=gen).to(device)
    return module, lambda m: m(x).square().mean()


def _register(model, mode, topology, args):
    if mode == "torch-fp16":
        model.register_comm_hook(None, fp16_compress_hook)
    elif mode == "noop":
        model.register_comm_hook(None, noop_hook)
    elif mode in POWERSGD_RANKS:
        # PyTorch's advice: plain all-reduce for a warm-up first (here: the untimed steps),
        # with error feedback and warm start on (the defaults).
        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD_RANKS[mode],
            start_powerSGD_iter=max(2, args.warmup),
        )
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        return state
    elif mode == AUTO:
        state = fastddp.CompressState(dtype="auto", topology=topology)
        fastddp.register_comm_hook(model, state)
        return state
    elif mode in FASTDDP_MODES or mode in DELAYED_MODES:
        state = fastddp_state(mode, topology=topology)
        fastddp.register_comm_hook(model, state)
        return state
    return None


def bucket_cap_mb(args, mode, module, device) -> float:
    """DDP's bucket size for ``mode``: ``--bucket-cap-mb``, but one bucket for PowerSGD on Gloo.

    PyTorch's PowerSGD hook issues its second all-reduce from a callback of the first one's
    future, which Gloo runs on one of its own threads: with several buckets the ranks issue
    those all-reduces in different orders, and Gloo aborts on the mismatched sizes (torch
    2.13). NCCL runs such callbacks inline, so on CUDA the option holds for every mode.
    """
    if mode not in POWERSGD_RANKS or device.type == "cuda":
        return args.bucket_cap_mb
    size_mb = sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20
    return max(args.bucket_cap_mb, size_mb + 1)


def _powersgd_bytes(model, rank, min_rate=2):
    """What one powerSGD_hook step sends per rank in its all-reduces: P and Q (fp32) of each
    matrix worth compressing, every other gradient in fp32 as it is."""
    total = 0
    for p in model.parameters():
        if p.dim() > 1:
            n, m = p.shape[0], p[0].numel()
            r = min(n, m, rank)
            if n * m > min_rate * (n + m) * r:  # as torch's _should_compress
                total += (n + m) * r * 4
                continue
        total += p.numel() * 4
    return total


def _percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def untimed_steps(mode: str, state, warmup: int) -> int:
    """The steps before the timed ones: ``warmup``, or more where ``mode`` would still be
    warming up: auto until it has planned, PowerSGD until it compresses."""
    if mode == AUTO:
        return max(warmup, state.trial_steps + 1)
    if mode in POWERSGD_RANKS:
        return max(warmup, state.start_powerSGD_iter)
    return warmup


def run_mode(env, args, label, mode, topology, topo, pacer=None):
    module, loss_of = _model_and_batch(args, env.device, env.rank)
    model = DDP(module, bucket_cap_mb=bucket_cap_mb(args, mode, module, env.device))
    state = _register(model, mode, topology, args)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    warmup = untimed_steps(mode, state, args.warmup)
    times = []
    for step in range(warmup + args.steps):
        if step == warmup:
            cpu = time.process_time()  # every thread of this rank, Gloo's included
        dist.barrier(group=pacer)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss_of(model).backward()
        opt.step()
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    cpu = torch.tensor([(time.process_time() - cpu) / args.steps], dtype=torch.float64)
    dist.all_reduce(cpu)
    steps = torch.tensor(times[warmup:], dtype=torch.float64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    numel = sum(p.numel() for p in model.parameters())
    per_elem = {"fp32": 4, "torch-fp16": 2, "noop": 0}
    calls = max(1, warmup + args.steps)
    if mode == AUTO:
        payload, cross, used = auto_bytes(state.stats(), numel, topo.ring_cross_bytes)
    elif mode in POWERSGD_RANKS:
        payload = _powersgd_bytes(model, POWERSGD_RANKS[mode])
        # Its all-reduces are fp32 rings in rank order: count the payload as fp32 elements.
        cross = topo.ring_cross_bytes(payload // 4, 4)
        used = None
    elif state is not None:
        stats = state.stats()
        assert stats["nonfinite_events"] == 0
        payload = stats["payload_bytes"] // calls
        cross = stats["cross_node_bytes"] // calls
        used = stats["topology_used"]
    else:
        payload = numel * per_elem[mode]
        cross = topo.ring_cross_bytes(numel, per_elem[mode]) if per_elem[mode] else 0
        used = None
    total = torch.tensor([cross], dtype=torch.int64)
    dist.all_reduce(total)
    topology = used
    if mode == AUTO:  # the chosen candidate's, where one reduced every bucket
        chosen = state.stats()["candidates"].get(used)
        topology = None if chosen is None else chosen["topology_used"]
    result = {
        "mode": label,
        "topology": topology,
        "params": numel,
        "p50_ms": _percentile(steps.tolist(), 0.5) * 1e3,
        "p90_ms": _percentile(steps.tolist(), 0.9) * 1e3,
        "payload_bytes": payload,
        "cross_node_bytes": int(total.item()),
        "cpu_s_per_step": cpu.item(),
        "steps": args.steps,
        "chose": used if mode == AUTO else None,  # auto's plan
    }
    if mode == AUTO:
        result["plan"] = state.stats()["plan"]  # and the figures behind it
    return result


def run(env, args):
    pretend_nodes(env, args)
    hashes = torch.tensor([node_hash()], dtype=torch.int64)
    everyone = [torch.empty_like(hashes) for _ in range(env.world_size)]
    dist.all_gather(everyone, hashes)
    topo = Topology([int(h) for h in everyone], env.rank)
    runs = fastddp_runs(args.modes, args.topologies)
    pacer = pacing_group()
    rows = [run_mode(env, args, *run, topo, pacer) for run in runs]
    floor = next((r["p50_ms"] for r in rows if r["mode"] == "noop"), None)
    base = next((r["p50_ms"] for r in rows if r["mode"] == "fp32"), None)
    for r in rows:
        r["vs_fp32"] = r["p50_ms"] / base if base else None
        r["exposed_comm"] = (r["p50_ms"] - floor) / r["p50_ms"] if floor is not None else None
    return rows
