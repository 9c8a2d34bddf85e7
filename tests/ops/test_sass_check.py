"""benchmarks/sass_check.py: a planted 2-byte loop or local array fails it, 16-byte loops pass it.

Listings written here test the parser and the rules without any tool; where nvcc and
cuobjdump are at hand, tiny kernels compiled for sm_90 and the decompress kernel of the real
header with its vector loop planted away test them on nvcc's own machine code (a few seconds).
``make cuda-check`` runs the checker on the whole build.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastddp.testing import slack

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sass_check  # noqa: E402


def _listing(name, body):
    return f"""
	code for sm_90
		Function : {name}
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                   /* 0x00000a00ff017b82 */
{body}
        /*0200*/                   EXIT ;                                   /* 0x000000000000794d */
        /*0210*/                   BRA 0x210;                               /* 0xfffffffc00fc7947 */
"""


# A loop from 0x0080 to 0x00f0 with the given load and store in it.
def _loop(load, store):
    return f"""        /*0080*/                   {load} R4, desc[UR4][R2.64] ;        /* 0x0 */
        /*0090*/                   IADD3 R0, R0, 0x100, RZ ;                /* 0x0 */
        /*00a0*/                   {store} desc[UR4][R6.64], R4 ;          /* 0x0 */
        /*00f0*/              @!P0 BRA 0x80 ;                               /* 0x0 */"""


WIDE = _loop("LDG.E.128.CONSTANT", "STG.E.128")
TWO_BYTES = _loop("LDG.E.U16.CONSTANT", "STG.E.U16")
WIDE_OUTSIDE_A_LOOP = (
    """        /*0040*/                   LDG.E.128 R8, desc[UR4][R2.64] ;        /* 0x0 */
        /*0050*/                   STG.E.128 desc[UR4][R6.64], R8 ;        /* 0x0 */
"""
    + TWO_BYTES
)
WIDE_LOAD_ONLY = _loop("LDG.E.128", "STG.E")

KERNEL = "_ZN7fastddp7kernels17decompress_kernelILNS_4math8WireKindE1EEEvPKtPflfl"


def _verdict(body, name=KERNEL):
    verdicts, _ = sass_check.check(_listing(name, body), vector=("decompress_kernel",), exempt={})
    assert len(verdicts) == 1
    return verdicts[0]


def test_a_loop_with_16_byte_loads_and_stores_passes():
    v = _verdict(WIDE)
    assert v.ok and v.kernel == "decompress_kernel<kBf16>", v.lines
    # Each loop's length is reported; the branch to itself that ends the code is no loop.
    assert "instructions a loop: 4" in v.lines, v.lines


@pytest.mark.parametrize(
    "body, missing",
    [(TWO_BYTES, "LDG or STG"), (WIDE_OUTSIDE_A_LOOP, "LDG or STG"), (WIDE_LOAD_ONLY, "STG")],
    ids=["2-byte loop", "16-byte accesses outside the loop", "16-byte loads only"],
)
def test_a_planted_narrow_loop_fails(body, missing):
    v = _verdict(body)
    assert not v.ok
    assert f"no 128-bit {missing} in any loop" in v.lines[-1]


def test_a_kernel_that_needs_only_wide_stores_says_why_and_fails_without_them():
    name = "_ZN7fastddp7kernels21dequantize_vec_kernelILi8EEEvNS_10Int8SourceENS0_5CodesEPff"
    verdicts, _ = sass_check.check(_listing(name, _loop("LDG.E", "STG.E.128")))
    assert verdicts[0].ok and verdicts[0].lines[-1].startswith("loads narrower: each lane")
    verdicts, _ = sass_check.check(_listing(name, _loop("LDG.E", "STG.E")))
    assert not verdicts[0].ok and "no 128-bit STG in any loop" in verdicts[0].lines[-1]


WIDE_PACKED = "_ZN7fastddp7kernels20quantize_wide_kernelILi{bits}ELb1ELb0ENS0_{values}EEEvNS_12QuantizeArgsENS0_7DividerET2_"  # noqa: E501


@pytest.mark.parametrize(
    "bits, values, load, store, ok",
    [
        (4, "10FlatValues", "LDG.E.128", "STG.E.64", True),
        (4, "10FlatValues", "LDG.E.64", "STG.E.64", False),  # fp32 values 8 bytes a load
        (4, "10FlatValues", "LDG.E.128", "STG.E", False),  # int4 codes 4 bytes a store
        (2, "10FlatValues", "LDG.E.128", "STG.E", True),
        (4, "10SummedRowsILi4EE", "LDG.E.64", "STG.E.64", True),
        (4, "10SummedRowsILi4EE", "LDG.E", "STG.E.64", False),  # a row's codes 4 bytes a load
        (2, "10SummedRowsILi2EE", "LDG.E", "STG.E", True),
        (2, "10SummedRowsILi2EE", "LDG.E.U16", "STG.E", False),
        (4, "10FlatValues", "LDG.E.128", "STG.E.128", False),  # int4 codes not 8 bytes a store
    ],
)
def test_the_packed_wide_kernel_needs_a_lanes_codes_in_one_access(bits, values, load, store, ok):
    name = WIDE_PACKED.format(bits=bits, values=values)
    verdicts, _ = sass_check.check(_listing(name, _loop(load, store)))
    v = verdicts[0]
    assert v.ok == ok and v.kernel.startswith(f"quantize_wide_kernel<{bits}, true, false"), v.lines
    assert v.lines[-1 if ok else -2].startswith(f"codes {16 * bits} bits a lane")
    # The int8 instance still needs 128-bit loads and stores.
    int8 = sass_check.check(_listing(WIDE_PACKED.format(bits=8, values=values), _loop(load, store)))
    assert not int8[0][0].ok or (load, store) == ("LDG.E.128", "STG.E.128")


def test_an_unknown_kernel_fails_and_a_missing_one_is_named():
    listing = _listing("_ZN7fastddp7kernels10new_kernelEv", WIDE)
    verdicts, missing = sass_check.check(listing)
    assert [v.ok for v in verdicts] == [False] and "not in VECTOR or EXEMPT" in verdicts[0].lines[0]
    assert set(missing) == set(sass_check.VECTOR) | set(sass_check.EXEMPT)


def test_an_exempt_kernel_says_why():
    verdicts, _ = sass_check.check(_listing("_ZN7fastddp7kernels13unpack_kernelEv", TWO_BYTES))
    assert verdicts[0].ok and verdicts[0].lines[0].startswith("exempt: the scalar fallback")


def test_widths():
    assert [sass_check.width(op) for op in ("LDG.E.128.CONSTANT", "STG.E.64", "LDG.E",
            "STG.E.U16", "LDG.E.S8")] == [128, 64, 32, 16, 8]  # fmt: skip


# A wide loop that also keeps an array in local memory.
LOCAL = (
    WIDE.replace("IADD3 R0, R0, 0x100, RZ ;", "STL [R1+0x4], R4 ;")
    + "\n        /*0100*/                   LDL R5, [R1+0x4] ;                      /* 0x0 */"
)


def test_local_memory_fails_any_kernel_even_an_exempt_one():
    v = _verdict(LOCAL)
    assert not v.ok and any("local memory: LDL x1, STL x1" in line for line in v.lines), v
    verdicts, _ = sass_check.check(
        _listing(KERNEL, LOCAL), vector=(), exempt={"decompress_kernel": "a reason"}
    )
    assert [v.ok for v in verdicts] == [False], verdicts
    verdicts, _ = sass_check.check(
        _listing(KERNEL, TWO_BYTES), vector=(), exempt={"decompress_kernel": "a reason"}
    )
    assert [v.ok for v in verdicts] == [True], verdicts


def test_the_command_line_exits_non_zero_on_a_planted_loop(tmp_path, capsys):
    good, bad = tmp_path / "good.sass", tmp_path / "bad.sass"
    good.write_text(_listing(KERNEL, WIDE))
    bad.write_text(_listing(KERNEL, TWO_BYTES))
    # The tables' other kernels are missing from these listings: both fail on that, and the
    # planted loop is reported as such.
    assert sass_check.main([str(bad)]) == 1
    out = capsys.readouterr().out
    assert "decompress_kernel<kBf16>: FAILED" in out and "no 128-bit LDG or STG" in out


# ---------------------------------------------------------------- nvcc's own machine code


def _tools():
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    try:
        sass_check.tool("cuobjdump"), sass_check.tool("nvdisasm")
    except SystemExit as e:
        pytest.skip(str(e))


def _compile(tmp_path, source: str, includes=()) -> str:
    cu = tmp_path / "k.cu"
    cu.write_text(source)
    cubin = tmp_path / "k.cubin"
    flags = ["-std=c++20", "--expt-relaxed-constexpr", "-O3", "-arch=sm_90", "-cubin"]
    cmd = ["nvcc", *flags, *[f"-I{i}" for i in includes], "-o", str(cubin), str(cu)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=slack.guard(300))
    assert res.returncode == 0, res.stderr
    return sass_check.sass_of_cubin(cubin)


def test_the_count_of_a_quantize_step_compiles_against_the_kernels(capsys):
    # benchmarks/sass_path.py's probe calls the kernels' internals: it must follow them.
    _tools()
    import sass_path

    assert sass_path.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [f"quantize int{b}{ef}" for ef in ("", " with error feedback") for b in (2, 4, 8)]
    assert sorted(line.split(",")[0] for line in lines) == sorted(names), lines
    counts = [int(re.search(r": (\d+) instructions", line).group(1)) for line in lines]
    assert all(100 < c < 1000 for c in counts), lines


TINY = r"""
#include <cstdint>
extern "C" __global__ void copy_2_bytes(const uint16_t* __restrict__ s, uint16_t* __restrict__ d,
                                        int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    d[i] = s[i];
  }
}
extern "C" __global__ void copy_16_bytes(const uint4* __restrict__ s, uint4* __restrict__ d,
                                         int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    d[i] = s[i];
  }
}
"""


def test_a_compiled_2_byte_loop_fails_and_a_16_byte_one_passes(tmp_path):
    _tools()
    sass = _compile(tmp_path, TINY)
    verdicts, _ = sass_check.check(sass, vector=("copy_2_bytes", "copy_16_bytes"), exempt={})
    ok = {v.kernel: v.ok for v in verdicts}
    assert ok == {"copy_2_bytes": False, "copy_16_bytes": True}, verdicts


# 16-byte loops, one of them with an array indexed by the counter of a loop left rolled.
LOCAL_ARRAY = r"""
#include <cstdint>
extern "C" __global__ void rolled(const float4* __restrict__ s, float4* __restrict__ d,
                                  int64_t n, int k) {
  float keep[8];
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float4 v = s[i];
#pragma unroll 1
    for (int j = 0; j < 8; ++j) {
      keep[j] = v.x * j;
    }
    d[i] = make_float4(keep[k & 7], v.y, v.z, v.w);
  }
}
extern "C" __global__ void unrolled(const float4* __restrict__ s, float4* __restrict__ d,
                                    int64_t n, int k) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float4 v = s[i];
    d[i] = make_float4(v.x * (k & 7), v.y, v.z, v.w);
  }
}
"""


def test_a_compiled_local_array_fails(tmp_path):
    _tools()
    sass = _compile(tmp_path, LOCAL_ARRAY)
    verdicts, _ = sass_check.check(sass, vector=("rolled", "unrolled"), exempt={})
    ok = {v.kernel: v.ok for v in verdicts}
    assert ok == {"rolled": False, "unrolled": True}, [(v.kernel, v.lines) for v in verdicts]


# The real header's decompress, its vector body planted away behind a 2-byte loop.
DECOMPRESS = r"""
#include "launch.h"
struct Rt {
  template <class K>
  int resident(K) const { return 132 * 4; }
  void zero_flag(int*) const {}
  template <class... P, class... A>
  void launch(void (*kernel)(P...), int grid, A... args) const {
    kernel<<<grid, fastddp::kernels::kThreads>>>(static_cast<P>(args)...);
  }
};
void run(const fastddp::DecompressArgs& a) {
  Rt rt;
  fastddp::kernels::run(rt, a);
}
"""
SCALAR_HEAD = (
    "grid_stride_loop(0, head, [&](int64_t i) { dst[i] = from_wire<K>(src[i]) * scale; });"
)


@pytest.mark.parametrize("planted", [False, True], ids=["header", "planted-2-byte-loop"])
def test_the_real_decompress_kernel(tmp_path, planted):
    _tools()
    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", csrc, ignore=shutil.ignore_patterns("cpu", "ddp", "emu"))
    if planted:
        header = csrc / "cuda" / "kernels.cuh"
        text = header.read_text()
        assert SCALAR_HEAD in text, "the decompress kernel changed: update SCALAR_HEAD"
        header.write_text(text.replace(SCALAR_HEAD, SCALAR_HEAD.replace("head", "n") + "return;"))
    sass = _compile(tmp_path, DECOMPRESS, [csrc / "include", csrc / "cuda"])
    verdicts, _ = sass_check.check(sass)
    verdicts = [v for v in verdicts if v.kernel.startswith("decompress_kernel")]
    assert len(verdicts) == 2  # fp16 and bf16
    assert all(v.ok != planted for v in verdicts), [(v.kernel, v.lines) for v in verdicts]


@pytest.mark.parametrize(
    "target, env, code, said",
    [
        ("cuda-check", [], 0, "nvcc not found: skipping the CUDA compile check"),
        ("cuda-check", ["REQUIRE_CUDA_CHECK=1"], 2, "nvcc not found; the CUDA check is required"),
        # Its parts, asked for alone, must not pass by doing nothing.
        ("cuda-check-kernels", [], 2, "nvcc not found: make cuda-check-kernels compiles with it"),
        ("cuda-check-hooks", [], 2, "nvcc not found: make cuda-check-hooks compiles with it"),
    ],
)
def test_make_cuda_check_without_nvcc(target, env, code, said):
    # Not the flags of a make that runs this test (make test passes REQUIRE_CUDA_CHECK=1 down).
    outer = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "REQUIRE_CUDA_CHECK")
    clean = {k: v for k, v in os.environ.items() if k not in outer}
    cmd = ["make", "-s", "--no-print-directory", target, "NVCC=", *env]
    res = subprocess.run(
        cmd, cwd=ROOT, env=clean, capture_output=True, text=True, timeout=slack.guard(60)
    )
    assert res.returncode == code and res.stdout.splitlines()[0] == said, res.stdout + res.stderr
