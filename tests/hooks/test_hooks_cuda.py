"""The hook on CUDA tensors, bit for bit against the hook on CPU tensors, on the same inputs.

Two ranks on Gloo sharing the one GPU (and four, as two "nodes", for the two-level path), and
NCCL with world size 1 against Gloo with world size 1. NCCL completes a future when the work
is enqueued and orders the rest with CUDA events, so these catch ordering bugs that Gloo on the
CPU cannot.

Each parameter's gradient is set exactly to a given tensor (``loss = sum((p * g).sum())``, whose
gradient in ``p`` is ``g`` on any device), so that both paths hand the hook the same buckets
and the comparison can be exact: the CUDA kernels match the CPU ones bit for bit
(tests/ops), Gloo sums CUDA tensors on the host as it sums CPU ones, and stochastic rounding
draws the same stateless random bits. A comparison against plain DDP could only hold to each
codec's own error, which for int4 and int2 is most of a gradient. The comparison itself runs
here on the CPU, CPU path against CPU path, so that a fault in it shows without a GPU.
"""

import contextlib
import os
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fastddp
from fastddp.hooks.presets import PRESETS, preset
from fastddp.hooks.topology import NODE_ENV

from .._dist import run_ranks
from .test_hook_core import _ddp

pytestmark = pytest.mark.multiproc
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CPU = torch.device("cpu")

# Every preset, and int8 with error feedback and stochastic rounding (its random numbers).
MODES = {name: preset(name) for name in PRESETS}
MODES["int8-ef+sr"] = {**preset("int8-ef"), "stochastic_rounding": True}
# Parameter lengths: odd, unaligned, one past a power of two; several buckets under _ddp's caps.
SIZES = (1000, 4099, 31, 65537, 257, 3)
STEPS = 4  # DDP rebuilds its buckets after the first; residuals carry over the rest


class _Given(nn.Module):
    """Parameters whose gradients are exactly the tensors passed to ``forward``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.params = nn.ParameterList(nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES)

    def forward(self, grads):
        return sum((p * g).sum() for p, g in zip(self.params, grads))


def _local_grads(rank: int, step: int, model: int) -> list:
    """A rank's gradients for one step, mixed magnitudes like real ones, made on the CPU."""
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + model)
    return [torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen)) for n in SIZES]


def hooked_grads(rank, device, settings, side_stream=False, group=None) -> list:
    """Train two DDP models that share one CompressState on ``device`` for ``STEPS`` steps,
    both in one backward; return each model's reduced gradients after each step, flat, on the
    CPU (``[step0 model0, step0 model1, step1 model0, ...]``).

    On CUDA, ``side_stream`` runs the steps on a stream other than the current one.
    """
    kwargs = {"process_group": group}
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    models = [_ddp(_Given(seed=m).to(device), **kwargs) for m in range(2)]
    state = fastddp.CompressState(**settings, process_group=group)
    for model in models:
        model.register_comm_hook(state, fastddp.compress_hook)
    cuda = device.type == "cuda"
    current = torch.cuda.current_stream(device) if cuda else None
    stream = torch.cuda.Stream(device) if cuda and side_stream else current
    out = []
    for step in range(STEPS):
        grads = [[g.to(device) for g in _local_grads(rank, step, m)] for m in range(2)]
        if cuda:
            stream.wait_stream(current)
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for model in models:
                model.zero_grad()
            (models[0](grads[0]) + models[1](grads[1])).backward()
        if cuda:
            current.wait_stream(stream)
        for model in models:
            for p in model.parameters():
                assert p.grad.device == p.device and p.device.type == device.type
            out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu())
    if cuda:
        torch.cuda.synchronize(device)
    return out


def assert_same_bits(got: list, want: list, what: str = "") -> None:
    """Equal bit patterns, tensor by tensor (a NaN matches only the same NaN)."""
    assert len(got) == len(want), f"{what}: {len(got)} tensors, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what} [{i}]: {g.shape} {w.shape}"
        differ = g.view(torch.int32) != w.view(torch.int32)
        if differ.any():
            where = differ.nonzero()[0].item()
            err = (g.double() - w.double()).abs().max().item()
            raise AssertionError(
                f"{what} tensor {i}: {int(differ.sum())} of {g.numel()} elements differ, "
                f"the first at {where} ({g[where].item()!r} vs {w[where].item()!r}), "
                f"the largest by {err:.3e}"
            )


def assert_same_on_every_rank(tensors: list) -> None:
    """What an all-reduce leaves: the same gradients, bit for bit, on every rank (checked
    against rank 0's over the default group)."""
    for t in tensors:
        first = t.clone()
        dist.broadcast(first, 0)
        assert_same_bits([t], [first], f"rank {dist.get_rank()} against rank 0")


@contextlib.contextmanager
def _on_node(rank, nodes):
    """This rank's node name from ``nodes`` (none: the environment as it is), for the
    duration only: ranks may serve later calls."""
    before = os.environ.get(NODE_ENV)
    if nodes is not None:
        os.environ[NODE_ENV] = f"node-{nodes[rank]}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(NODE_ENV, None)
        else:
            os.environ[NODE_ENV] = before


def _cuda_against_cpu(rank, world, settings, side_stream, nodes=None):
    with _on_node(rank, nodes):
        _compare_cuda_with_cpu(rank, settings, side_stream)


def _compare_cuda_with_cpu(rank, settings, side_stream):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    want = hooked_grads(rank, CPU, settings)
    got = hooked_grads(rank, device, settings, side_stream)
    assert_same_bits(got, want, "CUDA tensors against CPU tensors")
    assert_same_on_every_rank(got)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("side_stream", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
def test_gloo_with_cuda_tensors_matches_the_cpu_path(mode, side_stream):
    run_ranks(_cuda_against_cpu, 2, MODES[mode], side_stream, timeout=240)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mode", ["bf16", "bf16-acc-ef", "int8-ef+sr", "int4-ef"])
def test_two_level_path_on_cuda_tensors_matches_the_cpu_path(mode):
    # Two "nodes" of two ranks, all four on the one GPU, Gloo moving CUDA tensors.
    settings = {**MODES[mode], "topology": "hierarchical"}
    run_ranks(_cuda_against_cpu, 4, settings, True, [0, 0, 1, 1], timeout=300)


def _nccl_world_one(rank, world, settings):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    nccl = dist.new_group([0], backend="nccl")
    # The same steps on NCCL with CUDA tensors and on Gloo (the default group) with CPU ones;
    # then the two-level path, a node of one rank, its groups made with NCCL.
    for extra, side_stream in (({}, False), ({"topology": "hierarchical"}, True)):
        want = hooked_grads(rank, CPU, {**settings, **extra})
        got = hooked_grads(rank, device, {**settings, **extra}, side_stream, nccl)
        assert_same_bits(got, want, f"NCCL against Gloo {extra}")
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(5))
    int8 = settings.get("dtype") == torch.int8
    kwargs = {"dtype": torch.int8} if int8 else {}
    on_cpu, on_cuda = x.clone(), x.to(device)
    fastddp.all_reduce(on_cpu, **kwargs)
    fastddp.all_reduce(on_cuda, group=nccl, **kwargs)
    assert_same_bits([on_cuda.cpu()], [on_cpu], "all_reduce on NCCL against Gloo")
    step = x.abs().max() / 127 if int8 else x.abs().max() * 2**-8
    assert (on_cpu - x).abs().max() <= step
    dist.destroy_process_group(nccl)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mode", list(MODES))
def test_nccl_world_size_one_matches_gloo_on_the_cpu(mode):
    run_ranks(_nccl_world_one, 1, MODES[mode], timeout=240)


# What runs without a GPU: the comparison itself, the CPU path against the CPU path.


def _cpu_against_cpu(rank, world, settings):
    first = hooked_grads(rank, CPU, settings)
    again = hooked_grads(rank, CPU, settings)
    assert_same_bits(again, first, "CPU against CPU")
    assert_same_on_every_rank(first)
    # The gradients were reduced: finite, and nearer the mean of the two ranks' gradients
    # than this rank's own (by a margin even for int2, whose error is most of a gradient).
    mine = [torch.cat(_local_grads(rank, s, m)) for s in range(STEPS) for m in range(2)]
    theirs = [torch.cat(_local_grads(1 - rank, s, m)) for s in range(STEPS) for m in range(2)]
    for got, a, b in zip(first, mine, theirs):
        assert torch.isfinite(got).all()
        assert (got - (a + b) / 2).norm() < 0.9 * (got - a).norm()


@pytest.mark.parametrize("mode", ["bf16", "int8-ef+sr", "int2-ef"])
def test_the_comparison_on_the_cpu(mode):
    run_ranks(_cpu_against_cpu, 2, MODES[mode], timeout=240)


def test_a_one_bit_difference_is_reported():
    a = torch.randn(100)
    b = a.clone()
    b.view(torch.int32)[37] ^= 1
    assert_same_bits([a], [a.clone()])
    with pytest.raises(AssertionError, match="tensor 0: 1 of 100 elements differ, the first at 37"):
        assert_same_bits([a], [b], "planted")
    with pytest.raises(AssertionError, match="2 tensors, expected 1"):
        assert_same_bits([a, a], [a])
    nan = torch.full((3,), float("nan"))
    assert_same_bits([nan], [nan.clone()])


@pytest.mark.cuda
@needs_cuda
def test_fastddp_streams_are_its_own_not_torchs_pool():
    from fastddp.hooks.runtime import CudaRuntime, own_stream

    device = torch.device("cuda", 0)
    side = CudaRuntime(device).side_stream()
    assert side is CudaRuntime(device).side_stream(), "one side stream a device and thread"
    other = []
    thread = threading.Thread(target=lambda: other.append(CudaRuntime(device).side_stream()))
    thread.start()
    thread.join()
    assert other[0].cuda_stream != side.cuda_stream, "another thread's stages, another stream"
    # The device's highest priority (torch's pools stop at their own highest, or above it).
    assert side.priority <= torch.cuda.Stream(device, priority=-99).priority < 0
    # Every stream of torch's pools (32 of each priority, handed out in turn) differs from it.
    pool = {torch.cuda.Stream(device, priority=p).cuda_stream for p in (0, -1) for _ in range(64)}
    diloco = own_stream(device, "diloco", high_priority=False)
    assert side.cuda_stream not in pool and diloco.cuda_stream not in pool
    assert diloco.cuda_stream != side.cuda_stream and diloco.device == device
    with torch.cuda.stream(side):
        x = torch.ones(1 << 20, device=device).mul_(3)
    torch.cuda.current_stream(device).wait_stream(side)
    assert x.sum().item() == 3 * (1 << 20)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CUDA machine builds the extension with CUDA"
)
def test_a_build_without_cuda_names_itself_when_asked_for_a_stream():
    from fastddp import _extension
    from fastddp.hooks.runtime import own_stream

    if _extension.build_info()["with_cuda"]:
        pytest.skip("this build has CUDA")
    with pytest.raises(RuntimeError, match="built without CUDA.*rebuild it where nvcc"):
        own_stream(torch.device("cuda", 0), "side", high_priority=True)
