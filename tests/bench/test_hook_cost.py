"""``python -m fastddp.bench hook-cost``: the table and JSON of host time per bucket (run in this
process, its rank on the session's pooled one)."""

import json

import pytest

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
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == modes
    assert all(r["buckets"] == 6 and r["step_us"] > 0 for r in rows)
    floor = rows[0]
    assert floor["per_bucket_us"] == 0.0
    assert rows[1]["vs_torch_fp16"] == pytest.approx(1.0)
