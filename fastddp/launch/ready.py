"""The roll call's second phase: every node says when its own checks passed, and waits for
the others' (:mod:`fastddp.launch.roster`).

A node that cannot reach another, or be reached, ends with a note that the others read while
they wait, rather than in torch's rendezvous, waiting for workers that never come. Each card
promises at sign-in that its launcher will say so (a launcher without this phase promises
nothing and is not waited for). Under the static rendezvous a node rank whose every launcher
stopped before its checks passed (killed, or stopped by a signal, with no note) ends the
round: it cannot form. Under c10d such a launcher is left out (torch's rendezvous decides).
:class:`Beats` times the other launchers' heartbeats, for this phase and the first.
"""

import time
from typing import Callable, Optional

import torch.distributed as dist

__all__ = ["GONE_S", "Beats", "Readiness", "gone_line", "promise"]

# A launcher whose heartbeat has not moved for this long has stopped (well past what a loaded
# machine, or a store's hiccup, holds a roll call's thread for).
GONE_S = 30.0


def promise(store: dist.Store, prefix: str, number: int) -> None:
    """Promise, before card ``number`` is written, that its launcher will say when its checks
    passed."""
    store.set(prefix + f"will-confirm/{number}", "1")


class Readiness:
    """This node's word that its checks passed, and the nodes still to give theirs.

    Args:
        prefix: the roll call's keys in the rendezvous store.
        static: whether nodes are node ranks (static rendezvous) rather than launchers.
    """

    def __init__(self, prefix: str, static: bool) -> None:
        self._prefix, self._static = prefix, static
        self.mine = False  # this node's checks passed (set by confirm())
        self._said = False
        self._promised: set[int] = set()  # (keys are never removed: each is read once)
        self._ready: set[int] = set()

    def waiting(
        self, store: dist.Store, number: int, known: dict, still: Callable[[int], float]
    ) -> tuple[int, Optional[str]]:
        """Once this node's checks passed (said first, as card ``number``): how many nodes of
        ``known`` (card number: Card) promised to say so and have not, and the name of one
        that stopped first (static), if any. ``still(card)``: seconds since that card's
        heartbeat last moved (the roll call's reading)."""
        if not self._said:
            store.set(self._prefix + f"ready/{number}", "1")
            self._said = True
        self._promised |= self._found("will-confirm", store, set(known) - self._promised)
        self._ready |= self._found("ready", store, self._promised - self._ready)
        if not self._static:
            left = [i for i in self._promised - self._ready if still(i) < GONE_S]
            return len(left), None
        ranks: dict[int, list[int]] = {}
        for i, card in known.items():
            ranks.setdefault(card.node_rank, []).append(i)
        left = [n for _, n in sorted(ranks.items()) if self._ready.isdisjoint(n)]
        left = [n for n in left if not self._promised.isdisjoint(n)]
        # (every card of a node rank followed each poll: the heartbeats are timed)
        stopped = [n for n in left if all([still(i) >= GONE_S for i in n])]
        return len(left), known[stopped[0][-1]].name() if stopped else None

    def _found(self, name: str, store: dist.Store, numbers: set) -> set:
        return {i for i in numbers if store.check([self._prefix + f"{name}/{i}"])}


class Beats:
    """The other launchers' heartbeats (``beat/<card number>`` under ``prefix``), as this
    launcher reads them."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._seen: dict[int, tuple[int, float, bool]] = {}  # number: (beat, when, moved)

    def still(self, store: dist.Store, number: int) -> float:
        """Seconds since card ``number``'s heartbeat last moved (from its first reading)."""
        beat = int(store.add(self._prefix + f"beat/{number}", 0))
        now = time.monotonic()
        last, when, moved = self._seen.get(number, (beat, now, False))
        if beat != last:
            last, when, moved = beat, now, True
        self._seen[number] = (last, when, moved)
        return now - when

    def moved(self, number: int) -> bool:
        """Whether card ``number``'s heartbeat moved since :meth:`still` first read it."""
        return self._seen[number][2]


def gone_line(name: str) -> str:
    """What a node says when ``name``'s launcher stopped before its checks passed."""
    return (
        f"the launcher of {name} stopped before its checks passed (its heartbeat has not moved "
        f"for {GONE_S:g} s, and it left no note): the round cannot form; start that node again"
    )
