"""``compress_hook``, the public DDP comm hook, over one private worker, ``_reduce``."""

from typing import Optional

import torch
import torch.distributed as dist

from fastddp.hooks.paths import path_named
from fastddp.hooks.pipeline import Job, warn_stale
from fastddp.hooks.state import CompressState
from fastddp.hooks.topology import TOPOLOGIES, Topology, node_hash, resolve, ring_bytes

__all__ = ["compress_hook"]

_WIRE_DTYPES = (torch.float16, torch.bfloat16)
# Bumped whenever the bytes exchanged between ranks change meaning; part of the cross-rank
# settings check, so that ranks running different fastddp versions refuse to mix.
# 3: int8 rows carry their scales behind their values (one all-to-all, one all-gather).
# 4: the settings row carries the topology setting and a node identity.
_PROTOCOL = 4

_default_state: Optional[CompressState] = None


def _check_config(state: CompressState, device: torch.device) -> None:
    """Make every rank raise the same error when the ranks' settings differ; find the nodes.

    One all-gather carries each rank's settings and node identity, so every rank derives the
    same topology and raises the same errors.
    """
    group = state.process_group
    s = state.settings()
    loaded = state._loaded_from or (-1, -1)
    mine = torch.tensor(
        [
            _PROTOCOL,
            state.codec.code,
            int(s["accumulate_dtype"] is not None),
            int(s["error_feedback"]),
            int(s["stochastic_rounding"]),
            s["block_size"] or 0,
            TOPOLOGIES.index(state.topology),
            *loaded,
            node_hash(),
        ],
        dtype=torch.int64,
        device=device,
    )
    world = dist.get_world_size(group)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    rows = [tuple(t.tolist()) for t in everyone]
    if len({row[:7] for row in rows}) > 1:
        names = {1: "float16", 2: "bfloat16", 3: "int8"}
        lines = []
        for rank, row in enumerate(rows):
            lines.append(
                f"  rank {rank}: dtype={names.get(row[1], '?')}, accumulate_dtype="
                f"{'float32' if row[2] else None}, error_feedback={bool(row[3])}, "
                f"stochastic_rounding={bool(row[4])}, block_size={row[5] or None}, "
                f"topology={TOPOLOGIES[row[6]]!r}"
                + (f", fastddp protocol {row[0]}" if row[0] != _PROTOCOL else "")
            )
        raise ValueError(
            "fastddp: ranks disagree on the compression settings, so their payloads cannot be "
            "combined:\n" + "\n".join(lines) + "\nGive every rank the same CompressState "
            "arguments (and the same fastddp version)."
        )
    resized = sorted({row[8] for row in rows if row[7] != -1 and row[8] != world})
    if resized:
        raise ValueError(
            f"fastddp: CompressState.load_state_dict was given error-feedback residuals saved "
            f"by a job of {' and '.join(map(str, resized))} ranks, and this job has {world}. "
            "Residuals are per rank: load the saved state dicts of every rank, regroup them "
            f"with CompressState.reshard(saved, {world}), and load entry r into rank r "
            "(examples/resume.py does this); or start this state without them."
        )
    wrong = [
        f"  rank {rank} loaded the state dict of rank {row[7]} of {row[8]}"
        for rank, row in enumerate(rows)
        if row[7] != -1 and (row[7], row[8]) != (rank, world)
    ]
    if wrong:
        raise ValueError(
            "fastddp: CompressState.load_state_dict was given another rank's residuals:\n"
            + "\n".join(wrong)
            + f"\nSave one state_dict() per rank and load each into the same rank of a job of "
            f"the same world size ({world} now)."
        )
    topo = Topology([row[9] for row in rows], dist.get_rank(group))
    state._resolved = resolve(state.topology, topo)
    topo.make_groups(group, state._resolved == "hierarchical")
    state._topology = topo
    state._verified = True


def _reduce(
    state: CompressState,
    buffer: torch.Tensor,
    index: int,
    is_last: bool = True,
    average: bool = True,
    params: Optional[tuple] = None,
    parameters: Optional[list] = None,
) -> torch.futures.Future:
    """Sum (``average``: average) ``buffer`` across the group in place; return a future of it.

    ``index`` names the bucket. With ``is_last=False`` a stage may wait for the next call (see
    ``pipeline.py``); the call with ``is_last=True`` completes everything pending.
    ``parameters`` (a DDP bucket's tensors) or ``params`` (``(key, numel)`` of the tensors
    packed in ``buffer``) let buffers and error-feedback residuals follow their tensors.
    """
    pipeline = state._pipeline
    pipeline.check()
    group = state.process_group
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    passthrough = buffer.dtype in _WIRE_DTYPES
    if not passthrough and buffer.dtype != torch.float32:
        raise TypeError(
            f"fastddp.compress_hook: gradient bucket dtype {buffer.dtype} is not supported; it "
            "compresses float32 buckets (float16/bfloat16 buckets pass through). Train in "
            "float32, or register no hook for this model"
        )
    state._counters["calls"] += 1
    if passthrough:
        # The gradients are already 16-bit: nothing to compress, they travel as they are.
        state._counters["passthrough_calls"] += 1
        state._counters["payload_bytes"] += buffer.numel() * buffer.element_size()
        job = Job(path_named("passthrough"), None, buffer, (group,), world, average, (), None)
        pipeline.submit(lambda: job, is_last)
        return job.result
    if not state._verified:
        _check_config(state, buffer.device)
    key, signature = state._identify(index, buffer, parameters, params)
    previous = state._slots.get(key)
    if previous is not None and pipeline.is_pending(previous.job):
        warn_stale()
    holder = []

    def start() -> Optional[Job]:
        slot = state._slot_for(key, signature, index, buffer, parameters, params, world)
        pipeline.settle(slot.job)
        slot.calls += 1
        _count_bytes(state, slot)
        if slot.numel == 0:
            done = torch.futures.Future()
            done.set_result(buffer)
            holder.append(done)
            return None
        seeds = (state._seed(rank, index, 1), state._seed(rank, index, 2))
        if slot.path == "allreduce":
            seeds = (state._seed(rank, index, 0),)
        path = path_named(slot.path)
        groups = state._topology.groups_for(path.roles)
        job = Job(path, slot, buffer, groups, world, average, seeds, state._topology)
        slot.job = job
        holder.append(job.result)
        return job

    pipeline.submit(start, is_last)
    return holder[0]


def _count_bytes(state: CompressState, slot) -> None:
    n, topo = slot.numel, state._topology
    path = path_named(slot.path)
    payload = state.codec.payload_bytes(n)
    sent = path.sent_bytes(slot, topo)
    cross = path.cross_bytes(slot, topo)
    slot.payload_bytes += payload
    slot.wire_bytes += sent
    slot.cross_node_bytes += cross
    counters = state._counters
    counters["payload_bytes"] += payload
    counters["wire_bytes"] += sent
    counters["fp32_wire_bytes"] += ring_bytes(n, topo.world, 4)
    counters["cross_node_bytes"] += cross
    counters["fp32_ring_cross_node_bytes"] += topo.ring_cross_bytes(n, 4)


def compress_hook(
    state: Optional[CompressState], bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    r"""Average a DDP gradient bucket across ranks, sending it as fp16, bf16 or int8.

    By default one fused pass scales the fp32 bucket by ``1 / world_size`` and rounds it (to
    nearest even) into a persistent 16-bit buffer; the buffer is all-reduced asynchronously; a
    second fused pass widens the sum back into ``bucket.buffer()`` in place, which the future
    returns. With ``accumulate_dtype=torch.float32`` or ``dtype=torch.int8`` the sum is taken
    in fp32 after an all-to-all and rounded once (see :class:`CompressState`). An overflow
    gives inf or NaN, which reaches the gradients (so ``torch.amp.GradScaler`` skips the step)
    and is counted in ``state.stats()["nonfinite_events"]``; nothing is clipped.

    On its first call the hook checks that every rank has the same settings and raises the
    same ``ValueError`` on every rank if not. Buckets that are already float16/bfloat16 pass
    through: divided by the world size and all-reduced as they are. Other dtypes (float64)
    raise ``TypeError``.

    Args:
        state (CompressState, optional): ``None`` uses bfloat16 on the default process group
            (one state shared by every model registered with ``None``; each model keeps its
            own buffers).
        bucket (dist.GradBucket): the bucket DDP hands to the hook.

    Returns:
        A future holding ``bucket.buffer()``, averaged.

    .. warning::
        The future of a bucket may complete only when the next bucket reaches the hook, or at
        the end of the backward pass. A hook that wraps this one and waits on its future
        before returning must call ``state.flush()`` first.

    Example::

        >>> model = DDP(model)
        >>> model.register_comm_hook(None, fastddp.compress_hook)
        >>> # or bf16 summed in fp32, on a chosen group:
        >>> state = fastddp.CompressState(accumulate_dtype=torch.float32, process_group=pg)
        >>> model.register_comm_hook(state, fastddp.compress_hook)
    """
    if state is None:
        global _default_state
        if _default_state is None:
            _default_state = CompressState()
        state = _default_state
    elif not isinstance(state, CompressState):
        raise TypeError(
            "fastddp.compress_hook: state must be a fastddp.CompressState or None, got "
            f"{type(state).__name__}; register it with "
            "model.register_comm_hook(CompressState(...), fastddp.compress_hook)"
        )
    if isinstance(bucket, tuple):
        # Compiled DDP (optimize_ddp="python_reducer" with compiled autograd) calls hooks once
        # per parameter with (grad, param) and ignores what they return. Every rank gets here
        # at the same parameter before any collective, so every rank raises alike.
        raise TypeError(
            "fastddp.compress_hook: DDP passed a (gradient, parameter) pair instead of a "
            "GradBucket, as it does under torch.compile with "
            "torch._dynamo.config.optimize_ddp = 'python_reducer' and compiled autograd. "
            "fastddp compresses whole buckets and does not support that mode: keep "
            "optimize_ddp at its default ('ddp_optimizer'), compile without compiled "
            "autograd, or register no hook"
        )
    return _reduce(
        state, bucket.buffer(), bucket.index(), bucket.is_last(), parameters=bucket.parameters()
    )
