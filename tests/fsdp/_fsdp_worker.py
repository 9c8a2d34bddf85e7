"""One training run of a small decoder sharded by FSDP2, for the FSDP2 tests."""

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fastddp.fsdp
from fastddp.bench.models import Decoder


def train(
    rank: int,
    comm_dtype=None,
    *,
    steps: int = 3,
    reduce_dtype=None,
    divide_factor=None,
    force_sum=False,
    block_size=None,
    device="cpu",
    reference_comm=None,
):
    """Train a sharded small Decoder; return (first-step grads, final params, comm stats).

    Same seed for the model on every rank, each rank its own batch, same for every call. The
    stats (``None`` without a comm) are those after the first step and after the last.
    """
    torch.manual_seed(0)
    model = Decoder(vocab=61, width=32, heads=4, layers=2).to(device)
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    for module in (*model.blocks, model):  # these setters do not recurse
        if divide_factor is not None:
            module.set_gradient_divide_factor(divide_factor)
        if force_sum:
            module.set_force_sum_reduction_for_comms(True)
    comm = None
    if reference_comm is not None:
        for module in (*model.blocks, model):
            module.set_custom_reduce_scatter(reference_comm)
    if comm_dtype is not None:
        comm = fastddp.fsdp.compress_reduce_scatter(model, comm_dtype, block_size=block_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)
    first, stats = None, []
    for _ in range(steps):
        tokens = torch.randint(0, 61, (4, 17), generator=data).to(device)
        logits = model(tokens[:, :-1])
        loss = Decoder.loss(logits, tokens[:, 1:])
        loss.backward()
        if first is None:
            first = {n: p.grad.to_local().to("cpu", copy=True) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        if comm is not None:
            stats.append(comm.stats())
    params = {n: p.detach().to_local().to("cpu", copy=True) for n, p in model.named_parameters()}
    return first, params, (stats[0], stats[-1]) if stats else None
