"""Ctrl-C and SIGTERM before the launcher's workers start.

Until torch's agent starts the workers (and installs its own handlers, which stop them), the
launcher often waits in C++: the static rendezvous's store, waiting for the other nodes to join,
checks no Python signal, so a Python handler would run only when that wait times out, many
minutes later. The C-level handler still writes the signal's number to the wake-up fd; a thread
reading it ends the process when the main thread has not taken the signal within a second. It
acts only while the handler is this module's and the launcher has no child process: from then
on something must be stopped, which torch's handlers (or the main thread) do.

The handler raises :class:`Stopped`, a ``SignalException`` as torch's own handler raises: on
any other exception torch's ``launch_agent`` shuts the rendezvous down, which closes a c10d
rendezvous for every node of the job, not this one alone.
"""

import contextlib
import os
import signal
import threading
from typing import Callable, Optional

from torch.distributed.elastic.multiprocessing.api import SignalException

__all__ = ["Stopped", "at_stop", "end", "install", "requested", "signalled", "stop_self", "taken"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_GRACE_S = 1.0
_lock = threading.Lock()
_claimed = False
_cleanups: list[Callable[[], None]] = []
_received = threading.Event()  # a SIGINT or SIGTERM reached this process, whoever handled it
_requested: list[int] = []  # the exit status of a stop this process asked for (stop_self)


class Stopped(SignalException):
    """SIGINT or SIGTERM, taken by the launcher before torch's agent handled signals."""


def _raise(signum, frame):
    raise Stopped(f"stopped by {signal.Signals(signum).name}", signal.Signals(signum))


def taken() -> bool:
    """Claim the report of the stop; False when the watcher has already made it (it then ends
    the process at once)."""
    global _claimed
    with _lock:
        first, _claimed = not _claimed, True
        return first


def signalled() -> bool:
    """Whether SIGINT or SIGTERM has reached this process from outside (seen a moment after
    it came)."""
    return _received.is_set()


def stop_self(code: int) -> None:
    """Stop this launch as a SIGTERM would (torch's agent stops the workers), for a reason
    already said: where the signal finds no worker, the process ends with ``code``, without
    a word."""
    _requested.append(code)
    os.kill(os.getpid(), signal.SIGTERM)


def requested() -> Optional[int]:
    """The exit status :func:`stop_self` asked for, if it was called."""
    return _requested[0] if _requested else None


def at_stop(cleanup: Callable[[], None]) -> Callable[[], None]:
    """Run ``cleanup`` too where the watcher ends the process (no ``finally`` runs then);
    returns the call that takes it back."""
    _cleanups.append(cleanup)
    return lambda: _cleanups.remove(cleanup) if cleanup in _cleanups else None


def end(code: int) -> None:
    """End the process now with ``code``, after the cleanups of :func:`at_stop` (for a thread,
    while the main thread waits in C++ and no worker has started)."""
    for cleanup in list(_cleanups):
        with contextlib.suppress(Exception):  # the process ends now, whatever it did
            cleanup()
    os._exit(code)


def _has_children() -> bool:
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return True  # no way to tell: leave the stop to the main thread
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                if f.read().strip():
                    return True
        except OSError:
            return True
    return False


def _watch(fd: int, report: Callable[[int], None]) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        for signum in data:
            if signum in _SIGNALS and not _requested:
                _received.set()
            if signum not in _SIGNALS or signal.getsignal(signum) is not _raise:
                continue  # torch's handlers (or none of ours) take it
            threading.Event().wait(_GRACE_S)
            if _has_children() or not taken():
                continue
            if _requested:
                end(_requested[0])
            report(signum)
            end(128 + signum)


def install(report: Callable[[int], None]) -> None:
    """Make SIGINT and SIGTERM raise :class:`Stopped` in the main thread, and end the process
    with ``report(signum)`` and 128 + signum when that cannot happen in time."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    for signum in _SIGNALS:
        signal.signal(signum, _raise)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(r, report), name="fastddp-stop", daemon=True).start()
