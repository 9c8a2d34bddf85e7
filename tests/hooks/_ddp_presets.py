"""``examples/ddp_train.py`` once for each preset given, in one launched job.

    python -m fastddp.launch --standalone --nproc-per-node 2 tests/hooks/_ddp_presets.py \\
        STEPS PRESET...

The example's sessions, inside this one, use its process group (``fastddp.distributed_session``
does so for a session inside another): one launch's workers run every preset in turn.
"""

import runpy
import sys
from pathlib import Path

import fastddp

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py"

if __name__ == "__main__":
    example = runpy.run_path(str(SCRIPT), run_name="ddp_train")
    steps, *presets = sys.argv[1:]
    with fastddp.distributed_session():
        for preset in presets:
            example["main"](["--preset", preset, "--steps", steps])
    fastddp.distributed.exit_after_shutdown()
