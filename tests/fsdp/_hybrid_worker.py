"""Training runs of a small decoder under FSDP2 on a 2-D node mesh: native HSDP, or sharded
inside the node with :func:`fastddp.fsdp.hybrid` across nodes. For the hybrid tests."""

import re
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fastddp.fsdp
from fastddp.bench.models import Decoder

NATIVE = "native"  # FSDP2's own HSDP: fully_shard on the whole 2-D mesh


def build(
    mesh,
    mode: str,
    *,
    width=32,
    mp=None,
    divide_factor=None,
    force_sum=False,
    reduce_scatter=None,
    prefetch=False,
    device="cpu",
    replicate=None,
    **settings,
):
    """A small Decoder, sharded for ``mode``; returns (model, optimizer, hybrid comm or None)."""
    torch.manual_seed(0)
    model = Decoder(vocab=61, width=width, heads=4, layers=2).to(device)
    target = mesh if mode == NATIVE else mesh["shard"]
    policy = mp or MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=target, mp_policy=policy)
    fully_shard(model, mesh=target, mp_policy=policy)
    if prefetch:  # explicit prefetching: each block gathers the next (the previous in backward)
        blocks = list(model.blocks)
        for here, after in zip(blocks, blocks[1:]):
            here.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([here])
    for module in (*model.blocks, model):  # these setters do not recurse
        if divide_factor is not None:
            module.set_gradient_divide_factor(divide_factor)
        if force_sum:
            module.set_force_sum_reduction_for_comms(True)
    comm = None
    if mode != NATIVE:
        comm = fastddp.fsdp.hybrid(
            model,
            mesh["replicate"] if replicate is None else replicate,
            mode,
            reduce_scatter=reduce_scatter,
            **settings,
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, comm


def steps(model, opt, rank: int, first: int, count: int, *, accumulate=1, clip=None,
          sync="gradient"):  # fmt: skip
    """Train steps ``first .. first + count - 1`` (each rank its own batches, fixed per step);
    return the first step's sharded gradients and the losses. With ``accumulate``
    micro-batches, all but the last skip FSDP2's gradient sync (``sync="gradient"``), or only
    its all-reduce across nodes (``"all-reduce"``, HSDP's accumulation)."""
    grads, losses = None, []
    for step in range(first, first + count):
        for micro in range(accumulate):
            data = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
            tokens = torch.randint(0, 61, (4, 17), generator=data).to(model.head.weight.device)
            if accumulate > 1 and sync == "gradient":
                model.set_requires_gradient_sync(micro == accumulate - 1)
            elif accumulate > 1:
                model.set_requires_all_reduce(micro == accumulate - 1)
            loss = Decoder.loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if grads is None:
            grads = {n: p.grad.to_local().to("cpu", copy=True) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return grads, losses


def params_of(model) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().to_local().to("cpu", torch.float32, copy=True)
        for n, p in model.named_parameters()
    }


def same_across_nodes(mesh, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether every node holds these shards bit for bit (the replicate group compares)."""
    flat = torch.cat([t.flatten() for t in tensors.values()])
    group = mesh["replicate"].get_group()
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, flat, group=group)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def _checkpoint_state(model, opt, comm: Optional[object]) -> dict:
    """What a checkpoint holds: model, optimizer and, given one, the comm (a DCP Stateful)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    if comm is not None:
        state["fastddp"] = comm
    return state


def save(path: str, model, opt, comm: Optional[object]) -> None:
    dcp.save(_checkpoint_state(model, opt, comm), checkpoint_id=path)


def load(path: str, model, opt, comm: Optional[object]) -> None:
    state = _checkpoint_state(model, opt, comm)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def swapped_files_fail_every_rank(path: str, rank: int, build, where: str) -> None:
    """Each rank saves its comm's state to a file of its own, and rank 1 then loads rank 0's:
    the first step raises on every rank, naming rank 1, rather than on rank 1 alone while the
    others wait in a collective."""
    model, opt, comm = build()
    steps(model, opt, rank, 0, 1)
    torch.save(comm.state_dict(), f"{path}-rank{rank}.pt")
    dist.barrier()
    model, opt, comm = build()
    comm.load_state_dict(torch.load(f"{path}-rank{0 if rank == 1 else rank}.pt"))
    world = dist.get_world_size()
    told = "this is rank 1, and the state loaded here is rank 0's (rank0_of_"
    why = "ValueError: .*" + re.escape(told) if rank == 1 else "each of them raises"
    expected = re.escape(f"{where}: load_state_dict failed on rank(s) [1] of {world} (") + why
    with pytest.raises(ValueError, match=expected):
        steps(model, opt, rank, 1, 1)
