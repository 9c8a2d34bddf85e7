"""``CompressState``: what :func:`fastddp.compress_hook` keeps between calls.

The state holds its settings (checked in ``settings.py``), the slot table (``slots.py``), the
parked residuals (``residuals.py``) and the pipeline (``pipeline.py``); the hook (``hook.py``)
drives them. Statistics are in ``stats.py``, state dicts in ``checkpoint.py``.
"""

from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist

from fastddp.codecs import CODECS, Codec, codec_for
from fastddp.hooks import checkpoint, native, settings, stats
from fastddp.hooks.delay import Delayed
from fastddp.hooks.paths import Path
from fastddp.hooks.pipeline import Pipeline
from fastddp.hooks.presets import preset
from fastddp.hooks.reshard import reshard
from fastddp.hooks.residuals import Residuals
from fastddp.hooks.slots import SlotTable
from fastddp.hooks.topology import Topology
from fastddp.hooks.two_level import path_for

__all__ = ["CompressState", "DEFAULT_BLOCK_SIZE"]

DEFAULT_BLOCK_SIZE = CODECS[torch.int8].blocks.default


class CompressState:
    r"""Settings, buffers, error-feedback residuals and counters of :func:`compress_hook`.

    Args:
        dtype (torch.dtype): what travels on the wire: ``torch.bfloat16`` (default; the fp32
            exponent range, so nothing overflows), ``torch.float16`` (3 more mantissa bits;
            values above 65504 after the division by world size become inf and are counted), or
            ``torch.int8`` (a quarter of fp32's bytes plus one fp32 scale per ``block_size``
            elements; always summed in fp32), ``torch.int4`` (codes -7..7, two to a byte) or
            ``torch.int2`` (codes -1, 0, 1, four to a byte; only with ``error_feedback``), for
            slow links. ``"auto"`` measures the allowed modes on the job itself and uses the
            one that makes the step shortest (:class:`~fastddp.hooks.auto.AutoState`; then
            only ``process_group``, ``allow``, ``topology`` and ``seed`` apply).
        process_group (ProcessGroup, optional): the group to reduce over; ``None`` is the
            default group.
        accumulate_dtype (torch.dtype, optional): ``torch.float32`` sums the 16-bit payloads in
            fp32 (all-to-all, fused fp32 sum, all-gather: one rounding however many ranks);
            ``None`` (default for fp16/bf16) lets the collective sum in 16 bits, rounding at
            every hop. int8, int4 and int2 always accumulate in fp32.
        error_feedback (bool): keep what each rounding dropped and add it to the next step's
            gradient (per bucket, on the bucket's device; saved by :meth:`state_dict`).
        stochastic_rounding (bool): round up or down at random, with probabilities that make
            the rounding unbiased.
        block_size (int, optional): int8, int4 and int2: elements per absmax scale (default
            128, so the scales add 1/4 bit per element; int4 and int2: a power of two from 32
            to 256).
        seed (int): seed of the stochastic rounding (mixed with rank, bucket and step).
        topology (str): ``"auto"`` (default) reduces in two levels when the group spans
            several nodes and a node has several ranks, and flat otherwise; ``"flat"`` treats
            every rank alike; ``"hierarchical"`` always reduces in two levels: an fp32
            reduce-scatter inside each node, the codec across nodes on 1/L of the bucket per
            rank (L ranks per node), an all-gather inside the node. Nodes are told apart by
            host name and network namespace, or by ``FASTDDP_NODE_ID``. Nodes with different
            numbers of ranks make ``"auto"`` reduce flat with a warning and
            ``"hierarchical"`` raise, on every rank.
        delay (int): ``1`` applies, at each step, the gradient reduced during the previous
            step, so that the reduction has a whole step of compute to hide behind (one-step
            delayed gradients: the first step after the state is made applies zeros, and the
            last step's reduction is never applied; :meth:`state_dict` saves the reduced
            gradient in waiting). ``0`` (default) applies each step's own.

    .. warning::
        A bucket's reduction may finish only when the next bucket reaches the hook (so that
        collectives overlap the backward pass). Everything pending finishes with the bucket
        DDP marks ``is_last``, at the end of the backward pass, or at :meth:`flush`. A hook
        that waits on this hook's future before returning must call :meth:`flush` first.

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
        "topology",
        "delay",
        "codec",
        "_table",
        "_counters",
        "_verified",
        "_layout",
        "_shapes",
        "_pipeline",
        "_residuals",
        "_loaded_from",
        "_topology",
        "_resolved",
        "_delayed",
        "_native",
        "_runner",
        "_python_only",  # set by native.turn_off: no runner, a load included
        "_load_problem",  # why the last load_state_dict failed (checkpoint.deferred)
    )

    # The class a dtype given by name makes (``"auto"``: AutoState). It builds on this class, so
    # its module (auto.py) sets this: this module importing it would close an import circle.
    # Importing fastddp.hooks imports auto.py, so it is set before any state is made.
    _named: ClassVar[Optional[type]] = None

    def __new__(cls, dtype: Any = torch.bfloat16, *args: Any, **kwargs: Any) -> "CompressState":
        if cls is CompressState and isinstance(dtype, str) and cls._named is not None:
            return object.__new__(cls._named)
        if "allow" in kwargs and not isinstance(dtype, str):
            raise TypeError(
                f"CompressState: allow= lists the modes dtype='auto' chooses from; pass "
                f"dtype='auto' with it (dtype is {dtype})"
            )
        return object.__new__(cls)

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
        topology: str = "auto",
        delay: int = 0,
    ) -> None:
        args = settings.checked(
            dtype, process_group, accumulate_dtype, error_feedback, stochastic_rounding,
            block_size, seed, topology, delay,
        )  # fmt: skip
        for name, value in args.items():
            setattr(self, name, value)
        self.codec: Codec = codec_for(self.dtype, self.block_size)
        self._reset()
        self._counters = dict.fromkeys(stats.COUNTERS, 0)

    @classmethod
    def from_preset(
        cls, name: str, process_group: Optional[dist.ProcessGroup] = None, **overrides: Any
    ) -> "CompressState":
        """Make a state from a named mode of :data:`fastddp.PRESETS`, with ``overrides`` on top.

        Example::

            >>> state = fastddp.CompressState.from_preset("int8-ef", block_size=64)
        """
        if name == "auto":
            raise ValueError(
                "CompressState.from_preset: 'auto' is not a preset but the dtype that chooses "
                "among them: CompressState(dtype='auto')"
            )
        return cls(process_group=process_group, **{**preset(name), **overrides})

    def _reset(self) -> None:
        running = getattr(self, "_pipeline", None)
        if running is not None:  # a load mid-run: what is in flight finishes first
            running.drain([entry.job for entry in self._delayed.entries.values()])
        old = getattr(self, "_native", None)
        if old is not None:
            # Its reductions finish before all is dropped; the runner itself stays, as
            # fastddp.register_comm_hook has handed it to the model's reducer.
            old.sync(self)
            old.clear(self)
        else:
            self._native = native.make(self)  # runs the buckets' steady state (native.py)
            self._runner = self._native.runner if self._native is not None else None
        # Parameters keep their keys: residuals saved by key go back to their own parameters
        # whatever order the buckets come in after a load.
        keys = getattr(self, "_table", None)
        self._table = SlotTable() if keys is None else SlotTable(keys.param_keys, keys.forward)
        self._verified = False
        self._layout: Optional[tuple] = None  # all_reduce's (op, sizes, bucket) at its handshake
        self._shapes: Optional[tuple] = None  # and its tensors' shapes (not saved: checked again)
        self._pipeline = Pipeline()
        self._pipeline.on_fail = None if self._runner is None else self._runner.fail
        self._residuals = Residuals()
        self._loaded_from: Optional[tuple[int, int, int]] = None  # rank, world, reductions
        self._load_problem: Optional[str] = None
        self._topology: Optional[Topology] = None  # found at the first reduction
        self._resolved: Optional[str] = None  # "flat" or "hierarchical", from the topology
        self._delayed = Delayed()  # with delay=1: each bucket's reduced gradient in waiting

    @property
    def path(self) -> str:
        """How fp32 buckets are reduced: ``"allreduce"`` or ``"alltoall"``, prefixed with
        ``"hierarchical-"`` once the first reduction has chosen the two-level path."""
        return self._path().name

    def _path(self) -> Path:
        return path_for(self.accumulate_dtype == torch.float32, self._resolved == "hierarchical")

    def settings(self) -> dict[str, Any]:
        """The settings every rank must share, in plain Python types."""
        return settings.plain(self)

    def __repr__(self) -> str:
        group = "default" if self.process_group is None else "custom"
        args = ", ".join(f"{k}={v}" for k, v in self.settings().items() if v not in (None, False))
        return f"CompressState({args}, process_group={group})"

    # Pickling keeps settings, counters and residuals; the process group and buffers stay.
    def __getstate__(self) -> dict:
        return {"seed": self.seed, "state_dict": self.state_dict()}

    def __setstate__(self, saved: dict) -> None:
        args = settings.from_plain(saved["state_dict"]["settings"])
        CompressState.__init__(self, **args, seed=saved["seed"])
        self.load_state_dict(saved["state_dict"])

    def flush(self) -> None:
        """Finish every pending reduction of this state now.

        Issues the collectives still pending, waits for all of them, and orders the current
        stream after the work they queued; every rank must call it at the same point. Needed
        only where the bucket DDP marks ``is_last`` does not reach :func:`compress_hook` and the
        pending futures are waited on before the end of the backward pass (for example by a
        hook that waits on this hook's future).
        """
        self._pipeline.check()
        self._sync_native()
        self._pipeline.flush()

    def discard_feedback(self) -> None:
        """Drop the error-feedback residuals, after a step the optimizer skipped.

        Error feedback owes the next step what this step's rounding dropped, including what
        a skipped step's finite values dropped: after a loss spike whose gradients held inf
        (so GradScaler skipped the step) and huge finite values as well, the next step would
        apply a share of those. Call it on every rank, after the skipped step (with
        GradScaler: where ``scaler.get_scale()`` fell in ``scaler.update()``); every model
        sharing the state loses its residuals. The next step starts owing nothing, as a new
        state does. With ``delay=1`` the gradient reduced during the skipped step (which
        carried the spike's residual) is dropped as well: the next step applies none. Pending
        reductions are finished first, a collective as in :meth:`flush`, so the ranks must
        agree on the skip (as GradScaler's does, on the reduced gradients).
        """
        self.flush()
        self._drop_residuals()

    def _drop_residuals(self) -> None:
        for slot in self._table.slots.values():
            for residual in (slot.residual, slot.shard_residual):
                if residual is not None:
                    residual.zero_()
        self._residuals = Residuals()  # (parked: loaded or moved, not yet taken up)
        for entry in self._delayed.entries.values():
            entry.buffers[entry.reduced].zero_()  # what the next step would apply
        # (parked ones may be a loaded state dict's own tensors: dropped, not zeroed; a bucket
        # with nothing parked starts from zeros)
        self._delayed.parked.clear()

    def _sync_native(self) -> None:
        if self._native is not None:
            self._native.sync(self)

    def stats(self) -> dict[str, Any]:
        """Return settings and counters since creation (or the last :meth:`load_state_dict`).

        ``payload_bytes`` counts the compressed size of the reduced buckets; ``wire_bytes`` the
        bytes this rank sent for them (a ring all-reduce sends 2(n-1)/n of its payload), and
        ``fp32_wire_bytes`` what an fp32 ring all-reduce of the same buckets would have sent.
        ``cross_node_bytes`` counts what this rank sent to other nodes, and
        ``fp32_ring_cross_node_bytes`` what it would have sent to other nodes in an fp32 ring
        all-reduce of the same buckets in group rank order (Gloo's ring). ``nodes`` lists
        each node's ranks and ``topology_used`` is ``"flat"`` or ``"hierarchical"`` (``None``
        before the first reduction).
        ``nonfinite_events`` counts reductions in which an encode on this rank gave inf or NaN
        (of its share, or of the sum it reduces in fp32; once per reduction);
        ``allocations`` counts buffer (re)allocations, which stop after the second step;
        ``parked_residuals`` counts parameters whose loaded or moved residuals still wait for
        their bucket. ``buckets`` has each bucket's figures and ``path``, keyed by
        ``bucket.index()`` (``(index, k)`` for the k-th other model sharing this state); its
        counters include those of earlier buckets of that index (before DDP's rebuild after
        the first step, or before a resume), while its ``numel`` and ``path`` are the bucket's
        now. ``retired_buckets`` has, by index, the counters of earlier buckets whose index no
        bucket has now; with ``buckets`` they add up to the totals but for the buckets that
        passed through (16-bit gradients: ``passthrough_calls``), which have no entry.
        Reading ``nonfinite_events`` synchronises with the device, after the streams that
        reductions queued work on.
        """
        self._sync_native()
        self._pipeline.synchronize()  # the side stream may still be adding to the flags
        return stats.report(self)

    def state_dict(self) -> dict[str, Any]:
        """Return settings, counters and error-feedback residuals (on the CPU), for checkpoints.

        Residuals are per rank: save one state dict per rank, and load each into the same rank
        (a mismatch is refused at the first reduction, on every rank). They are stored with the
        parameters they belong to, so that they find their parameters again when the resumed
        DDP lays its buckets out differently. Pending reductions are finished first; with
        ``delay=1`` that sends the last bucket's remaining stages, a collective: call it on
        every rank, not under ``if rank == 0``.
        """
        self._sync_native()
        return checkpoint.save(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters and residuals saved by :meth:`state_dict`; the settings must match.

        Residuals are parked by parameter and taken up by the buckets that hold those
        parameters at their first reduction, whatever the bucket layout (moving shard residuals
        costs one reduce-scatter per bucket then). Call it on every rank, with that rank's own
        state dict: the first reduction checks, on every rank, that each rank loaded its own.
        A state dict that does not load (another state's, damaged) raises here only without
        other ranks; with them, at the first reduction, on every rank.
        """
        checkpoint.deferred(self, lambda: checkpoint.load(self, state_dict), self._reset)

    @staticmethod
    def reshard(state_dicts: list[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
        """Regroup the :meth:`state_dict` of every rank of a job for a job of ``world_size``.

        For a job resumed on more or fewer ranks (an elastic job that lost or gained a node).
        Error feedback owes the average the sum of all ranks' residuals, so new rank ``r``
        takes those of old ranks ``r, r + world_size, ...``: that sum is kept exactly, and no
        residual is lost. A state saved without error feedback needs none of this: it loads
        into any rank of any job. ``dtype="auto"``'s state dicts are regrouped candidate by
        candidate, the plan kept.

        Args:
            state_dicts (list of dict): :meth:`state_dict` of every rank of the saved job, in
                rank order.
            world_size (int): the number of ranks of the job that loads them.

        Returns:
            list of dict: ``world_size`` state dicts; load entry ``r`` into rank ``r``.

        Example::

            >>> saved = [torch.load(f"hook-rank{r}.pt") for r in range(old_world_size)]
            >>> state.load_state_dict(CompressState.reshard(saved, world_size)[rank])
        """
        return reshard(state_dicts, world_size)
