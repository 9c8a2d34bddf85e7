"""DDP communication hooks that send gradients as fp16, bf16 or int8.

Three paths, chosen by :class:`CompressState`:

- ``allreduce`` (fp16/bf16, the default): one fused kernel scales by 1/world_size and rounds to
  16 bits into a persistent per-bucket buffer, one asynchronous all-reduce of the 16-bit payload
  (summed in 16 bits by NCCL/Gloo), and one fused kernel widens the result back into
  ``bucket.buffer()`` in place.
- ``alltoall`` (fp16/bf16 with ``accumulate_dtype=torch.float32``, and always for int8): a
  reduce-scatter made of an all-to-all of the compressed chunks, a fused fp32 sum of the P
  received chunks with a single rounding, and an all-gather of the compressed shards. Each rank
  sends the same bytes as in a ring all-reduce, but the sum is never rounded per hop.
- ``passthrough``: buckets that are already fp16/bf16 are averaged as they are.

The all-to-all path has two collectives per bucket. To keep them overlapping with the backward
pass while issuing collectives in the same order on every rank, the second half of bucket k
runs when bucket k + 1 arrives, and the last bucket (``bucket.is_last()``) drains everything.
"""

import itertools
import math
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fastddp import ops

__all__ = ["CompressState", "compress_hook"]

_WIRE_DTYPES = (torch.float16, torch.bfloat16)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int8: "int8"}
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}
_COUNTERS = (
    "calls",
    "passthrough_calls",
    "allocations",
    "payload_bytes",
    "wire_bytes",
    "fp32_wire_bytes",
)
_BUCKET_COUNTERS = ("calls", "payload_bytes", "wire_bytes", "nonfinite_events")
DEFAULT_BLOCK_SIZE = 128
_MAX_BLOCK_SIZE = 1 << 20
# Shards start at multiples of this many elements: 16-byte aligned for every wire dtype.
_ALIGN = 16
# Bumped whenever the bytes exchanged between ranks change meaning; part of the cross-rank
# configuration check, so that ranks running different fastddp versions refuse to mix.
_PROTOCOL = 2
# torch 2.13 renamed all_gather_into_tensor (now deprecated); older releases have only that.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Slot:
    """Persistent buffers and counters of one DDP bucket (keyed by ``bucket.index()``)."""

    __slots__ = (
        "key",
        "params",
        "path",
        "bufs",
        "flag",
        "nonfinite",
        "residual",
        "shard_residual",
        "calls",
        "payload_bytes",
        "wire_bytes",
        "in_flight",
        "resized",
    )

    def __init__(self) -> None:
        self.key: Optional[tuple] = None  # (numel, device, world): what the buffers fit
        # (key, numel) of each parameter in the bucket, in buffer order: lets residuals follow
        # their parameters when DDP rebuilds its buckets or after a restart.
        self.params: Optional[tuple] = None
        self.path = ""
        self.bufs: dict[str, torch.Tensor] = {}
        self.flag: Optional[torch.Tensor] = None
        self.nonfinite: Optional[torch.Tensor] = None  # events, counted on the bucket's device
        self.residual: Optional[torch.Tensor] = None
        self.shard_residual: Optional[torch.Tensor] = None
        self.calls = 0
        self.payload_bytes = 0
        self.wire_bytes = 0
        self.in_flight = False
        self.resized = 0

    def nonfinite_events(self) -> int:
        return 0 if self.nonfinite is None else int(self.nonfinite.item())


class CompressState:
    r"""Settings, buffers, error-feedback residuals and counters of :func:`compress_hook`.

    Args:
        dtype (torch.dtype): what travels on the wire: ``torch.bfloat16`` (default; the fp32
            exponent range, so nothing overflows), ``torch.float16`` (3 more mantissa bits;
            values above 65504 after the division by world size become inf and are counted), or
            ``torch.int8`` (a quarter of fp32's bytes plus one fp32 scale per ``block_size``
            elements; always summed in fp32).
        process_group (ProcessGroup, optional): the group to reduce over; ``None`` is the
            default group.
        accumulate_dtype (torch.dtype, optional): ``torch.float32`` sums the 16-bit payloads in
            fp32 (all-to-all, fused fp32 sum, all-gather: one rounding however many ranks);
            ``None`` (default for fp16/bf16) lets the collective sum in 16 bits, rounding at
            every hop. int8 always accumulates in fp32.
        error_feedback (bool): keep what each rounding dropped and add it to the next step's
            gradient (per bucket, on the bucket's device; saved by :meth:`state_dict`).
        stochastic_rounding (bool): round up or down at random, with probabilities that make
            the rounding unbiased.
        block_size (int, optional): int8 only: elements per absmax scale (default 128, so the
            scales add 1/32 to the int8 bytes).
        seed (int): seed of the stochastic rounding (mixed with rank, bucket and step).

    .. warning::
        Buffers and residuals are keyed by ``bucket.index()``. Give each DDP model its own
        state: two models sharing one state stay correct, but reallocate their buffers on every
        step (a warning says so).

    Example::

        >>> state = fastddp.CompressState(dtype=torch.int8, error_feedback=True)
        >>> ddp_model.register_comm_hook(state, fastddp.compress_hook)
        >>> ...  # train
        >>> state.stats()["wire_bytes"] / state.stats()["fp32_wire_bytes"]
        0.258
    """

    __slots__ = (
        "dtype",
        "process_group",
        "accumulate_dtype",
        "error_feedback",
        "stochastic_rounding",
        "block_size",
        "seed",
        "_slots",
        "_counters",
        "_warned",
        "_verified",
        "_pending",
        "_saved",
        "_carry",
        "_param_keys",
    )

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        accumulate_dtype: Optional[torch.dtype] = None,
        error_feedback: bool = False,
        stochastic_rounding: bool = False,
        block_size: Optional[int] = None,
        seed: int = 0,
    ) -> None:
        where = "CompressState"
        if dtype not in _DTYPE_CODES:
            raise ValueError(
                f"{where}: dtype must be torch.float16, torch.bfloat16 or torch.int8, got {dtype!r}"
            )
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"{where}: process_group must be a torch.distributed.ProcessGroup or "
                f"None (the default group), got {type(process_group).__name__}"
            )
        if accumulate_dtype not in (None, torch.float32):
            raise ValueError(
                f"{where}: accumulate_dtype must be torch.float32 (sum in fp32) or None (let "
                f"the collective sum in the wire dtype), got {accumulate_dtype!r}"
            )
        if dtype == torch.int8:
            accumulate_dtype = torch.float32  # int8 payloads can only be summed after scaling
            block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
            if isinstance(block_size, bool) or not isinstance(block_size, int):
                raise TypeError(f"{where}: block_size must be an int, got {block_size!r}")
            if not 1 <= block_size <= _MAX_BLOCK_SIZE:
                raise ValueError(
                    f"{where}: block_size must be between 1 and {_MAX_BLOCK_SIZE}, got {block_size}"
                )
        elif block_size is not None:
            raise ValueError(
                f"{where}: block_size applies to dtype=torch.int8 only (16-bit values need no "
                "scales); leave it out, or use dtype=torch.int8"
            )
        for name, value in (
            ("error_feedback", error_feedback),
            ("stochastic_rounding", stochastic_rounding),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{where}: {name} must be True or False, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"{where}: seed must be an int, got {seed!r}")
        self.dtype = dtype
        self.process_group = process_group
        self.accumulate_dtype = accumulate_dtype
        self.error_feedback = error_feedback
        self.stochastic_rounding = stochastic_rounding
        self.block_size = block_size
        self.seed = seed
        self._slots: dict[int, _Slot] = {}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._warned = False
        self._verified = False
        self._pending: Optional[Callable[[], None]] = None
        # Bucket entries loaded by load_state_dict, taken up by the first call of each index.
        self._saved: dict[int, dict[str, Any]] = {}
        # Residuals per parameter key, between two bucket layouts: {"stage1"|"stage2": {k: t}}.
        self._carry: Optional[dict[str, dict[int, torch.Tensor]]] = None
        self._param_keys: dict[int, int] = {}  # id(parameter) -> key, in first-seen order

    @property
    def path(self) -> str:
        """``"allreduce"`` or ``"alltoall"``: how fp32 buckets are reduced (see the module)."""
        return "alltoall" if self.accumulate_dtype == torch.float32 else "allreduce"

    def settings(self) -> dict[str, Any]:
        """The settings every rank must share, in plain Python types."""
        return {
            "dtype": _DTYPE_NAMES[self.dtype],
            "accumulate_dtype": None if self.accumulate_dtype is None else "float32",
            "error_feedback": self.error_feedback,
            "stochastic_rounding": self.stochastic_rounding,
            "block_size": self.block_size,
        }

    def __repr__(self) -> str:
        group = "default" if self.process_group is None else "custom"
        args = ", ".join(f"{k}={v}" for k, v in self.settings().items() if v not in (None, False))
        return f"CompressState({args}, process_group={group})"

    # Pickling keeps settings, counters and residuals; the process group and buffers stay.
    def __getstate__(self) -> dict:
        return {"seed": self.seed, "state_dict": self.state_dict()}

    def __setstate__(self, saved: dict) -> None:
        settings = saved["state_dict"]["settings"]
        CompressState.__init__(
            self,
            _dtype_from_name(settings["dtype"]),
            accumulate_dtype=torch.float32 if settings["accumulate_dtype"] else None,
            error_feedback=settings["error_feedback"],
            stochastic_rounding=settings["stochastic_rounding"],
            block_size=settings["block_size"],
            seed=saved["seed"],
        )
        self.load_state_dict(saved["state_dict"])

    def stats(self) -> dict[str, Any]:
        """Return settings and counters since creation (or the last :meth:`load_state_dict`).

        ``payload_bytes`` counts the compressed size of the reduced buckets; ``wire_bytes`` the
        bytes this rank sent for them (a ring all-reduce sends 2(n-1)/n of its payload), and
        ``fp32_wire_bytes`` what an fp32 ring all-reduce of the same buckets would have sent.
        ``nonfinite_events`` counts reductions whose payload held an inf or NaN on this rank;
        ``allocations`` counts buffer (re)allocations, which stop after the second step;
        ``parked_residuals`` counts loaded residuals still waiting for a bucket of their size.
        Each bucket reports its ``path``. Reading ``nonfinite_events`` synchronises with the
        device.
        """
        buckets = {
            index: {
                "numel": 0 if slot.key is None else slot.key[0],
                "path": slot.path,
                "calls": slot.calls,
                "payload_bytes": slot.payload_bytes,
                "wire_bytes": slot.wire_bytes,
                "nonfinite_events": slot.nonfinite_events(),
            }
            for index, slot in sorted(self._slots.items())
        }
        return {
            **self.settings(),
            "path": self.path,
            **self._counters,
            "nonfinite_events": sum(b["nonfinite_events"] for b in buckets.values()),
            "parked_residuals": len(self._saved) + (0 if self._carry is None else 1),
            "buckets": buckets,
        }

    def state_dict(self) -> dict[str, Any]:
        """Return settings, counters and error-feedback residuals (on the CPU), for checkpoints.

        Residuals are per bucket and per rank: save one state dict per rank. They are stored
        with the parameters they belong to, so that they find their parameters again when the
        resumed DDP lays its buckets out differently.
        """
        buckets: dict[int, dict[str, Any]] = {}
        for index, slot in sorted(self._slots.items()):
            buckets[index] = {
                "numel": 0 if slot.key is None else slot.key[0],
                "world": None if slot.key is None else slot.key[2],
                "params": None if slot.params is None else [list(p) for p in slot.params],
                "calls": slot.calls,
                "payload_bytes": slot.payload_bytes,
                "wire_bytes": slot.wire_bytes,
                "nonfinite_events": slot.nonfinite_events(),
                "residual": _cpu(slot.residual),
                "shard_residual": _cpu(slot.shard_residual),
                "shard_offset": _entry_of(slot, self._rank())["shard_offset"],
            }
        for index, saved in self._saved.items():
            buckets.setdefault(index, dict(saved))
        carry = None
        if self._carry is not None:
            carry = {
                stage: {k: _cpu(t) for k, t in parts.items()}
                for stage, parts in self._carry.items()
            }
        return {
            "settings": self.settings(),
            "counters": dict(self._counters),
            "buckets": buckets,
            "carry": carry,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters and residuals saved by :meth:`state_dict`; the settings must match.

        Each residual goes back to its bucket at that bucket's first reduction; if DDP has laid
        the buckets out differently, residuals are moved to where their parameters now are
        (one extra all-reduce of the shard residuals, on every rank, at that moment).
        """
        saved_settings = state_dict.get("settings", {"dtype": state_dict.get("dtype")})
        for key, mine in self.settings().items():
            theirs = saved_settings.get(key, mine if key != "dtype" else None)
            if theirs != mine:
                raise ValueError(
                    f"CompressState.load_state_dict: saved {key} {theirs!r} does not match this "
                    f"state's {mine!r}; build the state with the settings it was saved with"
                )
        self._counters = {k: int(state_dict["counters"].get(k, 0)) for k in _COUNTERS}
        self._slots = {}
        self._pending = None
        self._saved = {int(i): dict(saved) for i, saved in state_dict["buckets"].items()}
        carry = state_dict.get("carry")
        self._carry = None if carry is None else {st: dict(p) for st, p in carry.items()}

    # -- buffers -------------------------------------------------------------------------

    def _keys_of(self, parameters: list[torch.Tensor]) -> tuple:
        keys = self._param_keys
        return tuple((keys.setdefault(id(p), len(keys)), p.numel()) for p in parameters)

    def _slot_for(
        self, index: int, bucket: torch.Tensor, world: int, params: Optional[tuple]
    ) -> _Slot:
        slot = self._slots.get(index)
        if slot is not None and slot.in_flight:
            # Another model's bucket with this index is still being reduced: use a private slot
            # rather than overwrite its payload.
            self._warn_shared()
            return self._fresh(_Slot(), (bucket.numel(), bucket.device, world), params)
        key = (bucket.numel(), bucket.device, world)
        if slot is not None and slot.key == key and slot.params == params:
            return slot
        if slot is not None and slot.key is not None:
            # DDP rebuilt its buckets (or another model shares this state).
            slot.resized += 1
            if slot.resized > 1:
                self._warn_shared()
            if self.error_feedback:
                live = [s for s in self._slots.values() if s.key is not None]
                self._carry_residuals([_entry_of(s, self._rank()) for s in live], bucket.device)
                for s in live:  # each reallocates, and takes its residuals, at its next call
                    s.key = None
        if slot is None:
            slot = self._slots[index] = _Slot()
        saved = self._saved.pop(index, None)
        if saved is not None:
            slot.calls = int(saved["calls"])
            slot.payload_bytes = int(saved["payload_bytes"])
            slot.wire_bytes = int(saved.get("wire_bytes", 0))
            slot.nonfinite = torch.tensor([int(saved["nonfinite_events"])], dtype=torch.int64)
            same = saved["numel"] == key[0] and saved.get("world") in (None, world)
            same = same and _as_params(saved.get("params")) == params
            if not same and self.error_feedback:
                # A different layout than at save time: send every saved residual to where its
                # parameters are now.
                entries = [saved, *self._saved.values()]
                self._saved = {i: {**e, "residual": None, "shard_residual": None}
                               for i, e in self._saved.items()}  # fmt: skip
                self._carry_residuals(entries, bucket.device)
                saved = None
        self._fresh(slot, key, params)
        if saved is not None:
            for name in ("residual", "shard_residual"):
                mine, theirs = getattr(slot, name), saved.get(name)
                if mine is not None and theirs is not None:
                    mine.copy_(theirs)
        self._fill_from_carry(slot)
        return slot

    def _fresh(self, slot: _Slot, key: tuple, params: Optional[tuple]) -> _Slot:
        self._allocate(slot, key)
        slot.params = params
        return slot

    def _rank(self) -> int:
        return dist.get_rank(self.process_group)

    def _carry_residuals(self, entries: list[dict[str, Any]], device: torch.device) -> None:
        """Split the residuals of ``entries`` (bucket layouts) by parameter into the carry."""
        if not self.error_feedback:
            return
        carry = self._carry or {"stage1": {}, "stage2": {}}
        sizes: dict[int, int] = {}
        for e in entries:
            params = _as_params(e.get("params"))
            if params is None:
                continue
            start = 0
            for k, numel in params:
                sizes[k] = numel
                if e.get("residual") is not None:
                    carry["stage1"][k] = e["residual"][start : start + numel].clone()
                start += numel
        if self.path == "alltoall" and sizes:
            # Each rank holds the stage-2 residual of its own shard: scatter every shard into
            # one vector in parameter-key order and sum across ranks to give everyone all of it.
            order = sorted(sizes)
            offsets = dict(zip(order, itertools.accumulate([0] + [sizes[k] for k in order])))
            full = torch.zeros(sum(sizes.values()), device=device)
            for e in entries:
                shard, params = e.get("shard_residual"), _as_params(e.get("params"))
                if shard is None or params is None:
                    continue
                lo_shard = int(e["shard_offset"])
                start = 0
                for k, numel in params:
                    lo, hi = max(start, lo_shard), min(start + numel, lo_shard + shard.numel())
                    if lo < hi:
                        dst = offsets[k] + lo - start
                        full[dst : dst + hi - lo] = shard[lo - lo_shard : hi - lo_shard]
                    start += numel
            dist.all_reduce(full, group=self.process_group)
            for k in order:
                carry["stage2"][k] = full[offsets[k] : offsets[k] + sizes[k]]
        self._carry = carry

    def _fill_from_carry(self, slot: _Slot) -> None:
        carry = self._carry
        if carry is None or slot.params is None:
            return
        start = 0
        shard = slot.shard_residual
        shard_lo = 0 if shard is None else self._rank() * shard.numel()
        for k, numel in slot.params:
            part = carry["stage1"].pop(k, None)
            if part is not None and slot.residual is not None:
                slot.residual[start : start + numel].copy_(part)
            whole = carry["stage2"].pop(k, None)
            if whole is not None and shard is not None:
                lo, hi = max(start, shard_lo), min(start + numel, shard_lo + shard.numel())
                if lo < hi:
                    shard[lo - shard_lo : hi - shard_lo].copy_(whole[lo - start : hi - start])
            start += numel
        if not carry["stage1"] and not carry["stage2"]:
            self._carry = None

    def _allocate(self, slot: _Slot, key: tuple) -> None:
        n, device, world = key
        old_events = slot.nonfinite_events()
        slot.key = key
        slot.path = self.path
        zeros = dict(device=device)
        bufs: dict[str, torch.Tensor] = {}
        if self.path == "allreduce":
            bufs["wire"] = torch.empty(n, dtype=self.dtype, **zeros)
            shard = 0
        else:
            align = _ALIGN if self.dtype != torch.int8 else math.lcm(self.block_size, _ALIGN)
            padded = -(-n // (world * align)) * world * align
            shard = padded // world
            # The padding stays zero: every stage maps zeros to zeros.
            bufs["wire"] = torch.zeros(padded, dtype=self.dtype, **zeros)
            bufs["recv"] = torch.empty(padded, dtype=self.dtype, **zeros)
            bufs["shard"] = torch.empty(shard, dtype=self.dtype, **zeros)
            if self.dtype == torch.int8:
                bufs["scales"] = torch.zeros(padded // self.block_size, **zeros)
                bufs["recv_scales"] = torch.empty(padded // self.block_size, **zeros)
                bufs["shard_sum"] = torch.empty(shard, **zeros)
                bufs["shard_scales"] = torch.empty(shard // self.block_size, **zeros)
        slot.bufs = bufs
        slot.flag = torch.zeros(1, dtype=torch.int32, **zeros)
        slot.nonfinite = torch.tensor([old_events], dtype=torch.int64, **zeros)
        slot.residual = torch.zeros(n, **zeros) if self.error_feedback else None
        with_shard = self.error_feedback and shard > 0
        slot.shard_residual = torch.zeros(shard, **zeros) if with_shard else None
        self._counters["allocations"] += 1

    def _warn_shared(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                "fastddp.CompressState is shared by several DDP models (bucket buffers are "
                "reallocated on every step); give each model its own CompressState",
                stacklevel=5,
            )

    def _seed(self, rank: int, index: int, stage: int) -> int:
        if not self.stochastic_rounding:
            return -1
        # Hashes of int tuples are the same in every process; each rank, bucket call and stage
        # draws its own numbers, reproducibly (and again after a restart: the count is saved).
        calls = self._counters["calls"]
        return hash((self.seed, rank, index, calls, stage)) & ((1 << 63) - 1)


def _cpu(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().cpu().clone()


def _as_params(params: Any) -> Optional[tuple]:
    return None if params is None else tuple((int(k), int(n)) for k, n in params)


def _entry_of(slot: _Slot, rank: int) -> dict[str, Any]:
    shard = slot.shard_residual
    return {
        "params": slot.params,
        "residual": slot.residual,
        "shard_residual": shard,
        "shard_offset": 0 if shard is None else rank * shard.numel(),
    }


def _dtype_from_name(name: str) -> torch.dtype:
    return {v: k for k, v in _DTYPE_NAMES.items()}[name]


_default_state: Optional[CompressState] = None


def _done(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def _new_future(device: torch.device) -> torch.futures.Future:
    # With devices set, the future records CUDA events for its value, so that whoever waits
    # on it also waits for the kernels that produced it.
    return torch.futures.Future(devices=[device] if device.type == "cuda" else None)


def _check_config(state: CompressState, device: torch.device) -> None:
    """Make every rank raise the same error when the ranks' settings differ."""
    group = state.process_group
    s = state.settings()
    mine = torch.tensor(
        [
            _PROTOCOL,
            _DTYPE_CODES[state.dtype],
            int(s["accumulate_dtype"] is not None),
            int(s["error_feedback"]),
            int(s["stochastic_rounding"]),
            s["block_size"] or 0,
        ],
        dtype=torch.int64,
        device=device,
    )
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    rows = [tuple(t.tolist()) for t in everyone]
    if len(set(rows)) > 1:
        names = {v: k for k, v in _DTYPE_CODES.items()}
        lines = []
        for rank, row in enumerate(rows):
            dtype = _DTYPE_NAMES.get(names.get(row[1]), "?")
            lines.append(
                f"  rank {rank}: dtype={dtype}, accumulate_dtype="
                f"{'float32' if row[2] else None}, error_feedback={bool(row[3])}, "
                f"stochastic_rounding={bool(row[4])}, block_size={row[5] or None}"
                + (f", fastddp protocol {row[0]}" if row[0] != _PROTOCOL else "")
            )
        raise ValueError(
            "fastddp: ranks disagree on the compression settings, so their payloads cannot be "
            "combined:\n" + "\n".join(lines) + "\nGive every rank the same CompressState "
            "arguments (and the same fastddp version)."
        )
    state._verified = True


def _drain(state: CompressState) -> None:
    pending, state._pending = state._pending, None
    if pending is not None:
        pending()


def _reduce(
    state: CompressState,
    buffer: torch.Tensor,
    index: int,
    is_last: bool = True,
    average: bool = True,
    params: Optional[tuple] = None,
) -> torch.futures.Future:
    """Sum (``average``: average) ``buffer`` across the group in place; return a future of it.

    ``index`` keys the persistent buffers. With ``is_last=False`` the second half of an
    all-to-all reduction may wait for the next call; the call with ``is_last=True`` completes
    every pending reduction. ``params`` lists ``(key, numel)`` of the tensors packed in
    ``buffer``, so that error-feedback residuals can follow them into another layout.
    """
    group = state.process_group
    world = dist.get_world_size(group)
    scale = 1.0 / world if average else 1.0
    if buffer.dtype in _WIRE_DTYPES:
        # The gradients are already 16-bit: nothing to compress, they travel as they are.
        state._counters["calls"] += 1
        state._counters["passthrough_calls"] += 1
        state._counters["payload_bytes"] += buffer.numel() * buffer.element_size()
        if average:
            buffer.div_(world)
        work = dist.all_reduce(buffer, group=group, async_op=True)
        if is_last:
            _drain(state)
        return work.get_future().then(lambda fut: (fut.value(), buffer)[1])
    if buffer.dtype != torch.float32:
        raise TypeError(
            f"fastddp.compress_hook: gradient bucket dtype {buffer.dtype} is not supported; it "
            "compresses float32 buckets (float16/bfloat16 buckets pass through). Train in "
            "float32, or register no hook for this model"
        )
    if not state._verified:
        _check_config(state, buffer.device)
    state._counters["calls"] += 1
    slot = state._slot_for(index, buffer, world, params)
    slot.calls += 1
    n = buffer.numel()
    _count_bytes(state, slot, n, world)
    if n == 0:
        if is_last:
            _drain(state)
        return _done(buffer)
    if slot.path == "allreduce":
        fut = _allreduce_path(state, slot, buffer, index, scale)
        if is_last:
            _drain(state)
        return fut
    result = _new_future(buffer.device)
    second_half = _alltoall_path(state, slot, buffer, index, scale, result)
    _drain(state)
    if is_last:
        second_half()
    else:
        state._pending = second_half
    return result


def _count_bytes(state: CompressState, slot: _Slot, n: int, world: int) -> None:
    ring_share = -(-n // world)  # elements per rank in a ring all-reduce
    if slot.path == "allreduce":
        payload = n * state.dtype.itemsize
        sent = 2 * (world - 1) * ring_share * state.dtype.itemsize
    else:
        shard = slot.bufs["shard"].numel()
        shard_bytes = shard * state.dtype.itemsize
        payload = n * state.dtype.itemsize
        if state.dtype == torch.int8:
            shard_bytes += (shard // state.block_size) * 4
            payload += -(-n // state.block_size) * 4
        sent = 2 * (world - 1) * shard_bytes  # all-to-all out, then all-gather out
    slot.payload_bytes += payload
    slot.wire_bytes += sent
    state._counters["payload_bytes"] += payload
    state._counters["wire_bytes"] += sent
    state._counters["fp32_wire_bytes"] += 2 * (world - 1) * ring_share * 4


def _allreduce_path(
    state: CompressState, slot: _Slot, buffer: torch.Tensor, index: int, scale: float
) -> torch.futures.Future:
    wire = slot.bufs["wire"]
    rank = dist.get_rank(state.process_group)
    seed = state._seed(rank, index, 0)
    ops.compress(buffer, wire, scale, slot.flag, slot.residual, seed)
    slot.nonfinite.add_(slot.flag)
    slot.in_flight = True
    work = dist.all_reduce(wire, group=state.process_group, async_op=True)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        slot.in_flight = False
        fut.value()  # re-raises a failed all-reduce
        ops.decompress(wire, buffer, 1.0)
        return buffer

    return work.get_future().then(decompress)


def _alltoall_path(
    state: CompressState,
    slot: _Slot,
    buffer: torch.Tensor,
    index: int,
    scale: float,
    result: torch.futures.Future,
) -> Callable[[], None]:
    """Start the all-to-all of ``buffer``'s chunks; return the function that finishes it."""
    group = state.process_group
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    b = slot.bufs
    n = buffer.numel()
    shard = b["shard"].numel()
    int8 = state.dtype == torch.int8
    seed1 = state._seed(rank, index, 1)
    seed2 = state._seed(rank, index, 2)
    if int8:
        block = state.block_size
        nb = -(-n // block)
        ops.quantize_int8(
            buffer, b["wire"][:n], b["scales"][:nb], block, scale, slot.flag, slot.residual, seed1
        )
    else:
        ops.compress(buffer, b["wire"][:n], scale, slot.flag, slot.residual, seed1)
    slot.nonfinite.add_(slot.flag)
    slot.in_flight = True
    first = [dist.all_to_all_single(b["recv"], b["wire"], group=group, async_op=True)]
    if int8:
        first.append(
            dist.all_to_all_single(b["recv_scales"], b["scales"], group=group, async_op=True)
        )

    def finish(fut: torch.futures.Future) -> None:
        # Before the result is set: whoever waits on it may reduce this bucket again at once.
        slot.in_flight = False
        try:
            fut.value()  # re-raises a failed all-gather
            if int8:
                ops.dequantize_int8(
                    b["wire"][:n].view(1, n), b["scales"][: -(-n // block)].view(1, -1),
                    buffer, block,
                )  # fmt: skip
            else:
                ops.decompress(b["wire"][:n], buffer, 1.0)
            result.set_result(buffer)
        except Exception as e:  # hand the failure to whoever waits on the bucket
            result.set_exception(e)

    def second_half() -> None:
        try:
            for work in first:
                work.wait()
            if int8:
                rows = b["recv"].view(world, shard)
                ops.dequantize_int8(
                    rows, b["recv_scales"].view(world, -1), b["shard_sum"], block, 1.0
                )
                ops.quantize_int8(
                    b["shard_sum"], b["shard"], b["shard_scales"], block, 1.0, slot.flag,
                    slot.shard_residual, seed2,
                )  # fmt: skip
            else:
                ops.sum_chunks(
                    b["recv"].view(world, shard), b["shard"], 1.0, slot.flag,
                    slot.shard_residual, seed2,
                )  # fmt: skip
            slot.nonfinite.add_(slot.flag)
            # The wire buffer is free again once the all-to-all is done: gather into it.
            futs = [
                _all_gather_single(b["wire"], b["shard"], group=group, async_op=True)
                .get_future()
            ]  # fmt: skip
            if int8:
                futs.append(
                    _all_gather_single(
                        b["scales"], b["shard_scales"], group=group, async_op=True
                    ).get_future()
                )
            torch.futures.collect_all(futs).then(lambda f: finish(_first_error(f)))
        except Exception as e:
            slot.in_flight = False
            result.set_exception(e)

    return second_half


def _first_error(collected: torch.futures.Future) -> torch.futures.Future:
    """The first failed future of a ``collect_all``, else the collected one."""
    for fut in collected.value():
        try:
            fut.value()
        except Exception:
            return fut
    return collected


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
            (one state shared by every model registered with ``None``).
        bucket (dist.GradBucket): the bucket DDP hands to the hook.

    Returns:
        A future holding ``bucket.buffer()``, averaged.

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
    params = state._keys_of(bucket.parameters()) if state.error_feedback else None
    return _reduce(state, bucket.buffer(), bucket.index(), bucket.is_last(), params=params)
