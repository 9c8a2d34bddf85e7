import sys

from fastddp.bench.cli import main

sys.exit(main())
