"""A worker whose node FAIL_NODE fails at start (its local rank FAIL_LOCAL_RANK, else all;
with FAIL_ONCE, in the first attempt only); the others join and would wait for it. With
HOLD_S, every worker joins, says so, and holds that long (to be stopped meanwhile); with
SLOW_NODE, that node's workers hold as long before they join, while the others wait for them;
with HOLD_UNTIL, a path, the joined workers hold until it exists."""

import os
import sys
import time

local = os.environ.get("FAIL_LOCAL_RANK", os.environ["LOCAL_RANK"])
this = os.environ["GROUP_RANK"] == os.environ.get("FAIL_NODE") and os.environ["LOCAL_RANK"] == local
first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" or not os.environ.get("FAIL_ONCE")
if this and first:
    sys.exit(f"node {os.environ['GROUP_RANK']} cannot start (a missing dataset, say)")
if os.environ["GROUP_RANK"] == os.environ.get("SLOW_NODE"):
    print(f"worker started (pid {os.getpid()})", flush=True)
    time.sleep(float(os.environ["HOLD_S"]))
# Imported here: a worker that fails or is stopped before it joins needs no torch (1.5 CPU s).
import fastddp  # noqa: E402

fastddp.init_distributed(backend="gloo")
print(f"worker joined (pid {os.getpid()})", flush=True)
hold = time.monotonic() + float(os.environ.get("HOLD_S", "0"))
while time.monotonic() < hold and not os.path.exists(os.environ.get("HOLD_UNTIL", "")):
    time.sleep(0.1)
print("worker ok", flush=True)
