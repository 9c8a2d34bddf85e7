"""``benchmarks/gpu_profile.py``: the table it makes of Nsight Compute's details page, read from
a page an H100 gave (two of its kernels, as ncu printed them), and its answers without a GPU."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_profile  # noqa: E402

from fastddp.testing import slack  # noqa: E402

PAGE = Path(__file__).parent / "data" / "ncu_details_h100.txt"
ELEMENTS = (100 << 20) // 4  # the page's bucket: 100 MB of fp32


def test_the_rows_of_a_real_details_page():
    rows = gpu_profile.parse_details(PAGE.read_text(), ELEMENTS)
    assert [r["kernel"] for r in rows] == ["compress_kernel<1>", "quantize_vec_kernel<8>"]
    compress, quantize = rows
    assert (compress["grid"], compress["block"]) == (792, 256)
    assert compress["duration_us"] == 50.14 and compress["dram_pct"] == 83.72
    assert compress["issue_busy_pct"] == 31.38 and compress["registers"] == 40
    assert compress["theoretical_occupancy_pct"] == 75
    assert compress["achieved_occupancy_pct"] == 72.91
    assert compress["waves_per_sm"] == 1 and compress["local_spills"] == 0
    # The quantize kernel: bound by its instructions (issue 67.5% busy, DRAM 33.4%), 773 warp
    # instructions for each 256 elements. "Memory Throughput" is named twice (% and TB/s).
    assert quantize["instructions"] == 79_153_152
    assert quantize["instructions_per_256"] == pytest.approx(79_153_152 * 256 / ELEMENTS)
    assert quantize["dram_pct"] == 33.42 and quantize["issue_busy_pct"] == 67.53
    assert quantize["registers"] == 60 and quantize["theoretical_occupancy_pct"] == 50
    # ncu's rule texts, wrapped over several lines: the busiest pipeline, and the stall that
    # holds warps longest (compress waits on its loads; the quantize's page names no stall).
    assert (compress["sm_busy_pct"], quantize["sm_busy_pct"]) == (39.18, 67.53)
    assert (compress["top_pipe"], quantize["top_pipe"]) == ("ALU 39.2%", "ALU 52.0%")
    assert compress["top_stall"] == "waiting for a scoreboard dependency on a L1TEX operation"
    assert compress["top_stall_pct"] == 79.7
    assert quantize["top_stall"] is None and quantize["top_stall_pct"] is None


def test_units_of_time_and_missing_metrics():
    page = (
        "  void k<2>(int *) (4, 1, 1)x(32, 1, 1), Context 1, Stream 7, Device 0, CC 9.0\n"
        "    Duration                         ms         1.50\n"
        "    Waves Per SM                                0.25\n"
    )
    (row,) = gpu_profile.parse_details(page)
    assert row["kernel"] == "k<2>" and row["duration_us"] == 1500.0
    assert row["waves_per_sm"] == 0.25 and row["dram_pct"] is None
    assert row["instructions_per_256"] is None and row["top_pipe"] is None
    assert "| k<2> | 4 | 1500.0 |  |" in gpu_profile.markdown([row], "1MB")
    # A template's instance among the arguments (requantize's instances of quantize).
    page = page.replace("k<2>", "quantize_vec_kernel<8, 1, 0, SummedRows<8>>")
    (row,) = gpu_profile.parse_details(page)
    assert row["kernel"] == "quantize_vec_kernel<8, 1, 0, SummedRows<8>>"


@pytest.mark.multiproc  # runs the script in processes of its own
def test_the_command_tabulates_a_page_and_says_when_it_cannot_profile(tmp_path):
    script = [sys.executable, "benchmarks/gpu_profile.py"]
    res = slack.run(
        [*script, str(tmp_path), "--parse", str(PAGE)],
        cwd=ROOT, capture_output=True, text=True, timeout=slack.guard(120),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert (
        "| quantize_vec_kernel<8> | 528 | 112.8 | 33.4 | 67.5 | 773 | 60 | 50 / 44.6 | 1 | 0 | "
        "ALU 52.0% |  |" in (tmp_path / "profile.md").read_text()
    )
    assert json.loads((tmp_path / "profile.json").read_text())["size"] == "100MB"
    # A page without a kernel in it is not a table.
    empty = tmp_path / "empty.txt"
    empty.write_text("==PROF== Disconnected\n")
    res = slack.run(
        [*script, str(tmp_path), "--parse", str(empty)],
        cwd=ROOT, capture_output=True, text=True, timeout=slack.guard(120),
    )  # fmt: skip
    assert res.returncode == 1
    if not gpu_profile_gpu():
        res = slack.run([*script, str(tmp_path / "run")], cwd=ROOT, timeout=slack.guard(120))
        assert res.returncode == 0 and "no GPU here" in res.stdout, res.stdout + res.stderr


def gpu_profile_gpu() -> bool:
    """Whether nvidia-smi lists a GPU here (then the command would profile it)."""
    import gpu_check

    return bool(gpu_check.gpu_names())


def _without_fastddp(tmp_path, *args, gpu=False):
    # fastddp not importable (a fresh machine before make gpu-check builds it).
    script = (
        "import runpy, sys; sys.modules['fastddp'] = None; import gpu_check; "
        + ("gpu_check.gpu_names = lambda: ['GPU 0: test']; " if gpu else "")
        + f"sys.argv = ['gpu_profile.py', {str(tmp_path)!r}, *{list(args)!r}]; "
        + f"runpy.run_path({str(ROOT / 'benchmarks' / 'gpu_profile.py')!r}, run_name='__main__')"
    )
    return slack.run(
        [sys.executable, "-c", script],
        cwd=ROOT / "benchmarks",
        capture_output=True,
        text=True,
        timeout=slack.guard(60),
    )


def test_without_a_build_it_says_to_build_first_and_still_tabulates_a_page(tmp_path):
    res = _without_fastddp(tmp_path / "a", gpu=True)
    assert res.returncode == 2, res.stderr
    assert res.stdout.startswith("gpu-profile: ") and "build fastddp first" in res.stdout
    assert "Traceback" not in res.stderr
    # Reading a details page back needs neither a GPU nor the build.
    res = _without_fastddp(tmp_path / "b", "--parse", str(PAGE))
    assert res.returncode == 0, res.stderr
    assert "compress_kernel<1>" in (tmp_path / "b" / "profile.md").read_text()


def test_the_sizes_are_the_bandwidth_table_s():
    import gpu_bandwidth

    for name, size in gpu_bandwidth.SIZES.items():
        assert gpu_profile._elements(name) == size // 4
