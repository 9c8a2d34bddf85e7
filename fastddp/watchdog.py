"""A peer watchdog: turn a rank that stops answering into an error that names it.

A collective waits for every rank. When one is stopped (SIGSTOP, a debugger, a hung driver) or
vanished without its sockets closing, the others wait until the process group's timeout, and
then report a timeout that does not say which rank is missing. The watchdog gives every rank a
heartbeat in the job's store, written by a background thread; a rank whose heartbeat has not
changed for ``timeout`` seconds is named, and the watching rank exits with status
:data:`EXIT_PEER_LOST`, so that the launcher stops (or restarts) the job. A rank that ends
says so: one that finished is not waited for, and one that ended with an uncaught exception
is named at once (NCCL's collectives would wait for it until their timeout).

Configured by :func:`fastddp.init_distributed` (``peer_timeout=``) or ``FASTDDP_PEER_TIMEOUT``
(seconds; 0 turns it off).
"""

import contextlib
import decimal
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from fastddp.cluster import ClusterError

__all__ = ["EXIT_PEER_LOST", "MIN_PEER_TIMEOUT_S", "PeerWatchdog", "peer_timeout_from_env"]

EXIT_PEER_LOST = 3
_DONE = "done"
_FAILED = "failed|"  # + where | what
_TOLD = "told"  # how many ranks' watchdogs named a peer (rank 0 waits for them; see _linger)
_PAST = "past0"  # how many ranks saw rank 0 finish, or ended first (see _leave)


class PeerWatchdog:
    """Heartbeats in a ``TCPStore`` and a check of everyone else's, on a daemon thread.

    Args:
        host, port: the job's store (``MASTER_ADDR``/``MASTER_PORT``); the watchdog opens its
            own client connection, so it never contends with the process group's.
        rank, world_size: this rank and the number of ranks.
        timeout (float): seconds without a heartbeat after which a peer counts as lost.
        namespace (str): key prefix, unique per job attempt (restarts get a new one).
        on_lost (callable, optional): called with the message; the default prints it and ends
            the process with :data:`EXIT_PEER_LOST`.
        store_in_rank0 (bool): the store is served by rank 0's process (``srun``, ``mpirun``,
            hand-set variables), not by a launcher: a stopped rank 0 silences it.
        alive (callable, optional): while it returns True this rank may wait in a collective;
            once False (the process group was destroyed) the watchdog stops as :meth:`stop`
            does, and the others no longer wait for this rank's heartbeat.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout: float,
        namespace: str,
        on_lost: Optional[Callable[[str], None]] = None,
        alive: Optional[Callable[[], bool]] = None,
        store_in_rank0: bool = False,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"PeerWatchdog: timeout must be positive, got {timeout}")
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.interval = min(timeout / 4, 5.0)
        self._prefix = f"fastddp/heartbeat/{namespace}/"
        self._store = dist.TCPStore(
            host,
            port,
            is_master=False,
            timeout=timedelta(seconds=max(30.0, timeout)),
            wait_for_workers=False,
        )
        self._on_lost = on_lost or _exit_with
        self._alive = alive
        self.store_in_rank0 = store_in_rank0
        self._store_at = f"{host}:{port}"
        self._stop = threading.Event()
        # What names this rank's node to the others: its node rank under a launcher, and the
        # address it reaches the store from (host names repeat across containers).
        node = os.environ.get("GROUP_RANK")
        where = f"node {node}, " if node is not None else ""
        self._me = (
            f"{where}{_local_address(host, port)}, pid {os.getpid()} on {socket.gethostname()}"
        )
        self._thread = threading.Thread(target=self._run, name="fastddp-watchdog", daemon=True)
        # A store call can block for good when the network to the store's node is cut (the
        # client's timeout does not cover a peer that stops answering): a second thread
        # watches the first one's progress instead of trusting every call to return.
        self._deadline = threading.Thread(
            target=self._watch_progress, name="fastddp-watchdog-deadline", daemon=True
        )
        self._last_ok = time.monotonic()
        self._last_error: Optional[Exception] = None
        self._reported = threading.Lock()
        self._stopping, self._stopped = threading.Lock(), False
        self._counted = False  # whether this rank added itself to _PAST
        self._others = world_size - 1  # peers that will name the same problem (see _linger)

    def start(self) -> "PeerWatchdog":
        self._beat(0)
        self._last_ok = time.monotonic()
        self._thread.start()
        self._deadline.start()
        return self

    def stop(self, failure: Optional[str] = None) -> None:
        """Stop watching, and tell the others that this rank finished (it is not lost), or,
        with ``failure``, that it ended with that uncaught exception. Once: later calls do
        nothing."""
        with self._stopping:
            if self._stopped:
                return
            self._stopped = True
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.interval + 5)
            if self._thread.is_alive():
                return  # stuck in a store call: the store is unreachable, and so is a write
        end = _DONE if failure is None else f"{_FAILED}{self._me}|{failure}"
        with contextlib.suppress(Exception):  # the store may be gone at the end of a job
            self._store.set(self._key(self.rank), end)
            if self.store_in_rank0:  # (a launcher's store outlives rank 0: nothing to count)
                self._past()
                if self.rank == 0 and failure is None:
                    self._leave()

    def _past(self) -> None:
        # Once per rank but 0: it needs rank 0's store no more (it ended, or saw rank 0 end).
        if self.rank != 0 and not self._counted:
            self._counted = True
            self._store.add(self._prefix + _PAST, 1)

    def _leave(self) -> None:
        # Rank 0's exit takes its store away: a rank still at work that had not yet read its
        # "done" would then report rank 0 and the store lost. Stay until every other rank has
        # ended or read it (each reads once an interval), or an interval and a half has passed
        # (one that ended without a word, or whose watchdog is off, is not waited for longer).
        deadline = time.monotonic() + 1.5 * self.interval + 1.0
        while time.monotonic() < deadline:
            if int(self._store.add(self._prefix + _PAST, 0)) >= self.world_size - 1:
                return
            time.sleep(0.05)

    def _key(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    def _beat(self, count: int) -> None:
        self._store.set(self._key(self.rank), f"{count}|{self._me}")

    def _report(self, message: str, told: bool = False) -> None:
        # Once, from whichever thread finds a problem first. ``told``: found in the store,
        # which still answers (not the deadline thread's finding that it does not).
        if not self._reported.acquire(blocking=False) or self._stop.is_set():
            return
        if told:
            with contextlib.suppress(Exception):
                self._store.add(self._prefix + _TOLD, 1)
            if self.store_in_rank0 and self.rank == 0:
                self._linger()
        self._on_lost(message)

    def _linger(self) -> None:
        # Rank 0's exit takes the store away: a peer that had not yet read the failure there
        # would then blame rank 0 and the store. Stay until every rank still running has named
        # it too (each reads the store once an interval), or two intervals have passed.
        deadline = time.monotonic() + 2 * self.interval + 2.0
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if int(self._store.add(self._prefix + _TOLD, 0)) >= self._others + 1:
                    return
            time.sleep(0.05)

    def _run(self) -> None:
        seen: dict[int, tuple[str, float]] = {}
        count = 0
        peers = [r for r in range(self.world_size) if r != self.rank]
        done: set[int] = set()
        woke = time.monotonic()
        while not self._stop.wait(self.interval):
            if self._alive is not None and not self._alive():
                self.stop()  # no collective of this rank can wait for anyone now
                return
            count += 1
            now = time.monotonic()
            slept, woke = now - woke, now
            if self._overslept(slept):
                seen.clear()  # every peer's silence starts again from now
            try:
                self._beat(count)
                now = time.monotonic()
                lost, failed = [], []
                for r in peers:
                    key = self._key(r)
                    value = self._store.get(key).decode() if self._store.check([key]) else ""
                    if value == _DONE:
                        done.add(r)
                        continue
                    if value.startswith(_FAILED):
                        failed.append((r, value[len(_FAILED) :]))
                        continue
                    last = seen.get(r)
                    if last is None or last[0] != value:
                        seen[r] = (value, now)
                    elif now - last[1] > self.timeout:
                        lost.append((r, value, now - last[1]))  # value "": never came up
            except Exception as e:
                # The store is gone (the job is ending, and stop() comes soon) or refuses us:
                # keep trying; the deadline thread gives up once nothing has worked for the
                # whole timeout.
                self._last_error = e
                continue
            self._last_ok = time.monotonic()
            if failed or lost:
                self._others = len(peers) - len(done) - len(failed) - len(lost)
                message = self._failed_message(failed) if failed else self._message(lost)
                self._report(message, told=True)
                return
            if 0 in done and self.store_in_rank0:
                # Rank 0 finished, and its store goes with its process: none of this rank's
                # collectives can wait for it now, and nothing is left to watch with.
                with contextlib.suppress(Exception):
                    self._past()
                with self._stopping:
                    self._stopped = True
                self._stop.set()
                return

    def _overslept(self, slept: float) -> bool:
        # A wait of one interval that took far longer: this process was stopped (a suspended
        # job, SIGSTOP and SIGCONT to every rank) or starved. The silence it then finds is
        # its own as much as the peers', who may have been stopped with it: it is not counted.
        return slept > 2 * self.interval + 1.0

    def _watch_progress(self) -> None:
        woke = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            slept, woke = now - woke, now
            if self._overslept(slept):
                self._last_ok = max(self._last_ok, now)  # the store gets a timeout again
            quiet = time.monotonic() - self._last_ok
            if quiet > self.timeout + self.interval:
                self._report(self._store_message(quiet, self._last_error))
                return

    def _message(self, lost: list[tuple[int, str, float]]) -> str:
        parts = []
        for r, value, quiet in lost:
            where = value.split("|", 1)[1] if "|" in value else "never started"
            parts.append(f"rank {r} ({where}) has not answered for {quiet:.0f} s")
        return (
            "fastddp: " + "; ".join(parts) + f" (peer timeout {self.timeout:g} s, "
            "FASTDDP_PEER_TIMEOUT): it is stopped, hung outside Python, or dead. Rank "
            f"{self.rank} exits with status {EXIT_PEER_LOST} instead of waiting in a "
            "collective forever."
        )

    def _failed_message(self, failed: list[tuple[int, str]]) -> str:
        parts = []
        for r, value in failed:
            where, _, what = value.partition("|")
            parts.append(f"rank {r} ({where}) ended with an uncaught exception ({what})")
        return (
            "fastddp: " + "; ".join(parts) + ": no collective it was part of will finish. "
            f"Rank {self.rank} exits with status {EXIT_PEER_LOST} instead of waiting in one "
            "forever."
        )

    def _store_message(self, quiet: float, error: Optional[Exception]) -> str:
        why = f"; last error: {error}" if error is not None else "; a call to it never returned"
        where, cause = (
            ("in rank 0's process", "rank 0 is stopped, hung outside Python or dead, or the "
             "network to its node is down")
            if self.store_in_rank0
            else ("on node 0, with the rendezvous", "the network to that node is down, or the "
                  "node is")
        )  # fmt: skip
        return (
            f"fastddp: the job's store at {self._store_at} ({where}) has not answered rank "
            f"{self.rank} for {quiet:.0f} s (peer timeout {self.timeout:g} s, "
            f"FASTDDP_PEER_TIMEOUT{why}): {cause}. Rank {self.rank} exits with status "
            f"{EXIT_PEER_LOST} instead of waiting in a collective forever."
        )


def _local_address(host: str, port: int) -> str:
    """The local address this process reaches ``host`` from (a UDP connect sends nothing)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "address unknown"


def _exit_with(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_PEER_LOST)


def peer_timeout_from_env(env: Mapping[str, str], world: int) -> float:
    """``FASTDDP_PEER_TIMEOUT`` in seconds (unset: 300 for up to 64 ranks, else 0, off).

    ``python -m fastddp.launch`` checks it before it starts a worker.

    Raises:
        ClusterError: it is not a number, or is negative.
    """
    raw = env.get("FASTDDP_PEER_TIMEOUT", "")
    if not raw:
        return 300.0 if world <= 64 else 0.0
    try:
        seconds = float(raw)
    except ValueError:
        raise ClusterError(
            f"FASTDDP_PEER_TIMEOUT={raw!r} is not a number of seconds (0 turns it off)"
        ) from None
    if not 0 <= seconds < math.inf:  # (NaN too)
        raise ClusterError(
            f"FASTDDP_PEER_TIMEOUT={raw!r} must be 0 (off) or a positive, finite number of seconds"
        )
    if seconds < MIN_PEER_TIMEOUT_S and decimal.Decimal(raw.strip()) != 0:  # (1e-400 is 0.0)
        raise ClusterError(f"FASTDDP_PEER_TIMEOUT={raw!r} {_TOO_SHORT}")
    return seconds


# A heartbeat every quarter of the timeout: under a second, a rank's watchdog thread that a
# busy machine holds back for a moment is named lost, and the store is polled hundreds of
# times a second.
MIN_PEER_TIMEOUT_S = 1.0
_TOO_SHORT = (
    f"is shorter than {MIN_PEER_TIMEOUT_S:g} s, the least the watchdog takes; use 0 to turn it off"
)
