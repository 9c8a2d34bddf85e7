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
"""

import os
import subprocess
import sys

__all__ = ["MAX", "REFERENCE_IMPORT_S", "VAR", "factor", "guard", "measure"]

VAR = "FASTDDP_TEST_SLACK"
REFERENCE_IMPORT_S = 1.0  # CPU s of `import torch` on the machine the guards were sized on
MAX = 4.0  # beyond this the machine is too slow for the suite's guards to mean anything


def measure() -> tuple[float, float]:
    """``(factor, seconds)``: the CPU seconds of ``import torch`` in a fresh interpreter, and
    their ratio to :data:`REFERENCE_IMPORT_S`, kept within 1 to :data:`MAX`."""
    code = "import time; t = time.process_time(); import torch; print(time.process_time() - t)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
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
