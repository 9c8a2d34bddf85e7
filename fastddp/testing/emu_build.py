"""The build of the CUDA grid emulator's library (``csrc/emu``), without torch.

:func:`build` compiles ``csrc/emu`` with g++ into a library; :mod:`fastddp.testing.emu` loads
it. This module imports neither torch nor the rest of fastddp (only :mod:`.slack`, itself
torch-free), so that ``tests/emu_objects.py`` can compile the objects the emulator's tests
will ask for while the test environment is still being installed.

Objects are kept in a cache shared by every copy of ``csrc`` (a copy with a planted defect
recompiles what it changed), named by the hash of the compiler, its flags and the sources and
headers they read. Each is compiled once, by whichever process asks first: another that asks
for it meanwhile waits on its lock, then takes it.
"""

import ctypes
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from . import slack

__all__ = ["CSRC", "OPS", "SHARED_CACHE", "EmuError", "asan_active", "build", "objects"]

CSRC = Path(__file__).resolve().parents[2] / "csrc"
# The library's sources. An object is rebuilt only when the source or a header it includes
# (under csrc, found by _headers) changes, so a copy of csrc with a planted kernel defect
# recompiles ops.cpp alone.
_SOURCES = ("emu/emu.cpp", "emu/ops.cpp")
_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)
SHARED_CACHE = Path(tempfile.gettempdir()) / "fastddp-emu"
# The ops of the library's C interface (``fastddp_emu_<op>`` in emu/ops.cpp).
OPS = ("compress", "decompress", "sum_chunks", "widen_sum", "quantize_int8", "dequantize_int8",
       "unpack_int8", "quantize_packed", "dequantize_packed", "unpack_packed",
       "requantize")  # fmt: skip


class EmuError(RuntimeError):
    """A launch failed on the emulator (a hang, a bad shuffle, a bad launch), or its build
    did; says which."""


def asan_active() -> bool:
    """Whether AddressSanitizer's runtime is loaded in this process."""
    with open("/proc/self/maps") as maps:
        return "libasan" in maps.read()


def _cxx_runtime() -> list[str]:
    """The shared ``libstdc++.so.6`` that the dynamic loader gives this process (torch's, in a
    process that has torch), as a link input; [] where there is none.

    A g++ that links libstdc++ statically by default (setup.py's ``_cxx_runtime`` says where)
    would give the library a second C++ runtime beside torch's, and its messages that format a
    number (a hang's report names its threads) a null locale facet.
    """
    try:
        ctypes.CDLL("libstdc++.so.6")
    except OSError:
        return []
    with open("/proc/self/maps") as maps:
        loaded = sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})
    return loaded[:1]


def _compile(cmd: list[str], out: Path) -> Path:
    """Run ``cmd`` (which writes its output to the path it ends with) into ``out``, atomically,
    unless another process has made ``out`` meanwhile."""
    compiler = cmd[0]
    if shutil.which(compiler) is None:
        raise EmuError(f"the emulator needs a C++17 compiler; {compiler!r} is not found")
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its holder dies
        if out.exists():
            return out
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        # Guarded by the compiler's CPU time, not the clock: at the lowest priority beside a
        # full test run, ops.cpp under AddressSanitizer has waited over 300 s for a core. Its
        # compile uses well under a minute of CPU; errors go to a file, so a long report
        # cannot block it.
        # Not under the sanitizer's runtime that this process may have preloaded: it would
        # only slow the compiler (by 60 %).
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        with tempfile.TemporaryFile(mode="w+") as err:
            proc = subprocess.Popen(
                [*cmd, str(tmp)], stdout=err, stderr=err, text=True, env=env,
                start_new_session=True,
            )  # fmt: skip
            code = slack.join_busy(proc, cpu_s=600, idle_s=120)
            err.seek(0)
            report = err.read()
        if code is None:
            raise EmuError(f"building the emulator was stopped by its hang guard:\n{report}")
        if code != 0:
            raise EmuError(f"building the emulator failed:\n{report}")
        os.replace(tmp, out)
    return out


def _flags(asan: bool, debug: bool) -> list[str]:
    # -ffp-contract=off as the extension's own builds: a * b + c rounds twice, as on the GPU.
    flags = ["-std=c++17", "-O1" if debug else "-O0", "-fPIC", "-Wall", "-Wextra", "-Werror",
             "-DFASTDDP_EMU", "-fno-omit-frame-pointer", "-fsanitize=undefined",
             "-fno-sanitize-recover=undefined", "-Wno-clobbered", "-ffp-contract=off"]  # fmt: skip
    if debug:
        # Line tables, all a sanitizer's report needs to name a line (-g's variables and types
        # would add half again to the compile).
        flags.append("-g1")
    if asan:
        flags.append("-fsanitize=address")
    return flags


def objects(
    csrc: Path = CSRC,
    *,
    sanitize: Optional[bool] = None,
    debug: bool = True,
    only: Optional[str] = None,
) -> list[tuple[Path, list[str]]]:
    """The objects :func:`build` links, in the shared cache, each with the command that
    compiles it (less the output path); nothing is compiled."""
    if only is not None and only not in OPS:
        raise ValueError(f"only={only!r}: not an op of the emulator; one of {', '.join(OPS)}")
    flags = _flags(asan_active() if sanitize is None else sanitize, debug)
    # Only the ops' source picks the op: the emulator's runtime is one object for every op.
    picks = [] if only is None else ["-DFASTDDP_EMU_ONLY", f"-DFASTDDP_EMU_OP_{only}"]
    compiler = os.environ.get("CXX", "g++")
    out = []
    for source in _SOURCES:
        flags_of = [*flags, *picks] if source == "emu/ops.cpp" else flags
        digest = hashlib.sha256(" ".join([compiler, *flags_of]).encode())
        for path in (csrc / source, *_headers(csrc, csrc / source)):
            digest.update(path.read_bytes())
        obj = SHARED_CACHE / f"{Path(source).stem}-{digest.hexdigest()[:16]}.o"
        cmd = [compiler, *flags_of, f"-I{csrc / 'include'}", "-c", str(csrc / source), "-o"]
        out.append((obj, cmd))
    return out


def _headers(csrc: Path, source: Path) -> list[Path]:
    """The headers under ``csrc`` that ``source`` includes, directly or not, in a fixed order:
    each ``#include "..."`` looked up beside its includer, then in csrc/include and csrc.
    (Listed by hand, the list once missed a new kernel header, whose edits kept a stale object.)"""
    found: dict[Path, None] = {}
    todo = [source]
    while todo:
        at = todo.pop(0)
        for quote, name in _INCLUDE.findall(at.read_text()):
            # <...>: csrc/include (as -I gives it) or not ours; "...": beside the includer too
            places = ((at.parent / name,) if quote == '"' else ()) + (
                csrc / "include" / name,
                csrc / name,
            )
            hit = next((p.resolve() for p in places if p.is_file()), None)
            if hit is not None and hit not in found:
                found[hit] = None
                todo.append(hit)
    return list(found)


def build(
    csrc: Path = CSRC,
    *,
    sanitize: Optional[bool] = None,
    cache: Optional[Path] = None,
    debug: bool = True,
    only: Optional[str] = None,
    link: bool = True,
) -> Optional[Path]:
    """Compile the emulator library from ``csrc`` (a copy, for mutation tests); its path.

    Its objects go to the shared cache; ``cache`` holds the library. ``debug=False`` leaves
    out the line tables and the optimiser (``-O0``: a library for one op compiles in half the
    CPU time, and its sweeps, with defects planted, end sooner than the compile they save), and
    ``only`` (an op's name, such as ``"quantize_int8"``) builds that op alone (a half to a
    quarter of the compile), for builds that only need to fail. The sanitizers check either
    build alike. ``sanitize`` (AddressSanitizer) defaults to whether this process runs under
    it. ``link=False`` compiles the objects alone and returns None.
    """
    asan = asan_active() if sanitize is None else sanitize
    planned = objects(csrc, sanitize=asan, debug=debug, only=only)
    SHARED_CACHE.mkdir(parents=True, exist_ok=True)
    for obj, cmd in planned:
        if not obj.exists():
            _compile(cmd, obj)
    if not link:
        return None
    names = "".join(obj.name for obj, _ in planned)
    cache = cache or SHARED_CACHE
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"libfastddp_emu-{hashlib.sha256(names.encode()).hexdigest()[:16]}.so"
    if not lib.exists():
        compiler = planned[0][1][0]
        sanitizers = [f for f in _flags(asan, debug) if f.startswith("-fsanitize")]
        objs = [str(o) for o, _ in planned]
        _compile([compiler, "-shared", *sanitizers, *objs, *_cxx_runtime(), "-o"], lib)
    return lib
