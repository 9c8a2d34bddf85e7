"""A compressed reduce-scatter for FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 reduce-scatters each parameter group's gradients in its ``MixedPrecisionPolicy``'s
``reduce_dtype`` and lets a module replace that collective (``set_custom_reduce_scatter``).
:class:`CompressedReduceScatter` is such a replacement: each rank encodes its whole input once
with a codec of :mod:`fastddp.codecs` (bf16, fp16, or int8/int4 with one fp32 scale per block, in
the hooks' row layout), one all-to-all hands rank ``r`` the encoded chunk ``r`` of every
rank, and rank ``r`` sums those chunks in fp32 straight into its output. The only rounding is
each rank's own encoding; the sum itself is never rounded to 16 bits, so the error does not
grow with the number of ranks (a 16-bit ring rounds at every hop).

With error feedback, what each rank's encoding dropped is kept and added to the next encoding
of the same parameter group. FSDP2 does not tell a reduce-scatter which group it reduces, so
:func:`compress_reduce_scatter` (``install.py``) gives each module a door of its own to the
shared comm, which names the module; the residual is as large as the group's unsharded
gradient, on every rank.
"""

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from fastddp.codecs import CODECS, HalfCodec, codec_for
from fastddp.fsdp._agree import codec_row, outer_group
from fastddp.fsdp._buffers import Buffers
from fastddp.fsdp._checkpoint import LoadCheck, pack

try:  # FSDP2's comm interfaces (torch >= 2.9 have set_custom_reduce_scatter)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError as error:  # pragma: no cover - depends on the installed torch
    raise ImportError(
        f"fastddp.fsdp needs FSDP2's custom reduce-scatter (torch >= 2.9): {error}"
    ) from error

__all__ = ["CompressedReduceScatter", "ReduceScatter", "premul_factor"]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def premul_factor(op: ReduceOp) -> float:
    """The factor of a ``PREMUL_SUM`` op as FSDP2 makes it: ``ReduceOp.PREMUL_SUM(f)``, or
    ``torch.distributed._make_nccl_premul_sum(f)`` in torch 2.11.

    Its state is ``(op, factor)`` in both; torch 2.11's op has no ``factor`` attribute.
    """
    return float(op.__getstate__()[1])


class CompressedReduceScatter(ReduceScatter):
    r"""FSDP2's reduce-scatter with gradients sent as bf16, fp16, int8, int4 or int2, summed in
    fp32.

    Install it with :func:`compress_reduce_scatter` (every ``fully_shard``-ed module of a
    model), or per module with ``module.set_custom_reduce_scatter(comm)``; one instance may
    serve every module, since FSDP2 reduces one parameter group at a time on one stream.

    FSDP2's ``op`` is honoured: ``SUM``, ``AVG`` and ``PREMUL_SUM(f)`` (which FSDP2 uses for a
    ``gradient_divide_factor``). The scale is applied in fp32 before encoding, so fp16 holds the
    averaged gradient rather than the sum. Inputs may be fp32, bf16 or fp16 (the
    ``reduce_dtype``); with fp32, the output is the fp32 sum of the decoded chunks, unrounded.

    Args:
        dtype (torch.dtype): on the wire: ``torch.bfloat16`` (default), ``torch.float16``
            (values beyond 65504 after the scaling become inf), ``torch.int8``, ``torch.int4``
            or ``torch.int2`` (one fp32 absmax scale per ``block_size`` elements of each rank's
            chunk; int2 only with ``error_feedback``).
        block_size (int, optional): int8, int4 and int2 only: elements per scale (default 128;
            int4 and int2: a power of two from 32 to 256).
        error_feedback (bool): keep each rank's rounding error per parameter group and add it
            to the next step's gradient (default False). Without it int4's rounding error is
            not carried over (0.2 to 0.9 of a gradient's norm per step in the tests). The
            residuals are state: save the comm with the model (``dcp.save({..., "fastddp":
            comm})``) to resume exactly. Every parameter must get a gradient each step.

    Buffers (wire out, wire in, and for 16-bit inputs of another wire dtype an fp32 staging
    buffer) are kept and reused; they grow to the largest parameter group and never shrink.
    :meth:`stats` counts calls, bytes and buffer allocations.

    Example::

        >>> for layer in model.layers:
        ...     fully_shard(layer)
        >>> fully_shard(model)
        >>> fastddp.fsdp.compress_reduce_scatter(model, dtype=torch.bfloat16)
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        *,
        block_size: Optional[int] = None,
        error_feedback: bool = False,
    ):
        self.codec = codec_for(dtype, block_size, "CompressedReduceScatter")
        if not isinstance(error_feedback, bool):
            raise TypeError(
                f"CompressedReduceScatter: error_feedback must be True or False, got "
                f"{error_feedback!r}"
            )
        if CODECS[dtype].feedback_required and not error_feedback:
            raise ValueError(
                f"CompressedReduceScatter: dtype={dtype} trains only with error feedback; pass "
                "error_feedback=True"
            )
        self.dtype = dtype
        self.block_size = self.codec.block_size
        self.error_feedback = error_feedback
        self._residuals: dict[Any, torch.Tensor] = {}  # by parameter group (module index)
        self.group_key: Any = None  # the group being reduced, set by its module's door
        self.group_names: dict[Any, str] = {}  # the modules' names, for errors (set there too)
        self.modules: list = []  # (name, module) it is installed on (compress_reduce_scatter's)
        self._buffers = Buffers()
        self._load = LoadCheck("CompressedReduceScatter")
        # Whether a failed load is agreed on over every rank of the job rather than the group
        # reduced: hybrid() sets it, whose later cross-node reduction would wait for the ranks
        # of another shard group that raised.
        self._agree_on_world = False
        self._counters = dict.fromkeys(("calls", "wire_bytes", "fp32_wire_bytes", "elements"), 0)
        # Per device: the flags of this rank's encode and of the 16-bit rounding of its sum,
        # and the reduce-scatters in which either met inf or NaN (counted on the device).
        self._nonfinite: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __repr__(self) -> str:
        block = f", block_size={self.block_size}" if self.block_size else ""
        feedback = ", error_feedback=True" if self.error_feedback else ""
        return f"CompressedReduceScatter(dtype={self.dtype}{block}{feedback})"

    # FSDP2 allocates its input and output through the comm. They must be fresh tensors: FSDP2
    # keeps views of the output as the sharded gradients.
    def allocate(
        self,
        size: Sequence[int],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def stats(self) -> dict[str, int]:
        """Counters since construction.

        ``calls``: reduce-scatters done; ``elements``: input elements reduced;
        ``wire_bytes``: bytes this rank sent to other ranks; ``fp32_wire_bytes``: what an fp32
        all-to-all reduce-scatter of the same inputs sends; ``allocations``: wire and staging
        buffers allocated or grown (flat after the first step); ``nonfinite_events``:
        reduce-scatters in which this rank's encode of its input, or its rounding of its
        chunk's sum to a 16-bit output, gave inf or NaN (reading it waits for the device).
        """
        events = 0
        for _, count in self._nonfinite.values():
            if count.is_cuda:
                torch.cuda.synchronize(count.device)  # FSDP2 adds on its reduce-scatter stream
            events += int(count.item())
        counters = {**self._counters, "allocations": self._buffers.allocations}
        return {**counters, "nonfinite_events": events}

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op=ReduceOp.SUM,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        world = dist.get_world_size(group)
        chunk = output_tensor.numel()
        pre, post = self._check(output_tensor, input_tensor, world, op, async_op)
        if not self._load.agreed:  # every rank's comm has the same settings and loaded well
            # (Under HSDP or hybrid(), across the shard groups too: see outer_group.)
            world_wide = self._agree_on_world
            checked, outer = (None, None) if world_wide else (group, outer_group(self.modules))
            row = codec_row(self.codec, self.error_feedback)
            self._load.agree(input_tensor.device, checked, row, outer)
        if chunk == 0:
            return None
        src = input_tensor.view(-1)
        dst = output_tensor.view(-1)
        codec = self.codec
        row = codec.row_elems(chunk)
        wire = (world * row, codec.wire_dtype, src.device)
        flags, count = self._flags(src.device)
        if codec.plain and src.dtype == codec.wire_dtype:
            send = src  # already in the wire dtype, nothing rounded; the scale after the sum
            flags[:1].zero_()
        else:
            send = self._buffers.get("send", *wire)
            residual = self._residual(src) if self.error_feedback else None
            source = self._fp32_source(src)
            codec.encode(source, send.view(world, row), chunk, pre, flags[:1], residual)
        recv = self._buffers.get("recv", *wire)
        dist.all_to_all_single(recv, send, group=group)
        rows = recv.view(world, row)
        met = flags  # the flags this call's ops set: the encode's, and a 16-bit rounding's
        if dst.dtype == torch.float32:
            codec.sum_into(rows, chunk, dst, post)
            met = flags[:1]  # (nothing rounded: the rounding's flag is an earlier call's)
        elif codec.plain and dst.dtype == codec.wire_dtype:
            codec.reduce(rows, dst, chunk, post, flags[1:])  # one rounding, of the fp32 sum
        else:  # a 16-bit output of another wire: the fp32 sum rounded once, overflow flagged
            total = self._buffers.get("sum", chunk, torch.float32, src.device)
            codec.sum_into(rows, chunk, total, post)
            HalfCodec(dst.dtype).encode(total, dst, chunk, 1.0, flags[1:])
        count.add_(met.amax())
        self._counters["calls"] += 1
        self._counters["elements"] += src.numel()
        self._counters["wire_bytes"] += (world - 1) * codec.payload_bytes(chunk)
        self._counters["fp32_wire_bytes"] += (world - 1) * chunk * 4
        return None

    def _flags(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._nonfinite:
            flags = torch.zeros(2, dtype=torch.int32, device=device)
            self._nonfinite[device] = (flags, torch.zeros(1, dtype=torch.int64, device=device))
        return self._nonfinite[device]

    def _check(self, output, input, world, op, async_op) -> tuple[float, float]:
        # Everything here depends only on what FSDP2 passes, which is the same on every rank:
        # a bad call raises on every rank before any collective.
        where = "CompressedReduceScatter"
        if async_op:
            raise ValueError(
                f"{where}: async_op=True is not supported (FSDP2 calls with async_op=False "
                "on its reduce-scatter stream); call it synchronously"
            )
        if input.dtype not in _INPUT_DTYPES or output.dtype != input.dtype:
            raise TypeError(
                f"{where}: input and output must both be float32, bfloat16 or float16 (FSDP2's "
                f"reduce_dtype), got {input.dtype} and {output.dtype}"
            )
        if input.device != output.device:
            raise ValueError(f"{where}: input is on {input.device} but output on {output.device}")
        if not (input.is_contiguous() and output.is_contiguous()):
            raise ValueError(f"{where}: input and output must be contiguous")
        if input.numel() != output.numel() * world:
            raise ValueError(
                f"{where}: input has {input.numel()} elements, but a reduce-scatter over "
                f"{world} ranks into {output.numel()} needs {output.numel() * world}"
            )
        kind = getattr(op, "op", op)  # PREMUL_SUM(f) is a ReduceOp carrying its factor
        if kind == ReduceOp.SUM:
            scale = 1.0
        elif kind == ReduceOp.AVG:
            scale = 1.0 / world
        elif kind == ReduceOp.PREMUL_SUM:
            scale = premul_factor(op)
        else:
            raise ValueError(
                f"{where}: op must be SUM, AVG or PREMUL_SUM (what FSDP2 uses for gradients), "
                f"got {kind}"
            )
        # fp32 inputs are scaled before encoding (fp16 then holds the average, not the sum);
        # 16-bit inputs sent as they are get the scale after the fp32 sum.
        if input.dtype == self.dtype and self.codec.plain:
            return 1.0, scale
        return scale, 1.0

    def discard_feedback(self) -> None:
        """Drop the error-feedback residuals, after a step the optimizer skipped: the next
        reductions owe nothing, as a new comm's do (see ``CompressState.discard_feedback``).
        Call it on every rank, between steps."""
        for residual in self._residuals.values():
            residual.zero_()

    def _residual(self, src: torch.Tensor) -> torch.Tensor:
        where = "CompressedReduceScatter"
        if self.group_key is None:
            raise ValueError(
                f"{where}: error feedback keeps a residual per parameter group, and this call "
                "does not say which group it reduces; install it with "
                "fastddp.fsdp.compress_reduce_scatter(model, dtype, error_feedback=True)"
            )
        residual = self._residuals.get(self.group_key)
        if residual is None:
            residual = torch.zeros(src.numel(), dtype=torch.float32, device=src.device)
        elif residual.numel() != src.numel():
            name = self.group_names.get(self.group_key)
            module = "" if name is None else f" (module {name!r})" if name else " (the root)"
            raise ValueError(
                f"{where}: parameter group {self.group_key}{module} reduced {residual.numel()} "
                f"elements before and {src.numel()} now: a parameter got no gradient in one of "
                "these steps. Error feedback needs every parameter's gradient each step (or "
                "requires_grad=False), or use error_feedback=False"
            )
        elif residual.device != src.device:  # loaded from a checkpoint, on the CPU
            residual = residual.to(src.device)
        self._residuals[self.group_key] = residual
        return residual

    def state_dict(self) -> dict[str, bytes]:
        """This rank's residuals, serialised under a key naming its rank (a DCP ``Stateful``:
        DCP keeps one copy of values saved under one key); empty without error feedback."""
        if not self.error_feedback:
            return {}
        residuals = {k: r.detach().cpu().clone() for k, r in self._residuals.items()}
        return pack({"codec": repr(self), "residuals": residuals})

    def load_state_dict(self, state_dict: dict[str, bytes]) -> None:
        """Restore this rank's residuals, saved by a comm of the same settings. Call it on
        every rank: what does not fit is raised on every rank at the first reduce-scatter.
        Without error feedback only an empty one fits (a comm with it saved residuals)."""
        if self.error_feedback or state_dict:
            self._load.load(state_dict, self._restore)

    def _restore(self, saved: dict[str, Any]) -> None:
        if saved["codec"] != repr(self):
            raise ValueError(
                f"CompressedReduceScatter.load_state_dict: saved by {saved['codec']}, loaded "
                f"into {self!r}; build the comm with the settings it was saved with, or leave "
                "this comm out of what you load"
            )
        self._residuals = dict(saved["residuals"])

    def _fp32_source(self, src: torch.Tensor) -> torch.Tensor:
        if src.dtype == torch.float32:
            return src
        staged = self._buffers.get("stage", src.numel(), torch.float32, src.device)
        staged.copy_(src)
        return staged
