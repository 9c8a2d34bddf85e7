"""``CompressState``: the settings of :func:`fastddp.compress_hook`, its statistics and checkpoints.

The state owns the slots (``buffers.py``), the parked residuals (``residuals.py``) and the
pipeline (``pipeline.py``); the hook (``hook.py``) drives them.
"""

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from fastddp.hooks.buffers import Slot, allocate
from fastddp.hooks.codecs import Codec, codec_for
from fastddp.hooks.pipeline import Pipeline
from fastddp.hooks.reshard import holds_residuals, parked, reshard
from fastddp.hooks.residuals import Residuals
from fastddp.hooks.topology import TOPOLOGIES, Topology

__all__ = ["CompressState", "DEFAULT_BLOCK_SIZE"]

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int8: "int8"}
_COUNTERS = (
    "calls",
    "passthrough_calls",
    "allocations",
    "payload_bytes",
    "wire_bytes",
    "fp32_wire_bytes",
    "cross_node_bytes",
    "fp32_ring_cross_node_bytes",
)
_SLOT_COUNTERS = ("calls", "payload_bytes", "wire_bytes", "cross_node_bytes", "nonfinite_events")
DEFAULT_BLOCK_SIZE = 128
_MAX_BLOCK_SIZE = 1 << 20
# Version of the state_dict() layout: 2 adds rank, world_size and per-rank parked pieces.
_STATE_VERSION = 2


def checked_block_size(where: str, dtype: torch.dtype, block_size) -> Optional[int]:
    """The int8 block size for a wire ``dtype`` (default 128), or ``None`` for 16-bit wires;
    anything else raises an error that starts with ``where``."""
    if dtype != torch.int8:
        if block_size is not None:
            raise ValueError(
                f"{where}: block_size applies to dtype=torch.int8 only (16-bit values need no "
                "scales); leave it out, or use dtype=torch.int8"
            )
        return None
    block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"{where}: block_size must be an int, got {block_size!r}")
    if not 1 <= block_size <= _MAX_BLOCK_SIZE:
        raise ValueError(
            f"{where}: block_size must be between 1 and {_MAX_BLOCK_SIZE}, got {block_size}"
        )
    return block_size


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
        topology (str): ``"auto"`` (default) reduces in two levels when the group spans
            several nodes and a node has several ranks, and flat otherwise; ``"flat"`` treats
            every rank alike; ``"hierarchical"`` always reduces in two levels: an fp32
            reduce-scatter inside each node, the codec across nodes on 1/L of the bucket per
            rank (L ranks per node), an all-gather inside the node. Nodes are told apart by
            host name and network namespace, or by ``FASTDDP_NODE_ID``. Nodes with different
            numbers of ranks make ``"auto"`` reduce flat with a warning and
            ``"hierarchical"`` raise, on every rank.

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
        "codec",
        "_slots",
        "_owners",
        "_param_keys",
        "_counters",
        "_verified",
        "_pipeline",
        "_residuals",
        "_saved_counters",
        "_loaded_from",
        "_topology",
        "_resolved",
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
        topology: str = "auto",
    ) -> None:
        where = "CompressState"
        if dtype not in _DTYPE_NAMES:
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
        block_size = checked_block_size(where, dtype, block_size)
        for name, value in (
            ("error_feedback", error_feedback),
            ("stochastic_rounding", stochastic_rounding),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{where}: {name} must be True or False, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"{where}: seed must be an int, got {seed!r}")
        if topology not in TOPOLOGIES:
            raise ValueError(
                f"{where}: topology must be one of {', '.join(map(repr, TOPOLOGIES))}, got "
                f"{topology!r}"
            )
        self.dtype = dtype
        self.process_group = process_group
        self.accumulate_dtype = accumulate_dtype
        self.error_feedback = error_feedback
        self.stochastic_rounding = stochastic_rounding
        self.block_size = block_size
        self.seed = seed
        self.topology = topology
        self.codec: Codec = codec_for(dtype, block_size)
        self._reset()
        self._counters = dict.fromkeys(_COUNTERS, 0)

    def _reset(self) -> None:
        self._slots: dict[Any, Slot] = {}
        self._owners: dict[int, Any] = {}  # parameter key -> key of the slot holding it
        # Keys of parameters in first-seen order; weak, so that a new tensor that happens to
        # reuse a dead one's id() never inherits its key.
        self._param_keys = WeakIdKeyDictionary()
        self._verified = False
        self._pipeline = Pipeline()
        self._residuals = Residuals()
        self._saved_counters: dict[int, dict[str, Any]] = {}
        self._loaded_from: Optional[tuple[int, int]] = None
        self._topology: Optional[Topology] = None  # found at the first reduction
        self._resolved: Optional[str] = None  # "flat" or "hierarchical", from the topology

    @property
    def path(self) -> str:
        """How fp32 buckets are reduced: ``"allreduce"`` or ``"alltoall"``, prefixed with
        ``"hierarchical-"`` once the first reduction has chosen the two-level path."""
        inner = "alltoall" if self.accumulate_dtype == torch.float32 else "allreduce"
        return f"hierarchical-{inner}" if self._resolved == "hierarchical" else inner

    def settings(self) -> dict[str, Any]:
        """The settings every rank must share, in plain Python types."""
        return {
            "dtype": _DTYPE_NAMES[self.dtype],
            "accumulate_dtype": None if self.accumulate_dtype is None else "float32",
            "error_feedback": self.error_feedback,
            "stochastic_rounding": self.stochastic_rounding,
            "block_size": self.block_size,
            "topology": self.topology,
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
            {v: k for k, v in _DTYPE_NAMES.items()}[settings["dtype"]],
            accumulate_dtype=torch.float32 if settings["accumulate_dtype"] else None,
            topology=settings.get("topology", "auto"),
            error_feedback=settings["error_feedback"],
            stochastic_rounding=settings["stochastic_rounding"],
            block_size=settings["block_size"],
            seed=saved["seed"],
        )
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
        self._pipeline.flush()

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
        ``nonfinite_events`` counts reductions whose payload held an inf or NaN on this rank;
        ``allocations`` counts buffer (re)allocations, which stop after the second step;
        ``parked_residuals`` counts parameters whose loaded or moved residuals still wait for
        their bucket. ``buckets`` has each bucket's figures and ``path``, keyed by
        ``bucket.index()`` (``(index, k)`` for the k-th other model sharing this state).
        Reading ``nonfinite_events`` synchronises with the device, after the streams that
        reductions queued work on.
        """
        self._pipeline.synchronize()  # the side stream may still be adding to the flags
        buckets = {
            key: {
                "numel": slot.numel,
                "path": slot.path,
                "calls": slot.calls,
                "payload_bytes": slot.payload_bytes,
                "wire_bytes": slot.wire_bytes,
                "cross_node_bytes": slot.cross_node_bytes,
                "nonfinite_events": slot.nonfinite_events(),
            }
            for key, slot in self._live_by_index()
        }
        return {
            **self.settings(),
            "path": self.path,
            "topology_used": self._resolved,
            "nodes": None if self._topology is None else self._topology.nodes,
            **self._counters,
            "nonfinite_events": sum(b["nonfinite_events"] for b in buckets.values()),
            "parked_residuals": len(self._residuals),
            "buckets": buckets,
        }

    def _live_by_index(self) -> list[tuple[Any, Slot]]:
        out, seen = [], {}
        for slot in sorted(self._slots.values(), key=lambda s: s.index):
            k = seen.get(slot.index, 0)
            seen[slot.index] = k + 1
            out.append((slot.index if k == 0 else (slot.index, k), slot))
        return out

    def state_dict(self) -> dict[str, Any]:
        """Return settings, counters and error-feedback residuals (on the CPU), for checkpoints.

        Residuals are per rank: save one state dict per rank, and load each into the same rank
        (a mismatch is refused at the first reduction, on every rank). They are stored with the
        parameters they belong to, so that they find their parameters again when the resumed
        DDP lays its buckets out differently. Pending reductions are finished first.
        """
        if not self._pipeline._failure:
            self._pipeline.flush()
        rank = dist.get_rank(self.process_group) if dist.is_initialized() else None
        world = dist.get_world_size(self.process_group) if dist.is_initialized() else None
        buckets: dict[int, dict[str, Any]] = {}
        for position, (_, slot) in enumerate(self._live_by_index()):
            parts = self._residuals_of(slot, rank)
            buckets[position] = {
                "index": slot.index,
                "numel": slot.numel,
                "world": slot.world,
                "params": None if slot.params is None else [list(p) for p in slot.params],
                "calls": slot.calls,
                "payload_bytes": slot.payload_bytes,
                "wire_bytes": slot.wire_bytes,
                "cross_node_bytes": slot.cross_node_bytes,
                "nonfinite_events": slot.nonfinite_events(),
                **{k: _cpu(v) if torch.is_tensor(v) else v for k, v in parts.items()},
            }
        return {
            "version": _STATE_VERSION,
            "rank": rank,
            "world_size": world,
            "settings": self.settings(),
            "counters": dict(self._counters),
            "buckets": buckets,
            "carry": self._residuals.state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters and residuals saved by :meth:`state_dict`; the settings must match.

        Residuals are parked by parameter and taken up by the buckets that hold those
        parameters at their first reduction, whatever the bucket layout (moving shard residuals
        costs one reduce-scatter per bucket then). Call it on every rank, with that rank's own
        state dict: the first reduction checks, on every rank, that each rank loaded its own.
        """
        saved_settings = state_dict.get("settings", {"dtype": state_dict.get("dtype")})
        for key, mine in self.settings().items():
            if key == "topology":
                continue  # residuals carry over between topologies (see residuals.py)
            theirs = saved_settings.get(key, mine if key != "dtype" else None)
            if theirs != mine:
                raise ValueError(
                    f"CompressState.load_state_dict: saved {key} {theirs!r} does not match this "
                    f"state's {mine!r}; build the state with the settings it was saved with"
                )
        self._reset()
        self._counters = {k: int(state_dict["counters"].get(k, 0)) for k in _COUNTERS}
        # Only residuals belong to one rank of one world size; counters fit any job.
        if state_dict.get("rank") is not None and holds_residuals(state_dict):
            self._loaded_from = (int(state_dict["rank"]), int(state_dict["world_size"]))
        for index, saved in state_dict["buckets"].items():
            self._saved_counters[int(saved.get("index", index))] = saved
        with_shards = self.error_feedback and self.accumulate_dtype == torch.float32
        self._residuals = parked(state_dict, with_shards)

    @staticmethod
    def reshard(state_dicts: list[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
        """Regroup the :meth:`state_dict` of every rank of a job for a job of ``world_size``.

        For a job resumed on more or fewer ranks (an elastic job that lost or gained a node).
        Error feedback owes the average the sum of all ranks' residuals, so new rank ``r``
        takes those of old ranks ``r, r + world_size, ...``: that sum is kept exactly, and no
        residual is lost. A state saved without error feedback needs none of this: it loads
        into any rank of any job.

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

    # -- slots ----------------------------------------------------------------------------

    def _keys_of(self, parameters: list[torch.Tensor]) -> tuple:
        keys = self._param_keys
        return tuple((keys.setdefault(p, len(keys)), p.numel()) for p in parameters)

    def _identify(self, index: int, buffer: torch.Tensor, parameters, params) -> tuple:
        """The slot key of a bucket and what must match for its slot to be reused."""
        if parameters:  # a DDP bucket: its first parameter names it, model and layout alike
            first = self._param_keys.get(parameters[0])
            last = self._param_keys.get(parameters[-1])
            if first is None:
                return ("p", None), None
            return ("p", first), (last, len(parameters), buffer.numel(), buffer.device)
        return ("i", index), (params, buffer.numel(), buffer.device)

    def _slot_for(self, key, signature, index, buffer, parameters, params, world) -> Slot:
        slot = self._slots.get(key)
        if slot is not None and slot.signature == signature:
            slot.index = index
            return slot
        if parameters:
            params = self._keys_of(parameters)
            key, signature = self._identify(index, buffer, parameters, None)
        rank = dist.get_rank(self.process_group)
        # Retire every slot holding one of these parameters (DDP rebuilt its buckets), and the
        # slot of this key: their residuals wait, by parameter, for the new slot.
        retired = {key} | {self._owners[k] for k, _ in params or () if k in self._owners}
        for old_key in retired:
            self._retire(old_key, rank)
        slot = Slot(index, buffer.numel(), buffer.device, world)
        slot.params, slot.signature = params, signature
        saved = self._saved_counters.pop(index, None)
        events = 0
        if saved is not None:
            slot.calls = int(saved["calls"])
            slot.payload_bytes = int(saved["payload_bytes"])
            slot.wire_bytes = int(saved.get("wire_bytes", 0))
            slot.cross_node_bytes = int(saved.get("cross_node_bytes", 0))
            events = int(saved["nonfinite_events"])
        topo = self._topology
        nodes, per_node = (len(topo.nodes), topo.per_node) if topo is not None else (1, 1)
        allocate(slot, self.path, self.codec, self.error_feedback, events, nodes, per_node)
        self._counters["allocations"] += 1
        self._slots[key] = slot
        for k, _ in params or ():
            self._owners[k] = key
        if self.error_feedback:
            two_level = self._topology if slot.node_shard else None
            self._residuals.take(slot, rank, self.process_group, two_level)
        return slot

    def _retire(self, key, rank: int) -> None:
        slot = self._slots.pop(key, None)
        if slot is None:
            return
        self._pipeline.settle(slot.job)
        slot.job = None  # the job points back at the slot: let the buffers go now, not at GC
        for k, _ in slot.params or ():
            if self._owners.get(k) == key:
                del self._owners[k]
        # Counters stay with the bucket index: the slot that takes this index next goes on.
        counts = self._saved_counters.setdefault(slot.index, dict.fromkeys(_SLOT_COUNTERS, 0))
        for name in ("calls", "payload_bytes", "wire_bytes", "cross_node_bytes"):
            counts[name] = int(counts.get(name, 0)) + getattr(slot, name)
        counts["nonfinite_events"] = int(counts.get("nonfinite_events", 0)) + (
            slot.nonfinite_events()
        )
        # Free the communication buffers first: the residuals are copied out next.
        slot.wire = slot.recv = slot.out = None
        slot.node_recv = slot.node_sum = slot.gathered = None
        slot.scratch = {}
        parts = self._residuals_of(slot, rank)
        slot.residual = slot.shard_residual = None
        self._residuals.park(
            slot.params,
            parts["residual"],
            parts["shard_residual"],
            parts["shard_offset"],
            with_shards=parts["shard_residual"] is not None,
            copy=True,
        )

    def _residuals_of(self, slot: Slot, rank: Optional[int]) -> dict[str, Any]:
        """A slot's residuals as saved and parked, the shard's at its offset in the bucket."""
        shard = slot.shard_residual
        offset = 0
        if shard is not None and slot.node_shard:
            topo = self._topology
            offset = topo.local_rank * slot.node_shard + topo.cross_rank * slot.shard
        elif shard is not None and rank is not None:
            offset = rank * shard.numel()
        residual = None if slot.residual is None else slot.residual[: slot.numel]
        return {"residual": residual, "shard_residual": shard, "shard_offset": offset}

    def _seed(self, rank: int, index: int, stage: int) -> int:
        if not self.stochastic_rounding:
            return -1
        # Hashes of int tuples are the same in every process; each rank, bucket call and stage
        # draws its own numbers, reproducibly (and again after a restart: the count is saved).
        calls = self._counters["calls"]
        return hash((self.seed, rank, index, calls, stage)) & ((1 << 63) - 1)


def _cpu(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().cpu().clone()
