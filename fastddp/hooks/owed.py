"""Residuals owed to parameters when ``dtype="auto"`` changes which candidate reduces them.

Error feedback keeps, per bucket, what rounding left out, for that bucket's next reduction to
add. When a plan gives a bucket to another candidate, or DDP moves a parameter to a bucket of
another candidate, no reduction of the first would add it again. :class:`Owed` takes such
residuals out of the candidate, by parameter, and adds each to the next bucket that holds its
parameter, whatever candidate reduces that bucket: nothing error feedback kept is lost. During a
trial each candidate keeps its residuals in its own buckets until its next turn: moving them at
every turn would cost the next candidate the copies.
"""

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from fastddp.hooks import lifecycle

__all__ = ["Owed"]


class Owed:
    """Residuals by parameter, added to the parameters' next reductions."""

    __slots__ = ("_by_param",)

    def __init__(self) -> None:
        self._by_param = WeakIdKeyDictionary()  # parameter -> residual its next reduction adds

    def __len__(self) -> int:
        return len(self._by_param)

    def collect(self, state, rank: int, keep: frozenset = frozenset()) -> None:
        """Take the residuals of ``state`` (a fixed :class:`~fastddp.CompressState`) out, by
        parameter; the buckets whose indices are in ``keep`` keep theirs."""
        state.flush()
        tensors = {key: p for p, key in state._table.param_keys.items()}
        for slot in state._table.slots.values():
            if slot.residual is None or not slot.params or slot.index in keep:
                continue
            parts = lifecycle.residuals_of(state, slot, rank)
            owed = parts["residual"].clone()
            shard = parts["shard_residual"]
            if shard is not None:
                lo = parts["shard_offset"]
                n = max(0, min(shard.numel(), slot.numel - lo))
                owed[lo : lo + n] += shard[:n]
            offset = 0
            for key, numel in slot.params:
                p = tensors.get(key)
                if p is not None:
                    self._add(p, owed[offset : offset + numel])
                offset += numel
            slot.residual.zero_()
            if slot.shard_residual is not None:
                slot.shard_residual.zero_()
        for key, owed in state._residuals.drain(rank).items():  # parked: loaded or moved
            p = tensors.get(key)
            if p is not None:
                self._add(p, owed)

    def repay(self, bucket: dist.GradBucket, world: int) -> None:
        """Add what the parameters of ``bucket`` are owed to its buffer, before it is reduced."""
        # Residuals are in units of the average; the bucket is divided by the world size.
        buffer, offset = bucket.buffer(), 0
        for p in bucket.parameters():
            n = p.numel()
            owed = self._by_param.pop(p, None)
            if owed is not None:
                buffer[offset : offset + n].add_(owed.to(buffer.device), alpha=world)
            offset += n

    def _add(self, p: torch.Tensor, owed: torch.Tensor) -> None:
        before = self._by_param.get(p)
        self._by_param[p] = owed if before is None else before + owed.to(before.device)

    def settle_plan(self, states: dict, using, group) -> None:
        """At a new plan (``using``: a candidate, or one per bucket): take out the residuals of
        every bucket a candidate of ``states`` no longer reduces, for its next reduction."""
        for name, state in states.items():
            if not state.error_feedback or not state._verified or using == name:
                continue  # (a candidate that reduces every bucket keeps its residuals)
            mine = () if isinstance(using, str) else [i for i, m in enumerate(using) if m == name]
            self.collect(state, dist.get_rank(group), frozenset(mine))

    def settle_moves(self, states: dict, before: dict, after: dict, group) -> None:
        """Between two steps (``before`` and ``after``: the parameter keys each candidate
        reduced in each): take out the residuals of candidates whose buckets lost parameters."""
        # DDP lays its buckets out again (after its first step, say): a parameter that left a
        # mode's buckets left its residual in that mode, which no bucket of it will take up. It
        # is repaid through the parameter's new bucket (a step late; nothing is lost).
        # (In a trial, where modes take turns, each keeps its residuals in its own buckets.)
        for name, keys in before.items():
            state = states.get(name)
            if state is None or not state.error_feedback or name not in after:
                continue
            if keys - after[name]:
                self.collect(state, dist.get_rank(group))
