"""DiLoCo under ``fastddp.launch --max-restarts``: a rank killed mid-round, the job restarted
from the last round's checkpoint, ends bit for bit where an uninterrupted job does."""

import sys
import types
from pathlib import Path

import pytest
import torch

from fastddp.testing import slack

from .._dist import run_ranks
from . import _restart_worker

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.launcher,
    pytest.mark.faults,
    pytest.mark.timeout(300),
]

WORKER = Path(__file__).with_name("_restart_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _job(run: Path, *extra: str) -> list[torch.Tensor]:
    run.mkdir()
    cmd = [sys.executable, "-m", "fastddp.launch", "--standalone", "--nproc-per-node", "4"]
    cmd += ["--max-restarts", "1", str(WORKER), "--dir", str(run), *extra]
    res = slack.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=slack.guard(240))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return torch.load(run / "params.pt")


def _clean_rank(rank: int, world_size: int, run: str) -> None:
    # As the launcher's 4 local ranks would have it, no rank killed.
    env = types.SimpleNamespace(rank=rank, local_rank=rank, local_world_size=world_size)
    _restart_worker.train(env, _restart_worker.args_of(["--dir", run]))


def test_a_rank_killed_mid_round_resumes_to_the_uninterrupted_result(tmp_path):
    # The uninterrupted job on pooled ranks (as tests/_references.py runs the others): the same
    # training without a launcher, whose job would cost 10 CPU s to start.
    clean = tmp_path / "clean"
    clean.mkdir()
    run_ranks(_clean_rank, 4, str(clean))
    want = torch.load(clean / "params.pt")
    # Step 13 is mid-round (rounds end at 4, 8, 12, 16, ...): the restart resumes from step 12.
    got = _job(tmp_path / "killed", "--kill", "13:3")
    attempts = (tmp_path / "killed" / "attempts").read_text().splitlines()
    assert attempts == ["attempt 0 from 0", "attempt 1 from 12"], attempts
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
