"""DDP communication hooks that send gradients as fp16 or bf16.

Each hook call runs one fused kernel (scale by 1/world_size and round to 16 bits into a
persistent per-bucket buffer), one asynchronous all-reduce of the 16-bit payload, and one fused
kernel that widens the result back into ``bucket.buffer()`` in place.
"""

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from fastddp import ops

__all__ = ["CompressState", "compress_hook"]

_WIRE_DTYPES = (torch.float16, torch.bfloat16)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_COUNTERS = ("calls", "passthrough_calls", "allocations", "payload_bytes")


class _Slot:
    """Persistent buffers and counters of one DDP bucket (keyed by ``bucket.index()``)."""

    __slots__ = ("wire", "flag", "nonfinite", "calls", "payload_bytes", "in_flight", "resized")

    def __init__(self) -> None:
        self.wire: Optional[torch.Tensor] = None
        self.flag: Optional[torch.Tensor] = None
        self.nonfinite: Optional[torch.Tensor] = None  # events, counted on the bucket's device
        self.calls = 0
        self.payload_bytes = 0
        self.in_flight = False
        self.resized = 0


class CompressState:
    r"""Settings, persistent buffers and counters of :func:`compress_hook`.

    Args:
        dtype (torch.dtype): what travels on the wire: ``torch.bfloat16`` (default; the fp32
            exponent range, so nothing overflows) or ``torch.float16`` (3 more mantissa bits;
            values above 65504 after the division by world size become inf and are counted).
        process_group (ProcessGroup, optional): the group to reduce over; ``None`` is the
            default group.

    .. warning::
        Buffers are keyed by ``bucket.index()``. Give each DDP model its own state: two models
        sharing one state stay correct, but reallocate their buffers on every step (a warning
        says so).

    Example::

        >>> state = fastddp.CompressState(dtype=torch.float16)
        >>> ddp_model.register_comm_hook(state, fastddp.compress_hook)
        >>> ...  # train
        >>> state.stats()["nonfinite_events"]
    """

    __slots__ = ("dtype", "process_group", "_slots", "_counters", "_warned")

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        process_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        if dtype not in _WIRE_DTYPES:
            raise ValueError(
                f"CompressState: dtype must be torch.float16 or torch.bfloat16, got {dtype!r}"
            )
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                "CompressState: process_group must be a torch.distributed.ProcessGroup or "
                f"None (the default group), got {type(process_group).__name__}"
            )
        self.dtype = dtype
        self.process_group = process_group
        self._slots: dict[int, _Slot] = {}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._warned = False

    def __repr__(self) -> str:
        group = "default" if self.process_group is None else "custom"
        return f"CompressState(dtype={self.dtype}, process_group={group})"

    # Pickling keeps settings and counters; the process group and buffers stay behind.
    def __getstate__(self) -> dict:
        return {"dtype": self.dtype, "state_dict": self.state_dict()}

    def __setstate__(self, saved: dict) -> None:
        CompressState.__init__(self, saved["dtype"])
        self.load_state_dict(saved["state_dict"])

    def stats(self) -> dict[str, Any]:
        """Return counters since creation (or the last :meth:`load_state_dict`).

        ``payload_bytes`` counts the bytes handed to all-reduce (a ring moves 2(n-1)/n times
        that per rank); ``nonfinite_events`` counts bucket reductions whose 16-bit payload held
        an inf or NaN; ``allocations`` counts buffer (re)allocations, which stop after the
        second step. Reading ``nonfinite_events`` synchronises with the device.
        """
        buckets = {
            index: {
                "numel": 0 if slot.wire is None else slot.wire.numel(),
                "calls": slot.calls,
                "payload_bytes": slot.payload_bytes,
                "nonfinite_events": 0 if slot.nonfinite is None else int(slot.nonfinite.item()),
            }
            for index, slot in sorted(self._slots.items())
        }
        return {
            "dtype": _DTYPE_NAMES[self.dtype],
            **self._counters,
            "nonfinite_events": sum(b["nonfinite_events"] for b in buckets.values()),
            "buckets": buckets,
        }

    def state_dict(self) -> dict[str, Any]:
        """Return the counters, so that statistics survive a restart."""
        stats = self.stats()
        return {
            "dtype": stats["dtype"],
            "counters": dict(self._counters),
            "buckets": stats["buckets"],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters saved by :meth:`state_dict` (the dtype must match)."""
        if state_dict.get("dtype") != _DTYPE_NAMES[self.dtype]:
            raise ValueError(
                f"CompressState.load_state_dict: saved dtype {state_dict.get('dtype')!r} does "
                f"not match this state's {_DTYPE_NAMES[self.dtype]!r}; build the state with the "
                "dtype it was saved with"
            )
        self._counters = {k: int(state_dict["counters"].get(k, 0)) for k in _COUNTERS}
        self._slots = {}
        for index, saved in state_dict["buckets"].items():
            slot = self._slots[int(index)] = _Slot()
            slot.calls = int(saved["calls"])
            slot.payload_bytes = int(saved["payload_bytes"])
            slot.nonfinite = torch.tensor([int(saved["nonfinite_events"])], dtype=torch.int64)

    def _slot_for(self, index: int, bucket: torch.Tensor) -> _Slot:
        slot = self._slots.get(index)
        if slot is None:
            slot = self._slots[index] = _Slot()
        elif slot.in_flight:
            # Another model's bucket with this index is still being reduced: use a private slot
            # rather than overwrite its payload.
            self._warn_shared()
            slot = _Slot()
        wire = slot.wire
        if wire is None or wire.numel() != bucket.numel() or wire.device != bucket.device:
            slot.resized += 1
            if slot.resized > 2:  # once at the first step, once when DDP rebuilds its buckets
                self._warn_shared()
            slot.wire = torch.empty(bucket.numel(), dtype=self.dtype, device=bucket.device)
            slot.flag = torch.zeros(1, dtype=torch.int32, device=bucket.device)
            old = 0 if slot.nonfinite is None else int(slot.nonfinite.item())
            slot.nonfinite = torch.tensor([old], dtype=torch.int64, device=bucket.device)
            self._counters["allocations"] += 1
        return slot

    def _warn_shared(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                "fastddp.CompressState is shared by several DDP models (bucket buffers are "
                "reallocated on every step); give each model its own CompressState",
                stacklevel=4,
            )


_default_state: Optional[CompressState] = None


def _reduce(state: CompressState, buffer: torch.Tensor, index: int) -> torch.futures.Future:
    """Average ``buffer`` across the group in 16 bits, in place; return a future of it."""
    group = state.process_group
    world = dist.get_world_size(group)
    state._counters["calls"] += 1
    if buffer.dtype in _WIRE_DTYPES:
        # The gradients are already 16-bit: nothing to compress, they travel as they are.
        state._counters["passthrough_calls"] += 1
        state._counters["payload_bytes"] += buffer.numel() * buffer.element_size()
        buffer.div_(world)
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: (fut.value(), buffer)[1])
    if buffer.dtype != torch.float32:
        raise TypeError(
            f"fastddp.compress_hook: gradient bucket dtype {buffer.dtype} is not supported; it "
            "compresses float32 buckets (float16/bfloat16 buckets pass through). Train in "
            "float32, or register no hook for this model"
        )
    slot = state._slot_for(index, buffer)
    wire = slot.wire
    slot.calls += 1
    payload = wire.numel() * wire.element_size()
    slot.payload_bytes += payload
    state._counters["payload_bytes"] += payload
    if buffer.numel() == 0:
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buffer)
        return done
    ops.compress(buffer, wire, 1.0 / world, slot.flag)
    slot.nonfinite.add_(slot.flag)
    slot.in_flight = True
    work = dist.all_reduce(wire, group=group, async_op=True)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        slot.in_flight = False
        fut.value()  # re-raises a failed all-reduce
        ops.decompress(wire, buffer, 1.0)
        return buffer

    return work.get_future().then(decompress)


def compress_hook(
    state: Optional[CompressState], bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    r"""Average a DDP gradient bucket across ranks, sending it as fp16 or bf16.

    One fused pass scales the fp32 bucket by ``1 / world_size`` and rounds it (to nearest even)
    into a persistent 16-bit buffer; the buffer is all-reduced asynchronously; a second fused
    pass widens the sum back into ``bucket.buffer()`` in place, which the future returns. An
    fp16 overflow gives inf, which reaches the gradients (so ``torch.amp.GradScaler`` skips the
    step) and is counted in ``state.stats()["nonfinite_events"]``; nothing is clipped.

    Buckets that are already float16/bfloat16 pass through: divided by the world size and
    all-reduced as they are. Other dtypes (float64) raise ``TypeError``.

    Args:
        state (CompressState, optional): ``None`` uses bfloat16 on the default process group
            (one state shared by every model registered with ``None``).
        bucket (dist.GradBucket): the bucket DDP hands to the hook.

    Returns:
        A future holding ``bucket.buffer()``, averaged.

    Example::

        >>> model = DDP(model)
        >>> model.register_comm_hook(None, fastddp.compress_hook)
        >>> # or fp16, on a chosen group:
        >>> model.register_comm_hook(
        ...     fastddp.CompressState(dtype=torch.float16, process_group=pg), fastddp.compress_hook)
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
    return _reduce(state, bucket.buffer(), bucket.index())
