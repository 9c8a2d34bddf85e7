"""A trainer that keeps its DDP model alive past destroy_process_group() exits cleanly.

fastddp leaves no callback or reference for a Gloo thread to run at interpreter exit, so the
hook does not make torch 2.13's abort at exit more likely. A few runs per mode here;
``benchmarks/exit_check.py`` runs many (figures in benchmarks/RESULTS.md).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import exit_check  # noqa: E402


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["bf16", "bf16-fp32acc", "int8-ef"])
def test_trainer_that_keeps_its_model_exits_cleanly(mode):
    for i in range(2):
        code, stderr = exit_check.run_once(mode, 29811 + i + 10 * len(mode))
        assert not exit_check.unclean(code, stderr), stderr[-2000:]
        assert code == 0
