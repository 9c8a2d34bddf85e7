"""The roll call: every node's launcher signs in at the rendezvous and checks the others' cards.

torch's rendezvous waits in silence while a node is missing, and takes nodes launched with
another ``--nnodes``, or two with one ``--node-rank``, without a word: their workers then wait
in ``init_process_group`` until its timeout. While its first rendezvous runs, each launcher
writes a card (its address, host name, node rank, ``--nnodes``, ``--nproc-per-node``,
versions) into the rendezvous store and reads everyone's:

- a card with another ``--nnodes`` or rendezvous backend, or a second launcher waiting with
  this node's ``--node-rank``, ends this launcher with exit status 2 before any worker starts
  (every launcher that reads it does the same, so no node is left waiting);
- another torch or fastddp version, other ``--max-restarts`` or ``--nproc-per-node``, is warned of;
- every so often it says who has signed in and, under the static rendezvous, which node ranks
  are missing;
- the workers start only once every node of the round has signed in and been checked, by
  this node and by every other (each says in the store that its checks passed).

Nodes that join a running job (c10d) check their card against every card of the job. Under
the static rendezvous, a launcher that signs in once every node's roll call has confirmed the
round (and stopped reading cards) is not one of its nodes: what it finds wrong (its node rank
taken by a running launcher, whose heartbeat goes on) ends it alone, and the job goes on.
Before that, a node still reading cards would end the job for it, and so it ends with them.
"""

import contextlib
import dataclasses
import json
import socket
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from fastddp.launch import cards, failures, reach, stop
from fastddp.launch.cards import Card, disagreement, read, still_missing, unreadable, warnings
from fastddp.launch.preflight import say
from fastddp.launch.ready import Beats, Readiness, gone_line, promise

__all__ = ["RollCall"]

SAY_AFTER_S = 20.0  # the first "still waiting" line; then one every SAY_EVERY_S
SAY_EVERY_S = 60.0
POLL_S = 0.2
# A card whose heartbeat has not moved for this long is of a launcher gone (one whose workers
# run beats on, failures.py; under c10d, one past its rendezvous): a node started again may
# reuse its node rank.
LIVE_S = 3.0
GRACE_S = 2.0  # a launcher that ends on a bad card lingers, so that the others read theirs


class RollCall:
    """One launcher's roll call during its first rendezvous (see the module docstring).

    A thread signs in and reads the cards while torch's rendezvous waits; :meth:`confirm`,
    called once the rendezvous has formed, waits until every node of the round has signed in
    and been checked.

    Args:
        endpoint: the rendezvous store's host and port.
        run_id: the job's ``--rdzv-id``: cards live under it.
        card: this node's card, its address still empty (found on connecting).
        timeout: how long the launcher waits for the store and for the others' cards.
    """

    def __init__(self, endpoint: tuple[str, int], run_id: str, card: Card, timeout: timedelta):
        self._endpoint = endpoint
        self._prefix = f"fastddp/roster/{run_id}/"
        self._run_id = run_id
        self.card = card
        self._timeout = timeout.total_seconds()
        self.store: Optional[dist.Store] = None  # a client of the rendezvous store, signed in
        self._cards: dict[int, Card] = {}
        self._mine = 0  # this card's number, from 1
        self._beats = Beats(self._prefix)
        self._undecided = False  # two cards of one node rank, one not yet known to be waiting
        self._gone: set[int] = set()  # cards of a node rank taken twice, their launcher gone
        self.ranks = 0  # the job's, summed over the round's cards (confirm())
        self._late = False  # signed in after every node's workers started
        self._confirmed = False  # confirm() found the round complete
        # Two phases: this node's check passed (it says so in the store), then every node's.
        self._ready = Readiness(self._prefix, card.node_rank is not None)
        self._waiting = -1  # nodes still to say their checks passed (-1: not counted yet)
        self._broken: Optional[str] = None
        self._prober: Optional[reach.Prober] = None
        self._said = False
        self._next_say = SAY_AFTER_S
        self._start = time.monotonic()
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._polled = threading.Event()  # the cards there were at sign-in have been checked
        self._thread = threading.Thread(target=self._run, name="fastddp-roster", daemon=True)

    def start(self) -> None:
        self._start = time.monotonic()
        self._thread.start()

    def checked_in(self) -> None:
        """Wait until this node has signed in and checked the cards already there, and
        reached their nodes.

        Under c10d, before torch's rendezvous: a node that would end on a running job's cards
        must not join that job's next round first (the others would restart their workers
        for it, and again until its keep-alive runs out)."""
        self._polled.wait(self._timeout)

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=10.0)

    def confirm(self, world_size: int) -> Optional[str]:
        """Wait until ``world_size`` nodes have signed in, agree, and found each other
        reachable; return None then, else what went wrong: too few nodes signed in within the
        timeout (a node started by plain torchrun, or an older fastddp, does not sign in).

        A node whose check passed waits for the others' too: one that cannot reach this node
        ends its launch with a note, which this node's roll call reads and ends on (torch's
        c10d rendezvous would otherwise leave it waiting for that node's workers)."""
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while True:
                checked = self._signed_in() >= world_size and not self._undecided
                checked = checked and not self._probing()
                self._ready.mine = self._ready.mine or checked
                if checked and self._waiting == 0:
                    break
                problems = [] if self._prober is None else self._prober.problems
                if self._broken is not None and problems:  # (found before the store went)
                    return problems[0]
                if self._broken is not None:
                    say(f"warning: the roll call stopped ({self._broken}); nodes not checked")
                    return None
                left = deadline - time.monotonic()
                if left <= 0 and problems:
                    return problems[0]
                if left <= 0 and checked:
                    return (
                        f"{self._waiting} of the round's {world_size} nodes did not find the "
                        f"others reachable within {self._timeout:.0f} s ({self._names()})"
                    )
                if left <= 0:
                    return (
                        f"{self._signed_in()} of the round's {world_size} nodes signed in at "
                        f"{self._address()} within {self._timeout:.0f} s ({self._names()}): "
                        "launch every node with fastddp.launch of the same version"
                    )
                self._cond.wait(min(left, 1.0))
        with self._cond:
            self._confirmed = True  # cards read from now on are late launchers' to judge
            nodes = cards.members(self._cards, self._gone)
        self._stopping.set()
        # The nodes' --nproc-per-node may differ: every node sums the same cards (failures.py).
        self.ranks, uneven = cards.ranks(nodes, self.card), cards.uneven(nodes)
        if uneven is not None:
            say(uneven)
        if self._said:
            say(f"all {world_size} nodes have signed in; the workers start")
        return None

    def _signed_in(self) -> int:
        # Static: node ranks, once each (a node started again leaves its old card behind).
        if self.card.node_rank is None:
            return len(self._cards)
        return len({c.node_rank for c in self._cards.values()})

    def hand_over(self) -> None:
        """After :meth:`stop`: under the static rendezvous, watch for another node's failure
        over this roll call's connection (:mod:`fastddp.launch.failures`)."""
        if self.card.node_rank is not None and self.store is not None and self._broken is None:
            prefix, nodes = self._prefix, self.card.max_nodes
            master = next((c.name() for c in self._cards.values() if c.node_rank == 0), None)
            names = (self.card.name(), master or f"node 0 at {self._endpoint[0]}")
            with contextlib.suppress(RuntimeError, OSError):  # (the watcher finds out)
                self.store.add(self._prefix + "handed", 1)
            job = (nodes, self._run_id, names, self.ranks)
            failures.watch(self.store, prefix, self._mine, self.card.node_rank, *job)

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            store = self.store = self._sign_in()
            while not self._stopping.is_set():
                self._poll(store)
                if not self._probing():  # (its probes judged: a failed one ends it first)
                    self._polled.set()
                self._say_progress()
                self._stopping.wait(POLL_S)
        except (RuntimeError, OSError) as e:  # the store is gone: torch's rendezvous says why
            with self._cond:
                self._broken = str(e).splitlines()[0] if str(e) else type(e).__name__
                self._cond.notify_all()
            self._polled.set()

    def _sign_in(self) -> dist.Store:
        # A plain connection first: it gives this node's address on the way, and lets the
        # store's own client connect only once something listens (it would print retries).
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                with socket.create_connection(self._endpoint, timeout=2.0) as sock:
                    address = sock.getsockname()[0]
                break
            except OSError:
                if time.monotonic() > deadline or self._stopping.wait(POLL_S):
                    raise
        host, port = self._endpoint
        store = dist.TCPStore(host, port, None, False, timedelta(seconds=30), False)
        workers = reach.workers_address(address)
        listening = reach.listen(workers)
        self.card = dataclasses.replace(
            self.card, address=address, listen_at=workers, listen_port=listening
        )
        self._prober = reach.Prober(self.card.name(), self._address())
        # A launcher that comes after the job's workers started is not one of its nodes: what
        # it finds wrong ends it alone.
        # Late only once every node's roll call has confirmed the round: until then one of
        # them may still read this card and end the job for it.
        self._late = int(store.add(self._prefix + "handed", 0)) >= self.card.max_nodes
        self._mine = int(store.add(self._prefix + "count", 1))
        promise(store, self._prefix, self._mine)
        store.set(self._prefix + f"card/{self._mine}", json.dumps(dataclasses.asdict(self.card)))
        return store

    def _poll(self, store: dist.Store) -> None:
        count = int(store.add(self._prefix + "count", 0))
        new = [i for i in range(1, count + 1) if i not in self._cards]
        ready = [i for i in new if store.check([self._prefix + f"card/{i}"])]
        values = store.multi_get([self._prefix + f"card/{i}" for i in ready]) if ready else []
        cards = {}
        for i, raw in zip(ready, values):
            card = read(raw)
            if card is None:  # ends this launch alone (the job goes on, if it runs)
                self._end(unreadable(raw), post=False)
            else:
                cards[i] = card
        note = failures.note_from(store, self._prefix)
        if note is not None:
            self._end(f"{note}; this launch ends too", post=False)
        for i, card in sorted(cards.items()):
            if i == self._mine:
                continue
            problem = disagreement(self.card, card)
            if problem is not None:
                self._end(problem)
            for line in warnings(self.card, card):
                say(line)
            self._prober.probe(card.name(), card.listen_at, card.listen_port, i)
        self._prober.judge_refused(self._alive)
        if self._prober.problems:
            self._end(self._prober.problems[0])
        store.add(self._prefix + f"beat/{self._mine}", 1)
        # The new cards count for confirm() only with their verdict: a node rank taken twice
        # is undecided (or ends the launch) before confirm() sees the count it completes.
        known = {**self._cards, **cards}  # (this thread alone writes _cards)
        by_rank: dict[int, list[int]] = {}
        for i, card in known.items():
            if card.node_rank is not None:
                by_rank.setdefault(card.node_rank, []).append(i)
        undecided, dead = False, set()
        for rank, numbers in sorted(by_rank.items()):
            if len(numbers) < 2:
                continue
            states = [self._alive(i) for i in numbers]
            undecided = undecided or None in states
            dead.update(i for i, alive in zip(numbers, states) if alive is False)
            alive_at = [i for i, alive in zip(numbers, states) if alive]
            live = [known[i] for i in alive_at]
            if len(live) >= 2 and self._late and self._mine in alive_at:
                other = known[next(i for i in alive_at if i != self._mine)]
                self._end(
                    f"--node-rank {rank} is taken: the job running at {self._address()} has a "
                    f"launcher with it at {self._who(other)}; this launch ends and the job goes "
                    f"on (give every node its own --node-rank, from 0 to "
                    f"{self.card.max_nodes - 1})"
                )
            if len(live) >= 2:
                self._end(
                    f"two launchers wait with --node-rank {rank}: at {self._who(live[0])} and "
                    f"at {self._who(live[1])}; give every node its own --node-rank, from 0 to "
                    f"{self.card.max_nodes - 1}"
                )
        with self._cond:
            mine = self._ready.mine
        waiting, gone = -1, None
        if mine:
            waiting, gone = self._ready.waiting(store, self._mine, known, self._still)
        if gone is not None:
            self._end(gone_line(gone))
        with self._cond:
            self._cards.update(cards)
            self._undecided, self._gone, self._waiting = undecided, dead, waiting
            self._cond.notify_all()

    def _alive(self, number: int) -> Optional[bool]:
        """Whether card ``number``'s launcher still waits (or runs its workers); None while
        that is not known."""
        if number == self._mine:
            return True
        if self._still(number) >= LIVE_S:
            return False
        return True if self._beats.moved(number) else None

    def _still(self, number: int) -> float:
        return self._beats.still(self.store, number)

    def _who(self, card: Card) -> str:
        return f"{card.where()}, pid {card.pid}"

    def _say_progress(self) -> None:
        waited = time.monotonic() - self._start
        if waited < self._next_say:
            return
        self._next_say = waited + SAY_EVERY_S
        self._said = True
        with self._cond:
            cards = list(self._cards.values())
        line = (
            f"waiting for the other nodes at {self._address()} for {waited:.0f} s: "
            f"{self._signed_in()} of {self.card.nodes()} signed in ({self._names()})"
        )
        say(line + still_missing(self.card, cards))

    def _end(self, problem: str, post: bool = True) -> None:
        with self._cond:
            if self._confirmed:  # the thread's last poll, after the round was confirmed
                return
        say(f"error: {problem}")
        # For the nodes that cannot see it themselves: past their roll call (failures.py), or
        # not reading the card that shows it.
        if post and self.store is not None and not self._late:
            failures.post(self.store, self._prefix, problem, GRACE_S)
        self._stopping.wait(GRACE_S)
        stop.end(2)

    def _probing(self) -> bool:
        # A failed probe counts too, until the thread's next poll ends the launch with it: a
        # round confirmed in between would start workers that wait for Gloo's connections.
        prober = self._prober
        return prober is not None and (prober.pending() or bool(prober.problems))

    def _address(self) -> str:
        host, port = self._endpoint
        return f"{host}:{port}"

    def _names(self) -> str:
        with self._cond:
            cards = sorted(self._cards.values(), key=lambda c: (c.node_rank or 0, c.address))
        return ", ".join(c.where() if c.node_rank is None else c.name() for c in cards)
