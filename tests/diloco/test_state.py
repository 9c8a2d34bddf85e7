"""``fastddp.DiLoCo``'s checkpoints and errors.

A job saved mid-round (model, inner optimizer and DiLoCo state dicts) and resumed in new objects
continues bit for bit; bad arguments, ranks that disagree and a model not wrapped in DDP over
its node raise the same ``ValueError`` on every rank, before any round.
"""

import io

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.diloco import checks

from .._dist import run_ranks
from .test_rounds import flat, inner_step, net

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

SETTINGS = {"sync_every": 2, "compress": "int8-ef", "outer_lr": 0.7, "outer_momentum": 0.9}


def _build(seed_shift, overlap, compress="int8-ef"):
    module = net()
    if seed_shift:  # a fresh job's weights, which the checkpoint must replace
        with torch.no_grad():
            for p in module.parameters():
                p.mul_(-0.5)
    model = DDP(module, process_group=fastddp.DiLoCo.node_group())
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    settings = {**SETTINGS, "compress": compress}
    return model, opt, fastddp.DiLoCo(model, overlap=overlap, **settings)


def _resume(rank, world, overlap, compress, cut):
    steps = 9  # rounds end at steps 2, 4, 6, 8: the cut (5, or 1 in the first round) is mid-round
    model, opt, diloco = _build(False, overlap, compress)
    for step in range(steps):
        inner_step(model, opt, rank, step)
        diloco.step()
    straight = flat(model)
    sent = diloco.stats()["cross_node_bytes"]
    diloco.close()

    model, opt, diloco = _build(False, overlap, compress)
    for step in range(cut):
        inner_step(model, opt, rank, step)
        diloco.step()
    buffer = io.BytesIO()
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "diloco": diloco.state_dict()}
    torch.save(saved, buffer)
    diloco.close()
    del model, opt, diloco

    buffer.seek(0)
    saved = torch.load(buffer)
    model, opt, diloco = _build(True, overlap, compress)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    diloco.load_state_dict(saved["diloco"])
    assert (diloco.round, diloco.inner_steps) == (cut // 2, cut)
    for step in range(cut, steps):
        inner_step(model, opt, rank, step)
        diloco.step()
    diloco.close()
    assert diloco.round == 4
    assert torch.equal(flat(model), straight), (flat(model) - straight).abs().max()
    assert diloco.stats()["cross_node_bytes"] == sent > 0  # the saved rounds' bytes counted
    if overlap:  # no average waits before the first round has ended
        assert (saved["diloco"]["pending"] is not None) == (cut > 2)
    if compress is not None and cut > 2:  # (none before the first round)
        assert saved["diloco"]["compress"]["buckets"][0]["residual"].abs().max() > 0


@pytest.mark.parametrize(
    "overlap, compress, cut",
    [(False, "int8-ef", 5), (True, "int8-ef", 5), (False, None, 5), (True, "int8-ef", 1)],
    ids=["sync", "overlap", "fp32", "overlap-first-round"],
)  # fmt: skip
def test_a_resume_mid_round_continues_bit_for_bit(overlap, compress, cut):
    run_ranks(_resume, 4, overlap, compress, cut, nodes=[0, 0, 1, 1])


def _refused(rank, world, cases):
    """Each case's error text on this rank (None where nothing was raised)."""
    seen = []
    for case in cases:
        module, kwargs = net(), dict(SETTINGS)
        if case == "bare module on a node of two":
            model = module
        elif case == "DDP over every rank":
            model = DDP(module)
        elif case == "compiled DDP over its node":
            model = torch.compile(DDP(module, process_group=fastddp.DiLoCo.node_group()))
        elif case == "a layer frozen on node 1":
            # Fewer parameters and elements there: the models' message, not the settings'
            # counts (parameters, numel) that differ with them.
            if rank >= 2:
                module[0].weight.requires_grad_(False)
            model = DDP(module, process_group=fastddp.DiLoCo.node_group())
        elif case == "layers in another order on node 1":
            # As many parameters and elements, laid out otherwise: slices of unrelated weights.
            if rank >= 2:
                module = torch.nn.Sequential(module[2], module[1], module[0])
            model = DDP(module, process_group=fastddp.DiLoCo.node_group())
        else:
            model = DDP(module, process_group=fastddp.DiLoCo.node_group())
            name, where, value = case
            if where in ("all", rank):
                kwargs[name] = value
        try:
            fastddp.DiLoCo(model, **kwargs)
            seen.append(None)
        except ValueError as e:
            seen.append(str(e))
    return seen


# (argument, on which rank, value), and what the error of every rank says
BAD = [
    (("sync_every", "all", 0), "sync_every must be an int >= 1 (inner steps per outer round), "
     "got 0 (on every rank)"),
    (("outer_lr", "all", 0.0), "outer_lr must be a positive, finite number"),
    (("outer_momentum", "all", 1.0), "outer_momentum must be in [0, 1)"),
    (("compress", "all", "int9"), "compress must be None (fp32 across nodes) or a preset name"),
    (("compress", "all", "auto"), "compress='auto' plans by DDP's step time"),
    (("compress", 3, ["int8-ef"]), "or a preset name, one of"),  # (unhashable: not a crash)
    (("outer_lr", 1, -1.0), "outer_lr must be a positive, finite number (0.7 is DiLoCo's), "
     "got -1.0 (rank 1)"),
    (("sync_every", 3, 5), "ranks disagree on sync_every"),
    (("compress", 0, "int4-ef"), "ranks disagree on compress"),
    (("outer_lr", "all", float("inf")), "outer_lr must be a positive, finite number"),
    (("nesterov", "all", "False"), "nesterov must be True or False, got 'False'"),
    (("overlap", 2, 1), "overlap must be True or False, got 1 (rank 2)"),
]  # fmt: skip


def test_bad_settings_fail_alike_on_every_rank():
    cases = [case for case, _ in BAD]
    out = run_ranks(_refused, 4, cases, nodes=[0, 0, 1, 1])
    for k, (_, expected) in enumerate(BAD):
        texts = {rank_seen[k] for rank_seen in out}
        assert len(texts) == 1, texts  # the same error on every rank
        text = texts.pop()
        assert text is not None and expected in text, (expected, text)
        assert text.startswith("fastddp.DiLoCo: ")
    assert "rank 0: compress='int4-ef'" in out[0][8] and "rank 1: compress='int8-ef'" in out[0][8]


def test_models_laid_out_otherwise_fail_alike_on_every_rank():
    out = run_ranks(_refused, 4, ["layers in another order on node 1"], nodes=[0, 0, 1, 1])
    assert len({o[0] for o in out}) == 1, out
    assert "the ranks' models differ" in out[0][0], out[0][0]
    assert "rank 2: module.0.weight [3, 40] float32, rank 0: module.0.weight [40, 12]" in out[0][0]
    out = run_ranks(_refused, 4, ["a layer frozen on node 1"], nodes=[0, 0, 1, 1])
    assert len({o[0] for o in out}) == 1 and "the ranks' models differ" in out[0][0], out
    assert "rank 2: module.0.weight [40, 12] float32 (no gradient), rank 0:" in out[0][0]


def test_numbers_of_other_types_are_taken():
    # numpy's integers and floats are numbers too (a config file's values often are).
    assert checks.local_problems(net(), np.int64(2), np.float32(0.7), 0.9, None) == []


def test_a_model_not_in_ddp_over_its_node_fails_alike_on_every_rank():
    out = run_ranks(_refused, 2, ["bare module on a node of two"], nodes=[0, 0])
    assert (
        out[0] == out[1] and "rank 0: a module without DDP, its node has ranks [0, 1]" in out[0][0]
    )
    assert "DDP(model, process_group=fastddp.DiLoCo.node_group())" in out[0][0]
    out = run_ranks(_refused, 2, ["DDP over every rank"], nodes=[0, 1])
    assert out[0] == out[1] and "rank 1: DDP over ranks [0, 1], its node has ranks [1]" in out[0][0]
    # torch.compile's wrapper is looked through: the DDP inside is over its node.
    assert run_ranks(_refused, 2, ["compiled DDP over its node"], nodes=[0, 0]) == [[None]] * 2


def _uneven(rank, world):
    try:
        fastddp.DiLoCo(net(), sync_every=2)
    except ValueError as e:
        return str(e)


def test_nodes_of_different_sizes_fail_alike_on_every_rank():
    out = run_ranks(_uneven, 4, nodes=[0, 0, 0, 1])
    assert len(set(out)) == 1 and "node 0: ranks [0, 1, 2], node 1: ranks [3]" in out[0]


def _mismatched_load(rank, world):
    model, opt, diloco = _build(False, False)
    saved = diloco.state_dict()
    other = fastddp.DiLoCo(model, sync_every=3, compress="int8-ef")
    with pytest.raises(ValueError, match="sync_every: saved 2, here 3"):
        other.load_state_dict(saved)
    saved["layout"]["ranks_per_node"] = 4
    with pytest.raises(ValueError, match="ranks_per_node: saved 4, here 2"):
        diloco.load_state_dict(saved)
    # Rank 0's state dict loaded on every rank fits rank 0 only: every rank raises, rank 0
    # too, naming the others (rank 0 going on alone would wait for them in its next round).
    first = [diloco.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(first, src=0)
    with pytest.raises(ValueError, match="does not fit") as info:
        diloco.load_state_dict(first[0])
    assert "local_rank: saved 0, here 1)" in str(info.value) and "(rank 1, 3)" in str(info.value)
    with pytest.raises(ValueError, match=r"version \d+ \(got 'NoneType'\) \(rank 2\)"):
        diloco.load_state_dict(None if rank == 2 else diloco.state_dict())
    # Each rank's own, but saved at another step on rank 2 (a checkpoint cut short there):
    # its rounds would pair with the others' other rounds.
    late = diloco.state_dict()
    late["round"] += rank == 2
    with pytest.raises(ValueError, match="saved at different steps") as info:
        diloco.load_state_dict(late)
    assert "rank 1: round 0, inner step 0\n  rank 2: round 1, inner step 0" in str(info.value)
    # Damaged on one rank only: found before anything loads, and raised on every rank.
    for damage, says in (
        (lambda d: d.update(outer={}), "its outer entry is not an optimizer's state_dict()"),
        (lambda d: d.pop("outer"), "it has no outer (damaged, or not what state_dict()"),
        (lambda d: d.update({"global": d["global"][1:]}), "its global slice is"),
        (lambda d: d["compress"].update(buckets=5), "its compress entry does not load"),
        # Of other types than the checks read (these raised on rank 3 alone, before the
        # exchange, and left the others waiting in it).
        (lambda d: d.update(settings=[1]), "its settings entry is a list, not a dict"),
        (lambda d: d.update({"global": d["global"].view(1, -1)}), "in one dimension"),
        (
            lambda d: d["outer"].update(state={0: {"momentum_buffer": np.zeros(3)}}),
            "its outer momentum is not a tensor",
        ),
        (lambda d: d["settings"].update(sync_every=torch.ones(2)), "could not be read"),
    ):
        mine = diloco.state_dict()
        if rank == 3:
            damage(mine)
        with pytest.raises(ValueError, match="does not fit") as info:
            diloco.load_state_dict(mine)
        assert says in str(info.value) and "(rank 3)" in str(info.value), str(info.value)
    # After a round (residuals to keep), nodes' files swapped between ranks 0 and 2: the same
    # local rank, but residuals of another rank of the cross-node group. Every rank raises at
    # the load, not ranks 0 and 2 alone at the next round while 1 and 3 wait for them.
    for step in range(2):
        inner_step(model, opt, rank, step)
        diloco.step()
    files = [None] * world
    dist.all_gather_object(files, diloco.state_dict())
    with pytest.raises(ValueError, match="does not fit") as info:
        diloco.load_state_dict(files[{0: 2, 2: 0}.get(rank, rank)])
    assert "saved by rank 1 of the 2 ranks of its cross-node group" in str(info.value)
    assert "(rank 0)" in str(info.value) and "(rank 2)" in str(info.value), str(info.value)
    diloco.load_state_dict(diloco.state_dict())  # and the group still works


def test_a_state_dict_of_other_settings_or_layout_is_refused():
    run_ranks(_mismatched_load, 4, nodes=[0, 0, 1, 1])


def test_a_group_that_is_none_and_a_meta_model_are_refused_by_name():
    # Before any collective, as every rank passes the same (the group's exchange needs it).
    with pytest.raises(TypeError, match="DiLoCo: group must be a ProcessGroup or None, got 'x'"):
        fastddp.DiLoCo(torch.nn.Linear(2, 2), sync_every=2, group="x")
    # (accepted, its outer step did nothing and state_dict() failed)
    meta = torch.nn.Linear(2, 2, device="meta")
    found = checks.local_problems(meta, 2, 0.7, 0.9, "int8-ef")
    assert found == [
        "the parameters are on the meta device: materialise them (to_empty, then initialise) "
        "before DiLoCo"
    ], found
