"""``stats()["nonfinite_events"]``: one event per reduction that met an inf or NaN, on the rank
whose encode met it.

Each case puts one NaN into rank 0's gradient of a one-bucket model, at the bucket's first or
last element, in the first and third of three steps, and reads every rank's counters. Summed
in fp32, the last element lies in the shard another rank sums: that rank counts the reduction
too, and rank 0 counts it once, although its payload and (for the first element) its shard's
sum both held the NaN.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.hooks.presets import preset
from tests._dist import run_ranks

N = 1000


class _Weights(nn.Module):
    # The gradient of ``p`` is the input itself: each case sets it element by element.
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(N))

    def forward(self, g):
        return (self.p * g).sum()


def _events(rank, world, cases, topology):
    out = []
    for mode, at in cases:
        model = DDP(_Weights())
        state = fastddp.CompressState(**preset(mode), topology=topology)
        fastddp.register_comm_hook(model, state)
        for step in range(3):  # the first reduction in Python, the third by the native runner
            g = torch.ones(N)
            if rank == 0 and step != 1:
                g[at] = float("nan")
            model.zero_grad()
            model(g).backward()
        dist.barrier()
        stats = state.stats()
        assert len(state._native.slots) == 1, "the bucket was not run natively"
        out.append((stats["calls"], stats["nonfinite_events"]))
    return out


CASES = [(mode, at) for mode in ("bf16", "bf16-acc", "int8-ef") for at in (0, N - 1)]


@pytest.mark.multiproc
def test_each_reduction_counts_once_on_the_ranks_that_met_it():
    results = run_ranks(_events, 2, CASES, "flat")
    for i, (mode, at) in enumerate(CASES):
        got = [r[i] for r in results]
        # Rank 0's payload held the NaN; summed in fp32, rank 1 sums the last element's shard.
        shard_of_rank1 = mode != "bf16" and at == N - 1
        want = [(3, 2), (3, 2 if shard_of_rank1 else 0)]
        assert got == want, f"{mode}, NaN at {at}: (calls, events) per rank {got}, want {want}"


@pytest.mark.multiproc
def test_two_levels_count_on_the_rank_that_reduces_the_node_shard():
    # Two nodes of two ranks: rank 0's payload goes unencoded, in fp32, to the rank that sums
    # its node shard (node shards of 512 elements: local rank 0 the first, 1 the last), which
    # encodes the sum. Summed in fp32 across nodes too, that node shard's second half (the
    # last element's) is summed and encoded again by rank 3, local rank 1 of the other node.
    results = run_ranks(_events, 4, CASES, "hierarchical", nodes=[0, 0, 1, 1])
    for i, (mode, at) in enumerate(CASES):
        got = [r[i][1] for r in results]
        met = {0} if at == 0 else {1} if mode == "bf16" else {1, 3}
        want = [2 * (r in met) for r in range(4)]
        assert got == want, f"{mode}, NaN at {at}: events per rank {got}, want {want}"
        assert all(r[i][0] == 3 for r in results)


def _sum_overflow(rank, world):
    # Shares of 50000 fit fp16; their sum, 100000, does not.
    out = {}
    for mode in ("fp16", "fp16-acc"):
        model = DDP(_Weights())
        state = fastddp.CompressState.from_preset(mode)
        fastddp.register_comm_hook(model, state)
        g = torch.ones(N)
        g[0] = 1e5
        model(g).backward()
        out[mode] = (model.module.p.grad[0].item(), state.stats()["nonfinite_events"])
    return out


@pytest.mark.multiproc
def test_a_sum_that_overflows_in_the_collective_counts_nowhere():
    # As hooks.md says: the inf reaches every rank's gradient; summed in 16 bits by the
    # collective no encode meets it, summed in fp32 the rank that sums its shard does.
    results = run_ranks(_sum_overflow, 2)
    assert [r["fp16"] for r in results] == [(float("inf"), 0)] * 2
    assert [r["fp16-acc"] for r in results] == [(float("inf"), 1), (float("inf"), 0)]


# (name, the state's arguments); with delay=1 the spike reaches .grad a step later, and the
# gradient reduced meanwhile carries its residual.
SPIKE_STATES = [
    ("bf16-acc-ef", {"dtype": "bf16-acc-ef"}),
    ("int8-ef", {"dtype": "int8-ef"}),
    ("int8-ef, delay=1", {"dtype": "int8-ef", "delay": 1}),
    ("auto", {"dtype": "auto", "allow": ["int8-ef"]}),
]


def _state(kwargs):
    kwargs = dict(kwargs)
    mode = kwargs.pop("dtype")
    if mode == "auto":
        return fastddp.CompressState(dtype="auto", **kwargs)
    return fastddp.CompressState.from_preset(mode, **kwargs)


def _after_a_skipped_spike(rank, world, discard):
    # A loss spike on rank 1: its gradient is huge (1e30) and holds an inf, so every rank's
    # reduced gradient holds the inf and the step is skipped, as GradScaler skips it. Error
    # feedback keeps what the spike's finite values dropped, unless the state drops it.
    out = {}
    for name, kwargs in SPIKE_STATES:
        torch.manual_seed(0)
        model = DDP(_Weights())
        state = _state(kwargs)
        if name == "int8-ef":
            fastddp.register_comm_hook(model, state)  # from the second step, in C++
        else:
            model.register_comm_hook(state, fastddp.compress_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        skipped = 0
        for step in range(7):
            g = torch.randn(N, generator=torch.Generator().manual_seed(10 * step + rank))
            if step == 2 and rank == 1:
                g = g * 1e30
                g[0] = float("inf")
            opt.zero_grad()
            model(g).backward()
            if torch.isfinite(model.module.p.grad).all():
                opt.step()
            else:
                skipped += 1
                if discard:
                    state.discard_feedback()
        state.flush()
        assert skipped == 1, (name, skipped)
        out[name] = model.module.p.detach().abs().max().item()
    return out


@pytest.mark.multiproc
def test_feedback_dropped_after_a_skipped_spike_keeps_training_bounded():
    # Steps of unit gradients move p by about 0.1 each: 6 steps stay well below 10. Kept, the
    # spike's dropped values (about 2^-9 or 1/254 of 1e30) reach p at the next step.
    kept = run_ranks(_after_a_skipped_spike, 2, False)
    dropped = run_ranks(_after_a_skipped_spike, 2, True)
    for name, _ in SPIKE_STATES:
        assert all(r[name] > 1e20 for r in kept), (name, kept)
        assert all(r[name] < 10 for r in dropped), (name, dropped)
