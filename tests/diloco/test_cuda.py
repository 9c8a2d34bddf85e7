"""DiLoCo on CUDA tensors, bit for bit against the same rounds on CPU tensors.

Two ranks on Gloo share the one GPU as two "nodes". Every step's gradient is set exactly
(``loss = sum(p * g)``) and the inner and outer steps subtract it whole (SGD with lr 1, no
momentum: ``p - g`` rounds the same on any device), so the only arithmetic that differs by
device is the codec's, whose CUDA kernels match the CPU ones bit for bit (tests/ops). What is
left to differ is ordering: with ``overlap=True`` a thread of its own averages a round's slice
on a stream of its own while the next steps train, and a missing wait would show as other bits.
The comparison runs here on the CPU too, CPU rounds against CPU rounds.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastddp

from .._dist import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = [(37, 5), (129,), (300,)]  # 614 elements: no multiple of a block


def _rounds(device: torch.device, overlap: bool, steps: int = 9) -> torch.Tensor:
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    params = nn.ParameterList(nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES)
    params = params.to(device)
    inner = torch.optim.SGD(params.parameters(), lr=1.0)
    diloco = fastddp.DiLoCo(
        params, sync_every=3, outer_lr=1.0, outer_momentum=0.0, compress="int8-ef",
        overlap=overlap,
    )  # fmt: skip
    for step in range(steps):
        grads = torch.Generator().manual_seed(1000 * rank + step)
        inner.zero_grad()
        loss = sum((p * torch.randn(p.shape, generator=grads).to(device)).sum() for p in params)
        loss.backward()
        inner.step()
        diloco.step()
    diloco.close()
    return torch.cat([p.detach().reshape(-1).cpu() for p in params])


def _cuda_against_cpu(rank, world, device, overlap):
    want = _rounds(torch.device("cpu"), overlap)
    got = _rounds(torch.device(device), overlap)
    return torch.equal(got, want), (got - want).abs().max().item()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_the_rounds_on_the_cpu_twice_are_the_same(overlap):
    for same, worst in run_ranks(_cuda_against_cpu, 2, "cpu", overlap, nodes=[0, 1]):
        assert same, worst


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_cuda_rounds_match_the_cpu_rounds_bit_for_bit(overlap):
    for same, worst in run_ranks(_cuda_against_cpu, 2, "cuda:0", overlap, nodes=[0, 1]):
        assert same, f"CUDA differs from CPU by up to {worst}"
