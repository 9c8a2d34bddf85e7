"""The CUDA backend's launch code and kernels, run on the CPU by the grid emulator (csrc/emu).

Every op, wire dtype, block size and error-feedback / stochastic-rounding variant gives exactly
the CPU op's bits at sizes that take 3 passes of the grid-stride loops on an emulated 1-SM
device, for every tail length from 0 to twice the vector width, and with tensors one element
into their buffers (no 16-byte alignment). Then defects are planted, one at a time, in a copy
of the kernel header and launch code: each must make the checks fail. ``make test`` runs this
module a second time under AddressSanitizer.
"""

import shutil
import subprocess
import sys

import pytest
import torch

from fastddp.testing import emu as emulator
from fastddp.testing.emu_cases import (
    CHECKS,
    VEC,
    check_compress,
    check_decompress,
    check_quantize_int8,
    check_quantize_packed,
    check_sum_chunks,
    sizes,
)

pytestmark = [
    pytest.mark.emu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++"),
]

WIRES = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def emu():
    return emulator.load(sms=1, seed=2024)


@pytest.mark.parametrize(
    "check, args",
    [pytest.param(check, args, id=f"{name}-{k}") for name, check, cases in CHECKS
     for k, args in enumerate(cases)],
)  # fmt: skip
def test_every_op_matches_the_cpu_op(emu, check, args):
    check(emu, *args)


@pytest.mark.parametrize("dtype", WIRES)
@pytest.mark.parametrize("offset", [False, True], ids=["aligned", "offset"])
def test_every_tail_of_the_vectorised_paths(emu, dtype, offset):
    for n in sizes(VEC):
        check_compress(emu, n, dtype, "flag", offset, special=True)
        check_decompress(emu, n, dtype, offset)


@pytest.mark.parametrize("variant", ["ef", "sr", "ef-sr"])
def test_every_tail_of_the_scalar_paths(emu, variant):
    for n in sizes(1):
        check_compress(emu, n, torch.bfloat16, variant, offset=True, special=True)
        check_sum_chunks(emu, n, torch.float16, 2, variant)


@pytest.mark.parametrize("block", [1, 32, 64, 100, 256])
def test_int8_block_sizes(emu, block):
    for n in (1, block - 1, 3 * 64 * block + 3):
        if n >= 1:
            check_quantize_int8(emu, n, block, "ef-sr", rows=1)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("block", [32, 64, 256])
def test_packed_block_sizes_and_short_last_bytes(emu, bits, block):
    for n in (1, 2, 3, block - 1, block + 1, 3 * 64 * block + 3):
        check_quantize_packed(emu, bits, n, block, "ef-sr", rows=1)


def test_thread_and_block_order_do_not_change_the_bits():
    results = []
    src = torch.randn(3 * 2048 * 8 + 5, generator=torch.Generator().manual_seed(0))
    for seed in (1, 2, 3):
        emu = emulator.load(sms=1, seed=seed)
        dst = torch.empty(src.numel(), dtype=torch.int8)
        scales = torch.empty(-(-src.numel() // 32))
        emu.quantize_int8(src, dst, scales, 32, 1.0, None, torch.zeros_like(src), 7)
        results.append((dst, scales))
    for dst, scales in results[1:]:
        assert torch.equal(dst, results[0][0]) and torch.equal(scales, results[0][1])


# ---------------------------------------------------------------- planted defects

# (name, file under csrc, the text, what replaces it, the op whose checks must fail)
DEFECTS = [
    ("grid stride off by one block", "cuda/kernels.cuh",
     "const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;",
     "const int64_t stride = static_cast<int64_t>(gridDim.x + 1) * blockDim.x;", "compress"),
    ("a warp-shuffle step dropped", "cuda/kernels.cuh",
     "for (int offset = 16; offset > 0; offset /= 2) {",
     "for (int offset = 16; offset > 1; offset /= 2) {", "quantize_int8"),
    ("a divergent shuffle", "cuda/kernels.cuh",
     "for (int offset = 16; offset > 0; offset /= 2) {",
     "for (int offset = 16; offset > 0 && lane < 16; offset /= 2) {", "quantize_int8"),
    ("loop bound < made <=", "cuda/kernels.cuh",
     "for (int64_t i = begin + thread_index(); i < end; i += stride) {",
     "for (int64_t i = begin + thread_index(); i <= end; i += stride) {", "compress"),
    ("__syncthreads_or replaced by the thread's own flag", "cuda/kernels.cuh",
     "if (flag != nullptr && __syncthreads_or(bad) && threadIdx.x == 0) {",
     "if (flag != nullptr && bad && threadIdx.x == 0) {", "compress"),
    ("the codes of a packed byte in reverse order", "cuda/packed_kernels.cuh",
     "byte |= pack_code(math::quantize_element(mode, v, inverse, step, i, qmax), kBits, j);",
     "byte |= pack_code(math::quantize_element(mode, v, inverse, step, i, qmax), kBits, "
     "kPer - 1 - j);", "quantize_packed"),
    ("the last byte of a packed row left out", "cuda/packed_kernels.cuh",
     "const int64_t end_byte = (hi - row_first + kPer - 1) / kPer;",
     "const int64_t end_byte = (hi - row_first) / kPer;", "quantize_packed"),
    ("a vector load at an offset that is not a multiple of its width", "cuda/launch.h",
     "const bool vec = aligned16(a.src) && aligned16(a.dst);", "const bool vec = true;",
     "compress"),
]  # fmt: skip


def _sweep(tmp_path, op, edit=None):
    """Build a copy of csrc (with ``edit`` applied) and run ``op``'s checks in a subprocess."""
    csrc = tmp_path / "csrc"
    shutil.copytree(emulator.CSRC, csrc)
    if edit is not None:
        rel, old, new = edit
        path = csrc / rel
        text = path.read_text()
        assert old in text, f"the defect's target text is gone from {rel}: update DEFECTS"
        path.write_text(text.replace(old, new, 1))
    lib = emulator.build(csrc, cache=tmp_path / "lib")
    cmd = [sys.executable, "-m", "fastddp.testing.emu_cases", "--lib", str(lib), "--op", op]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None  # a hang is a failure too


def test_the_unchanged_copy_passes(tmp_path):
    res = _sweep(tmp_path, "compress")
    assert res is not None and res.returncode == 0, res and res.stderr[-3000:]


@pytest.mark.parametrize("name, rel, old, new, op", DEFECTS, ids=[d[0] for d in DEFECTS])
def test_a_planted_defect_fails_the_checks(tmp_path, name, rel, old, new, op):
    res = _sweep(tmp_path, op, (rel, old, new))
    if res is not None:
        assert res.returncode != 0, f"{name!r} survived the emulator checks:\n{res.stdout}"
        print(f"{name}: {res.stderr.strip().splitlines()[-1][:300]}")
