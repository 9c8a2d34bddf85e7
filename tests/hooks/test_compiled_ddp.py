"""The hook under compiled DDP (``optimize_ddp="python_reducer"`` with compiled autograd), where
DDP passes ``(grad, param)`` instead of a bucket: refused with the same clear error on every
rank, instead of an AttributeError from deep inside a compiled graph or a hang."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp

from .._dist import run_ranks

pytestmark = pytest.mark.multiproc


def _compiled_autograd():
    try:
        from torch._dynamo import compiled_autograd
    except ImportError:
        return None
    return getattr(compiled_autograd, "_enable", None)


def _python_reducer(rank, world):
    import torch._dynamo

    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        _refused_under_python_reducer(rank)


def _refused_under_python_reducer(rank):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)))
    model.register_comm_hook(fastddp.CompressState(), fastddp.compress_hook)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    enabled = _compiled_autograd()(torch.compile(backend="eager"))
    with pytest.raises(Exception) as info, enabled:
        compiled(x).square().mean().backward()
    chain, error = [], info.value
    while error is not None:
        chain.append(str(error))
        error = error.__cause__ or error.__context__
    assert any("optimize_ddp = 'python_reducer'" in text for text in chain), chain[0][:2000]


@pytest.mark.skipif(_compiled_autograd() is None, reason="this torch has no compiled autograd")
def test_compiled_ddp_python_reducer_is_refused_on_every_rank():
    run_ranks(_python_reducer, 2, timeout=240)
