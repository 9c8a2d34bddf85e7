"""Topology-aware reduction on several ranks per node: discovery, the two-level path for every
codec against plain DDP, flat unchanged, uneven nodes, and error feedback that loses nothing.

Real processes on Gloo; "nodes" here are told apart by ``FASTDDP_NODE_ID`` (the override a
user sets where host name and network namespace do not tell nodes apart). The same checks over
real network namespaces and a rate-limited link are in ``test_topology_netns.py``.
"""

import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import fastddp
from fastddp.hooks.presets import preset
from fastddp.hooks.topology import NODE_ENV

from .._dist import run_ranks
from .test_hook_core import _collectives_per_bucket, _ddp, _Net

pytestmark = pytest.mark.multiproc

# The presets of each codec and summation, and how far each may be from plain DDP (relative
# to the largest gradient).
TOLERANCES = {"bf16": 2**-7, "fp16": 2**-10, "bf16-acc": 2**-7, "int8": 2**-5, "int4-ef": 2**-1}


def _on_node(node_of_rank, rank):
    os.environ[NODE_ENV] = f"node-{node_of_rank[rank]}"


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _train_pair(rank, settings, steps=3, depth=5):
    """Plain DDP and DDP with the hook, same data: the hooked model, its state, the gaps."""
    torch.manual_seed(0)
    base = _Net(depth=depth)
    ref, hooked = _ddp(copy.deepcopy(base)), _ddp(copy.deepcopy(base))
    state = fastddp.CompressState(**settings)
    hooked.register_comm_hook(state, fastddp.compress_hook)
    gen = torch.Generator().manual_seed(rank)
    gaps = []
    for _ in range(steps):
        x = torch.randn(8, 24, generator=gen)
        for m in (ref, hooked):
            m.zero_grad()
            m(x).square().mean().backward()
        gaps.append([(a - b, a) for a, b in zip(_grads(ref), _grads(hooked))])
    return hooked, state, gaps


def _parity(rank, world, node_of_rank, codec, topology, want_path):
    _on_node(node_of_rank, rank)
    tol = TOLERANCES[codec]
    model, state, gaps = _train_pair(rank, {**preset(codec), "topology": topology})
    for step in gaps:
        # int8 blocks span parameters: errors scale with the largest value around, so bound
        # them by the step's largest gradient.
        bound = tol * max(ref.abs().max().item() for _, ref in step)
        worst = max(gap.abs().max().item() for gap, _ in step)
        assert worst <= bound, f"off by {worst:.2e} (bound {bound:.2e})"
    stats = state.stats()
    nodes = sorted(sorted(r for r in range(world) if node_of_rank[r] == n) for n in {*node_of_rank})
    assert sorted(stats["nodes"]) == nodes
    assert stats["path"] == want_path
    assert {b["path"] for b in stats["buckets"].values()} == {want_path}
    assert len(stats["buckets"]) >= 3
    # Hierarchical: only 1/L of each bucket leaves the node, in the wire dtype.
    cross = stats["cross_node_bytes"]
    everyone = torch.tensor([cross, stats["fp32_ring_cross_node_bytes"]])
    dist.all_reduce(everyone)
    if want_path.startswith("hierarchical"):
        assert 0 < everyone[0] < everyone[1] / 2
    return model


@pytest.mark.parametrize("codec", list(TOLERANCES))
def test_two_nodes_of_two_ranks_match_plain_ddp(codec):
    inner = "allreduce" if codec in ("bf16", "fp16") else "alltoall"
    run_ranks(_parity, 4, [0, 0, 1, 1], codec, "auto", f"hierarchical-{inner}")


def test_nodes_are_found_whatever_the_rank_numbering():
    # Ranks 0 and 2 on one node, 1 and 3 on the other, as a round-robin launcher would do.
    run_ranks(_parity, 4, [0, 1, 0, 1], "int8", "hierarchical", "hierarchical-alltoall")


def _two_level_collectives(rank, world, codec, expected):
    _on_node([0, 0, 1, 1], rank)
    _collectives_per_bucket(rank, world, {**preset(codec), "topology": "hierarchical"}, expected)


@pytest.mark.parametrize(
    "codec, expected", [("bf16", 3), ("bf16-acc", 4), ("int8", 4), ("int4-ef", 4), ("int2-ef", 4)]
)
def test_two_level_collectives_per_bucket(codec, expected):
    # In the node: all-to-all, all-gather; across: the codec's one all-reduce or two.
    run_ranks(_two_level_collectives, 4, codec, expected)


def _flat_unchanged(rank, world, codec):
    # topology="flat" over two nodes gives bit for bit what one node gives.
    results = []
    for node_of_rank, topology in (([0, 0, 1, 1], "flat"), ([0, 0, 0, 0], "auto")):
        _on_node(node_of_rank, rank)
        model, state, _ = _train_pair(rank, {**preset(codec), "topology": topology})
        assert state.stats()["topology_used"] == "flat"
        results.append(_grads(model))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_flat_topology_is_unchanged(codec):
    run_ranks(_flat_unchanged, 4, codec)


def _uneven(rank, world):
    _on_node([0, 0, 1], rank)
    # "auto": flat, with a warning on every rank.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, state, _ = _train_pair(rank, {"topology": "auto"}, steps=1, depth=3)
    assert state.stats()["topology_used"] == "flat"
    assert any("different numbers of ranks" in str(w.message) for w in caught)
    # "hierarchical": the same error on every rank, before any payload moves.
    with pytest.raises(ValueError, match="needs the same number of ranks on every node") as info:
        _train_pair(rank, {"topology": "hierarchical"}, steps=1, depth=3)
    assert "node 0: ranks [0, 1], node 1: ranks [2]" in str(info.value)
    # auto's candidate that names the two-level path: refused on every rank at the first step,
    # by name, before its turn in the trial comes.
    auto = {"dtype": "auto", "allow": ["none", "bf16", "int8-ef:hierarchical"]}
    with pytest.raises(ValueError, match="cannot run its candidate 'int8-ef:hierarchical'") as info:
        _train_pair(rank, auto, steps=1, depth=3)
    assert "node 0: ranks [0, 1], node 1: ranks [2]. Leave 'int8-ef:hierarchical' out" in str(
        info.value
    )
    # Resumed with a plan (made on other nodes): refused alike where the plan uses it, and
    # the error says so; a plan that does not use it runs.
    for using, refused in (("int8-ef:hierarchical", True), ("bf16", False)):
        saved = fastddp.CompressState(**auto).state_dict()
        saved["plan"] = {"mode": using, "buckets": None, "planned_ms": 1.0}
        model = _ddp(_Net(depth=3))
        state = fastddp.CompressState(**auto)
        state.load_state_dict(saved)
        model.register_comm_hook(state, fastddp.compress_hook)
        try:
            model(torch.randn(8, 24)).square().mean().backward()
        except ValueError as e:
            assert refused, e
            assert "cannot run its candidate 'int8-ef:hierarchical'" in str(e), e
            assert "The plan loaded uses it: resume on the nodes the plan was made on" in str(e)
        else:
            assert not refused and state.stats()["mode"] == using
    # Ranks that disagree on the setting: refused on every rank too.
    topology = "flat" if rank == 0 else "auto"
    with pytest.raises(ValueError, match="ranks disagree") as info:
        _train_pair(rank, {"topology": topology}, steps=1, depth=3)
    assert "topology='flat'" in str(info.value) and "topology='auto'" in str(info.value)


def test_uneven_nodes_and_disagreeing_ranks_fail_alike_on_every_rank():
    run_ranks(_uneven, 3, timeout=120)


def _residual_total(state, keys):
    """Every residual this rank holds (live slots and parked), per parameter key, in fp64."""
    saved = state.state_dict()
    total = {k: torch.zeros(n, dtype=torch.float64) for k, n in keys.values()}

    def add(k, offset, values):
        total[k][offset : offset + values.numel()] += values.double()

    for bucket in saved["buckets"].values():
        start = 0
        lo = bucket["shard_offset"]
        shard = bucket["shard_residual"]
        for k, n in bucket["params"]:
            if bucket["residual"] is not None:
                add(k, 0, bucket["residual"][start : start + n])
            if shard is not None:
                a, b = max(start, lo), min(start + n, lo + shard.numel())
                if a < b:
                    add(k, a - start, shard[a - lo : b - lo])
            start += n
    carry = saved["carry"]
    for k, t in carry["stage1"].items():
        add(k, 0, t)
    for k, pieces in carry["stage2"].items():
        for offset, piece in pieces:
            add(k, offset, piece)
    return total


def _nothing_lost(rank, world, settings, topologies):
    # With error feedback, what the reductions dropped so far is exactly what the residuals
    # hold: sum of exact averages - sum of results = sum over ranks of every residual. Through a
    # bucket rebuild, and through a checkpoint loaded under another topology.
    _on_node([0, 0, 1, 1], rank)
    torch.manual_seed(0)
    module = _Net(depth=5)
    local = copy.deepcopy(module)

    def build(topology, saved=None):
        model = _ddp(module)
        state = fastddp.CompressState(**settings, topology=topology)
        if saved is not None:
            state.load_state_dict(saved)
        model.register_comm_hook(state, fastddp.compress_hook)
        return model, state

    model, state = build(topologies[0])
    params = list(module.parameters())
    exact = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    got = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    gen = torch.Generator().manual_seed(rank)
    for step in range(6):
        if step == 3:
            saved = state.state_dict()
            model, state = build(topologies[1], saved)
        x = torch.randn(8, 24, generator=gen)
        for m in (model, local):
            m.zero_grad()
            m(x).square().mean().backward()
        for e, g, p, q in zip(exact, got, params, local.parameters()):
            mine = q.grad.double()
            dist.all_reduce(mine)
            e += mine / world
            g += p.grad.double()
    used = {state.stats()["topology_used"]}
    keys = {p: (state._table.param_keys[p], p.numel()) for p in params}
    total = _residual_total(state, keys)
    for p, e, g in zip(params, exact, got):
        held = total[keys[p][0]].view(p.shape)
        dist.all_reduce(held)
        lost = (e - g - held).abs().max().item()
        assert lost <= 1e-5 * e.abs().max().item(), f"{lost:.3e} lost under {used}"


@pytest.mark.parametrize("mode", ["bf16-acc-ef", "int8-ef", "int4-ef", "int2-ef"])
@pytest.mark.parametrize(
    "topologies",
    [("hierarchical", "hierarchical"), ("hierarchical", "flat"), ("flat", "hierarchical")],
    ids=["hierarchical", "hierarchical-to-flat", "flat-to-hierarchical"],
)
def test_error_feedback_loses_nothing_across_layouts_and_topologies(mode, topologies):
    run_ranks(_nothing_lost, 4, preset(mode), topologies, timeout=150)


def _tiny_and_sums(rank, world):
    # Buckets smaller than a node shard leave some ranks nothing to reduce across nodes.
    _on_node([0, 0, 1, 1], rank)
    for codec, tol in TOLERANCES.items():
        for n in (1, 10, 17, 300, 4099):
            x = torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + n))
            everyone = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(everyone, x)
            want = torch.stack(everyone).double().sum(0)
            got = x.clone()
            state = fastddp.CompressState.from_preset(codec, topology="hierarchical")
            fastddp.all_reduce(got, op="sum", state=state)
            err = (got.double() - want).abs().max().item()
            assert err <= 4 * tol * want.abs().max().item(), (codec, n, err)


def test_tiny_buckets_and_sums_on_two_levels():
    run_ranks(_tiny_and_sums, 4)


def _reinit(rank, world):
    # A process that destroys its groups and starts again gets new two-level groups, not the
    # destroyed ones it made before.
    _on_node([0, 0, 1, 1], rank)
    for attempt in range(2):
        if attempt:
            dist.destroy_process_group()
            dist.init_process_group(
                "gloo", init_method="tcp://127.0.0.1:29547", rank=rank, world_size=world
            )
        x = torch.full((1000,), float(rank))
        fastddp.all_reduce(x, topology="hierarchical")
        torch.testing.assert_close(x, torch.full((1000,), 1.5))


def test_groups_are_made_again_after_the_process_group_is_destroyed():
    run_ranks(_reinit, 4)


def _groups_made_alike(rank, world, node_of_rank):
    # Every rank must make the same groups in the same order: with NCCL and a bound device,
    # new groups split the default communicator and a rank that skips one hangs the others.
    _on_node(node_of_rank, rank)
    made = []
    create = dist.new_group

    def record(ranks=None, *args, **kwargs):
        made.append((list(ranks), kwargs.get("use_local_synchronization", False)))
        return create(ranks, *args, **kwargs)

    dist.new_group = record
    try:
        _train_pair(rank, {"topology": "hierarchical"}, steps=1)
    finally:
        dist.new_group = create
    everyone = [None] * world
    dist.all_gather_object(everyone, made)
    assert made == [([0, 1], False), ([2, 3], False), ([0, 2], False), ([1, 3], False)], made
    assert all(other == made for other in everyone), everyone


def test_every_rank_makes_every_node_group_in_one_order():
    run_ranks(_groups_made_alike, 4, [0, 0, 1, 1])


def _groups_keep_the_timeout(rank, world):
    # Two groups over the same ranks, with different timeouts: each one's two-level groups
    # are made with its own, not shared with the other's.
    # (Timeouts no other test uses: the pooled processes keep their groups between tests.)
    from datetime import timedelta

    _on_node([0, 0, 1, 1], rank)
    made = []
    create = dist.new_group

    def record(ranks=None, *args, **kwargs):
        made.append((list(ranks), kwargs.get("timeout")))
        return create(ranks, *args, **kwargs)

    long, short = (create(list(range(world)), timeout=timedelta(seconds=s)) for s in (93, 47))
    dist.new_group = record
    try:
        for group in (long, short, short):
            fastddp.all_reduce(torch.ones(1000), group=group, topology="hierarchical")
    finally:
        dist.new_group = create
    layout = [[0, 1], [2, 3], [0, 2], [1, 3]]
    assert made == [(r, timedelta(seconds=s)) for s in (93, 47) for r in layout], made


def test_a_groups_two_level_groups_keep_its_timeout():
    run_ranks(_groups_keep_the_timeout, 4)


def test_a_collective_over_every_rank_has_one_level_on_every_rank():
    # Uneven nodes (3 + 1): the lone rank's node has one rank, but a collective over every
    # rank crosses both levels on every rank (auto's links figures add the ranks' levels up).
    from fastddp.hooks import links
    from fastddp.hooks.topology import Topology

    for hashes, want in (([7, 7, 7, 9], "flat"), ([7, 9, 5], "cross"), ([7, 7], "intra")):
        levels = {links.level_of("group", Topology(hashes, r)) for r in range(len(hashes))}
        assert levels == {want}, (hashes, levels)
