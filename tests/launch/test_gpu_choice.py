"""Which GPU each rank takes, and two ranks on one GPU refused on every rank before init.

The ranks' join runs over a real c10d store, one thread per rank; the GPUs are named by the
UUIDs a driver would give (the CUDA side, ``gpu_identity``, runs in ``test_gpu_errors.py``).
"""

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from fastddp import joining
from fastddp.gpu_choice import cuda_index
from fastddp.testing import slack


@pytest.mark.parametrize(
    "local_rank,visible,index",
    [
        (0, 4, 0),
        (3, 4, 3),  # torchrun, srun --gpus-per-node: every rank sees the node's GPUs
        (0, 1, 0),
        (5, 1, 0),  # srun --gpus-per-task=1: each rank sees its own GPU as cuda:0
        (2, 2, None),  # three ranks, two GPUs
        (7, 4, None),
    ],
)
def test_a_rank_takes_its_local_rank_or_the_one_gpu_it_sees(local_rank, visible, index):
    got, problem = cuda_index(local_rank, visible)
    assert got == index
    if index is None:
        assert f"local rank {local_rank} needs cuda:{local_rank} but {visible} GPU(s)" in problem
        assert "at most one process per GPU" in problem
    else:
        assert problem is None


def _join_all(gpus: list, problems: dict = None) -> dict:
    """Every rank's ``agree`` over one store, each in a thread; return what each raised."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=slack.guard(30)))
    said: dict = {}

    def join(rank):
        try:
            problem = (problems or {}).get(rank)
            joining.agree(store, rank, len(gpus), "nccl", problem, gpu=gpus[rank])
            said[rank] = None
        except Exception as e:  # (the assertions below say which)
            said[rank] = e

    threads = [threading.Thread(target=join, args=(r,)) for r in range(len(gpus))]
    for rank, t in enumerate(threads):  # in rank order: each has posted its GPU when the next comes
        t.start()
        deadline = time.monotonic() + slack.guard(30)
        while store.add("fastddp/join/arrived", 0) <= rank:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    for t in threads:
        t.join(slack.guard(60))
    assert not any(t.is_alive() for t in threads)
    return said


def test_ranks_that_each_see_their_own_gpu_as_cuda0_all_start():
    # Two nodes of two tasks, srun --gpus-per-task=1: four cuda:0, four GPUs.
    gpus = [
        ("GPU-aa", "cuda:0 on n1"),
        ("GPU-bb", "cuda:0 on n1"),
        ("GPU-cc", "cuda:0 on n2"),
        ("GPU-dd", "cuda:0 on n2"),
    ]
    assert _join_all(gpus) == {0: None, 1: None, 2: None, 3: None}


@pytest.mark.parametrize("own_problem", [False, True])
def test_two_ranks_on_one_gpu_are_refused_on_every_rank(own_problem):
    # Ranks 2 and 3 on one GPU: as cuda:1 where rank 2 sees all of its node's GPUs, cuda:0
    # where rank 3 was given that one alone; every rank raises the same error naming both.
    gpus = [
        ("GPU-aa", "cuda:0 on n1"),
        ("GPU-bb", "cuda:1 on n1"),
        ("GPU-cc", "cuda:1 on n2"),
        ("GPU-cc", "cuda:0 on n2"),
    ]
    said = _join_all(gpus, {3: "a problem of its own"} if own_problem else {})
    texts = {str(e) for e in said.values()}
    assert len(texts) == 1 and all(e is not None for e in said.values()), said
    own = "a problem of its own; " if own_problem else ""
    assert (
        f"1 of 4 rank(s) cannot start (3); rank 3: {own}ranks 2 (cuda:1 on n2) and 3 (cuda:0 "
        "on n2) use the same GPU (GPU-cc); give each rank a GPU of its own" in texts.pop()
    ), said
