"""``python -m fastddp.bench hook-cost``: the table and JSON of host time per bucket (run in this
process, its rank on the session's pooled one)."""

import json

import pytest

from fastddp.bench import hook_cost
from fastddp.bench.cli import main
from fastddp.testing import spawn

from .._dist import pool

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


def test_hook_cost_times_every_mode_against_plain_ddp(tmp_path):
    out = tmp_path / "cost.json"
    modes = ["fp32", "torch-fp16", "fastddp-bf16", "fastddp-int8-ef-native"]
    argv = ["hook-cost", "--layers", "6", "--rounds", "2", "--steps", "2", "--json", str(out)]
    with spawn.pooled(pool):
        assert main([*argv, "--modes", *modes]) == 0
    written = json.loads(out.read_text())
    rows = written["rows"]
    assert [r["mode"] for r in rows] == modes
    # What changes the figures from outside the options is recorded (FASTDDP_NATIVE=0 would
    # have run the -native rows in Python).
    assert written["python"] and isinstance(written["environment"], dict)
    assert all(k.startswith("FASTDDP_") or k == "OMP_NUM_THREADS" for k in written["environment"])
    assert all(r["buckets"] == 6 and r["step_us"] > 0 for r in rows)
    floor = rows[0]
    assert floor["per_bucket_us"] == 0.0
    # 1 against itself; none where noise put it at or below plain DDP (2 rounds of 2 steps).
    assert rows[1]["vs_torch_fp16"] == (
        pytest.approx(1.0) if rows[1]["per_bucket_us"] > 0 else None
    )


def test_a_baseline_measured_at_no_cost_gives_no_ratios(capsys):
    # Noise over a short run can put the baseline at or below plain DDP: its ratios would be
    # of the wrong sign, so there are none, with a warning.
    assert hook_cost.baseline({"fp32": 1e-3, "torch-fp16": 1.2e-3}, 4) == pytest.approx(5e-5)
    assert hook_cost.baseline({"fp32": 1e-3, "torch-fp16": 0.9e-3}, 4) is None
    assert "torch-fp16 measured -25.0 us a bucket, no more than plain DDP" in (
        capsys.readouterr().err
    )
    assert hook_cost.baseline({"torch-fp16": 1e-3}, 4) is None
