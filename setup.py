"""Build fastddp and its compiled extension ``fastddp._C``.

CPU sources are always built. CUDA sources are added when the installed torch was built with
CUDA and nvcc is found, or when ``FORCE_CUDA=1`` (``TORCH_CUDA_ARCH_LIST`` picks the GPUs).
Install with ``pip install --no-build-isolation .`` so that the extension is built against the
torch already installed, not a fresh copy pulled into an isolated build environment.
"""

import os
import shutil
import sys
from pathlib import Path

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def _want_cuda() -> bool:
    forced = os.environ.get("FORCE_CUDA", "0") == "1"
    have_nvcc = cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None
    return forced or (torch.version.cuda is not None and have_nvcc)


def _one_unit(name: str, sources: list[Path]) -> Path:
    """A source that includes ``sources``, to compile them as one translation unit.

    Sources that parse the same heavy torch headers spend most of their compile there: the two
    DDP hooks (c10d's reducer, the JIT's pybind utilities) take 26 CPU s together, 47 apart. Written
    under build/ only when its text changes, so that ninja does not rebuild it for nothing; the
    compiler's dependency file still names the sources, so editing one rebuilds it.
    """
    unit = ROOT / "build" / "unity" / f"{name}.cpp"
    text = "".join(f'#include "{source}"\n' for source in sources)
    if not unit.exists() or unit.read_text() != text:
        unit.parent.mkdir(parents=True, exist_ok=True)
        unit.write_text(text)
    return unit


def _cxx_runtime() -> list[str]:
    """The C++ runtime torch runs with, as a link input: its ``libstdc++.so.6``, or nothing.

    Some toolchains link libstdc++ statically unless told otherwise (a g++ built under ``/opt``,
    as in the images torch's own wheels are built in). The extension then carries a second copy
    of the locale and stream code, which shares its facet ids with torch's copy but not its
    locale: the first error message that formats a number crashed on a null facet. Naming
    torch's shared runtime first gives the linker every C++ runtime symbol from it, so the
    process has one runtime.
    """
    if not sys.platform.startswith("linux"):
        return []
    with open("/proc/self/maps") as maps:  # torch, imported above, has loaded it
        loaded = sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})
    return loaded[:1]


def _extension():
    with_cuda = _want_cuda()
    # The groups of CMakeLists.txt's FASTDDP_UNITY, the longest first: ninja starts jobs in this
    # order, and the other sources fit beside it.
    sources = [_one_unit("ddp_hooks", sorted((CSRC / "ddp").glob("*.cpp")))]
    # The op entries of each backend: with CUDA, csrc/cuda/ops.cpp (the host compiler) calls the
    # launches of csrc/cuda/launches.cu (nvcc, no torch header).
    entries = [CSRC / "fastddp.cpp", CSRC / "cpu" / "ops.cpp"]
    if with_cuda:
        entries.append(CSRC / "cuda" / "ops.cpp")
    sources.append(_one_unit("torch_ops", entries))
    sources += sorted(set((CSRC / "cpu").glob("*.cpp")) - {CSRC / "cpu" / "ops.cpp"})
    if with_cuda:
        sources += sorted((CSRC / "cuda").glob("*.cu"))
    macros = [
        ("FASTDDP_TORCH_VERSION", f'"{torch.__version__}"'),
        ("FASTDDP_WITH_CUDA", "1" if with_cuda else "0"),
    ]
    # -fopenmp: at::parallel_for is an inline OpenMP region; without it the loops run serially.
    # -ffp-contract=off: the accumulating ops must round a * b + c twice, as the CUDA kernels and
    # the torch reference do, not fuse it into one FMA.
    cxx = ["-O3", "-fopenmp", "-ffp-contract=off", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    # -g0: a distribution's Python (Debian's, for one) puts -g in the flags that extensions get.
    # Debug info is a third of the compile of a DDP hook (35 CPU s instead of 24) and 96 % of its
    # object's size; FASTDDP_DEBUG_INFO=1 keeps it.
    cxx.append("-g" if os.environ.get("FASTDDP_DEBUG_INFO") == "1" else "-g0")
    kwargs = dict(
        name="fastddp._C",
        # setuptools wants sources relative to setup.py; include dirs stay absolute.
        sources=[str(s.relative_to(ROOT)) for s in sources],
        include_dirs=[str(CSRC / "include")],
        define_macros=macros,
        extra_link_args=["-fopenmp", *_cxx_runtime()],
    )
    if with_cuda:
        nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo", "-Xcompiler=-ffp-contract=off"]
        return cpp_extension.CUDAExtension(**kwargs, extra_compile_args={"cxx": cxx, "nvcc": nvcc})
    return cpp_extension.CppExtension(**kwargs, extra_compile_args={"cxx": cxx})


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
