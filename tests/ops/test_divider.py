"""fastddp::Divider (csrc/include/fastddp/layout.h): the kernels' n / d without a division.

The header is compiled with g++ into a small program that compares ``Divider::of(d).div(n)``
(and ``div_small(n)``, for dividends and divisors below 2^32) with ``n / d`` for every divisor
up to 4096 against every dividend up to 65536 and the dividends around each multiple of d near
2^31 and 2^32, and for random divisors up to 2^32 (and a few beyond, which take the plain
division) against random dividends and those around their multiples and the largest below
2^32. The kernels and the emulator run the same code.
"""

import shutil
import subprocess

import pytest

from fastddp.testing import emu as emulator
from fastddp.testing import slack

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++"),
]

_PROGRAM = r"""
#include <cstdio>
#include <random>
#include "fastddp/layout.h"

static long failures = 0, checked = 0;

static void check(const fastddp::Divider& v, int64_t n) {
  ++checked;
  if (v.div(n) != n / v.d && failures++ < 5) {
    std::printf("wrong: %lld / %lld gives %lld\n", (long long)n, (long long)v.d,
                (long long)v.div(n));
  }
  // div_small, where it applies: the same quotient without div's test of n.
  if (n < (int64_t{1} << 32) && v.d < (int64_t{1} << 32)) {
    ++checked;
    const int64_t q = v.div_small(static_cast<uint32_t>(n));
    if (q != n / v.d && failures++ < 5) {
      std::printf("wrong: div_small %lld / %lld gives %lld\n", (long long)n, (long long)v.d,
                  (long long)q);
    }
  }
}

// Dividends around the multiples of d near x.
static void around(const fastddp::Divider& v, int64_t x) {
  const int64_t k = x / v.d;
  for (int64_t m = k - 2; m <= k + 2; ++m) {
    for (int64_t e = -2; e <= 2; ++e) {
      const int64_t n = m * v.d + e;
      if (n >= 0) check(v, n);
    }
  }
}

int main() {
  const int64_t top = (int64_t{1} << 32) - 1;
  for (int64_t d = 1; d <= 4096; ++d) {
    const auto v = fastddp::Divider::of(d);
    for (int64_t n = 0; n <= 65536; ++n) check(v, n);
    around(v, int64_t{1} << 31);
    around(v, top);
    check(v, top);
  }
  std::mt19937_64 gen(2024);
  for (int i = 0; i < 20000; ++i) {
    const int64_t d = 1 + static_cast<int64_t>(gen() % static_cast<uint64_t>(top));
    const auto v = fastddp::Divider::of(d);
    for (int j = 0; j < 50; ++j) check(v, static_cast<int64_t>(gen() % (uint64_t{1} << 33)));
    around(v, top);
    check(v, top);
  }
  for (int64_t d : {top, top + 1, top + 2, int64_t{1} << 40}) {
    const auto v = fastddp::Divider::of(d);
    for (int64_t n : {int64_t{0}, d - 1, d, 2 * d + 1, top, top + 1}) check(v, n);
  }
  std::printf("%ld checked, %ld wrong\n", checked, failures);
  return failures == 0 ? 0 : 1;
}
"""


def test_divider_matches_division(tmp_path):
    src, exe = tmp_path / "divider.cpp", tmp_path / "divider"
    src.write_text(_PROGRAM)
    include = emulator.CSRC / "include"
    build = ["g++", "-std=c++17", "-O2", "-I", str(include), str(src), "-o", str(exe)]
    subprocess.run(build, check=True, capture_output=True, timeout=slack.guard(100))
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=slack.guard(100))
    assert res.returncode == 0, res.stdout
    assert " 0 wrong" in res.stdout
