"""The compress/decompress ops against a pure-torch reference, on CPU and (when present) CUDA."""

import os
import subprocess
import sys

import pytest
import torch

import fastddp
from fastddp import ops
from fastddp.testing import slack

from ._grid import SCALAR, VECTORISED, devices_and_lengths

WIRE = [torch.float16, torch.bfloat16]
LENGTHS = [0, 1, 7, 8, 15, 16, 17, 33, 1000, 65537, 2**20 + 3]


def _random(n, device, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed + n)
    # Mixed magnitudes, like real gradients: most small, some large.
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * scale)
    return x.to(device)


def _same_bits(a, b):
    """Equal bit patterns, except that any NaN matches any NaN."""
    nan = torch.isnan(a.float())
    assert torch.equal(nan, torch.isnan(b.float()))
    assert torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


@pytest.mark.parametrize("device, n", devices_and_lengths(LENGTHS, VECTORISED), indirect=["device"])
@pytest.mark.parametrize("dtype", WIRE)
def test_compress_matches_torch(device, dtype, n):
    x = _random(n, device)
    for scale in (1.0, 0.5, 1.0 / 3.0):
        out = torch.full((n,), 7.0, dtype=dtype, device=device)
        flag = torch.full((1,), 5, dtype=torch.int32, device=device)
        ops.compress(x, out, scale, flag)
        expected = (x * scale).to(dtype)
        _same_bits(out, expected)
        assert flag.item() == int(not torch.isfinite(expected.float()).all())


@pytest.mark.parametrize("device, n", devices_and_lengths(LENGTHS, VECTORISED), indirect=["device"])
@pytest.mark.parametrize("dtype", WIRE)
def test_decompress_matches_torch(device, dtype, n):
    wire = _random(n, device, seed=1).to(dtype)
    for scale in (1.0, 2.0, 0.25):
        out = torch.full((n,), 7.0, device=device)
        ops.decompress(wire, out, scale)
        torch.testing.assert_close(out, wire.float() * scale, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", WIRE)
def test_every_16bit_pattern_round_trips(device, dtype):
    # Decompress all 65536 encodings, then compress them back: both directions exactly.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).to(device)
    wire = bits.view(dtype)
    wide = torch.empty(wire.numel(), device=device)
    ops.decompress(wire, wide, 1.0)
    torch.testing.assert_close(wide, wire.float(), rtol=0, atol=0, equal_nan=True)
    back = torch.empty_like(wire)
    ops.compress(wide, back, 1.0)
    _same_bits(back, wire)


@pytest.mark.parametrize("dtype", WIRE)
def test_compress_rounding_edges(device, dtype):
    # Halfway cases, the fp16 overflow boundary, subnormals, signed zeros and specials.
    finfo = torch.finfo(dtype)
    vals = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        finfo.max,
        -finfo.max,
        finfo.tiny,
        finfo.tiny / 3,
        1e-40,
        65504.0,
        65519.99,
        65520.0,
        65536.0,
        1e30,
        -1e30,
        3.4e38,
        float("inf"),
        float("-inf"),
        float("nan"),
    ]
    one = torch.tensor(1.0, dtype=dtype).float()
    eps = torch.finfo(dtype).eps
    vals += [float(one + eps / 2), float(one + 1.5 * eps), float(one + eps / 2 + 1e-7)]
    x = torch.tensor(vals * 3, dtype=torch.float32, device=device)  # past one vector width
    out = torch.empty(x.numel(), dtype=dtype, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    ops.compress(x, out, 1.0, flag)
    _same_bits(out, x.to(dtype))
    assert flag.item() == 1


def test_fp16_overflow_is_inf_not_clipped(device):
    x = torch.ones(1001, device=device)
    x[500] = 70000.0
    x[777] = -1e6
    out = torch.empty(1001, dtype=torch.float16, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    ops.compress(x, out, 1.0, flag)
    assert flag.item() == 1
    assert out[500].item() == float("inf") and out[777].item() == float("-inf")
    # Scaling first can bring it back in range: the flag is then cleared.
    ops.compress(x, out, 1.0 / 16, flag)
    assert flag.item() == 0 and torch.isfinite(out).all()


@pytest.mark.parametrize("device, n", devices_and_lengths([4099], SCALAR), indirect=["device"])
@pytest.mark.parametrize("dtype", WIRE)
def test_unaligned_views(device, dtype, n):
    # Offsets that break 16-byte alignment must take the scalar path and still be exact.
    base = _random(n, device, seed=2)
    wire_base = torch.empty(n, dtype=dtype, device=device)
    for offset in (1, 3, 5):
        x = base[offset:]
        out = wire_base[offset - 1 : n - 1]
        ops.compress(x, out, 0.5)
        _same_bits(out, (x * 0.5).to(dtype))
        back = base.clone()[offset:]
        ops.decompress(out, back, 2.0)
        torch.testing.assert_close(back, out.float() * 2.0, rtol=0, atol=0)


@pytest.mark.parametrize(
    "switch",
    [{"FASTDDP_DISABLE_SIMD": "1"}, {"FASTDDP_STREAM_MIN_BYTES": "0"}],
    ids=["portable", "streaming"],
)
def test_other_cpu_loops_match_torch(switch):
    # The portable loops (no AVX2/F16C) and the streaming-store loops, in fresh processes.
    script = os.path.join(os.path.dirname(__file__), "_loop_check.py")
    env = dict(os.environ, **switch)
    res = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=slack.guard(120)
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.parametrize("dtype", WIRE)
def test_opcheck(device, dtype):
    x = _random(1031, device, seed=3)
    out = torch.empty(1031, dtype=dtype, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.fastddp.compress.default, (x, out, 0.5, flag))
    torch.library.opcheck(torch.ops.fastddp.compress.default, (x, out, 0.5, None))
    wide = torch.empty(1031, device=device)
    torch.library.opcheck(torch.ops.fastddp.decompress.default, (out, wide, 2.0))


def test_ops_under_torch_compile():
    def f(x, w, y):
        ops.compress(x, w, 0.5)
        ops.decompress(w, y, 2.0)
        return y + 1

    x = _random(257, "cpu")
    w = torch.empty(257, dtype=torch.bfloat16)
    y = torch.empty(257)
    expected = (x * 0.5).to(torch.bfloat16).float() * 2.0 + 1
    got = torch.compile(f, backend="eager", fullgraph=True)(x, w, y)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


BAD_INPUTS = [
    (
        lambda: (torch.ones(4, dtype=torch.float64), torch.empty(4, dtype=torch.bfloat16)),
        "bucket must be float32, got Double",
    ),
    (
        lambda: (torch.ones(4), torch.empty(4, dtype=torch.float32)),
        "wire buffer must be float16 or bfloat16, got Float",
    ),
    (
        lambda: (torch.ones(4), torch.empty(5, dtype=torch.bfloat16)),
        "bucket has 4 elements but the wire buffer has 5",
    ),
    (
        lambda: (torch.ones(4, 2).t(), torch.empty(8, dtype=torch.bfloat16).view(4, 2).t()),
        "must be contiguous",
    ),
]


@pytest.mark.parametrize("make,message", BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(make, message):
    src, dst = make()
    with pytest.raises(RuntimeError, match=message):
        ops.compress(src, dst, 1.0)


def test_bad_flag_and_aliasing():
    x = torch.ones(8)
    w = torch.empty(8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="one-element int32 tensor"):
        ops.compress(x, w, 1.0, torch.zeros(1))
    # (any negative seed rounded to nearest)
    with pytest.raises(RuntimeError, match="seed must be -1 .* or at least 0 .*, got -5"):
        ops.compress(x, w, 1.0, seed=-5)
    with pytest.raises(RuntimeError, match="fastddp.quantize_int8: seed must be -1"):
        ops.quantize_int8(x, torch.empty(8, dtype=torch.int8), torch.empty(1), 8, seed=-2)
    # torch's schemas take a bool for an int: seed=True would be seed 1 at every call.
    codes, packed, one = torch.empty(8, dtype=torch.int8), torch.empty(4, dtype=torch.uint8), [1]
    for name, call in [
        ("compress", lambda s: ops.compress(x, w, 1.0, seed=s)),
        ("sum_chunks", lambda s: ops.sum_chunks(w.view(1, 8).clone(), w, 1.0, seed=s)),
        ("quantize_int8", lambda s: ops.quantize_int8(x, codes, torch.empty(one), 8, seed=s)),
        ("quantize_packed", lambda s: ops.quantize_packed(x, packed, torch.empty(1), 4, 8, seed=s)),
        ("requantize", lambda s: ops.requantize(torch.zeros(1, 8, dtype=torch.int8),
                                                torch.ones(1, 1), codes, torch.empty(1), 8, 8,
                                                seed=s)),
    ]:  # fmt: skip
        with pytest.raises(TypeError, match=f"fastddp.{name}: seed must be an int, got True"):
            call(True)
        call(7)  # an int is taken
    # One buffer for a bucket and its wire: refused where they overlap, taken where apart.
    storage = torch.arange(12.0)
    with pytest.raises(RuntimeError, match="the bucket overlaps the wire buffer in memory"):
        ops.compress(storage[:8], storage[4:8].view(torch.bfloat16), 1.0)
    with pytest.raises(RuntimeError, match="the bucket overlaps the wire buffer in memory"):
        ops.decompress(storage[4:8].view(torch.bfloat16), storage[:8], 1.0)
    wire = storage[8:].view(torch.bfloat16)
    ops.compress(storage[:8], wire, 1.0)
    assert torch.equal(wire, torch.arange(8.0).to(torch.bfloat16))
    ops.decompress(wire, storage[:8], 2.0)
    assert torch.equal(storage[:8], torch.arange(0.0, 16.0, 2.0))
    with pytest.raises(RuntimeError, match="the wire buffer must be float16 or bfloat16"):
        ops.decompress(torch.ones(8), torch.empty(8), 1.0)


def test_import_does_not_initialise_cuda_and_records_build():
    # build_info() loads the compiled ops (if importing fastddp has not already).
    code = (
        "import torch, fastddp\n"
        "assert not torch.cuda.is_initialized()\n"
        "print(fastddp.build_info()['torch_version'])\n"
        "assert hasattr(torch.ops.fastddp, 'compress')\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=slack.guard(120)
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == torch.__version__
    assert fastddp.build_info()["with_cuda"] == (torch.version.cuda is not None)


def test_mismatched_build_names_the_rebuild_command():
    # A _C module recording another torch version stands in for a stale build.
    code = (
        "import sys, types\n"
        "stale = types.ModuleType('fastddp._C')\n"
        "stale.torch_version = '1.0.0'\n"
        "stale.with_cuda = 0\n"
        "sys.modules['fastddp._C'] = stale\n"
        "import fastddp.ops\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=slack.guard(120)
    )
    assert res.returncode != 0
    assert "built against torch 1.0.0" in res.stderr
    assert "pip install --no-build-isolation -e ." in res.stderr


def test_missing_build_names_the_rebuild_command():
    # A None entry in sys.modules makes `import fastddp._C` fail, as a missing build does.
    code = "import sys\nsys.modules['fastddp._C'] = None\nimport fastddp.ops\n"
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=slack.guard(120)
    )
    assert res.returncode != 0
    assert "fastddp's compiled extension could not be loaded" in res.stderr
    assert "pip install --no-build-isolation -e ." in res.stderr
