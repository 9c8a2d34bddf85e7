"""Errors that need a GPU to happen: tensors on two devices, a local rank beyond the visible
GPUs (taken as a task's own GPU where it sees one), two ranks on one GPU, a refused shape.
Each must be a clear error, never a crash or a hang."""

import pytest
import torch

import fastddp
from fastddp import ops
from fastddp.cluster import ClusterError

from .._dist import run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_ops_refuse_tensors_on_two_devices():
    src = torch.randn(1000, device="cuda")
    with pytest.raises(RuntimeError, match="same device"):
        ops.compress(src, torch.empty(1000, dtype=torch.bfloat16), 1.0)
    with pytest.raises(RuntimeError, match="same device"):
        ops.decompress(torch.empty(1000, dtype=torch.bfloat16), src, 1.0)
    q = torch.empty(1000, dtype=torch.int8, device="cuda")
    with pytest.raises(RuntimeError, match="device"):
        ops.quantize_int8(src, q, torch.empty(8), 128)


def test_a_refused_shape_raises_on_cuda_tensors():
    # Codes of one flat row given to dequantize, which takes [chunks, m]: the check's error, as
    # on the CPU (on an H200 such a call in test_beyond_int32 once ended the process).
    codes = torch.zeros(1024, dtype=torch.int8, device="cuda")
    scales = torch.ones(8, device="cuda")
    with pytest.raises(RuntimeError, match=r"must have shape \[chunks, m\]"):
        ops.dequantize_int8(codes, scales, torch.empty(1024, device="cuda"), 128)
    packed = torch.zeros(512, dtype=torch.uint8, device="cuda")
    with pytest.raises(RuntimeError, match=r"must have shape \[chunks, bytes\]"):
        ops.dequantize_packed(packed, scales, torch.empty(1024, device="cuda"), 4, 128)


def test_a_local_rank_beyond_the_visible_gpus():
    count = torch.cuda.device_count()
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": str(max(count, 2))}
    env.update(LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    if count > 1:
        with pytest.raises(ClusterError, match=f"{count} GPU\\(s\\) are visible"):
            fastddp.init_distributed(backend="nccl", environ=env)
        return
    # One GPU seen: the task's own (srun --gpus-per-task=1), whatever its local rank.
    try:
        assert fastddp.init_distributed(backend="nccl", environ=env).device.index == 0
    finally:
        fastddp.shutdown_distributed()


def _same_gpu(rank, world):
    import torch.distributed as dist

    dist.destroy_process_group()  # the helper's Gloo group; this test makes its own
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29519")
    with pytest.raises(Exception) as info:
        fastddp.init_distributed(backend="nccl", environ=env)
    # Refused before NCCL's init (which would say "Duplicate GPU"), by the GPU's UUID.
    text = str(info.value)
    assert "(cuda:0 on " in text and "use the same GPU (" in text, text
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29521", rank=rank, world_size=2)


def test_two_ranks_on_one_gpu_fail_clearly_on_both():
    run_ranks(_same_gpu, 2, timeout=120)
