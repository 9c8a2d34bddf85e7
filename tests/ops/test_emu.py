"""The CUDA backend's launch code and kernels, run on the CPU by the grid emulator (csrc/emu).

Every op, wire dtype, block size and error-feedback / stochastic-rounding variant gives exactly
the CPU op's bits at sizes that take 3 passes of the kernels' loops on an emulated 1-SM
device, for every tail length from 0 to twice the vector width, with tensors one element into
their buffers (a scalar head before the 16-byte body, or the scalar kernels of the codes), and
with rows of codes that are not 16-byte aligned; the cases launch every kernel, vector and
scalar. Then defects are planted, one at a time, in a copy of the kernel header and launch
code: each must make the checks fail. ``make test`` runs this module a second time under
AddressSanitizer.
"""

import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastddp.testing import emu as emulator
from fastddp.testing import slack
from fastddp.testing.emu_cases import CHECKS, KERNELS, VEC, _codes_n, run_logged, sizes
from fastddp.testing.emu_cases import main as run_all_main
from fastddp.testing.emu_checks import (
    check_compress,
    check_decode_packed,
    check_decompress,
    check_quantize_int8,
    check_quantize_packed,
    check_sum_chunks,
)
from fastddp.testing.pool import stop_fork_server

from ._defects import DEFECTS, PLANTED_BUILD, planted_copy

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
    _LAUNCHED.update(emu.launched())
    _RAN.append(args)


_LAUNCHED: set = set()
_RAN: list = []


def test_the_checks_run_every_kernel():
    """Every vector kernel and every scalar one ran in the cases above (the whole sweep)."""
    if len(_RAN) < sum(len(cases) for _, _, cases in CHECKS):
        pytest.skip("needs every case of test_every_op_matches_the_cpu_op in this session")
    assert _LAUNCHED == KERNELS, f"not run: {sorted(KERNELS - _LAUNCHED)}"


@pytest.mark.parametrize("dtype", WIRES)
@pytest.mark.parametrize("offset", [False, True], ids=["aligned", "offset"])
def test_every_tail_of_the_vectorised_paths(emu, dtype, offset):
    for n in sizes(VEC):
        check_compress(emu, n, dtype, "flag", offset, special=True)
        check_decompress(emu, n, dtype, offset)


@pytest.mark.parametrize("variant", ["ef", "sr", "ef-sr"])
def test_every_tail_of_the_rounding_paths(emu, variant):
    for n in sizes(VEC):
        check_compress(emu, n, torch.bfloat16, variant, offset=True, special=True)
        check_sum_chunks(emu, n, torch.float16, 2, variant, offset=True)
        # One row aligns wherever it starts: every length of tail past the last whole octet.
        check_sum_chunks(emu, n, torch.bfloat16, 1, variant, offset=False)


@pytest.mark.parametrize("block", [1, 4, 8, 16, 32, 48, 64, 100, 128, 256, 384, 512])
def test_int8_block_sizes(emu, block):
    # 4 * 2^k up to 128 and multiples of 128: the vector kernel, or the wide one for powers of
    # two from 16 to 512 (a lane to a warp a block); 1, 48, 100: the scalar one.
    for n in (1, block - 1, block + 1, _codes_n(block, 3)):
        if n >= 1:
            check_quantize_int8(emu, n, block, "ef-sr", rows=1, special=True)
    if block % 4 == 0 and 128 % block == 0:  # rows of whole steps, placed by shifts
        check_quantize_int8(emu, _codes_n(block, 3), block, "ef-sr", rows=3, special=True)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("block", [4, 8, 12, 32, 64, 256, 512])
def test_packed_block_sizes_and_short_last_bytes(emu, bits, block):
    for n in (1, 2, 3, block - 1, block + 1, _codes_n(block, 3)):
        check_quantize_packed(emu, bits, n, block, "ef-sr", rows=1, special=True)
        check_decode_packed(emu, "unpack", bits, n, block, 1)
    if block % 4 == 0 and 128 % block == 0:  # rows of whole steps, placed by shifts
        check_quantize_packed(emu, bits, _codes_n(block, 3), block, "ef-sr", rows=3, special=True)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("block", [8, 16, 32, 128])
def test_extreme_blocks_quantize_as_on_the_cpu(emu, bits, block):
    # Zero, tiny (an inverse past FLT_MAX), FLT_MAX (a scale one step down), inf and NaN blocks,
    # for the quantize whose lanes share their blocks' scales (plain, sr; blocks of at least 16
    # elements) and the one whose lanes each divide (ef-sr; blocks of 8).
    n = 6 * 128 * 3 + 5
    for variant in ("plain", "sr", "ef-sr"):
        if bits == 8:
            check_quantize_int8(emu, n, block, variant, extreme=True)
        else:
            check_quantize_packed(emu, bits, n, block, variant, extreme=True)


def test_the_bandwidth_tables_requantize_rows_take_the_kernels_they_compare(emu):
    # benchmarks/gpu_bandwidth.py times requantize_int8 on aligned rows and, in its ", 4 a lane"
    # row, on rows 4 bytes off 16-byte alignment into the same aligned row: the wide kernel,
    # then the vector one, as the rows say.
    n, block, ranks = 4096, 128, 4
    residual, scales = torch.zeros(n), torch.empty(n // block)
    rows = torch.randint(-127, 128, (ranks, n), dtype=torch.int8)
    rows4 = torch.empty(ranks, n + 4, dtype=torch.int8)[:, 4:]
    rows4.copy_(rows)
    row_scales = torch.rand(ranks, n // block)
    out = torch.empty(n, dtype=torch.int8)
    emu.launched()  # (forget the launches of the tests before)
    for q_rows, kernel in (
        (rows, "quantize_wide_kernel<8, true, false, summed>"),
        (rows4, "quantize_vec_kernel<8, true, false, summed>"),
    ):
        emu.requantize(q_rows, row_scales, out, scales, 8, block, 0.25, None, residual)
        assert emu.launched() == {kernel}


@pytest.mark.parametrize("dtype, bits", [(torch.int8, 8), (torch.int4, 4), (torch.int2, 2)])
def test_the_codecs_rows_take_the_wide_kernel_bit_for_bit(emu, dtype, bits):
    # The hook's layout (fastddp.codecs: rows row_elems codes apart, shards of whole blocks) as
    # the int8-ef, int4-ef and int2-ef presets encode and reduce it: each op the codec calls,
    # run by the emulator, takes the wide kernel and writes the CPU op's bits; a shard past the
    # last whole step of a warp (512 elements), with a short last block, too.
    from fastddp.codecs import codec_for

    codec = codec_for(dtype, 128)
    for world, shard in ((3, 3 * 512 + 128), (2, 5 * 128)):
        src, residual = torch.randn(world * shard), torch.randn(world * shard) * 1e-3
        rows = torch.zeros(world, codec.row_elems(shard), dtype=codec.wire_dtype)
        got = {}
        for run, name in ((None, "cpu"), (emu, "emu")):
            r, q = residual.clone(), rows.clone()
            calls = codec.encode_calls(src, q, shard, 0.5, None, r, -1)
            out = torch.zeros(codec.row_elems(shard), dtype=codec.wire_dtype)
            calls += codec.reduce_calls(q, out, shard, 0.5, None, r[:shard], 7)
            emu.launched()
            for op, args, kwargs in calls:
                if run is None:
                    op(*args, **kwargs)
                else:
                    getattr(emu, op.name().split("::")[1])(*args, **kwargs)
            if run is not None:
                assert emu.launched() == {
                    f"quantize_wide_kernel<{bits}, true, false>",
                    f"quantize_wide_kernel<{bits}, true, false, summed>",
                }
            got[name] = (q, out, r)
        for a, b in zip(got["cpu"], got["emu"]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (world, shard)


def test_a_sum_of_no_rows_is_refused(emu):
    # As the op refuses it: the kernels read row 0 of the rows they sum.
    rows = torch.empty(0, 64, dtype=torch.bfloat16)
    with pytest.raises(emulator.EmuError, match="sum_chunks needs at least one row"):
        emu.sum_chunks(rows, torch.empty(64, dtype=torch.bfloat16))
    with pytest.raises(emulator.EmuError, match="widen_sum needs at least one row"):
        emu.widen_sum(rows, torch.empty(64))


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
# (tests/ops/_defects.py lists them)

# Each sweep runs in a process of its own (a defect may crash it), forked from a server that
# has imported torch once: under AddressSanitizer a fresh interpreter costs 3 CPU-s to start.
_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(["fastddp.testing.emu_cases"])


@pytest.fixture(scope="module", autouse=True)
def _reap_the_fork_server():
    yield
    stop_fork_server()  # the sweeps' parent


def _sweep(tmp_path, op, edit=None):
    """Build a copy of csrc (with ``edit`` applied) and run ``op``'s checks in a process of
    their own; its exit status and output, or None if it hung."""
    csrc = planted_copy(emulator.CSRC, tmp_path / "csrc", edit)
    # Without line tables or the optimiser, and with the swept op alone: the copies only need
    # to fail, and the unchanged one, built the same way, shows that they fail for their defect.
    # (tests/emu_objects.py compiles the same objects before the tests start.)
    lib = emulator.build(csrc, cache=tmp_path / "lib", **PLANTED_BUILD, only=op)
    log = tmp_path / "sweep.log"
    proc = _FORKS.Process(target=run_logged, args=(str(lib), op, str(log)))
    proc.start()
    # Guarded by its CPU time, not the clock: the stream runs niced, and under a full suite a
    # healthy sweep can wait minutes for a core. The slowest defect's sweep uses ~110 CPU s.
    code = slack.join_busy(proc, cpu_s=300, idle_s=120)
    if code is None:
        return None  # a hang is a failure too
    out = log.read_text(errors="replace")
    return subprocess.CompletedProcess(proc.name, code, out, out)


# The build and sweep of the stream's first tests wait longest for a core (see _sweep).
PLANTED_LIMIT = pytest.mark.timeout(900)


@pytest.mark.planted
@PLANTED_LIMIT
def test_the_unchanged_copy_passes(tmp_path):
    res = _sweep(tmp_path, "compress")
    assert res is not None, "the unchanged copy's sweep was stopped by its hang guard"
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.planted
def test_a_library_for_one_op_holds_it_alone_and_a_sweep_of_another_says_so(tmp_path, capsys):
    lib = emulator.build(cache=tmp_path, **PLANTED_BUILD, only="decompress")
    emu = emulator.load(lib, sms=1)
    assert emu.has("decompress") and not emu.has("compress")
    with pytest.raises(emulator.EmuError, match="has no compress"):
        emu.compress(torch.ones(4), torch.empty(4, dtype=torch.bfloat16))
    # Exit status 2, which the defects' sweeps must not end with: not a check that failed.
    assert run_all_main(["--lib", str(lib), "--op", "compress"]) == 2
    assert "--op compress: not an op of" in capsys.readouterr().err
    assert run_all_main(["--lib", str(lib), "--op", "compres"]) == 2
    with pytest.raises(ValueError, match="not an op of the emulator"):
        emulator.build(only="compres")


@pytest.mark.planted
def test_the_objects_compiled_before_the_tests_are_those_the_tests_ask_for(tmp_path):
    # make test runs tests/emu_objects.py beside its install: an object it missed would be
    # compiled again by a stream, late. The streams run under AddressSanitizer.
    script = [sys.executable, str(Path(__file__).parents[1] / "emu_objects.py")]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    res = subprocess.run(
        [*script, "--dry-run"], capture_output=True, text=True, env=env, timeout=slack.guard(60)
    )
    assert res.returncode == 0, res.stderr
    listed = set(res.stdout.split())
    wanted = [emulator.objects(sanitize=True)]  # the emu stream's
    for op in ("compress", "decompress"):  # the unchanged copy's sweep; the one-op library
        wanted.append(emulator.objects(sanitize=True, **PLANTED_BUILD, only=op))
    for k, (_, rel, old, new, op) in enumerate(DEFECTS):  # as _sweep builds them
        csrc = planted_copy(emulator.CSRC, tmp_path / str(k), (rel, old, new))
        wanted.append(emulator.objects(csrc, sanitize=True, **PLANTED_BUILD, only=op))
    assert {str(obj) for objs in wanted for obj, _ in objs} == listed
    # Without a compiler it compiles nothing, and leaves the tests to say so.
    res = subprocess.run(
        script, capture_output=True, text=True, env={**env, "CXX": "no-cxx"},
        timeout=slack.guard(60),
    )  # fmt: skip
    assert res.returncode == 0 and "'no-cxx' is not found" in res.stdout, res.stdout + res.stderr


@pytest.mark.planted
@PLANTED_LIMIT
@pytest.mark.parametrize("name, rel, old, new, op", DEFECTS, ids=[d[0] for d in DEFECTS])
def test_a_planted_defect_fails_the_checks(tmp_path, name, rel, old, new, op):
    res = _sweep(tmp_path, op, (rel, old, new))
    if res is not None:
        assert res.returncode != 0, f"{name!r} survived the emulator checks:\n{res.stdout}"
        assert res.returncode != 2, f"the sweep of {op} did not run:\n{res.stdout}"
        lines = res.stderr.strip().splitlines() or [""]
        why = next((line for line in lines if "runtime error" in line), lines[-1])
        print(f"{name}: {why[:300]}")
