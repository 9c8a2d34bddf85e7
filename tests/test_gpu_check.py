"""``make gpu-check``: safe without a GPU, and its parts (op sweep, bandwidth, verdicts, summary)
working on the CPU, so that the one GPU run it exists for finds nothing of its own broken."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


@pytest.mark.skipif(bool(gpu_check.gpu_names()), reason="a GPU is present: the check would run")
def test_make_gpu_check_without_a_gpu_says_so_and_builds_nothing(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(
        ["make", "-s", "gpu-check", f"OUT={out}", f"GPU_PYTHON={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        "gpu-check: no GPU here (nvidia-smi lists none); nothing built or run"
    ]
    assert not out.exists()


def test_the_op_sweep_runs_on_cpu():
    res = subprocess.run(
        [sys.executable, "benchmarks/gpu_ops_all.py", "--device", "cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "all results as expected" in res.stdout


def test_the_bandwidth_table_on_cpu(tmp_path):
    out = tmp_path / "bw.json"
    md = tmp_path / "bw.md"
    cmd = [sys.executable, "benchmarks/gpu_bandwidth.py", "--device", "cpu", "--sizes", "1MB"]
    cmd += ["--iters", "2", "--json", str(out), "--markdown", str(md)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {r["op"] for r in rows} >= {
        "copy (d2d)",
        "compress",
        "decompress",
        "sum_chunks",
        "quantize_int8",
        "dequantize_int8",
        "unpack_int8",
        "torch to(bf16).div_ + copy_",
    }
    copy = next(r for r in rows if r["op"] == "copy (d2d)")
    assert copy["ratio_to_copy"] == 1.0 and all(r["gbs"] > 0 for r in rows)
    assert "| 1MB | compress |" in md.read_text()


def test_verdicts_and_summary(tmp_path):
    assert gpu_check.sanitizer_verdict(0, "========= ERROR SUMMARY: 0 errors")[0]
    bad = gpu_check.sanitizer_verdict(99, "========= ERROR SUMMARY: 3 errors")
    assert bad == (False, "ERROR SUMMARY: 3 errors")
    assert gpu_check.pytest_verdict(1, "== 2 failed, 40 passed in 3.0s ==") == (
        False,
        "2 failed, 40 passed in 3.0s",
    )
    slow = gpu_check.run_step("slow", ["sleep", "5"], tmp_path, limit=0.5)
    assert not slow.ok and "timed out" in slow.detail
    good = gpu_check.run_step("good", [sys.executable, "-c", "print(1)"], tmp_path, limit=30)
    assert good.ok and (tmp_path / "good.log").read_text().endswith("1\n")
    ok = gpu_check.write_summary(tmp_path, {"gpu": "test"}, [good, slow])
    assert not ok
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is False and [s["ok"] for s in summary["steps"]] == [True, False]
    assert (tmp_path / "summary.md").read_text().startswith("# gpu-check: FAILED")
