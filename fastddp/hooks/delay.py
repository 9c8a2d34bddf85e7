"""One-step delayed reduction, ``CompressState(delay=1)``: buffers of the gradients in waiting.

With ``delay=1`` the hook copies a bucket's gradient into one of two persistent buffers of the
bucket's :class:`Entry`, starts reducing it there, and gives the bucket back, at once, the
gradient reduced from the other buffer during the previous step. The reduction then has the
whole next step (optimizer, forward, backward) to cross the wire. The two buffers alternate, so
a reduction in flight is never overwritten; its job is settled before its buffer is read.

Reduced gradients follow their parameters, as residuals do: when DDP lays its buckets out
anew (after its first iteration, or on a resumed job), the old entries' gradients are parked by
parameter and taken up by the new buckets; a parameter with nothing in waiting (the first step
after the state is made) gets zeros. :meth:`Delayed.state` saves them for checkpoints.
"""

from typing import Any, Callable, Optional

import torch

__all__ = ["Delayed", "Entry"]


class Entry:
    """The two buffers of one bucket, and the reduction in flight."""

    __slots__ = ("params", "buffers", "reduced", "job")

    def __init__(self, params: tuple, first: torch.Tensor) -> None:
        self.params = params  # (key, numel) of each parameter, in bucket order
        self.buffers = (first, torch.empty_like(first))
        self.reduced = 0  # which buffer holds (or will hold) the latest reduced gradient
        self.job = None  # the pipeline job reducing buffers[reduced], or None

    def pieces(self) -> dict[int, torch.Tensor]:
        """The reduced gradient by parameter key (views; the job must be settled)."""
        out, offset = {}, 0
        for key, numel in self.params:
            out[key] = self.buffers[self.reduced][offset : offset + numel]
            offset += numel
        return out


class Delayed:
    """Every bucket's :class:`Entry`, by first parameter, and gradients parked by parameter."""

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}
        self.parked: dict[int, torch.Tensor] = {}  # parameter key -> reduced gradient

    def entry_for(
        self, params: tuple, bucket: torch.Tensor, settle: Callable[[Any], None]
    ) -> Entry:
        """The entry of a bucket holding ``params``; made anew if the layout changed.

        ``settle(job)`` finishes an old entry's reduction before its gradient is parked.
        """
        entry = self.entries.get(params[0][0])
        if entry is not None and entry.params == params:
            return entry
        mine = {key for key, _ in params}
        for first, old in list(self.entries.items()):
            if mine.isdisjoint(k for k, _ in old.params):
                continue
            settle(old.job)
            self.parked.update(old.pieces())
            del self.entries[first]
        first = torch.zeros_like(bucket)
        offset = 0
        for key, numel in params:
            piece = self.parked.pop(key, None)
            if piece is not None:
                if piece.numel() != numel:
                    raise ValueError(
                        f"fastddp: the delayed gradient in waiting for parameter {key} has "
                        f"{piece.numel()} elements and the parameter has {numel}; load a "
                        "CompressState.state_dict() saved with this model"
                    )
                first[offset : offset + numel].copy_(piece.reshape(-1))
            offset += numel
        entry = self.entries[params[0][0]] = Entry(params, first)
        return entry

    def state(self, settle: Callable[[Any], None]) -> dict[int, torch.Tensor]:
        """Every gradient in waiting by parameter key, on the CPU (reductions settled first)."""
        out = {key: t.detach().cpu().clone() for key, t in self.parked.items()}
        for entry in self.entries.values():
            settle(entry.job)
            out.update({k: t.cpu().clone() for k, t in entry.pieces().items()})
        return out

    def load(self, saved: Optional[dict[int, torch.Tensor]]) -> None:
        """Park gradients saved by :meth:`state`; the buckets holding them take them up."""
        self.entries.clear()
        self.parked = {int(k): t for k, t in (saved or {}).items()}

    def start(self, entry: Entry, bucket: torch.Tensor) -> torch.Tensor:
        """Swap: the buffer to send (holding ``bucket``'s gradient), ``bucket`` the reduced one.

        The entry's job must be settled. Returns the buffer the caller reduces next.
        """
        send = entry.buffers[1 - entry.reduced]
        send.copy_(bucket)
        bucket.copy_(entry.buffers[entry.reduced])
        entry.reduced = 1 - entry.reduced
        return send
