"""What each node's launcher was started with (its card), and how two cards disagree.

The roll call (:mod:`fastddp.launch.roster`) writes this node's card into the rendezvous store
and reads the others'.
"""

import dataclasses
import json
import os
import socket
from typing import Optional

import torch

from fastddp._version import __version__

__all__ = [
    "Card",
    "disagreement",
    "members",
    "ranks",
    "read",
    "still_missing",
    "this_node",
    "uneven",
    "unreadable",
    "warnings",
]


@dataclasses.dataclass(frozen=True)
class Card:
    """What one node's launcher was started with.

    Fields added later have defaults, so that an older fastddp's card still reads; a card with
    a field this version does not know does not (:func:`read`)."""

    address: str  # the node's address on the way to the rendezvous
    host: str
    node_rank: Optional[int]  # the static rendezvous's --node-rank; None under c10d
    min_nodes: int
    max_nodes: int
    backend: str
    max_restarts: int
    torch: str
    fastddp: str
    pid: int
    listen_at: str = ""  # where this node listens for the others' probes (reach.py)
    listen_port: int = 0
    nproc_per_node: int = 0  # this node's workers; 0 on an older fastddp's card, which lacks it

    def nodes(self) -> str:
        """``--nnodes`` as it was given."""
        same = self.min_nodes == self.max_nodes
        return str(self.max_nodes) if same else f"{self.min_nodes}:{self.max_nodes}"

    def where(self) -> str:
        return self.address if self.host in ("", self.address) else f"{self.address} ({self.host})"

    def name(self) -> str:
        at = self.where()
        return f"the node at {at}" if self.node_rank is None else f"node {self.node_rank} at {at}"


def disagreement(mine: Card, other: Card) -> Optional[str]:
    """Why ``other``'s node cannot join this node's job, or None."""
    theirs, ours = f"--nnodes {other.nodes()}", f"--nnodes {mine.nodes()}"
    if other.backend != mine.backend:
        theirs += f" and the {other.backend} rendezvous"
        ours += f" and the {mine.backend} rendezvous"
    if theirs == ours:
        return None
    return (
        f"{other.name()} was launched with {theirs}, and {mine.name()} with {ours}: launch "
        "every node with the same --nnodes and --rdzv-backend"
    )


def warnings(mine: Card, other: Card) -> list[str]:
    """What differs between the nodes and may fail later."""
    said = []
    for field, what in (("torch", "torch"), ("fastddp", "fastddp")):
        if getattr(other, field) != getattr(mine, field):
            said.append(
                f"warning: {other.name()} runs {what} {getattr(other, field)}, this node "
                f"{getattr(mine, field)}: collectives between versions can fail or hang; "
                "install the same on every node"
            )
    if other.max_restarts != mine.max_restarts:
        said.append(
            f"warning: {other.name()} has --max-restarts {other.max_restarts}, this node "
            f"{mine.max_restarts}: after a failure the nodes restart apart, and one that waits "
            "for another's round waits until the rendezvous timeout; give every node the same"
        )
    return said


def members(known: dict[int, Card], gone: set) -> list[Card]:
    """The round's nodes' cards, of ``known`` (card number: Card): under the static rendezvous
    a node rank's newest, but not one whose launcher was found ``gone`` while another card of
    that rank remains (a node started again leaves its old card behind)."""
    nodes: dict[int, Card] = {}
    for number, card in sorted(known.items()):
        node = -number if card.node_rank is None else card.node_rank  # (c10d: every launcher)
        if number in gone:
            nodes.setdefault(node, card)
        else:
            nodes[node] = card
    return list(nodes.values())


def ranks(nodes: list[Card], mine: Card) -> int:
    """The job's ranks: the sum of ``nodes``' ``--nproc-per-node`` (a card each); a card that
    does not say counts as many as ``mine``."""
    return sum(card.nproc_per_node or mine.nproc_per_node for card in nodes)


def uneven(nodes: list[Card]) -> Optional[str]:
    """A warning where ``nodes`` (a card each) run different numbers of workers, else None:
    often one node's command line gone wrong (or ``--nproc-per-node gpu`` on unlike nodes),
    which fastddp's topologies that need even nodes find only once the workers run."""
    counts: dict[int, list[str]] = {}
    for card in sorted(nodes, key=lambda c: (c.node_rank or 0, c.address)):
        if card.nproc_per_node:
            counts.setdefault(card.nproc_per_node, []).append(card.name())
    if len(counts) < 2:
        return None
    said = "; ".join(
        f"{n} on " + ", ".join(names[:3]) + (f" and {len(names) - 3} more" if names[3:] else "")
        for n, names in sorted(counts.items())
    )
    return (
        f"warning: the nodes run different numbers of workers (--nproc-per-node: {said}); torch "
        "takes that, but fastddp's topology='hierarchical', DiLoCo and hybrid sharding refuse "
        "it once the workers run"
    )


def read(raw: bytes) -> Optional[Card]:
    """The card written as ``raw``; None where this version cannot read it (:func:`unreadable`
    says so)."""
    try:
        return Card(**json.loads(raw))
    except (TypeError, ValueError):
        return None


def still_missing(mine: Card, cards: list) -> str:
    """What the roll call's progress line adds about the nodes not signed in yet."""
    if mine.node_rank is None:
        return (
            "; start the others with this --rdzv-endpoint and --nnodes, and check that they "
            "reach it"
        )
    missing = sorted(set(range(mine.max_nodes)) - {c.node_rank for c in cards})
    if not missing:
        return "; checking them"
    return (
        f"; missing node rank(s) {', '.join(map(str, missing))}: start them with --nnodes "
        f"{mine.nodes()} and this --master-addr and --master-port, and check that they reach "
        "this address"
    )


def unreadable(raw: bytes) -> str:
    """What is wrong with a card :func:`read` cannot read."""
    return (
        f"a node signed in with a card this fastddp {__version__} cannot read "
        f"({raw[:120]!r}): run the same fastddp on every node"
    )


def this_node(
    node_rank: Optional[int], min_nodes: int, max_nodes: int, backend: str, launch: dict
) -> Card:
    """This node's card, its address still to be found. ``launch``: its ``max_restarts`` and
    ``nproc_per_node``, where known."""
    host, restarts = socket.gethostname(), launch.get("max_restarts", 0)
    versions = (torch.__version__, __version__)
    return Card(
        "", host, node_rank, min_nodes, max_nodes, backend, restarts, *versions, os.getpid(),
        nproc_per_node=launch.get("nproc_per_node", 0),
    )  # fmt: skip
