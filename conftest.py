"""Set-up for every pytest process of this checkout (``tests/`` and ``benchmarks/``), before
any test module imports torch."""

import os

# Between parallel regions OpenMP's threads spin (libgomp: up to 300,000 turns) before they
# sleep. Where streams of tests, their ranks and their launched jobs share two cores, that
# spinning is taken from the others: test_accum_ops.py and test_packed_ops.py took 14-15 CPU s
# under load, 6-7 with the threads sleeping at once. Set before torch loads libgomp, which
# reads it once; every process the tests start inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
