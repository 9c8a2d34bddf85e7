"""Error-feedback residuals that outlive a bucket layout.

Each slot keeps two residuals: ``residual`` (stage 1, one per bucket element, on every rank)
and ``shard_residual`` (stage 2 of the all-to-all path: one per element of this rank's shard).
When a slot is retired (DDP rebuilt its buckets) or a checkpoint is loaded, its residuals are
*parked* here by parameter, and the next slot holding that parameter takes them back:

- stage 1 is local on the flat path: the new slot copies each parameter's slice (parked as
  views, no copy);
- stage 2 is spread over the ranks: each rank parks the pieces it owns, and the new slot's
  shards are rebuilt with one ``reduce_scatter`` of a bucket-sized vector, in which each element
  is non-zero on at most one rank. Whether a slot needs it depends only on the parameters'
  history, which every rank shares, so every rank issues the same collectives.

On the two-level path, stage 1 is a node's: the rank that now reduces an element's node shard
needs the residual of that element held on its node. One ``reduce_scatter`` inside the node
brings each node shard of both parts to its rank, and one across nodes brings each stage-2 shard
to its rank. A residual thus comes back to the rank that rounds its element, so a resume is
exact on both paths. Parts saved under the other topology (or by another world size) are
summed where they land: rounded elsewhere, but never lost.

A retired slot's communication buffers are freed before its residuals are copied out by
parameter, and its residuals right after; each part is freed when a new slot takes it. While
DDP rebuilds its buckets the residuals therefore exist about once, plus one bucket-sized
temporary per new slot, instead of once per layout plus a model-sized vector.
"""

from typing import Any, Optional

import torch
import torch.distributed as dist

from fastddp.hooks.slots import Slot

__all__ = ["Residuals"]

# torch 2.13 renamed reduce_scatter_tensor (now deprecated); older releases have only that.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Residuals:
    """Parked residuals, by parameter key (see the module docstring)."""

    __slots__ = ("stage1", "stage2", "moved", "sizes", "replicated")

    def __init__(self) -> None:
        self.stage1: dict[int, torch.Tensor] = {}
        self.stage2: dict[int, list[tuple[int, torch.Tensor]]] = {}  # (offset, piece) we own
        self.moved: set[int] = set()  # parameters whose stage-2 shards must be rebuilt
        self.sizes: dict[int, int] = {}
        # Stage-2 values held whole by every rank (an old checkpoint format): rank 0 adds them.
        self.replicated: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(set(self.stage1) | self.moved)

    def park(
        self,
        params: Optional[tuple],
        residual: Optional[torch.Tensor],
        shard_residual: Optional[torch.Tensor],
        shard_offset: int,
        with_shards: bool,
        copy: bool = False,
    ) -> None:
        """Park a bucket's residuals by parameter.

        With ``copy``, each parameter's part is copied out, so that the caller can free the
        bucket's residuals at once and each part is freed when its new bucket takes it: while
        DDP rebuilds its buckets, the residuals then exist about once, not once per layout.
        Without, the parts are views (of a loaded checkpoint, say).
        """
        own = (lambda t: t.clone()) if copy else (lambda t: t)
        if params is None:
            return
        lo_shard = shard_offset
        hi_shard = lo_shard + (0 if shard_residual is None else shard_residual.numel())
        start = 0
        for k, numel in params:
            self.sizes[k] = numel
            self.moved.add(k)  # whoever takes it next may have to move its parts
            if residual is not None:
                self.stage1[k] = own(residual[start : start + numel])
            if with_shards:
                lo, hi = max(start, lo_shard), min(start + numel, hi_shard)
                if lo < hi:
                    piece = own(shard_residual[lo - lo_shard : hi - lo_shard])
                    self.stage2.setdefault(k, []).append((lo - start, piece))
            start += numel

    def take(
        self,
        slot: Slot,
        rank: int,
        group: Optional[dist.ProcessGroup],
        topo: Optional[Any] = None,
    ) -> None:
        """Fill a new slot's residuals from what is parked for its parameters.

        ``topo`` (a two-level slot's :class:`~fastddp.hooks.topology.Topology`): the parts go
        to the ranks that reduce their elements, within the node and across nodes.
        """
        if slot.params is None:
            return
        self.check_sizes(slot.params)
        if topo is not None:
            self._take_two_level(slot, rank, topo)
            return
        start = 0
        for k, numel in slot.params:
            part = self.stage1.pop(k, None)
            if part is not None and slot.residual is not None:
                slot.residual[start : start + numel].copy_(part)
            start += numel
        if not any(k in self.moved for k, _ in slot.params):
            return
        full = None
        if slot.shard_residual is not None:
            full = torch.zeros(slot.world * slot.shard, dtype=torch.float32, device=slot.device)
        start = 0
        for k, numel in slot.params:
            pieces = self.stage2.pop(k, ())
            whole = self.replicated.pop(k, None)
            self.moved.discard(k)
            if full is not None:
                for offset, piece in pieces:
                    lo = start + offset
                    full[lo : lo + piece.numel()] = piece
                if whole is not None and rank == 0:
                    full[start : start + numel] += whole
            start += numel
        if full is not None:
            _reduce_scatter_single(slot.shard_residual, full, group=group)

    def _take_two_level(self, slot: Slot, rank: int, topo: Any) -> None:
        if slot.residual is None or not any(k in self.moved for k, _ in slot.params):
            return
        per_node, ns = topo.per_node, slot.node_shard
        stages = 1 if slot.shard_residual is None else 2
        # [stage][element of the padded bucket]: stage-1 parts, and stage-2 pieces.
        parts = torch.zeros(stages, per_node * ns, dtype=torch.float32, device=slot.device)
        start = 0
        for k, numel in slot.params:
            part = self.stage1.pop(k, None)
            if part is not None:
                parts[0, start : start + numel] += part.to(slot.device)
            for offset, piece in self.stage2.pop(k, ()):
                lo = start + offset
                parts[stages - 1, lo : lo + piece.numel()] += piece.to(slot.device)
            whole = self.replicated.pop(k, None)
            if whole is not None and rank == 0:
                parts[stages - 1, start : start + numel] += whole.to(slot.device)
            self.moved.discard(k)
            start += numel
        # Node shard l of every stage to local rank l, summed over the node's ranks.
        send = parts.view(stages, per_node, ns).transpose(0, 1).contiguous().view(-1)
        mine = torch.empty(stages * ns, dtype=torch.float32, device=slot.device)
        _reduce_scatter_single(mine, send, group=topo.groups["intra"])
        lo = topo.local_rank * ns
        slot.residual.zero_()
        slot.residual[lo : lo + ns].copy_(mine[:ns])
        if slot.shard_residual is not None:
            # Shard c of this node shard to the rank of cross-node rank c, summed over nodes.
            _reduce_scatter_single(slot.shard_residual, mine[ns:], group=topo.groups["cross"])

    def add(self, other: "Residuals") -> None:
        """Add another rank's parked residuals to these (``reshard.py``): stage-1 parts are
        summed, stage-2 pieces kept side by side (each lies where its old shard did)."""
        for k, numel in other.sizes.items():
            if self.sizes.setdefault(k, numel) != numel:
                raise ValueError(
                    f"fastddp: parameter {k} has {numel} elements in one rank's residuals and "
                    f"{self.sizes[k]} in another's; these are not one job's state dicts"
                )
        for k, part in other.stage1.items():
            self.stage1[k] = self.stage1[k] + part if k in self.stage1 else part
        for k, pieces in other.stage2.items():
            self.stage2.setdefault(k, []).extend(pieces)
        self.moved |= other.moved
        self.replicated.update(other.replicated)

    def drain(self, rank: int) -> dict[int, torch.Tensor]:
        """Take out everything parked: per parameter key, this rank's parts summed into one
        tensor of the parameter's size (stage-2 values held whole count on rank 0 only)."""
        out: dict[int, torch.Tensor] = {}
        for k in sorted(set(self.stage1) | set(self.stage2) | set(self.replicated)):
            parts = [(0, self.stage1.get(k))] + list(self.stage2.get(k, ()))
            if rank == 0:
                parts.append((0, self.replicated.get(k)))
            parts = [(o, t) for o, t in parts if t is not None]
            if not parts:
                continue
            whole = torch.zeros(self.sizes[k], dtype=torch.float32, device=parts[0][1].device)
            for offset, t in parts:
                whole[offset : offset + t.numel()] += t.to(whole.device)
            out[k] = whole
        self.stage1.clear()
        self.stage2.clear()
        self.replicated.clear()
        self.moved.clear()
        return out

    def check_sizes(self, params: tuple) -> None:
        """Raise if what is parked for one of ``params`` (``(key, numel)``) is of another size."""
        for k, numel in params:
            saved = self.sizes.get(k)
            if saved is not None and saved != numel and (k in self.stage1 or k in self.moved):
                raise ValueError(
                    f"fastddp: the error-feedback residual kept for parameter {k} has {saved} "
                    f"elements, but that parameter now has {numel}; the residuals belong to "
                    "other tensors: a checkpoint of another model, or all_reduce calls with "
                    "other tensors. Load a checkpoint into the model it was saved with (or "
                    "start without its hook state), and give each set of tensors a state of "
                    "its own"
                )

    def state(self) -> dict[str, Any]:
        """What is parked, on the CPU, for a checkpoint."""
        return {
            "stage1": {k: _cpu(t) for k, t in self.stage1.items()},
            "stage2": {k: [(o, _cpu(p)) for o, p in ps] for k, ps in self.stage2.items()},
            "moved": sorted(self.moved),
            "sizes": dict(self.sizes),
            "replicated": {k: _cpu(t) for k, t in self.replicated.items()},
        }

    def load(self, saved: dict[str, Any]) -> None:
        """Add what :meth:`state` saved (version 2) or an old-format ``carry`` (version 1)."""
        if "moved" not in saved:  # version 1: stage 2 held whole, identically on every rank
            for k, t in saved.get("stage1", {}).items():
                self.stage1[int(k)] = t
                self.sizes[int(k)] = t.numel()
            for k, t in saved.get("stage2", {}).items():
                self.replicated[int(k)] = t
                self.moved.add(int(k))
                self.sizes[int(k)] = t.numel()
            return
        self.stage1.update({int(k): t for k, t in saved["stage1"].items()})
        for k, pieces in saved["stage2"].items():
            self.stage2.setdefault(int(k), []).extend((int(o), p) for o, p in pieces)
        self.moved.update(int(k) for k in saved["moved"])
        self.sizes.update({int(k): int(n) for k, n in saved["sizes"].items()})
        self.replicated.update({int(k): t for k, t in saved.get("replicated", {}).items()})


def _cpu(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().cpu().clone()
