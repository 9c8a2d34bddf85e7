"""The roll call's second phase: every node says when its own checks passed, and waits for
the others' (:mod:`fastddp.launch.roster`).

A node that cannot reach another, or be reached, ends with a note that the others read while
they wait, rather than in torch's rendezvous, waiting for workers that never come. Under the
static rendezvous a node rank whose every launcher stopped before its checks passed (killed,
or stopped by a signal, with no note) ends the round at once: it cannot form.
"""

import time
from typing import Optional

import torch.distributed as dist

__all__ = ["GONE_S", "Readiness", "gone_line"]

# A launcher whose heartbeat has not moved for this long has stopped (a loaded machine can
# hold a roll call's thread for a few seconds).
GONE_S = 10.0


class Readiness:
    """This node's word that its checks passed, and the count of the nodes that said so.

    Args:
        prefix: the roll call's keys in the rendezvous store.
        static: whether nodes are node ranks (static rendezvous) rather than launchers.
    """

    def __init__(self, prefix: str, static: bool) -> None:
        self._prefix, self._static = prefix, static
        self.mine = False  # this node's checks passed (set by confirm())
        self._said = False
        self._moved: dict[int, tuple[int, float]] = {}  # card: (beat, when it last moved)

    def count(self, store: dist.Store, number: int, known: dict) -> tuple[int, Optional[str]]:
        """Once this node's checks passed (written first, as card ``number``): the nodes of
        ``known`` (card number: Card) whose checks passed, once each, and the name of a node
        gone before (static), if any."""
        if not self.mine:
            return 0, None
        if not self._said:
            store.set(self._prefix + f"ready/{number}", "1")
            self._said = True
        ready = {i for i in known if store.check([self._prefix + f"ready/{i}"])}
        if not self._static:
            return len(ready), None
        ranks: dict[int, list[int]] = {}
        for i, card in known.items():
            ranks.setdefault(card.node_rank, []).append(i)
        waiting = [n for _, n in sorted(ranks.items()) if ready.isdisjoint(n)]
        # (every card of a node rank checked each poll: the heartbeats are followed)
        stopped = [n for n in waiting if all([self._stopped(store, i) for i in n])]
        gone = known[stopped[0][-1]].name() if stopped else None
        return len(ranks) - len(waiting), gone

    def _stopped(self, store: dist.Store, number: int) -> bool:
        beat = int(store.add(self._prefix + f"beat/{number}", 0))
        now = time.monotonic()
        last, when = self._moved.get(number, (beat, now))
        if beat != last:
            last, when = beat, now
        self._moved[number] = (last, when)
        return now - when >= GONE_S


def gone_line(name: str) -> str:
    """What a node says when ``name``'s launcher stopped before its checks passed."""
    return (
        f"the launcher of {name} stopped before its checks passed (its heartbeat has not moved for "
        f"{GONE_S:g} s, and it left no note): the round cannot form; start that node again"
    )
