"""A node whose launch fails tells the others, which stop their workers instead of waiting.

Under the static rendezvous no node can go on without the others. When one node's workers
fail for good (or its next round cannot form), its launcher exits, and the other nodes'
workers wait for its ranks, in ``init_process_group`` or a collective, until their timeouts
(10 minutes in ``init_distributed``, 30 in torch's), in silence. Here the failing launcher
posts a note in the rendezvous store, which node 0's launcher serves; every other launcher
reads it within a second, says it, and stops its own workers (exit status 1). Node 0, whose
exit takes the store away, waits for the others to read its note first (at most
:data:`LINGER_S`).

Node 0's launch that ends well says so too, and waits as long for the others to let its store
go. So a store that closes without that word means node 0's launcher is gone (killed, or
crashed) while its host still answers: the others then stop their workers, which would wait
for its ranks, in ``init_process_group`` or a collective, until their timeouts.

A node that goes silent (its link or its host down: no connection closes) is named within the
peer timeout (``FASTDDP_PEER_TIMEOUT``; unset, as for the workers: 300 s for up to 64 ranks,
else off, the job's ranks summed over the nodes' roll-call cards, so that every node decides
alike, whatever ``--nproc-per-node`` each has) plus :data:`QUIET_MARGIN_S`: node 0 watches
every other node's heartbeat in its store (a node whose launch ended is not waited for), and
the other nodes watch that node 0's store still answers. Running workers' own watchdogs
(:mod:`fastddp.watchdog`) name a silent rank first; this covers workers not watching yet,
still loading data or waiting for the others.

The c10d rendezvous is left to torch: a node that fails there can be started again and
rejoin, and the others' agents wait for it (``--max-restarts``, ``--nnodes MIN:MAX``).
"""

import os
import threading
import time
from typing import Optional

import torch.distributed as dist

from fastddp.cluster import ClusterError
from fastddp.launch import stop
from fastddp.launch.cards import read, unreadable
from fastddp.launch.preflight import say
from fastddp.watchdog import peer_timeout_from_env

__all__ = ["ARRIVALS", "arrived", "ended", "note_from", "peer_failure", "post", "watch"]

WATCH_S = 1.0
LINGER_S = 5.0
# A node stopped by a signal is often one of many (a scheduler ending the job): this node
# waits as long for its own signal before it stops its workers for the other's.
SIGNAL_GRACE_S = 3.0
# Node 0's store lost: how long this node's own end (its workers done too) may take to show.
LOST_GRACE_S = 2.0
# A silent node is named this long after the peer timeout: running workers' watchdogs, which
# name the silent ranks themselves, speak first.
QUIET_MARGIN_S = 10.0

# Counted by every node as it joins a round (store.py); read here too, off the agent's
# thread, for :func:`arrived`.
ARRIVALS = "fastddp/round_store/arrivals"

_watcher: Optional["_Watcher"] = None
_ending = threading.Lock()
_peer_note: Optional[str] = None
_kept: list = []  # what node 0's rendezvous store lives in, until this launch has ended


class _Watcher:
    def __init__(
        self, store, prefix: str, card: int, node_rank: int, nodes: int, run_id: str, names,
        ranks: int = 1,
    ):  # fmt: skip
        self.store, self.prefix, self.card = store, prefix, card
        self.rounds = dist.PrefixStore(run_id, store)  # where the static rendezvous's keys are
        self.arrived = -1
        self.key = prefix + "failed"
        # "over": node 0's launch ended without a failure; "let_go": how many nodes are done
        # with its store (ended, or read the note it lingers for).
        self.over, self.let_go = prefix + "over", prefix + "let_go"
        # This node's card keeps its heartbeat, so that a late launcher with its node rank is
        # refused (roster.py).
        self.beat = prefix + f"beat/{card}"
        self.name, self.master = names
        self.node_rank, self.nodes = node_rank, nodes
        self.released = node_rank == 0  # this node needs node 0's store no more
        self._releasing = threading.Lock()
        self._stop = threading.Event()
        # On by default where the workers' watchdogs are (off for big jobs): the job's ranks,
        # summed over the nodes' cards, so that every node decides alike.
        try:  # (a bad value was refused by the preflight, or is by the workers)
            timeout = peer_timeout_from_env(os.environ, world=ranks)
        except ClusterError:
            timeout = 0.0
        self.quiet_limit = timeout + QUIET_MARGIN_S if timeout > 0 else 0.0
        self.last_ok = time.monotonic()  # the last loop that reached node 0's store
        self.peers: dict[int, tuple[int, str]] = {}  # node 0: card -> (node rank, name)
        self.beats: dict[int, tuple[int, float]] = {}  # card -> (beat, when it last moved)
        self.ignored: set[int] = set()  # cards this version cannot read
        self.noted = False  # node 0 posted the note of a silent node (_quiet)
        self._thread = threading.Thread(target=self._run, name="fastddp-failures", daemon=True)
        self._thread.start()
        if self.quiet_limit and node_rank != 0:
            name = "fastddp-failures-quiet"
            threading.Thread(target=self._watch_quiet, name=name, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(WATCH_S):
            try:
                self.store.add(self.beat, 1)
                self.arrived = int(self.rounds.add(ARRIVALS, 0))
                if not self.released and self.store.check([self.over]):
                    self.release()
                    return  # node 0's launch ended well: its store goes, and nothing is lost
                self.last_ok = time.monotonic()
                if not self.store.check([self.key]):
                    silent = self._silent() if self.quiet_limit and self.node_rank == 0 else None
                    if silent is not None:
                        self._quiet(silent)
                        return
                    continue
                value = self.store.get(self.key).decode()
                self.release()
            except (RuntimeError, OSError) as e:
                if not self.released:
                    self._lost(e)
                return
            # "s": a signal stopped that node; "f": it failed; "c": its roll call found the
            # nodes launched unlike, or apart (roster.py), which ends every launcher with 2.
            kind, note = value[:1], value[1:]
            if kind == "s":
                self._stop.wait(SIGNAL_GRACE_S)
            if stop.signalled() or self._stop.is_set():
                return  # this node is stopping on its own; a second signal would interrupt it
            _stop_workers(note, 2 if kind == "c" else 1)
            return

    def release(self) -> None:
        """Tell node 0 that this node no longer needs its store (once)."""
        with self._releasing:  # (the watcher's thread, or the one of ended())
            if not self.released:
                self.store.set(self.prefix + f"done/{self.card}", "1")  # no longer beats
                self.store.add(self.let_go, 1)  # (raises where the store is gone)
                self.released = True

    def _silent(self) -> Optional[str]:
        """Node 0: the first other node whose launcher's heartbeat has not moved for the quiet
        limit (its launch not ended), said as such; None if there is none."""
        self._read_cards()
        now, last = time.monotonic(), {}  # node rank -> (when a card of it last beat, name)
        for number, (rank, name) in sorted(self.peers.items()):
            if self.store.check([self.prefix + f"done/{number}"]):
                last[rank] = (now, name)  # that node's launch ended: nothing to wait for
                continue
            beat = int(self.store.add(self.prefix + f"beat/{number}", 0))
            seen, when = self.beats.get(number, (beat, now))
            self.beats[number] = (beat, now if beat != seen else when)
            if rank not in last or self.beats[number][1] > last[rank][0]:
                last[rank] = (self.beats[number][1], name)  # (a node started again: its newest)
        for when, name in (v for _, v in sorted(last.items())):
            if now - when > self.quiet_limit:
                return f"{name} has not answered node 0's launcher for {now - when:.0f} s"
        return None

    def _read_cards(self) -> None:
        # The other nodes' cards, those of nodes started again after the roll call too.
        count = int(self.store.add(self.prefix + "count", 0))
        for number in range(1, count + 1):
            key = self.prefix + f"card/{number}"
            if number == self.card or number in self.peers or number in self.ignored:
                continue
            if self.store.check([key]):
                raw = self.store.get(key)
                card = read(raw)
                if card is None:  # a late launcher of another version, which ends alone
                    say(f"warning: {unreadable(raw)}; the job goes on without it")
                    self.ignored.add(number)
                elif card.node_rank is not None:
                    self.peers[number] = (card.node_rank, card.name())

    def _watch_quiet(self) -> None:
        """The other nodes: node 0's store must keep answering the watcher's loop."""
        while not self._stop.wait(WATCH_S):
            quiet = time.monotonic() - self.last_ok
            if self.released:
                return
            if quiet > self.quiet_limit:
                what = f"{self.master} has not answered this node's launcher for {quiet:.0f} s"
                self._quiet(what)
                return

    def _quiet(self, what: str) -> None:
        """A node went silent: say so, tell the others (node 0), stop this node's workers."""
        global _peer_note
        if stop.signalled() or self._stop.is_set():
            return
        limit = self.quiet_limit - QUIET_MARGIN_S
        _peer_note = (
            f"{what} (peer timeout {limit:g} s + {QUIET_MARGIN_S:g}, FASTDDP_PEER_TIMEOUT): the "
            "network to it, or that node, is down"
        )
        if self.node_rank == 0:  # the others read it in its store, as a failure's note
            note = f"f{self.name} stopped: {_peer_note}"
            self.noted = _bounded(WATCH_S, lambda: self.store.set(self.key, note)) is None
        _stop_workers(_peer_note)

    def gone(self, error: Exception) -> str:
        """Node 0 is gone: what its store's ``error`` says."""
        return (
            f"{self.master} is gone: the rendezvous store its launcher served closed without "
            f"that launch ending ({error}; was the launcher killed?)"
        )

    def _lost(self, error: Exception) -> None:
        """Node 0's store closed without its launch ending there: its launcher is gone."""
        if self._stop.wait(LOST_GRACE_S) or stop.signalled():
            return  # this node's launch ended meanwhile, or a signal ends it
        _stop_workers(self.gone(error))

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            # Not for long: over a link that went down, its store call may never return.
            self._thread.join(timeout=2 * WATCH_S)


def watch(
    store, prefix: str, card: int, node_rank: int, nodes: int, run_id: str, names, ranks: int
) -> None:
    """Watch for another node's failure, or node 0's launcher gone, over ``store`` (a client
    of the rendezvous store), and keep card number ``card``'s heartbeat. ``names``: this
    node's and node 0's; ``ranks``: the job's, for the peer timeout's default."""
    global _watcher
    _watcher = _Watcher(store, prefix, card, node_rank, nodes, run_id, names, ranks)


def keep(owner) -> None:
    """Keep ``owner`` (torch's rendezvous handler, whose store node 0 serves) alive until
    :func:`ended` has told the others: torch lets it go when its launch returns."""
    _kept.append(owner)


def arrived() -> int:
    """How many times nodes have joined a round of this job (as of the last second), or -1
    where that is not watched. A node whose workers failed and restarted has joined the next
    round while the others still run the last: the agents must restart theirs to meet it."""
    return -1 if _watcher is None else _watcher.arrived


def note_from(store: dist.Store, prefix: str) -> Optional[str]:
    """The note another node posted under ``prefix``, if one did (read during the roll call)."""
    key = prefix + "failed"
    return store.get(key).decode()[1:] if store.check([key]) else None


def post(store: dist.Store, prefix: str, note: str, seconds: float) -> None:
    """Post ``note`` (what this node's roll call found wrong) under ``prefix``, giving up
    after ``seconds``."""
    _bounded(seconds, lambda: store.set(prefix + "failed", "c" + note))


def peer_failure() -> Optional[str]:
    """The note of another node's failure that stopped this node's workers, if one did."""
    return _peer_note


def ended(failure: Optional[str], signalled: bool = False) -> Optional[str]:
    """This node's launch has ended: stop watching, and post ``failure`` (what failed here;
    ``signalled``: a signal stopped it) for the other nodes, unless it is None or this node
    was stopped for another's. Returns what to say where node 0's store is gone without its
    launch ending (its workers' peers here fail with it)."""
    global _watcher
    with _ending:  # (the main thread, or stop.py's that ends the process)
        watcher, _watcher = _watcher, None
    try:
        return _end(watcher, failure, signalled)
    finally:
        _kept.clear()


def _end(watcher: Optional[_Watcher], failure: Optional[str], signalled: bool) -> Optional[str]:
    if watcher is None:
        return None
    watcher.stop()
    if _peer_note is not None:
        if watcher.noted:  # node 0's own note: its store must outlive the others' reading
            _bounded(LINGER_S + 1.0, lambda: _linger(watcher))
        return None
    if failure is None and watcher.node_rank != 0:
        _bounded(WATCH_S, watcher.release)
        return None
    # Node 0's exit that ends well takes the store away too: the others must not take that
    # for its loss.
    key, value = watcher.over, "1"
    if failure is not None:
        kind = "s" if signalled else "f"
        key, value = watcher.key, f"{kind}{watcher.name} failed: {failure}"

    def tell() -> None:
        watcher.store.set(key, value)
        if watcher.node_rank != 0:
            watcher.release()
            return
        _linger(watcher)

    error = _bounded(LINGER_S + 1.0, tell)
    if error is None or watcher.released:
        return None
    return f"{watcher.gone(error)}, and this node's workers failed with it"


def _linger(watcher: _Watcher) -> None:
    # Node 0 stays until the others are done with its store (most read the note within a
    # second; those that ended already are), for a while.
    deadline = time.monotonic() + LINGER_S
    while int(watcher.store.add(watcher.let_go, 0)) < watcher.nodes - 1:
        if time.monotonic() > deadline:
            return
        time.sleep(0.1)


def _stop_workers(note: str, code: int = 1) -> None:
    """Another node's ``note`` stops this node's workers (torch's agent stops them), and this
    launch with ``code``: 2 where the nodes were launched unlike (roster.py)."""
    global _peer_note
    _peer_note = note
    why = "stopping this node's workers, which cannot go on without that node (static rendezvous)"
    say(f"error: {note}; " + ("this launch ends too" if code == 2 else why))
    stop.stop_self(code)


def _bounded(seconds: float, work) -> Optional[Exception]:
    """Run ``work`` (store calls) in a thread of its own for at most ``seconds``: over a link
    that went down, a store call may never return (its client timeout does not cover a peer
    that stops answering). A store gone meanwhile leaves nobody to tell: returns its error."""
    errors: list[Exception] = []

    def run() -> None:
        try:
            work()
        except (RuntimeError, OSError) as e:
            errors.append(e)

    thread = threading.Thread(target=run, name="fastddp-note", daemon=True)
    thread.start()
    thread.join(seconds)
    return errors[0] if errors else None
