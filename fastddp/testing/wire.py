"""A point-to-point link forwarded in userspace, with a fixed delay and random loss.

This kernel has no ``tc netem`` (nor ``fq``, nor nftables' ``queue``), so nothing in it can
hold a packet back for a while. Two TUN devices can: every packet one node sends comes out of
its TUN device here, waits ``delay`` seconds in a queue, and is written into the other node's
device, or dropped with probability ``loss``. Order is kept. Python forwards a few thousand
packets a second, so the devices use a 65000-byte MTU: about 80 MB/s each way, enough for
tests, not for benchmarks.
"""

import collections
import fcntl
import os
import random
import select
import struct
import threading
import time

__all__ = ["MTU", "Wire", "open_tun"]

MTU = 65000
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000


def open_tun(name: str) -> int:
    """Attach to the TUN device ``name`` (of this network namespace); its file descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class Wire:
    """Forward packets between two TUN file descriptors, both ways, on daemon threads.

    Args:
        fd_a, fd_b: the two devices (from :func:`open_tun`); the wire closes them on stop.
        delay (float): seconds each packet waits, each way.
        loss (float): the share of packets dropped, in [0, 1).
        seed (int): for the drops.
    """

    def __init__(self, fd_a: int, fd_b: int, delay: float, loss: float, seed: int = 0) -> None:
        if delay < 0 or not 0 <= loss < 1:
            raise ValueError(f"Wire: delay must be >= 0 and loss in [0, 1), got {delay}, {loss}")
        self.delay, self.loss = delay, loss
        self._forwarded = [0, 0]  # per direction: one thread writes each count
        self._dropped = [0, 0]
        self._fds = (fd_a, fd_b)
        self._random = random.Random(seed)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def forwarded(self) -> int:
        """Packets delivered so far, both ways."""
        return sum(self._forwarded)

    @property
    def dropped(self) -> int:
        """Packets dropped so far, both ways."""
        return sum(self._dropped)

    def start(self) -> "Wire":
        for way, (src, dst) in enumerate((self._fds, self._fds[::-1])):
            queue: collections.deque = collections.deque()
            ready = threading.Condition()
            args = (way, queue, ready)
            self._threads += [
                threading.Thread(target=self._read, args=(src, *args), daemon=True),
                threading.Thread(target=self._write, args=(dst, *args), daemon=True),
            ]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        for fd in self._fds:
            os.close(fd)

    def _read(self, src: int, way: int, queue: collections.deque, ready) -> None:
        while not self._stop.is_set():
            if not select.select([src], [], [], 0.1)[0]:
                continue
            try:
                packet = os.read(src, MTU + 64)
            except OSError:
                return  # the device went away with its namespace
            if self.loss and self._random.random() < self.loss:
                self._dropped[way] += 1
                continue
            with ready:
                queue.append((time.monotonic() + self.delay, packet))
                ready.notify()

    def _write(self, dst: int, way: int, queue: collections.deque, ready) -> None:
        while not self._stop.is_set():
            with ready:
                if not queue:
                    ready.wait(0.1)
                    continue
                due, packet = queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                os.write(dst, packet)
            except OSError:
                return
            self._forwarded[way] += 1
