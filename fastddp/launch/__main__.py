"""``python -m fastddp.launch``."""

import gc
import sys

from fastddp.launch.cli import main, say

try:
    code = main()
except KeyboardInterrupt:  # before torch's agent handles signals (preflight, rendezvous)
    say("stopped by SIGINT")
    code = 130
# The interpreter's last cycle collection at exit walks every object torch made, a quarter of a
# launcher's CPU (0.4 of 1.6 s). Frozen objects are left out of it; the process's memory is
# released whole anyway.
gc.freeze()
sys.exit(code)
