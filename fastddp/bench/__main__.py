import sys

from fastddp.bench.cli import main
from fastddp.netns import quietly

sys.exit(quietly(main, "fastddp.bench"))
