"""``fastddp.DiLoCo``'s outer rounds against what they must equal.

- ``sync_every=1``, ``outer_lr=1``, no momentum, fp32: averaging the models every step, to
  fp32 rounding (the outer step computes ``g - mean(g - x_i)``, which is ``mean(x_i)`` only
  in exact arithmetic: the differences, their sum and the step each round once);
- int8 with error feedback: what the rounds delivered plus what the residuals still owe is the
  exact average of the pseudo-gradients;
- 2 nodes x 2 ranks, each rank averaging its slice across nodes: every rank ends with the
  same parameters, bit for bit those of 2 nodes x 1 rank on the same data;
- ``overlap=True``: the one-round-delayed outer update, computed here by hand, bit for bit.
"""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.diloco import start
from fastddp.hooks.topology import NODE_ENV
from fastddp.testing import slack

from .._dist import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]


def net() -> nn.Module:
    torch.manual_seed(0)
    # 12*40 + 40 + 40*3 + 3 = 643 parameters: no multiple of a block, a rank or a node count
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 3))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def node_of_rank() -> int:
    return int(os.environ[NODE_ENV].rsplit("-", 1)[1])


def inner_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randn(16, 12, generator=gen)
    y = torch.sin(x[:, :3] * 2)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _h1_is_averaging(rank, world):
    model, ref = net(), net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)  # no momentum: no state to share
    diloco = fastddp.DiLoCo(model, sync_every=1, outer_lr=1.0, outer_momentum=0.0, compress=None)
    worst = 0.0
    for step in range(6):
        ref.load_state_dict(model.state_dict())  # both from the same point
        start = flat(model)
        inner_step(model, opt, rank, step)
        assert diloco.step() and diloco.round == step + 1
        inner_step(ref, ref_opt, rank, step)
        with torch.no_grad():
            for p in ref.parameters():
                dist.all_reduce(p)
                p.div_(world)
        got, want = flat(model), flat(ref)
        # In ulp of the larger of the operands (the start and the average)
        ulp = torch.finfo(torch.float32).eps * torch.maximum(start.abs(), want.abs())
        worst = max(worst, ((got - want).abs() / ulp.clamp_min(1e-30)).max().item())
    assert worst <= 2, f"{worst} ulp from the every-step average"
    assert not torch.equal(flat(model), flat(net()))
    return worst


def test_sync_every_step_with_plain_sgd_is_averaging_the_models():
    worst = run_ranks(_h1_is_averaging, 2, nodes=[0, 1])
    assert worst[0] == worst[1]


def _owed(saved: dict, lo: int, numel: int) -> torch.Tensor:
    """What one rank's codec residuals still owe the average, at their place in the model."""
    owed = torch.zeros(numel + 8192, dtype=torch.float64)
    for b in saved["buckets"].values():
        if b["residual"] is not None:
            owed[lo : lo + b["residual"].numel()] += b["residual"].double()
        if b["shard_residual"] is not None:
            at = lo + b["shard_offset"]
            owed[at : at + b["shard_residual"].numel()] += b["shard_residual"].double()
    return owed[:numel]


def _error_feedback(rank, world, rounds):
    model = DDP(net(), process_group=fastddp.DiLoCo.node_group())
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    diloco = fastddp.DiLoCo(model, sync_every=2, outer_lr=1.0, outer_momentum=0.0)
    start = flat(model).double()
    anchor, truth = start.clone(), torch.zeros_like(start)
    for step in range(2 * rounds):
        inner_step(model, opt, rank, step)
        if diloco.inner_steps % 2 == 1:
            # The exact average of the nodes' pseudo-gradients (each node's is on its ranks).
            everyone = [torch.empty_like(anchor) for _ in range(world)]
            dist.all_gather(everyone, anchor - flat(model).double())
            truth += torch.stack(everyone).mean(0)
        if diloco.step():
            anchor = flat(model).double()
    saved = diloco.state_dict()
    layout = saved["layout"]
    lo = layout["local_rank"] * layout["slice_numel"]
    owed = _owed(saved["compress"], lo, start.numel())
    everyone = [torch.empty_like(owed) for _ in range(world)]
    dist.all_gather(everyone, owed)
    delivered = start - flat(model).double()
    return delivered, truth, sum(everyone), diloco.stats()


def test_error_feedback_keeps_the_sum_of_the_pseudo_gradients():
    rounds = 4
    results = run_ranks(_error_feedback, 4, rounds, nodes=[0, 0, 1, 1])
    delivered, truth, owed, stats = results[0]
    for other in results[1:]:
        assert torch.equal(other[0], delivered)  # every rank holds the same parameters
    gap = (delivered + owed - truth).abs().max().item()
    assert gap < 2e-6, f"{gap:.2e} of the pseudo-gradients lost"
    assert owed.abs().max() > 100 * 2e-6  # int8 dropped far more than that: it was kept
    assert (delivered - truth).abs().max() > 100 * 2e-6
    assert stats["round"] == rounds and stats["inner_steps"] == 2 * rounds
    assert stats["nodes"] == 2 and stats["ranks_per_node"] == 2
    assert stats["compress"]["calls"] == rounds
    # One slice per rank: half the model, int8 (a quarter) plus scales, per round.
    assert 0 < stats["cross_node_bytes"] < rounds * stats["slice_numel"] * 4 * 0.3


def _slices(rank, world, per_node, overlap):
    node = node_of_rank()
    module = net()
    model = DDP(module, process_group=fastddp.DiLoCo.node_group()) if per_node > 1 else module
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    diloco = fastddp.DiLoCo(model, sync_every=3, compress="int8-ef", overlap=overlap)
    after = []
    for step in range(9):
        inner_step(model, opt, node, step)  # both ranks of a node on the node's data
        if diloco.step():
            after.append(flat(model))
    diloco.close()
    return after


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_two_ranks_per_node_share_the_slices_as_one_rank_per_node(overlap):
    four = run_ranks(_slices, 4, 2, overlap, nodes=[0, 0, 1, 1])
    two = run_ranks(_slices, 2, 1, overlap, nodes=[0, 1])
    assert len(two[0]) == 3
    for r in range(1, 4):
        for a, b in zip(four[r], four[0]):
            assert torch.equal(a, b), f"rank {r} differs from rank 0"
    for k, (a, b) in enumerate(zip(four[0], two[0])):
        assert torch.equal(a, b), f"round {k}: {(a - b).abs().max().item():.2e}"
    assert not torch.equal(two[0][-1], two[0][-2])


def _delayed(rank, world, lr, momentum):
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    with pytest.warns(UserWarning, match=r"one round late: measured, that diverged"):
        diloco = fastddp.DiLoCo(
            model, sync_every=2, outer_lr=lr, outer_momentum=momentum, compress=None, overlap=True
        )
    g, buf, pending = flat(model), None, None  # the hand-made outer state
    for step in range(10):
        inner_step(model, opt, rank, step)
        if diloco.inner_steps % 2 == 1:  # this step ends a round: the formula, by hand
            everyone = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(everyone, flat(model))
            average = (g - everyone[0]).add_(g - everyone[1]).div_(world)
            if pending is not None:  # round r applies round r - 1's average (SGD, Nesterov)
                buf = pending.clone() if buf is None else buf.mul_(momentum).add_(pending)
                g = g.add(pending.add(buf, alpha=momentum), alpha=-lr)
            pending = average
        if diloco.step():
            assert torch.equal(flat(model), g), f"round {diloco.round}"
    diloco.close()
    return flat(model)


def test_overlap_applies_each_round_one_round_late():
    a, b = run_ranks(_delayed, 2, 0.7, 0.9, nodes=[0, 1])
    assert torch.equal(a, b)


def _with_frozen() -> nn.Module:
    module = net()
    module.add_module("frozen", nn.Linear(3, 3).requires_grad_(False))  # (an adapter's base)
    module.register_buffer("steps", torch.tensor(0))
    module.register_buffer("mask", torch.arange(5) % 2 == 0)
    return module


def _states(module: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in module.state_dict().values()]


def _copy_between_nodes(rank, world):
    # Nodes that start from different weights all start from the first node's: the trained
    # parameters, and the frozen ones and buffers, which the outer step does not move.
    module = _with_frozen()
    if node_of_rank() == 1:
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1.0)
            module.frozen.bias.sub_(3.0)
            module.steps.fill_(7)
            module.mask.logical_not_()
    model = DDP(module, process_group=fastddp.DiLoCo.node_group())
    fastddp.DiLoCo(model, sync_every=4)
    return _states(module)


@pytest.mark.parametrize("nodes", [[0, 0, 1, 1], [0, 1, 1, 0]], ids=["grouped", "interleaved"])
def test_every_rank_starts_from_the_first_nodes_parameters(nodes):
    # Interleaved, the second half's cross-node group {1, 3} has its lowest rank on node 1.
    out = run_ranks(_copy_between_nodes, 4, nodes=nodes)
    want = _states(_with_frozen())
    assert all(len(o) == len(want) and all(map(torch.equal, o, want)) for o in out)


def test_fingerprints_tell_every_byte_and_its_place():
    a = torch.randn(1000)
    b = a.clone()
    b[17] = torch.nextafter(b[17], torch.tensor(2.0))  # one bit of one element
    swapped = a.clone()
    swapped[[3, 4]] = a[[4, 3]]
    # SHA-256 on the CPU; on a GPU two sums, whose arithmetic is checked here on the CPU.
    bytes_of = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    for fingerprint in (start._fingerprint, lambda t: start._sums(bytes_of(t))):
        prints = [fingerprint(t).tolist() for t in (a, a.clone(), b, swapped)]
        assert prints[0] == prints[1] and len({tuple(p) for p in prints[1:]}) == 3


def _trained_set_changes(rank, world, change, where):
    # A group with a short timeout: a rank left waiting in a collective fails in seconds.
    group = dist.new_group(timeout=timedelta(seconds=slack.guard(10)))
    model = net()
    model[0].weight.requires_grad_(change == "unfreeze")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    diloco = fastddp.DiLoCo(model, sync_every=2, compress=None, group=group)
    inner_step(model, opt, rank, 0)
    assert not diloco.step()  # no round yet: nothing checked, nothing sent
    if where in ("all", rank):
        model[0].weight.requires_grad_(change != "unfreeze")
    inner_step(model, opt, rank, 1)
    with pytest.raises(RuntimeError) as err:
        diloco.step()  # every rank raises, before its round sends anything
    return str(err.value)


TRAINED_SET_CHANGED = (
    "fastddp.DiLoCo.step: parameters were frozen or unfrozen since it was built, and the "
    "outer rounds average those that required a gradient then:\n"
    "  requires_grad of 0.weight changed ({})\n"
    "Freeze or unfreeze alike on every rank, then build the DDP model and DiLoCo again"
)


@pytest.mark.parametrize("change", ["unfreeze", "freeze"])
def test_a_parameter_frozen_or_unfrozen_after_construction_is_named(change):
    # Unfrozen, it would train on each node apart and never be averaged; frozen, the outer step
    # would still move it.
    said = run_ranks(_trained_set_changes, 2, change, "all", nodes=[0, 1], timeout=60)
    assert said == [TRAINED_SET_CHANGED.format("on every rank")] * 2, said


def test_a_parameter_frozen_on_one_rank_fails_on_every_rank():
    # Rank 0 has nothing to say itself; left to its round, it would wait for rank 1 in the
    # cross-node all-reduce until the group's timeout.
    said = run_ranks(_trained_set_changes, 2, "freeze", 1, nodes=[0, 1], timeout=60)
    assert said == [TRAINED_SET_CHANGED.format("rank 1")] * 2, said
