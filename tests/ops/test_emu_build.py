"""The emulator's build (``fastddp.testing.emu_build``): each object compiled once, by whichever
process asks first, and a failed compile reported with the compiler's words. A stand-in
compiler (``CXX``) records its calls; the real one is ``tests/ops/test_emu.py``'s."""

import os
import threading

import pytest

from fastddp.testing import emu_build

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake_cxx(tmp_path, monkeypatch):
    """A compiler that logs each call, takes a second (so that calls overlap), and writes the
    path after ``-o``; its log."""
    log = tmp_path / "calls"
    cxx = tmp_path / "cxx"
    cxx.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {log}\n'
        'case "$*" in *planted-error*) echo "error: the planted one" >&2; exit 1;; esac\n'
        "sleep 1\n"
        'while [ "$1" != -o ]; do shift; done; echo object > "$2"\n'
    )
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setattr(emu_build, "SHARED_CACHE", tmp_path / "cache")
    return log


def test_an_object_asked_for_at_once_by_two_builders_is_compiled_once(fake_cxx, tmp_path):
    errors = []

    def builder():
        try:
            emu_build.build(sanitize=True, debug=False, only="compress", link=False)
        except Exception as e:  # reported below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=builder) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    calls = fake_cxx.read_text().splitlines()
    # The runtime and the op's source, once each: the second builder waited on their locks.
    assert len(calls) == 2 and all("-fsanitize=address" in c for c in calls), calls
    planned = [obj for obj, _ in emu_build.objects(sanitize=True, debug=False, only="compress")]
    assert all(obj.exists() for obj in planned)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.suffix == ".tmp"]
    # Asked again, nothing is compiled; the library is linked, to the shared C++ runtime.
    lib = emu_build.build(sanitize=True, debug=False, only="compress", cache=tmp_path / "lib")
    calls = fake_cxx.read_text().splitlines()
    assert lib.exists() and len(calls) == 3
    assert "-shared" in calls[2] and "/libstdc++.so.6" in calls[2], calls[2]


def test_a_failed_compile_names_the_compilers_error_and_leaves_no_object(fake_cxx, tmp_path):
    out = tmp_path / "x.o"
    # The stand-in fails on this word, as a compiler on an error in the source.
    with pytest.raises(emu_build.EmuError, match="failed:\nerror: the planted one"):
        emu_build._compile([os.environ["CXX"], "-Dplanted-error", "-o"], out)
    assert not out.exists() and not list(tmp_path.glob("x.*.tmp"))
    with pytest.raises(emu_build.EmuError, match="'no-cxx' is not found"):
        emu_build._compile(["no-cxx", "-o"], out)


def test_the_build_refuses_an_unknown_op():
    with pytest.raises(ValueError, match="not an op of the emulator"):
        emu_build.objects(only="compres")


def test_an_edit_of_any_header_an_object_includes_renames_that_object(tmp_path):
    # Every header ops.cpp includes, directly or through another (the list was once written by
    # hand, and missed a new kernel header: an edit of it alone kept a stale object).
    import shutil

    copy = tmp_path / "csrc"
    shutil.copytree(emu_build.CSRC, copy)
    before = [obj for obj, _ in emu_build.objects(copy, sanitize=False)]
    headers = emu_build._headers(copy, copy / "emu" / "ops.cpp")
    names = {h.relative_to(copy.resolve()).as_posix() for h in headers}
    assert {"cuda/launch.h", "cuda/wide_kernels.cuh", "include/fastddp/rounding.h"} <= names
    for header in headers:
        text = header.read_text()
        header.write_text(text + "\n// an edit\n")
        emu_obj, ops_obj = (obj for obj, _ in emu_build.objects(copy, sanitize=False))
        assert ops_obj != before[1], header
        # emu.cpp's object follows only its own headers
        assert (emu_obj != before[0]) == (header.name in ("cuda_emu.h", "rounding.h")), header
        header.write_text(text)
