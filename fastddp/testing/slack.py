"""Hang guards sized to the machine's cores.

The suite's long waits on launched jobs (launchers, restarts, namespace nodes) are hang guards:
they never decide a result, they only stop a job that would otherwise hang. They were sized on
a 2-core machine where ``import torch`` takes 1.0 CPU s. On slower cores every launched process
starts slower by the same factor, so a fixed guard that holds there cuts off a healthy job
here. :func:`guard` scales a guard by :func:`factor`, read from ``FASTDDP_TEST_SLACK``, which
``tests/streams.py`` (``make test``) sets from :func:`measure` before its streams start, and
``tests/conftest.py`` scales every test's pytest time limit by the same factor. A wait that is
part of what a test checks (a peer timeout, an outage's length) is not a guard and is not
scaled.

A process that only computes (an emulator sweep, a compiler) is guarded by its CPU time and its
descendants' instead (:func:`join_busy`): run niced under a full machine it may wait minutes
for a core, which a wall-clock guard takes for a hang.
"""

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

__all__ = [
    "MAX",
    "REFERENCE_IMPORT_S",
    "VAR",
    "factor",
    "guard",
    "join_busy",
    "measure",
    "run",
    "run_busy",
]

VAR = "FASTDDP_TEST_SLACK"
REFERENCE_IMPORT_S = 1.0  # CPU s of `import torch` on the machine the guards were sized on
MAX = 4.0  # beyond this the machine is too slow for the suite's guards to mean anything


def measure(python: str = sys.executable) -> tuple[float, float]:
    """``(factor, seconds)``: the CPU seconds of ``import torch`` in a fresh interpreter (of
    ``python``), and their ratio to :data:`REFERENCE_IMPORT_S`, kept within 1 to :data:`MAX`."""
    code = "import time; t = time.process_time(); import torch; print(time.process_time() - t)"
    out = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    seconds = float(out.stdout.split()[-1])
    return min(MAX, max(1.0, seconds / REFERENCE_IMPORT_S)), seconds


def factor() -> float:
    """The factor in ``FASTDDP_TEST_SLACK`` (1 when it is not set)."""
    value = os.environ.get(VAR)
    if value is None:
        return 1.0
    try:
        got = float(value)
    except ValueError:
        got = float("nan")
    if not 1.0 <= got <= MAX:
        raise ValueError(
            f"{VAR}={value!r}: give a number from 1 to {MAX:g} (how many times slower this "
            "machine's cores are than those the hang guards were sized on), or unset it"
        )
    return got


def guard(seconds: float) -> float:
    """``seconds`` of a hang guard, scaled to this machine by :func:`factor`."""
    return seconds * factor()


def _cpu_seconds(pid: int) -> Optional[float]:
    """CPU seconds of process ``pid``, its reaped children and its live descendants so far
    (None once it is gone): a compiler driver's work is done by the processes it starts."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return None
    ticks = sum(int(t) for t in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK") + sum(_cpu_seconds(c) or 0.0 for c in children)


def _exit_code(proc, poll: float) -> Optional[int]:
    """Wait up to ``poll`` s for ``proc`` (a ``Popen`` or a ``multiprocessing.Process``)."""
    if isinstance(proc, subprocess.Popen):
        try:
            return proc.wait(poll)
        except subprocess.TimeoutExpired:
            return None
    proc.join(poll)
    return proc.exitcode


def join_busy(proc, cpu_s: float, idle_s: float, poll: float = 0.5) -> Optional[int]:
    """Wait for ``proc`` (a started ``subprocess.Popen`` or ``multiprocessing.Process``),
    guarded by the CPU time of it and its descendants.

    It is killed when it has used ``cpu_s`` CPU seconds (a loop that never ends), or when it
    has used none for ``idle_s`` seconds (blocked for good); both are scaled by :func:`guard`.
    Waiting for a core costs it nothing, so a niced process under a full machine is not cut
    off. A ``Popen`` started with ``start_new_session=True`` is killed with its whole group.
    Returns its exit code, or None if it was killed.
    """
    cpu_limit, idle_limit = guard(cpu_s), guard(idle_s)
    used, moved = 0.0, time.monotonic()
    while True:
        code = _exit_code(proc, poll)
        if code is not None:
            return code
        now = _cpu_seconds(proc.pid)
        if now is not None and now > used:
            used, moved = now, time.monotonic()
        if used > cpu_limit or time.monotonic() - moved > idle_limit:
            if isinstance(proc, subprocess.Popen) and os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            while _exit_code(proc, poll) is None:
                pass
            return None


def run(cmd, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)`` in a session of its own.

    A command past ``timeout`` (seconds, not scaled here) is stopped with what it started,
    which ``subprocess.run`` would leave running to hold ports, namespaces and cores under the
    tests after it: SIGTERM to its group first (a launcher stops its workers, which have
    sessions of their own; ``python -m fastddp.netns`` removes its namespaces), SIGKILL to
    the group after a grace period. Raises ``subprocess.TimeoutExpired`` with what it wrote.
    """
    kwargs.pop("capture_output", None)  # as subprocess.run's: this captures by default
    kwargs.setdefault("text", True)
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    with subprocess.Popen(cmd, start_new_session=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = _stop(proc)
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
        except BaseException:
            _stop(proc)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_busy(cmd, cpu_s: float, idle_s: float = 120.0, **kwargs) -> subprocess.CompletedProcess:
    """:func:`run` for a command that only computes (a sweep over the ops, a benchmark table):
    guarded by its CPU time and its descendants' (:func:`join_busy`; ``cpu_s`` and ``idle_s``
    scaled there), not by the wall clock, which a full machine stretches many times over for a
    niced process. Its output is captured as text; ``kwargs`` go to ``subprocess.Popen``
    (``cwd``, ``env``). Raises ``subprocess.TimeoutExpired`` with what it wrote when stopped,
    its ``timeout`` the CPU limit (also when it was the idle limit that stopped it). Stopped
    itself (a test's time limit, Ctrl-C), it kills the command's group first.
    """
    kwargs.pop("capture_output", None)
    kwargs.pop("text", None)
    # Files, not pipes: nobody reads a pipe while join_busy waits, and a full one would block.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            cmd, start_new_session=True, stdout=out, stderr=err, text=True, **kwargs
        )
        try:
            code = join_busy(proc, cpu_s, idle_s)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        said, complained = out.read(), err.read()
    if code is None:
        raise subprocess.TimeoutExpired(cmd, guard(cpu_s), output=said, stderr=complained)
    return subprocess.CompletedProcess(cmd, code, said, complained)


def _stop(proc: subprocess.Popen, grace: float = 15.0) -> tuple:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        return proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return proc.communicate()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate()
