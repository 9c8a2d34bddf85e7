"""The pooled ranks the multi-rank tests run on (``_dist.run_ranks``): results and tracebacks
come back, each call starts clean, and a rank that dies or hangs fails only its own call."""

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastddp
from fastddp.hooks.slots import Slot
from fastddp.testing import slack
from fastddp.testing.pool import pid_running

from ._dist import RankError, pool, run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]


def _sum_and_pid(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item(), os.getpid()


def _leave_a_mess(rank, world):
    os.environ["FASTDDP_LEFT_BEHIND"] = "1"
    fastddp.hooks.hook._default_state = fastddp.CompressState()
    Slot.give_buffers = None
    Slot.planted = True
    torch.manual_seed(rank + 123)
    torch.set_default_dtype(torch.float64)
    return torch.rand(1).item()


def _clean(rank, world):
    assert "FASTDDP_LEFT_BEHIND" not in os.environ
    assert fastddp.hooks.hook._default_state is None
    assert callable(Slot.give_buffers) and not hasattr(Slot, "planted")
    assert torch.get_default_dtype() == torch.float32
    assert dist.get_world_size() == world
    return torch.rand(1).item()


def _raise_on_one(rank, world):
    if rank == 1:
        raise ValueError("planted on rank one")
    dist.barrier()  # the other rank waits for rank 1, which never comes


def _kill_rank_one(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _hang_on_one(rank, world):
    if rank == 1:
        time.sleep(3600)
    dist.barrier()


def _node(rank, world):
    return os.environ.get("FASTDDP_NODE_ID")


def test_results_come_back_in_rank_order_from_the_same_processes():
    first = run_ranks(_sum_and_pid, 2)
    second = run_ranks(_sum_and_pid, 2)
    assert [s for s, _ in first] == [3.0, 3.0]
    assert first == second  # the same two processes served both calls
    assert [pid for _, pid in first] == pool(2).pids


def test_each_call_starts_as_a_fresh_rank_would():
    fresh = run_ranks(_clean, 3)
    run_ranks(_leave_a_mess, 3)
    assert run_ranks(_clean, 3) == fresh  # and the same seed


def test_nodes_are_set_per_call():
    assert run_ranks(_node, 4, nodes=[0, 0, 1, 1]) == ["node-0", "node-0", "node-1", "node-1"]
    assert run_ranks(_node, 4) == [None] * 4


def test_a_raising_rank_fails_the_call_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError, match="(?s)_raise_on_one failed on rank 1.*planted on rank one"):
        run_ranks(_raise_on_one, 2)
    # Well below the groups' timeout (guard(60)), which alone would end the other rank's wait.
    assert time.monotonic() - start < slack.guard(20), "the other rank's wait was not cut short"
    assert [s for s, _ in run_ranks(_sum_and_pid, 2)] == [3.0, 3.0]


def test_a_killed_rank_fails_its_call_alone_and_is_replaced():
    before = run_ranks(_sum_and_pid, 2)
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 died \(exit code -9\)"):
        run_ranks(_kill_rank_one, 2)
    assert time.monotonic() - start < slack.guard(20)
    after = run_ranks(_sum_and_pid, 2)
    assert [s for s, _ in after] == [3.0, 3.0]
    assert not {pid for _, pid in before} & {pid for _, pid in after}, "the ranks were not replaced"


def test_a_rank_lost_between_calls_is_replaced_before_the_next():
    pid = run_ranks(_sum_and_pid, 2)[1][1]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + slack.guard(10)
    while pid_running(pid):  # a zombie, or reaped by the fork server
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = run_ranks(_sum_and_pid, 2)
    assert [s for s, _ in after] == [3.0, 3.0] and pid not in {p for _, p in after}


def test_a_hung_rank_fails_its_call_within_the_timeout():
    start = time.monotonic()
    limit = f"{slack.guard(3):.0f}"  # run_ranks scales its limit like every hang guard
    with pytest.raises(TimeoutError, match=rf"ranks \[0, 1\] of 2 did not finish within {limit} s"):
        run_ranks(_hang_on_one, 2, timeout=3)
    assert time.monotonic() - start < slack.guard(15)
    assert [s for s, _ in run_ranks(_sum_and_pid, 2)] == [3.0, 3.0]


def test_a_test_that_kills_its_rank_fails_and_the_next_one_passes(tmp_path):
    # Two tests in a session of their own, on one pool: the first kills a rank, the second runs.
    (tmp_path / "test_two.py").write_text(
        textwrap.dedent(
            """
            from tests._dist import run_ranks
            from tests.test_pool import _kill_rank_one, _sum_and_pid

            def test_kills():
                run_ranks(_kill_rank_one, 2)

            def test_after():
                assert [s for s, _ in run_ranks(_sum_and_pid, 2)] == [3.0, 3.0]
            """
        )
    )
    root = Path(__file__).resolve().parents[1]
    session = slack.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
         "-rf", "test_two.py"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(root)}, timeout=slack.guard(100),
    )  # fmt: skip
    out = session.stdout + session.stderr
    assert "1 failed, 1 passed" in out, out
    assert "_kill_rank_one failed on rank 1; rank 1 died (exit code -9)" in out, out
    assert "FAILED test_two.py::test_kills" in out, out
