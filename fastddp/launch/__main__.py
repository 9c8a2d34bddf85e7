"""``python -m fastddp.launch``."""

import sys

from fastddp.launch.cli import main

sys.exit(main())
