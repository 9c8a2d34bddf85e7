"""Per-bucket slots: the persistent buffers, residuals and counters of one DDP bucket.

A slot is allocated when a bucket is first seen and reused on every later step, so that the
hook never allocates per step; DDP's bucket rebuild after its first iteration (or a changed
bucket) retires the old slot and allocates a new one. Slots belong to one bucket *of one
model*: two models sharing a state never share buffers. :class:`SlotTable` finds a bucket's
slot and remembers which slot holds each parameter; the path allocates a slot's buffers.
"""

from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from fastddp.codecs import Codec

__all__ = ["SLOT_COUNTERS", "Slot", "SlotTable"]

# Counters of one slot, kept with its bucket index when the slot is retired.
SLOT_COUNTERS = ("calls", "payload_bytes", "wire_bytes", "cross_node_bytes", "nonfinite_events")


class Slot:
    """Buffers, residuals and counters of one bucket (see the module docstring)."""

    __slots__ = (
        "index",
        "numel",
        "device",
        "world",
        "params",
        "signature",
        "path",
        "codec",
        "shard",
        "row",
        "wire",
        "recv",
        "out",
        "flag",
        "shard_flag",
        "nonfinite",
        "carried_events",
        "residual",
        "shard_residual",
        "node_shard",
        "node_recv",
        "node_sum",
        "gathered",
        "calls",
        "payload_bytes",
        "wire_bytes",
        "cross_node_bytes",
        "job",
        "plan",
        "held",
    )

    def __init__(self, index: int, numel: int, device: torch.device, world: int) -> None:
        self.index = index
        self.numel = numel
        self.device = device
        self.world = world
        # (key, numel) of each parameter in the bucket, in buffer order: lets residuals follow
        # their parameters into another bucket layout or a restarted job.
        self.params: Optional[tuple] = None
        self.signature: tuple = ()  # what identifies the bucket cheaply on every call
        self.path = None  # the paths.Path that reduces this bucket
        self.codec: Optional[Codec] = None
        self.shard = 0
        self.row = 0
        self.wire: Optional[torch.Tensor] = None
        self.recv: Optional[torch.Tensor] = None
        self.out: Optional[torch.Tensor] = None
        # Set by the encode of this rank's payload and by that of the shard sum it reduces
        # (summed in fp32); a reduction that met inf or NaN in either counts once.
        self.flag: Optional[torch.Tensor] = None
        self.shard_flag: Optional[torch.Tensor] = None
        self.nonfinite: Optional[torch.Tensor] = None  # events, counted on the bucket's device
        # Events of retired buckets this one took over, on the host: an add to ``nonfinite``
        # on this stream could race with the side stream's adds of a reduction in flight.
        self.carried_events = 0
        self.residual: Optional[torch.Tensor] = None
        self.shard_residual: Optional[torch.Tensor] = None
        # Two-level path: residuals taken over from another layout wait in ``residual`` to be
        # added to the next bucket before it is sent (see residuals.py).
        self.node_shard = 0  # elements of the bucket each rank of a node reduces across nodes
        self.node_recv: Optional[torch.Tensor] = None  # [L, node_shard] fp32, from the node
        self.node_sum: Optional[torch.Tensor] = None  # [node_shard] fp32, their sum
        self.gathered: Optional[torch.Tensor] = None  # [L, inner wire] every rank's result
        self.calls = 0
        self.payload_bytes = 0
        self.wire_bytes = 0
        self.cross_node_bytes = 0
        self.held = False  # its buffers are held on the side stream (Pipeline._step)
        self.job = None  # the latest reduction of this bucket (job.Job)
        self.plan: Optional[tuple] = None  # (id, bucket buffer) of its native plan (native.py)

    @property
    def per_row(self) -> int:
        """Bucket elements in one wire row."""
        return self.shard or self.row

    def nonfinite_events(self) -> int:
        own = 0 if self.nonfinite is None else int(self.nonfinite.item())
        return own + self.carried_events

    def counts(self) -> dict[str, int]:
        """The counters of :data:`SLOT_COUNTERS` (reads the device's event count)."""
        return {
            name: self.nonfinite_events() if name == "nonfinite_events" else getattr(self, name)
            for name in SLOT_COUNTERS
        }

    def resume(self, saved: Optional[dict[str, Any]]) -> int:
        """Go on from counters saved for this bucket index; return its non-finite events."""
        if saved is None:
            return 0
        for name in SLOT_COUNTERS[:-1]:
            setattr(self, name, int(saved.get(name, 0)))
        return int(saved.get("nonfinite_events", 0))

    def absorb(self, counts: dict[str, int]) -> None:
        """Add a retired bucket's counters to this one's (a bucket that took its index)."""
        for name in SLOT_COUNTERS[:-1]:
            setattr(self, name, getattr(self, name) + int(counts.get(name, 0)))
        self.carried_events += int(counts.get("nonfinite_events", 0))

    def give_buffers(self, codec: Codec, error_feedback: bool, events: int, per_node: int) -> None:
        """Give the flags and, with ``error_feedback``, the residuals (after the path's buffers).

        Two-level: one residual per element of the padded bucket, non-zero in this rank's node
        shard only (residuals.py moves them there).
        """
        on = dict(device=self.device)
        self.codec = codec
        flags = torch.zeros(2, dtype=torch.int32, **on)
        self.flag, self.shard_flag = flags[:1], flags[1:]
        # (a fill, where a tensor from a Python list would wait for a host-to-device copy)
        self.nonfinite = torch.full((1,), events, dtype=torch.int64, **on)
        if error_feedback:
            fp32 = dict(dtype=torch.float32, **on)  # (not the default dtype, which may be fp64)
            self.residual = torch.zeros(max(self.numel, per_node * self.node_shard), **fp32)
            if self.shard > 0:
                self.shard_residual = torch.zeros(self.shard, **fp32)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer of this slot: what a side stream may write."""
        named = (self.wire, self.recv, self.out, self.node_recv, self.node_sum, self.gathered,
                 self.flag, self.nonfinite, self.residual, self.shard_residual)  # fmt: skip
        return [t for t in named if t is not None]

    def hold(self, runtime) -> None:
        """Hold the buffers on ``runtime``'s current stream (a side stream), once: a state
        dropped while that stream still writes them (``delay=1`` leaves reductions in flight)
        must not hand their memory to new tensors."""
        if not self.held:
            runtime.hold(self.tensors())
            self.held = True

    def free_buffers(self) -> None:
        """Let the communication buffers go (the residuals stay)."""
        self.wire = self.recv = self.out = None
        self.node_recv = self.node_sum = self.gathered = None


# Dtypes other than float32 that DDP parameters may have, each with keys of its own.
_OTHER_DTYPES = (torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.complex128)


def _key(kind: Optional[torch.dtype], n: int) -> int:
    """The ``n``-th key of parameters of dtype ``kind`` (None: of any dtype)."""
    if kind is None or kind == torch.float32:
        return n
    code = _OTHER_DTYPES.index(kind) if kind in _OTHER_DTYPES else 15
    return -1 - (16 * n + code)


class SlotTable:
    """The slots of one state by bucket key, and which slot holds each parameter.

    A DDP bucket is keyed by its first parameter (so a model's bucket keeps its slot whatever
    its index), other buffers by index. ``saved`` keeps counters by bucket index for the slot
    that takes that index next (after a retire or a :meth:`CompressState.load_state_dict`).
    """

    def __init__(
        self, param_keys: Optional[WeakIdKeyDictionary] = None, forward: bool = False
    ) -> None:
        self.slots: dict[Any, Slot] = {}
        self.owners: dict[int, Any] = {}  # parameter key -> key of the slot holding it
        # Keys of parameters (``param_keys``: a previous table's, kept); weak, so that a new
        # tensor that happens to reuse a dead one's id() never inherits its key.
        self.param_keys = WeakIdKeyDictionary() if param_keys is None else param_keys
        # A bucket's new parameters are keyed from its last to its first, each dtype apart:
        # DDP's first layout gives each dtype buckets of its own, puts the last parameters of
        # a dtype in its first bucket, and each bucket in the model's order, so a key is the
        # parameter's place counted from the end of the model's parameters of its dtype,
        # whatever bucket_cap_mb or bucket_cap_mb_list cut (a resume under other caps finds
        # its residuals). ``forward``: first to last, one count for all, as state dicts of
        # version 2 and earlier keyed them.
        self.forward = forward
        self.saved: dict[int, dict[str, Any]] = {}
        # Counters loaded for an index already saved: another model's bucket of that index
        # (two models sharing a state), for the next slot that takes it.
        self.queued: dict[int, list[dict[str, Any]]] = {}

    def keys_of(self, parameters: list[torch.Tensor]) -> tuple:
        """``(key, numel)`` of each of ``parameters``, in their order; new ones keyed here."""
        keys = self.param_keys
        try:
            return tuple((keys[p], p.numel()) for p in parameters)
        except KeyError:
            self._key_new(parameters if self.forward else reversed(parameters))
        return tuple((keys[p], p.numel()) for p in parameters)

    def _key_new(self, parameters) -> None:
        # Each new parameter takes the smallest key of its kind that no live parameter holds:
        # a state moved to a new model (the old one gone) keys it as it keyed the old one, and
        # a layer replaced (a new head) takes the keys its old one held, never a live one's.
        # float32 parameters (the only ones with residuals) are keyed 0, 1, ...; each other
        # dtype apart, in negative keys (``forward``: one count for all, as before version 3).
        keys = self.param_keys
        held = set(keys.values())
        counts: dict[Optional[torch.dtype], int] = {}
        for p in parameters:
            if p in keys:
                continue
            kind = None if self.forward else p.dtype
            n = counts.get(kind, 0)
            while (key := _key(kind, n)) in held:
                n += 1
            counts[kind] = n + 1
            keys[p] = key
            held.add(key)

    def identify(self, index: int, buffer: torch.Tensor, parameters, params) -> tuple:
        """The slot key of a bucket and what must match for its slot to be reused."""
        if parameters:  # a DDP bucket: its first parameter names it, model and layout alike
            first = self.param_keys.get(parameters[0])
            if first is None:
                return ("p", None), None
            # Every parameter, in order: DDP's rebuild may reorder a bucket's middle alone.
            # (Identities suffice: the first is alive and known, so these are its model's.)
            return ("p", first), (tuple(map(id, parameters)), buffer.numel(), buffer.device)
        return ("i", index), (params, buffer.numel(), buffer.device)

    def reusable(self, key, signature, index: int) -> Optional[Slot]:
        """The slot of ``key`` if it still fits the bucket (it takes ``index``), else None."""
        slot = self.slots.get(key)
        if slot is not None and slot.signature == signature:
            slot.index = index
            return slot
        return None

    def holders(self, key, params) -> set:
        """Keys of the slot of ``key`` and of every slot holding one of ``params``."""
        return {key} | {self.owners[k] for k, _ in params or () if k in self.owners}

    def add(self, key, slot: Slot) -> None:
        self.slots[key] = slot
        for k, _ in slot.params or ():
            self.owners[k] = key

    def remove(self, key) -> Optional[Slot]:
        """Take the slot of ``key`` out; its counters stay with its bucket index: in the live
        slot of that index (one DDP's rebuild made before retiring this one), else saved for
        the next."""
        slot = self.slots.pop(key, None)
        if slot is None:
            return None
        for k, _ in slot.params or ():
            if self.owners.get(k) == key:
                del self.owners[k]
        live = next((s for s in self.slots.values() if s.index == slot.index), None)
        if live is not None:
            live.absorb(slot.counts())
            return slot
        counts = self.saved.setdefault(slot.index, dict.fromkeys(SLOT_COUNTERS, 0))
        for name, value in slot.counts().items():
            counts[name] = int(counts.get(name, 0)) + value
        return slot

    def keep(self, index: int, saved: dict[str, Any]) -> None:
        """Keep loaded counters of bucket ``index`` for the slot that takes it (a second entry
        of one index for the slot that takes it after that one)."""
        if index in self.saved:
            self.queued.setdefault(index, []).append(saved)
        else:
            self.saved[index] = saved

    def take(self, index: int) -> Optional[dict[str, Any]]:
        """The counters kept for ``index``, for a new slot of that index; None if none."""
        saved = self.saved.pop(index, None)
        if self.queued.get(index):
            self.saved[index] = self.queued[index].pop(0)
        return saved

    def retired(self) -> dict[int, dict[str, int]]:
        """Counters of retired (or loaded) buckets that no live bucket has taken, by index."""
        out = {}
        for index, saved in sorted(self.saved.items()):
            entries = [saved, *self.queued.get(index, ())]
            out[index] = {n: sum(int(e.get(n, 0)) for e in entries) for n in SLOT_COUNTERS}
        return out

    def by_index(self) -> list[tuple[Any, Slot]]:
        """Live slots in bucket order, keyed by index (``(index, k)`` for the k-th other model)."""
        out, seen = [], {}
        for slot in sorted(self.slots.values(), key=lambda s: s.index):
            k = seen.get(slot.index, 0)
            seen[slot.index] = k + 1
            out.append((slot.index if k == 0 else (slot.index, k), slot))
        return out
