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


def plan(tmp: Path) -> list[tuple[Path, dict]]:
    """The builds, each a copy of csrc (made under ``tmp``) and :func:`build`'s options."""
    # The emu stream's library first: its first test waits for it; then test_emu.py's sweep of
    # an unchanged copy, and its library of one op.
    builds = [(emu_build.CSRC, {})]
    builds += [(emu_build.CSRC, {**PLANTED_BUILD, "only": op}) for op in ("compress", "decompress")]
    for k, (_, rel, old, new, op) in enumerate(DEFECTS):
        csrc = planted_copy(emu_build.CSRC, tmp / str(k), (rel, old, new))
        builds.append((csrc, {**PLANTED_BUILD, "only": op}))
    return builds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="print the objects' paths, compile none")
    args = p.parse_args(argv)
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None and not args.dry_run:
        print(f"emulator objects: {compiler!r} is not found; the emulator's tests will say so")
        return 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fastddp-emu-objects-") as tmp:
        builds = plan(Path(tmp))
        for csrc, options in builds:
            if args.dry_run:
                print(*(obj for obj, _ in emu_build.objects(csrc, sanitize=True, **options)))
            else:
                # The emu stream's library is linked too, into the shared cache where that
                # stream looks; a sweep links its own, in its test's folder.
                emu_build.build(csrc, sanitize=True, **options, link=not options)
    if not args.dry_run:
        took = time.monotonic() - start
        print(f"emulator objects: those of {len(builds)} builds compiled or found in {took:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
