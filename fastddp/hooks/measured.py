"""What ``dtype="auto"``'s measured steps record, and the per-bucket figures read from them.

A :class:`StepRecord` is one step of one candidate (or plan): per bucket, when it reached the
hook and left it, its size and the time the hook blocked on collectives; when its last
reduction ended; the step's period (to the next step's first bucket); and, in the trial, its
collectives (``links.py``). :func:`profile` reads the figures of the per-bucket model
(``planner.py``) off a trial's records.
"""

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch

from fastddp.hooks.topology import ring_bytes

__all__ = ["StepRecord", "profile"]


class StepRecord:
    """What one step measured: per bucket, when it reached the hook and left it, its size and
    the time the hook blocked on collectives; and when the last reduction ended."""

    __slots__ = (
        "label",
        "kind",
        "began",
        "left",
        "numel",
        "waited",
        "done",
        "period",
        "held",
        "collectives",
    )

    def __init__(self, label: str, kind: Optional[str]) -> None:
        self.label, self.kind = label, kind  # kind: "trial", "verify" or None (not measured)
        self.began: list[float] = []
        self.left: list[float] = []
        self.numel: list[int] = []
        self.waited: list[float] = []
        self.done = 0.0
        self.period = 0.0  # to the next step's first bucket
        self.held: dict[str, set[int]] = {}  # parameter keys each mode reduced
        self.collectives: list[tuple] = []  # (level, bytes, issued, stamp): see links.py

    def finished(self, _future: torch.futures.Future) -> None:
        self.done = max(self.done, time.perf_counter())

    def figures(self) -> tuple[list[float], float, float]:
        """Compute gaps before each bucket, host seconds per element, seconds to the end."""
        gaps = [0.0] + [b - a for a, b in zip(self.left, self.began[1:])]
        busy = sum(b - a for a, b in zip(self.began, self.left)) - sum(self.waited)
        end = max(self.done, self.left[-1])
        return gaps, max(busy, 0.0) / max(sum(self.numel), 1), end - self.began[0]


def profile(
    allow: Sequence[str], states: Mapping[str, Any], runs: Mapping[str, Sequence[StepRecord]]
) -> Optional[list[float]]:
    """This rank's figures for the per-bucket model, flat, from each candidate's measured trial
    steps (``runs``; ``states``: the fastddp candidates), or None where it does not apply: no
    bucket a fastddp candidate compresses, a single bucket, or a bucket layout that changed.

    The list holds the number of buckets, their sizes, then per candidate in ``allow`` order
    the medians of its compute gaps before each bucket, its host seconds per element, its
    seconds from the first bucket to the last reduction's end, and each bucket's bytes on the
    slowest link.
    """
    if not any(s._verified for s in states.values()):
        return None  # 16-bit buckets pass through: nothing to plan
    sizes = {tuple(r.numel) for rs in runs.values() for r in rs}
    if len(sizes) != 1:
        return None
    numel = list(next(iter(sizes)))
    if len(numel) < 2:
        return None
    flat: list[float] = [float(len(numel)), *map(float, numel)]
    for name in allow:
        rows = [r.figures() for r in runs[name]]
        gaps = [statistics.median(g[i] for g, _, _ in rows) for i in range(len(numel))]
        cost = statistics.median(c for _, c, _ in rows)
        reduce_s = statistics.median(e for _, _, e in rows)
        flat += [*gaps, cost, reduce_s, *_sent(name, states, numel)]
    return flat


def _sent(name: str, states: Mapping[str, Any], numel: list[int]) -> list[float]:
    """Bytes of each bucket on the slowest link: across nodes where there are several."""
    topo = next(s for s in states.values() if s._verified)._topology
    across = len(topo.nodes) > 1
    if name not in states:  # "none": PyTorch's fp32 ring all-reduce
        if across:
            return [float(topo.ring_cross_bytes(n, 4)) for n in numel]
        return [float(ring_bytes(n, topo.world, 4)) for n in numel]
    slots = dict(states[name]._table.by_index())
    sent = []
    for i, n in enumerate(numel):
        slot = slots.get(i)
        if slot is None or not slot.calls:
            sent.append(float(ring_bytes(n, topo.world, 4)))
            continue
        total = slot.cross_node_bytes if across else slot.wire_bytes
        sent.append(total / slot.calls)
    return sent
