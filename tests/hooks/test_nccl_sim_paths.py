"""The other users of the codecs on the simulated NCCL (:mod:`fastddp.testing.nccl_sim`) equal
plain Gloo, as the hook does (``test_nccl_sim.py``): :func:`fastddp.all_reduce` in every codec's
path, 16-bit buckets passed through with and without ``delay``, and DiLoCo's rounds across two
nodes of two ranks, overlapped or not. Every output reads NaN until it is waited for, and no
tensor a side stream wrote may be freed first.
"""

import copy
import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.testing import nccl_sim, sim_streams

from .._dist import run_ranks

pytestmark = [pytest.mark.nccl_sim, pytest.mark.multiproc, pytest.mark.timeout(300)]


def _reduced(group, mode, rank):
    # Buckets of several tensors (copied back) and of one (reduced in place), three calls.
    state = fastddp.CompressState.from_preset(mode, group, topology="flat")
    gen = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(3):
        tensors = [torch.randn(n, generator=gen) for n in (300, 7, 1000, 64, 513)]
        fastddp.all_reduce(tensors, state=state, bucket_cap_mb=0.002)
        out += tensors
    return out


def _all_reduce_on_sim(rank, world):
    nccl_sim.install()
    sim = dist.new_group(backend=nccl_sim.BACKEND)
    sim_streams.early_frees()
    for mode in ("bf16", "bf16-acc", "int8-ef", "int4-ef"):
        want, got = _reduced(None, mode, rank), _reduced(sim, mode, rank)
        assert all(torch.isfinite(w).all() for w in want), mode
        assert all(torch.equal(a, b) for a, b in zip(got, want)), mode
    gc.collect()
    assert sim_streams.early_frees() == []


def test_all_reduce_on_nccl_s_order_equals_gloo():
    run_ranks(_all_reduce_on_sim, 2, timeout=240)


def _passed_through(base, group, delay, rank):
    model = DDP(copy.deepcopy(base), process_group=group, bucket_cap_mb=0.001)
    state = fastddp.CompressState(process_group=group, delay=delay)
    model.register_comm_hook(state, fastddp.compress_hook)
    gen = torch.Generator().manual_seed(rank)
    grads = []
    for _ in range(4):
        model.zero_grad()
        model(torch.randn(8, 24, generator=gen).bfloat16()).float().square().mean().backward()
        grads += [p.grad.clone() for p in model.parameters()]
    state.flush()
    return grads, state.stats()["passthrough_calls"]


def _sixteen_bit_buckets_on_sim(rank, world):
    nccl_sim.install()
    sim = dist.new_group(backend=nccl_sim.BACKEND)
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(24, 24) for _ in range(4)]).bfloat16()
    sim_streams.early_frees()
    for delay in (0, 1):
        want, _ = _passed_through(base, None, delay, rank)
        got, calls = _passed_through(base, sim, delay, rank)
        assert calls > 0, "no bucket was passed through"
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"delay={delay}"
        gc.collect()
        assert sim_streams.early_frees() == [], f"delay={delay}"


def test_sixteen_bit_buckets_passed_through_on_nccl_s_order_equal_gloo():
    run_ranks(_sixteen_bit_buckets_on_sim, 2, timeout=240)


def _diloco_rounds(group, node_group, overlap, rank):
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 3)), process_group=node_group
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = fastddp.DiLoCo(model, sync_every=2, compress="int8-ef", group=group, overlap=overlap)
    for step in range(8):
        x = torch.randn(16, 12, generator=torch.Generator().manual_seed(1000 * rank + step))
        opt.zero_grad()
        nn.functional.mse_loss(model(x), torch.sin(x[:, :3])).backward()
        opt.step()
        outer.step()
    outer.wait()
    outer.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _diloco_on_sim(rank, world):
    nccl_sim.install()
    sim = dist.new_group(backend=nccl_sim.BACKEND)
    node_group = fastddp.DiLoCo.node_group()
    sim_streams.early_frees()
    for overlap in (False, True):
        want = _diloco_rounds(None, node_group, overlap, rank)
        got = _diloco_rounds(sim, node_group, overlap, rank)
        assert torch.isfinite(want).all() and torch.equal(got, want), f"overlap={overlap}"
        gc.collect()
        assert sim_streams.early_frees() == [], f"overlap={overlap}"


def test_diloco_rounds_on_nccl_s_order_equal_gloo():
    run_ranks(_diloco_on_sim, 4, nodes=[0, 0, 1, 1], timeout=240)
