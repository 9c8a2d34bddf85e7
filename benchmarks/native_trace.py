"""Native frames of a test process that dies of a signal (the GPU check's CUDA tests).

A fault in the extension ends a pytest process with Python's frames only (its faulthandler):
the CUDA tests of four H200 runs died in an op's error message before the native frame
(libstdc++'s number formatting, inside ``fastddp/_C.so``) was known. This builds
``native_trace.c`` into a library for the test processes to preload, and reads the frames it
prints back out of their logs.

    library, why_not = native_trace.build(folder)
    env = native_trace.environ(library)  # for each test process
    native_trace.describe(log_text)      # "native: _C.cpython-312-x86_64-linux-gnu.so near ..."
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("native_trace.c")
_FRAME = re.compile(r"^fastddp-native-frame \d+ (\S+) \+0x([0-9a-f]+) (\S+)$", re.M)
# Frames of the signal's handling rather than of the fault: this library, the C library (the
# signal's return trampoline, raise), Python (its faulthandler, in libpython or the interpreter).
_HANDLING = re.compile(r"native_trace|/libc\.so|/libpython|(^|/)python[0-9.]*$")


def build(folder: Path) -> "tuple[Path | None, str]":
    """Compile the tracer into ``folder``: ``(its path, "")``, or ``(None, why not)``."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc or gcc) on the PATH"
    out = Path(folder) / "native_trace.so"
    cmd = [cc, "-shared", "-fPIC", "-O1", "-Wall", "-o", str(out), str(SOURCE)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return None, f"{cc} failed: {done.stderr.strip()[-300:]}"
    return out, ""


def environ(library: Path, base: "dict | None" = None) -> dict:
    """``base`` (this process's environment) with ``library`` preloaded first."""
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = " ".join(p for p in (str(library), env.get("LD_PRELOAD", "")) if p)
    return env


def frames(log: str) -> "list[tuple[str, int, str]]":
    """``(library, offset, nearest exported symbol)`` of the native frames in ``log``,
    innermost first, from the first one outside the signal's handling."""
    found = [(lib, int(off, 16), sym) for lib, off, sym in _FRAME.findall(log)]
    start = 0
    while start < len(found) and _HANDLING.search(found[start][0]):
        start += 1
    return found[start:]


def _demangled(names: "list[str]") -> "list[str]":
    filt = shutil.which("c++filt")
    if filt is None or not names:
        return names
    done = subprocess.run([filt, *names], capture_output=True, text=True)
    out = done.stdout.splitlines()
    return out if done.returncode == 0 and len(out) == len(names) else names


def describe(log: str, count: int = 2, width: int = 90) -> str:
    """The innermost ``count`` frames of the fault, one line: ``native: LIB near SYMBOL <
    LIB near SYMBOL``; "" where ``log`` holds none. A symbol is the nearest exported one at or
    below the address, which for a hidden function is a neighbour's: a hint where to look."""
    innermost = frames(log)[:count]
    if not innermost:
        return ""
    names = _demangled([sym for _, _, sym in innermost])
    parts = []
    for (lib, offset, sym), name in zip(innermost, names):
        near = name if sym != "?" else f"+0x{offset:x}"
        if len(near) > width:  # a template's return type first: its own name is at the end
            near = "..." + near[-width:]
        parts.append(f"{Path(lib).name} near {near}")
    return "native: " + " < ".join(parts)
