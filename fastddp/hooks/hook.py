"""``compress_hook``, the public DDP comm hook, over one private worker, ``_reduce``."""

from typing import Optional

import torch
import torch.distributed as dist

from fastddp.hooks import handshake, lifecycle, stats
from fastddp.hooks.job import Job
from fastddp.hooks.paths import PASSTHROUGH
from fastddp.hooks.pipeline import warn_stale
from fastddp.hooks.state import CompressState
from fastddp.hooks.topology import resolve

__all__ = ["compress_hook"]

# Buckets of these dtypes are already small: they pass through, averaged as they are.
_PASSTHROUGH_DTYPES = (torch.float16, torch.bfloat16)

_default_state: Optional[CompressState] = None


def _verify(
    state: CompressState,
    device: torch.device,
    layout: tuple[int, int, int] = (0, 0, 0),
    problem: tuple[int, int] = (0, 0),
    op: int = 0,
    bucket: int = 0,
    dtype: Optional[torch.dtype] = None,
) -> None:
    """Check every rank's settings (and ``all_reduce``'s ``layout``, tensor ``problem``, ``op``
    and ``bucket`` size; a hook's first bucket ``dtype``) alike, the handshake; then find the
    nodes and make groups."""
    rows = handshake.exchange(state, device, layout, problem, op, bucket, dtype)
    handshake.check(rows, state._load_problem)
    topo = handshake.topology_of(rows, dist.get_rank(state.process_group))
    resolved = resolve(state.topology, topo)
    topo.make_groups(state.process_group, resolved == "hierarchical")
    state._resolved, state._topology, state._verified = resolved, topo, True


def _reduce(
    state: CompressState,
    buffer: torch.Tensor,
    index: int,
    is_last: bool = True,
    average: bool = True,
    params: Optional[tuple] = None,
    parameters: Optional[list] = None,
    plan: bool = False,
) -> torch.futures.Future:
    """Sum (``average``: average) ``buffer`` across the group in place; return a future of it.

    ``index`` names the bucket. With ``is_last=False`` a stage may wait for the next call (see
    ``pipeline.py``); the call with ``is_last=True`` completes everything pending.
    ``parameters`` (a DDP bucket's tensors) or ``params`` (``(key, numel)`` of the tensors
    packed in ``buffer``) let buffers and error-feedback residuals follow their tensors.
    ``plan``: hand the bucket's plan to the state's native runner (``native.py``), which
    reduces this buffer from its next call on.
    """
    future, job = _start(state, buffer, index, is_last, average, params, parameters)
    if plan and job is not None and job.slot is not None and job.runtime.native:
        make = lambda seeds: Job(  # noqa: E731
            job.path, job.slot, buffer, job.groups, job.world, average, seeds, job.topo
        )
        state._native.plan(job, make, state)
    return future


def _start(
    state: CompressState,
    buffer: torch.Tensor,
    index: int,
    is_last: bool,
    average: bool,
    params: Optional[tuple],
    parameters: Optional[list],
    defer: bool = False,
) -> tuple[torch.futures.Future, Optional[Job]]:
    """:func:`_reduce`, returning the job too (None if nothing is sent); ``defer`` leaves it
    pending past the end of the backward pass (``delay=1``)."""
    pipeline = state._pipeline
    pipeline.check()
    group = state.process_group
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    passthrough = buffer.dtype in _PASSTHROUGH_DTYPES
    if buffer.layout != torch.strided:
        raise TypeError(
            "fastddp.compress_hook: DDP handed it a sparse gradient (nn.Embedding(sparse=True) "
            "and nn.EmbeddingBag(sparse=True) make them); it compresses dense buckets. Build "
            "the module with sparse=False, or register no hook for this model"
        )
    if not state._verified:  # (any dtype: a model cast on one rank only is named on every rank)
        _verify(state, buffer.device, dtype=buffer.dtype)
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
        job = Job(PASSTHROUGH, None, buffer, (group,), world, average, (), None)
        pipeline.submit(lambda: job, is_last, defer)
        return job.result, job
    key, signature = state._table.identify(index, buffer, parameters, params)
    previous = state._table.slots.get(key)
    if previous is not None and pipeline.is_pending(previous.job):
        warn_stale()
    holder = []

    def start() -> Optional[Job]:
        slot = lifecycle.slot_for(state, key, signature, index, buffer, parameters, params, world)
        pipeline.settle(slot.job)
        slot.calls += 1
        stats.count(state._counters, slot, state.codec, state._topology)
        if slot.numel == 0:
            done = torch.futures.Future()
            done.set_result(buffer)
            holder.append(done)
            return None
        path = slot.path
        seeds = tuple(lifecycle.seed(state, rank, index, stage) for stage in path.seed_stages)
        groups = state._topology.groups_for(path.roles)
        job = Job(path, slot, buffer, groups, world, average, seeds, state._topology)
        slot.job = job
        holder.extend((job.result, job))
        return job

    pipeline.submit(start, is_last, defer)
    return holder[0], holder[1] if len(holder) > 1 else None


def _reduce_delayed(state: CompressState, bucket: dist.GradBucket) -> torch.futures.Future:
    """``delay=1``: start reducing this step's gradient, give the bucket the previous step's."""
    pipeline = state._pipeline
    pipeline.check()
    buffer, parameters = bucket.buffer(), bucket.parameters()
    params = state._table.keys_of(parameters)
    delayed = state._delayed

    def swap_and_start() -> None:
        if not state._verified:  # before a loaded gradient in waiting can raise on one rank
            _verify(state, buffer.device, dtype=buffer.dtype)
        entry = delayed.entry_for(params, buffer, pipeline.settle)
        pipeline.settle(entry.job)
        send = delayed.start(entry, buffer)
        entry.job = _start(state, send, bucket.index(), False, True, None, parameters, True)[1]

    pipeline.guarded(swap_and_start)
    done = torch.futures.Future(devices=[buffer.device] if buffer.device.type == "cuda" else None)
    done.set_result(buffer)
    return done


def compress_hook(
    state: Optional[CompressState], bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    r"""Average a DDP gradient bucket across ranks, sending it as fp16, bf16, int8, int4 or int2.

    By default one fused pass scales the fp32 bucket by ``1 / world_size`` and rounds it (to
    nearest even) into a persistent 16-bit buffer; the buffer is all-reduced asynchronously; a
    second fused pass widens the sum back into ``bucket.buffer()`` in place, which the future
    returns. With ``accumulate_dtype=torch.float32`` or a block codec (int8, int4, int2) the sum
    is taken in fp32 after an all-to-all and rounded once (see :class:`CompressState`). An overflow
    gives inf or NaN, which reaches the gradients (so ``torch.amp.GradScaler`` skips the step)
    and, where one of this rank's encodes met it, is counted in
    ``state.stats()["nonfinite_events"]``; nothing is clipped.

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
        state = _default_state if _default_state is not None else _new_default_state()
    runner = getattr(state, "_runner", None)
    if runner is not None:
        # The bucket's steady state, run by the extension (native.py); None: not planned.
        future = runner.run(bucket)
        if future is not None:
            return future
    if not isinstance(state, CompressState):
        raise TypeError(
            "fastddp.compress_hook: state must be a fastddp.CompressState or None, got "
            f"{type(state).__name__}; register it with "
            "model.register_comm_hook(CompressState(...), fastddp.compress_hook)"
        )
    if not isinstance(bucket, dist.GradBucket):
        _not_a_bucket(bucket)
    if state.dtype == "auto":
        return state._reduce_bucket(bucket)
    if state.delay:
        return _reduce_delayed(state, bucket)
    if state._layout is not None:
        raise ValueError(
            "fastddp.compress_hook: this state was given to fastddp.all_reduce, and its buffers "
            "and residuals belong to those tensors; register a CompressState of its own"
        )
    return _reduce(
        state,
        bucket.buffer(),
        bucket.index(),
        bucket.is_last(),
        parameters=bucket.parameters(),
        plan=getattr(state, "_native", None) is not None,
    )


def _not_a_bucket(bucket) -> None:
    """Raise the ``TypeError`` that says what to hand the hook instead of ``bucket``."""
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
    raise TypeError(
        "fastddp.compress_hook: bucket must be the dist.GradBucket that DDP hands a comm hook, "
        f"got {type(bucket).__name__}; register the hook on a DDP model "
        "(model.register_comm_hook(state, fastddp.compress_hook)), or average tensors with "
        "fastddp.all_reduce(tensors)"
    )


def _new_default_state() -> CompressState:
    global _default_state
    _default_state = CompressState()
    return _default_state
