"""fastddp.fsdp on CUDA tensors: called on a side stream (as FSDP2 calls it, on its
reduce-scatter stream) by two ranks on Gloo sharing the GPU, inside FSDP2 on the GPU, and on
NCCL with world size 1; hybrid sharding on four ranks as two nodes. Skipped without a GPU."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import fastddp.fsdp
from fastddp.bench.fsdp import AllToAllReduceScatter
from fastddp.fsdp import CompressedReduceScatter
from fastddp.fsdp._buffers import Buffers
from fastddp.hooks.topology import NODE_ENV

from .._dist import run_ranks
from . import _fsdp_worker, _hybrid_worker
from .test_fsdp import _TOL, _expected, _relative
from .test_hybrid import GRAD_TOL

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _on_side_stream(rank, world, group=None):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    side = torch.cuda.Stream(device)
    gen = torch.Generator().manual_seed(rank)
    for wire in (torch.bfloat16, torch.float16, torch.int8):
        comm = CompressedReduceScatter(wire, block_size=64 if wire == torch.int8 else None)
        for chunk in (1000, 1 << 16):
            for in_dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(world * chunk, generator=gen) * 3).to(in_dtype)
                inputs = [torch.empty_like(x) for _ in range(world)]
                dist.all_gather(inputs, x)  # on the CPU (Gloo), for the emulation
                want = _expected(inputs, rank, chunk, wire, in_dtype, 1.0 / world, 64)
                out = torch.empty(chunk, dtype=in_dtype, device=device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    # Written on the side stream right before the call: the comm must read it
                    # on that stream, and its result must be ready there.
                    src = x.to(device, non_blocking=True)
                    comm(out, src, group or dist.group.WORLD, ReduceOp.AVG)
                    got = out.cpu()
                assert torch.equal(got, want), (wire, chunk, in_dtype)


def test_gloo_with_cuda_tensors_on_a_side_stream():
    run_ranks(_on_side_stream, 2, timeout=240)


def test_each_stream_has_its_own_buffers():
    # FSDP2 all-gathers on its own stream in forward, on the current one for unshard().
    buffers, device = Buffers(), torch.device("cuda", 0)
    here = buffers.get("recv", 64, torch.int8, device)
    with torch.cuda.stream(torch.cuda.Stream(device)):
        there = buffers.get("recv", 64, torch.int8, device)
        assert buffers.get("recv", 32, torch.int8, device).data_ptr() == there.data_ptr()
    assert here.data_ptr() != there.data_ptr()
    assert buffers.get("recv", 64, torch.int8, device).data_ptr() == here.data_ptr()


def _fsdp_on_cuda(rank, world):
    torch.cuda.set_device(0)
    # The reference: an exact fp32 reduce-scatter through the same all-to-all.
    ref = _fsdp_worker.train(rank, device="cuda", reference_comm=AllToAllReduceScatter())
    for wire in (torch.bfloat16, torch.int8):
        grads, params, (first, last) = _fsdp_worker.train(rank, wire, device="cuda")
        assert _relative(grads, ref[0]) < _TOL[wire][0]
        assert _relative(params, ref[1]) < _TOL[wire][1]
        assert last["allocations"] == first["allocations"]


def test_fsdp2_on_cuda_tensors_over_gloo():
    run_ranks(_fsdp_on_cuda, 2, timeout=240)


def _nccl_world_one(rank, world):
    nccl = dist.new_group([0], backend="nccl")
    _on_side_stream(rank, 1, nccl)
    dist.destroy_process_group(nccl)


def test_nccl_world_size_one_on_a_side_stream():
    run_ranks(_nccl_world_one, 1, timeout=240)


def _hybrid_on_cuda(rank, world):
    torch.cuda.set_device(0)
    os.environ[NODE_ENV] = f"n{rank // 2}"
    mesh = fastddp.fsdp.node_mesh("cuda")
    model, opt, _ = _hybrid_worker.build(mesh, _hybrid_worker.NATIVE, device="cuda")
    ref, _ = _hybrid_worker.steps(model, opt, rank, 0, 3)
    for mode in ("bf16-acc", "int8-ef"):
        model, opt, comm = _hybrid_worker.build(mesh, mode, device="cuda")
        grads, _ = _hybrid_worker.steps(model, opt, rank, 0, 3)
        worst = _relative(grads, ref)
        assert 0 < worst < GRAD_TOL[mode], (mode, worst)
        assert _hybrid_worker.same_across_nodes(mesh, _hybrid_worker.params_of(model)), mode
        assert comm.stats()["calls"] == 9


def test_hybrid_on_cuda_tensors_over_gloo():
    run_ranks(_hybrid_on_cuda, 4, timeout=300)
