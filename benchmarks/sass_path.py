"""Count the sm_90 instructions of one whole step of quantize, without a GPU.

Nsight Compute found quantize bound by its instruction count (355 warp instructions per 256
elements for int8 on an H200), so the count is a figure to track where no GPU is at hand.
This compiles a probe kernel that runs one whole step of ``quantize_vec_kernel`` (one row, a
block of 128 elements, to nearest: the path a flat bucket takes) for each code width, without
and with error feedback, and counts the machine instructions from the kernel's entry to its first
unconditional ``EXIT``: a step's straight line, with the branches around the rare paths (an
IEEE division's slow path) counted but not their targets. A warp's step is 256 elements, so
the count compares with Nsight Compute's instructions per 256 elements; it leaves out the
loop's own few.

    python benchmarks/sass_path.py            # needs nvcc, and cuobjdump as sass_check finds it
"""

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import sass_check

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
#include "cuda/values.cuh"
using namespace fastddp;
using namespace fastddp::kernels;

template <int kBits, bool kFeedback>
__global__ void __launch_bounds__(kThreads, 4) whole_step(QuantizeArgs a, Codes codes,
                                                          int64_t first, int* out) {
  constexpr int kBlockLog2 = 5;  // 32 chunks: a block of 128 elements
  math::Mode mode = a.rounding.mode();
  mode.feedback = kFeedback;
  mode.stochastic = false;
  const WholeStep w = whole_step_of<kBits>(a, codes, first, kBlockLog2 + 2);
  const bool bad = quantize_runs<kBits, true, true>(
      a, FlatValues{a.src}, mode, first, kBlockLog2,
      [&](int index, int64_t) { return whole_place<kBits>(w, index, kBlockLog2); });
  if (bad) {
    *out = 1;
  }
}
template __global__ void whole_step<8, false>(QuantizeArgs, Codes, int64_t, int*);
template __global__ void whole_step<4, false>(QuantizeArgs, Codes, int64_t, int*);
template __global__ void whole_step<2, false>(QuantizeArgs, Codes, int64_t, int*);
template __global__ void whole_step<8, true>(QuantizeArgs, Codes, int64_t, int*);
template __global__ void whole_step<4, true>(QuantizeArgs, Codes, int64_t, int*);
template __global__ void whole_step<2, true>(QuantizeArgs, Codes, int64_t, int*);
"""


def straight_line(kernel: sass_check.Kernel) -> list[str]:
    """The opcodes from the entry to the first unconditional EXIT."""
    ops = []
    for _, opcode, _ in kernel.instructions:
        ops.append(opcode)
        if opcode == "EXIT":
            break
    return ops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvcc", default="nvcc")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        source, cubin = Path(tmp) / "probe.cu", Path(tmp) / "probe.cubin"
        source.write_text(PROBE)
        cmd = [args.nvcc, "-O3", "-std=c++20", "--expt-relaxed-constexpr",
               "--generate-code=arch=compute_90,code=sm_90", "-cubin",
               f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc' / 'include'}", "-o", str(cubin),
               str(source)]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise SystemExit(f"sass_path: {' '.join(cmd)} failed:\n{res.stderr}")
        kernels = sass_check.parse(sass_check.sass_of_cubin(cubin))
    for kernel in sorted(kernels, key=lambda k: k.name):
        m = re.search(r"whole_stepILi(\d)ELb([01])E", kernel.name)
        if not m:
            continue
        ops = straight_line(kernel)
        kinds = Counter(op.split(".")[0] for op in ops)
        top = ", ".join(f"{op} {n}" for op, n in kinds.most_common(6))
        mode = " with error feedback" if m.group(2) == "1" else ""
        print(f"quantize int{m.group(1)}{mode}, a whole step of 256 elements: {len(ops)} "
              f"instructions ({top})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
