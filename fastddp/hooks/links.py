"""The rate each level of the network gave ``dtype="auto"``'s collectives during its trial.

In the trial's measured steps every collective a fastddp candidate issues is recorded with its
level, the bytes this rank sends in it, when it was issued and when it completed. The
completion is stamped by the extension on the thread that completes the collective's future,
without Python's lock (a Python callback there would wait for the training thread to let go
of it, and stamp late). Levels:

- ``"intra"``: collectives among the ranks of one node (the two-level path's first and last
  stages, or any collective when the job has one node);
- ``"cross"``: collectives between nodes, one rank of each (the two-level path's middle stages,
  or any collective when each node has one rank);
- ``"flat"``: collectives over every rank of several nodes of several ranks (a flat path
  there), whose bytes cross both levels.

A level's rate is the bytes one node's ranks sent at that level over the time its collectives
were in flight (the union of their intervals in each step). It is what the collectives achieved,
not the link's nominal rate: it counts each collective's latency, Gloo's own work on the data,
and the time a rank waits in a collective for the others to join. Of the ranks' times the least
is taken, since the rank that issues a collective last waits least for the others. Timed for
CPU tensors on Gloo, where a collective's future completes when the collective has (NCCL's
completes when it is enqueued).
"""

from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fastddp import _extension

__all__ = ["LEVELS", "in_flight", "issued", "level_of", "stamper", "summary"]

LEVELS = ("intra", "cross", "flat")


def level_of(role: str, topo: Any) -> str:
    """The level of a collective on the process group of ``role`` (``"group"``, ``"intra"``
    or ``"cross"``, as :class:`~fastddp.hooks.paths.Path` names them) under ``topo``."""
    if role != "group":
        return role
    if len(topo.nodes) == 1:
        return "intra"
    # From the whole layout, not this rank's node: with uneven nodes (3 + 1) every rank must
    # file the same collective under the same level, or the levels' times do not add up.
    return "cross" if max(len(n) for n in topo.nodes) == 1 else "flat"


def stamper(device: torch.device, group: Optional[dist.ProcessGroup]) -> Optional[Callable]:
    """The extension's completion stamp where the levels are timed (CPU tensors on Gloo), else
    None."""
    if device.type != "cpu" or "gloo" not in str(dist.get_backend(group)):
        return None
    return _extension.load().stamp_completion


def issued(job: Any, stage: int, began: float, stamp: Callable) -> tuple[str, int, float, Any]:
    """The collective ``job`` issued at ``stage``, as a measured step records it: its level,
    the bytes this rank sends, ``began`` (``time.perf_counter()`` just before it was issued)
    and ``stamp`` of its future.

    The time must be taken before the collective is issued: a small one can complete before
    the call returns, and ``stamp`` of a completed future stamps at once, so a time taken
    after would leave it no time in flight."""
    level = level_of(job.path.roles[stage], job.topo)
    return level, job.path.stage_bytes(job, stage), began, stamp(job.work.get_future())


def in_flight(steps: Iterable[Sequence[tuple[str, int, float, Any]]]) -> list[float]:
    """Per level of :data:`LEVELS`: bytes sent, seconds in flight and the number of completed
    collectives, summed over ``steps`` (each a list of ``(level, bytes, issued, stamp)``, with
    ``stamp.done`` the completion time, 0 while pending), as one flat list of three per level."""
    out = [0.0] * (3 * len(LEVELS))
    for collectives in steps:
        for k, level in enumerate(LEVELS):
            spans = sorted(
                (issued, max(issued, stamp.done), sent)
                for name, sent, issued, stamp in collectives
                if name == level and stamp.done > 0
            )
            busy, end = 0.0, float("-inf")
            for begin, done, _ in spans:
                if done > end:
                    busy += done - max(begin, end)
                    end = done
            out[3 * k] += sum(sent for _, _, sent in spans)
            out[3 * k + 1] += busy
            out[3 * k + 2] += len(spans)
    return out


def summary(
    sent: Sequence[float], busy: Sequence[float], count: Sequence[float], nodes: int, world: int
) -> dict[str, dict[str, float]]:
    """Per level with timed collectives: ``MBps`` (a node's bytes per second in flight), ``MB``
    (a node's bytes), ``busy_ms`` and ``collectives`` (per rank), from every rank's bytes and
    counts summed and the least of the ranks' times in flight."""
    out = {}
    for level, total, seconds, n in zip(LEVELS, sent, busy, count):
        if n <= 0 or seconds <= 0 or total <= 0:
            continue
        per_node = total / nodes
        out[level] = {
            "MBps": per_node / seconds / 1e6,
            "MB": per_node / 1e6,
            "busy_ms": seconds * 1e3,
            "collectives": n / world,
        }
    return out
