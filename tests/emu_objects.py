"""Compile the emulator's objects that the ``emu`` and ``planted`` streams will ask for.

    python3 tests/emu_objects.py

``make test`` runs this beside the install of the test environment, which keeps one core
busy for half a minute and leaves the other idle: the objects, under AddressSanitizer as the
streams build them, are then in the shared cache when the streams start (or still being
compiled, and a stream that asks for one waits on its lock rather than compiling it again).
They are the debug build of every op that the ``emu`` stream loads, and the build of each op
alone that ``tests/ops/test_emu.py`` sweeps, from an unchanged copy of ``csrc`` and from each
copy with a defect planted. Needs a C++ compiler, not torch (any Python 3.9 or newer).
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ops._defects import DEFECTS, PLANTED_BUILD, planted_copy
from streams import torchless

emu_build = torchless("emu_build")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.parse_args(argv)
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        print(f"emulator objects: {compiler!r} is not found; the emulator's tests will say so")
        return 0
    start = time.monotonic()
    # The emu stream's library first: its first test waits for it; the planted stream's
    # first sweeps are of unchanged copies.
    emu_build.build(sanitize=True)
    # test_emu.py's sweep of an unchanged copy, and its library of one op.
    unchanged = ("compress", "decompress")
    for op in unchanged:
        emu_build.build(sanitize=True, **PLANTED_BUILD, only=op, link=False)
    with tempfile.TemporaryDirectory(prefix="fastddp-emu-objects-") as tmp:
        for k, (_, rel, old, new, op) in enumerate(DEFECTS):
            csrc = planted_copy(emu_build.CSRC, Path(tmp) / str(k), (rel, old, new))
            emu_build.build(csrc, sanitize=True, **PLANTED_BUILD, only=op, link=False)
    took = time.monotonic() - start
    print(f"emulator objects: the debug library, {len(unchanged)} unchanged ops and "
          f"{len(DEFECTS)} planted defects' ops compiled or found in {took:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
