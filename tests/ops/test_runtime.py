"""The extension runs on torch's own C++ runtime, never on a copy of its own.

A g++ that links libstdc++ statically by default (one built under ``/opt``, as in the images
torch's wheels are built in) gave the extension a second copy of the locale code, which shared
its facet ids with torch's copy but not its locale: the first error message that formatted a
number ended the process with a segmentation fault. setup.py now names torch's runtime as a
link input. These checks read the built library and make an op refuse with numbers in its
message; the GPU check runs them on its own build too (``-m "cuda or binary"``).
"""

import shutil
import subprocess
import sys

import pytest
import torch

from fastddp import _C as extension
from fastddp import _extension, ops

pytestmark = [
    pytest.mark.binary,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads an ELF library"),
]

# std::locale::classic() and num_put<char>'s facet id: defined only by a C++ runtime.
RUNTIME_SYMBOLS = (
    "_ZNSt6locale7classicEv",
    "_ZNSt7num_putIcSt19ostreambuf_iteratorIcSt11char_traitsIcEEE2idE",
)


def _tool(name: str, *args: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"needs {name} (binutils)")
    return subprocess.run([path, *args], capture_output=True, text=True, check=True).stdout


def test_the_extension_needs_the_shared_cxx_runtime():
    needed = [
        line.split("[")[1].rstrip("]")
        for line in _tool("readelf", "-d", "--wide", extension.__file__).splitlines()
        if "(NEEDED)" in line
    ]
    assert "libstdc++.so.6" in needed, f"{extension.__file__} links no shared libstdc++: {needed}"


def test_the_process_holds_one_cxx_runtime():
    with open("/proc/self/maps") as maps:
        loaded = {line.split()[-1] for line in maps if "/libstdc++.so" in line}
    assert len(loaded) == 1, loaded


def test_the_extension_defines_no_runtime_symbol():
    defined = set(_tool("nm", "-D", "--defined-only", extension.__file__).split())
    assert not defined & set(RUNTIME_SYMBOLS), f"{extension.__file__} carries its own libstdc++"


def test_a_library_with_its_own_cxx_runtime_is_told_apart(tmp_path):
    assert not _extension.carries_cxx_runtime(extension.__file__)
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++ to build a library with libstdc++ linked in")
    source = tmp_path / "own.cpp"
    source.write_text(
        "#include <sstream>\n#include <string>\n"
        'extern "C" int width(long v) { std::ostringstream s; s << v; return s.str().size(); }\n'
    )
    lib = tmp_path / "libown.so"
    cmd = [cxx, "-shared", "-fPIC", "-static-libstdc++", str(source), "-o", str(lib)]
    subprocess.run(cmd, check=True, capture_output=True)
    assert _extension.carries_cxx_runtime(str(lib))


def test_loading_an_extension_with_its_own_cxx_runtime_names_the_rebuild(monkeypatch):
    monkeypatch.setattr(_extension, "_module", None)  # load again; restored after
    monkeypatch.setattr(_extension, "carries_cxx_runtime", lambda path: path == extension.__file__)
    own = r"carries its own copy of libstdc\+\+"
    with pytest.raises(_extension.ExtensionError, match=own) as e:
        _extension.load()
    assert extension.__file__ in str(e.value) and _extension.REBUILD in str(e.value)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_refusal_with_numbers_in_its_message_raises(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    codes = torch.zeros(1024, dtype=torch.int8, device=device)
    scales = torch.ones(8, device=device)
    with pytest.raises(RuntimeError, match=r"got \[1024\]"):
        ops.dequantize_int8(codes, scales, torch.empty(1024, device=device), 128)
    with pytest.raises(RuntimeError, match="1024"):
        ops.compress(
            torch.zeros(1024, device=device),
            torch.empty(10, dtype=torch.bfloat16, device=device),
            1.0,
        )
