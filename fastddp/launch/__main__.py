"""``python -m fastddp.launch``."""

import gc
import sys

from fastddp.launch.cli import main

code = main()
# The interpreter's last cycle collection at exit walks every object torch made, a quarter of a
# launcher's CPU (0.4 of 1.6 s). Frozen objects are left out of it; the process's memory is
# released whole anyway.
gc.freeze()
sys.exit(code)
