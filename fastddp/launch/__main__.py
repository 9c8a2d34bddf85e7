"""``python -m fastddp.launch``."""

import gc
import signal
import sys

from fastddp.launch import failures, stop
from fastddp.launch.cli import main, say


def _report(signum: int) -> None:
    # (Also where stop.py's thread ends the process while the main thread waits in C++: the
    # other nodes read the note at once, rather than wait for this node's silence.)
    name = signal.Signals(signum).name
    failures.ended(f"stopped by {name}", signalled=True)
    say(f"stopped by {name}")


stop.install(_report)
try:
    code = main()
except (stop.Stopped, KeyboardInterrupt) as e:  # before torch's agent handles signals
    signum = int(getattr(e, "sigval", signal.SIGINT))
    code = stop.requested()
    if code is None:
        if stop.taken():
            _report(signum)
        code = 128 + signum
# A signal from here on finds nothing to stop: it ends the process as it would any other,
# rather than raising into torch's exit handlers (a traceback after a finished job).
for _signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signum, signal.SIG_DFL)
# The interpreter's last cycle collection at exit walks every object torch made, a quarter of a
# launcher's CPU (0.4 of 1.6 s). Frozen objects are left out of it; the process's memory is
# released whole anyway.
gc.freeze()
sys.exit(code)
