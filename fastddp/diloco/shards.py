"""Where each rank's slice of the model lies, and the copies between the model and the slices.

The parameters (those that require a gradient, in ``model.parameters()`` order) are laid end to
end as one fp32 vector, padded with zeros to ``per_node`` slices of ``size`` elements; local
rank ``k`` owns slice ``k``. ``size`` is a multiple of ``align`` (the codec's block times the
number of nodes), so that every slice, and every rank's chunk of it in the codec's
reduce-scatter, starts on a block boundary: a block then holds the same elements whatever the
number of ranks per node, and a node of L ranks reduces bit for bit what a node of one would.
"""

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["Shards"]

# torch 2.13 renamed all_gather_into_tensor (now deprecated); older releases have only that.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Shards:
    """One rank's view of the flat parameter vector: its slice, and the node's all-gather."""

    __slots__ = ("params", "numel", "size", "per_node", "lo", "device", "_full")

    def __init__(self, params: list[torch.Tensor], per_node: int, local_rank: int, align: int):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.per_node = per_node
        share = -(-self.numel // per_node)
        self.size = -(-share // align) * align
        self.lo = local_rank * self.size
        self.device = params[0].device
        self._full: Optional[torch.Tensor] = None  # the node's slices, gathered (per_node > 1)

    def read(self, out: torch.Tensor) -> torch.Tensor:
        """Copy this rank's slice of the model's parameters into ``out`` (fp32, zero padded)."""
        hi = self.lo + self.size
        out.zero_()
        at = 0
        for p in self.params:
            n = p.numel()
            a, b = max(at, self.lo), min(at + n, hi)
            if a < b:
                out[a - self.lo : b - self.lo].copy_(p.detach().reshape(-1)[a - at : b - at])
            at += n
        return out

    def write(self, mine: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
        """Gather every local rank's slice (``mine`` here) and copy them into the parameters.

        A collective over the node's ``group`` when the node has several ranks.
        """
        full = mine
        if self.per_node > 1:
            if self._full is None:
                self._full = torch.empty(
                    self.per_node * self.size, dtype=mine.dtype, device=self.device
                )
            _all_gather_single(self._full, mine, group=group)
            full = self._full
        at = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(full[at : at + n].view_as(p))
                at += n
