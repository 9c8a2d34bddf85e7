"""The hook on CUDA tensors: two ranks on Gloo sharing the one GPU, and NCCL with world size 1.

NCCL completes a future when the work is enqueued and orders the rest with CUDA events, so
these catch ordering bugs that Gloo on the CPU cannot. Skipped without a GPU.
"""

import os

import pytest
import torch
import torch.distributed as dist

import fastddp
from fastddp.hooks.presets import PRESETS, preset
from fastddp.hooks.topology import NODE_ENV

from .._dist import run_ranks
from .test_hook_core import _ddp, _grads, _Net

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Every preset, and int8 with error feedback and stochastic rounding (its random numbers).
MODES = {name: preset(name) for name in PRESETS}
MODES["int8-ef+sr"] = {**preset("int8-ef"), "stochastic_rounding": True}


def _cuda_against_plain_ddp(rank, world, settings, side_stream, group=None, nodes=None):
    if nodes is not None:
        os.environ[NODE_ENV] = f"node-{nodes[rank]}"
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    kwargs = dict(device_ids=[0], process_group=group)
    plain = _ddp(_Net(width=512, depth=6).to(device), **kwargs)
    hooked_a = _ddp(_Net(width=512, depth=6).to(device), **kwargs)
    hooked_b = _ddp(_Net(width=512, depth=6, seed=3).to(device), **kwargs)
    plain_b = _ddp(_Net(width=512, depth=6, seed=3).to(device), **kwargs)
    state = fastddp.CompressState(**settings, process_group=group)
    hooked_a.register_comm_hook(state, fastddp.compress_hook)  # two models, one state
    hooked_b.register_comm_hook(state, fastddp.compress_hook)
    gen = torch.Generator(device=device).manual_seed(rank)
    stream = torch.cuda.Stream(device) if side_stream else torch.cuda.current_stream(device)
    for _ in range(4):
        x = torch.randn(32, 512, generator=gen, device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for a, b in ((plain, plain_b), (hooked_a, hooked_b)):
                a.zero_grad()
                b.zero_grad()
                (a(x).square().mean() + b(x).abs().mean()).backward()
        torch.cuda.current_stream(device).wait_stream(stream)
        for p, h in ((plain, hooked_a), (plain_b, hooked_b)):
            want, got = _grads(p), _grads(h)
            err = (got - want).abs().max().item()
            assert err <= 2**-5 * want.abs().max().item(), f"deviation {err:.3e}"
    torch.cuda.synchronize()


@pytest.mark.parametrize("side_stream", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
def test_gloo_with_cuda_tensors_matches_plain_ddp(mode, side_stream):
    run_ranks(_cuda_against_plain_ddp, 2, MODES[mode], side_stream, timeout=240)


@pytest.mark.parametrize("mode", ["bf16", "bf16-acc-ef", "int8-ef+sr"])
def test_two_level_path_on_cuda_tensors(mode):
    # Two "nodes" of two ranks, all four on the one GPU, Gloo moving CUDA tensors.
    settings = {**MODES[mode], "topology": "hierarchical"}
    run_ranks(_cuda_against_plain_ddp, 4, settings, True, None, [0, 0, 1, 1], timeout=300)


def _nccl_world_one(rank, world, settings):
    nccl = dist.new_group([0], backend="nccl")
    _cuda_against_plain_ddp(rank, world, settings, False, nccl)
    # The two-level path on NCCL: a node of one rank, its groups made with NCCL.
    _cuda_against_plain_ddp(rank, world, {**settings, "topology": "hierarchical"}, True, nccl)
    x = torch.randn(1_000_003, device="cuda")
    y = x.clone()
    int8 = settings.get("dtype") == torch.int8
    fastddp.all_reduce(y, group=nccl, **({"dtype": torch.int8} if int8 else {}))
    step = x.abs().max() / 127 if int8 else x.abs().max() * 2**-8
    assert (y - x).abs().max() <= step
    dist.destroy_process_group(nccl)


@pytest.mark.parametrize("mode", list(MODES))
def test_nccl_world_size_one(mode):
    run_ranks(_nccl_world_one, 1, MODES[mode], timeout=240)
