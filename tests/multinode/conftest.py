"""The run shared by the tests of 2 nodes x 2 ranks on a 1 Gbit/s link."""

import subprocess
import sys
from pathlib import Path

import pytest

from fastddp.testing import netns, slack

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def two_by_two(tmp_path_factory):
    """``_two_nodes_worker.py``'s run on 2 namespace nodes of 2 ranks at 1 Gbit/s: its output
    folder and its completed process (which has failed if its folder lacks a report)."""
    why = netns.unavailable_reason()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("two-by-two")
    cmd = [sys.executable, "-m", "fastddp.netns", "--nodes", "2", "--nproc-per-node", "2"]
    cmd += ["--rate", "1gbit", "--timeout", f"{slack.guard(240):.0f}"]
    cmd += ["tests/multinode/_two_nodes_worker.py", str(out)]
    try:  # (the guards stay below the limit of the first test, which counts this run)
        res = slack.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=slack.guard(280))
    except subprocess.TimeoutExpired as e:
        said = (e.output or "")[-3000:] + (e.stderr or "")[-3000:]
        pytest.fail(f"the run of 2 nodes x 2 ranks ran past {e.timeout:.0f} s:\n{said}")
    return out, res
