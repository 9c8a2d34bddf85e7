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

__all__ = ["Card", "disagreement", "read", "still_missing", "this_node", "unreadable", "warnings"]


@dataclasses.dataclass(frozen=True)
class Card:
    """What one node's launcher was started with."""

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
    node_rank: Optional[int], min_nodes: int, max_nodes: int, backend: str, max_restarts: int
) -> Card:
    """This node's card, its address still to be found."""
    host = socket.gethostname()
    versions = (torch.__version__, __version__)
    return Card(
        "", host, node_rank, min_nodes, max_nodes, backend, max_restarts, *versions, os.getpid()
    )
