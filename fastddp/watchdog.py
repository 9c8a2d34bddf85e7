"""A peer watchdog: turn a rank that stops answering into an error that names it.

A collective waits for every rank. When one is stopped (SIGSTOP, a debugger, a hung driver) or
vanished without its sockets closing, the others wait until the process group's timeout, and
then report a timeout that does not say which rank is missing. The watchdog gives every rank a
heartbeat in the job's store, written by a background thread; a rank whose heartbeat has not
changed for ``timeout`` seconds is named, and the watching rank exits with status
:data:`EXIT_PEER_LOST`, so that the launcher stops (or restarts) the job.

Configured by :func:`fastddp.init_distributed` (``peer_timeout=``) or ``FASTDDP_PEER_TIMEOUT``
(seconds; 0 turns it off).
"""

import contextlib
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

__all__ = ["EXIT_PEER_LOST", "PeerWatchdog"]

EXIT_PEER_LOST = 3
_DONE = "done"


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
        self._stop = threading.Event()
        self._me = f"pid {os.getpid()} on {socket.gethostname()}"
        self._thread = threading.Thread(target=self._run, name="fastddp-watchdog", daemon=True)

    def start(self) -> "PeerWatchdog":
        self._beat(0)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching, and tell the others that this rank finished (it is not lost)."""
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)
        with contextlib.suppress(Exception):  # the store may be gone at the end of a job
            self._store.set(self._key(self.rank), _DONE)

    def _key(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    def _beat(self, count: int) -> None:
        self._store.set(self._key(self.rank), f"{count}|{self._me}")

    def _run(self) -> None:
        seen: dict[int, tuple[str, float]] = {}
        count = 0
        peers = [r for r in range(self.world_size) if r != self.rank]
        while not self._stop.wait(self.interval):
            count += 1
            try:
                self._beat(count)
                now = time.monotonic()
                lost = []
                for r in peers:
                    key = self._key(r)
                    value = self._store.get(key).decode() if self._store.check([key]) else ""
                    if value == _DONE:
                        continue
                    last = seen.get(r)
                    if last is None or last[0] != value:
                        seen[r] = (value, now)
                    elif now - last[1] > self.timeout:
                        lost.append((r, value, now - last[1]))  # value "": never came up
            except Exception as e:  # the store itself is gone: the job is ending
                if not self._stop.is_set():
                    print(f"fastddp watchdog on rank {self.rank}: store unreachable ({e})",
                          file=sys.stderr, flush=True)  # fmt: skip
                return
            if lost:
                self._on_lost(self._message(lost))
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


def _exit_with(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_PEER_LOST)
