"""``examples/diloco_train.py`` runs under the launcher as documented, and learns."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastddp.testing import slack
from fastddp.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.multiproc, pytest.mark.launcher, pytest.mark.timeout(180)]


def test_the_example_learns_on_two_pretend_nodes():
    cmd = [sys.executable, "-m", "fastddp.launch", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "examples" / "diloco_train.py"), "--pretend-nodes", "2"]
    cmd += ["--steps", "40", "--sync-every", "10"]
    res = slack.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=slack.guard(150))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "int8-ef: 2 node(s) x 1 rank(s), 4 rounds" in out, out
    assert "weights identical on every rank: True" in out, out
    losses = [float(v) for v in re.findall(r"step +\d+ round \d+ loss (\S+)", out)]
    assert len(losses) == 5 and losses[-1] < losses[0] / 2, losses
    sent = int(re.search(r"rounds, (\d+) bytes across nodes", out).group(1))
    assert 0 < sent < 4 * 10504 * 4 * 0.3  # int8 and its scales: about a quarter of fp32


def test_pretend_nodes_that_do_not_divide_the_ranks_are_refused():
    cmd = [sys.executable, "-m", "fastddp.launch", "--standalone", "--nproc-per-node", "2"]
    cmd += [
        str(ROOT / "examples" / "diloco_train.py"),
        "--pretend-nodes",
        "3",
        "--steps",
        "2",
        "--sync-every",
        "2",
    ]
    res = slack.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=slack.guard(150))
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "--pretend-nodes 3 splits this machine's 2 rank(s) unevenly" in out, out


def test_pretend_nodes_on_a_job_of_several_nodes_are_refused():
    # Ranks of two nodes (hand-started, each its own FASTDDP_NODE_ID): pretend nodes cut
    # across them, so DDP would cross the slow link every step.
    port = free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "GROUP_RANK")}
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=str(port), FASTDDP_NODE_ID=f"n{rank}", OMP_NUM_THREADS="1")
        cmd = [sys.executable, str(ROOT / "examples" / "diloco_train.py"), "--pretend-nodes", "1"]
        procs.append(
            subprocess.Popen(
                [*cmd, "--steps", "2", "--sync-every", "2"],
                cwd=ROOT,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        )
    for proc in procs:
        out, _ = proc.communicate(timeout=slack.guard(120))
        assert proc.returncode != 0, out
        assert "this job already runs on 2 nodes (their groups would cross them)" in out, out
