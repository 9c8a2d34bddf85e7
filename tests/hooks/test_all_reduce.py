"""fastddp.all_reduce outside DDP: real processes, Gloo."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp

from .._dist import run_ranks

pytestmark = pytest.mark.multiproc


def _tensors(rank, loud=1e3):
    g = torch.Generator().manual_seed(rank)
    big = torch.randn(300, 7, generator=g)
    return [
        torch.randn(1001, generator=g),
        big.t(),  # not contiguous: goes through a packed bucket
        torch.randn(3, 5, generator=g) * loud,
        torch.empty(0),
        torch.randn(50_000, generator=g),
    ]


def _exact(parts, world, dtype, average):
    """Each rank's share rounded to dtype, summed in fp32 in rank order, rounded once."""
    scale = 1.0 / world if average else 1.0
    acc = (parts[0] * scale).to(dtype).float()
    for p in parts[1:]:
        acc = acc + (p * scale).to(dtype).float()
    return acc.to(dtype).float()


def _matches_reference(rank, world):
    for dtype in (torch.bfloat16, torch.float16):
        for op in ("avg", "sum"):
            tensors = _tensors(rank)
            gathered = []
            for t in tensors:
                parts = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(parts, t.contiguous())
                gathered.append(parts)
            fastddp.all_reduce(tensors, dtype=dtype, op=op, bucket_cap_mb=0.05)
            for t, parts in zip(tensors, gathered):
                want = _exact(parts, world, dtype, op == "avg")
                assert torch.equal(t, want.view_as(t)), (dtype, op, t.shape)
    # int8: a sum within half a block step of each rank's share, twice. (Blocks span tensor
    # boundaries, so a loud tensor would set the step of its quieter neighbours: keep them alike.)
    tensors = _tensors(rank, loud=1.0)
    want = []
    for t in tensors:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        want.append(torch.stack(parts).double().sum(0))
    # int4 likewise, with a step of absmax / 7.
    for dtype, tol in ((torch.int8, 2**-5), (torch.int4, 2**-1)):
        got = [t.clone() for t in tensors]
        fastddp.all_reduce(got, dtype=dtype, op="sum")
        for t, w in zip(got, want):
            if t.numel():
                err = (t.double() - w).abs().max() / w.abs().max()
                assert err < tol, (dtype, err.item())
    # An inf on one rank: as it is through a 16-bit wire dtype; NaN over its whole block, and
    # only there, through a block-scaled code (as the docstring says).
    for dtype in (torch.bfloat16, torch.int8):
        t = torch.ones(512)
        t[5] = float("inf") if rank == 0 else 1.0
        fastddp.all_reduce(t, dtype=dtype, op="sum")
        rest = torch.cat([t[:5], t[6:]]) if dtype == torch.bfloat16 else t[128:]
        assert torch.allclose(rest, torch.full_like(rest, world), rtol=2**-7), dtype
        if dtype == torch.bfloat16:
            assert t[5] == float("inf")
        else:
            assert t[:128].isnan().all()
    # One tensor, no fp32 accumulation: the plain 16-bit all-reduce path, in place.
    t = torch.full((17,), float(rank + 1))
    ptr = t.data_ptr()
    fastddp.all_reduce(t, accumulate_dtype=None)
    assert t.data_ptr() == ptr and torch.equal(t, torch.full((17,), (world + 1) / 2))


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_matches_reference(world):
    run_ranks(_matches_reference, world)


def _with_state(rank, world):
    state = fastddp.CompressState(dtype=torch.int8, error_feedback=True)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4096, generator=g)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    mean = torch.stack(parts).mean(0)
    # Error feedback: averaging the same tensor over many calls converges on the exact mean,
    # because what each call drops is added to the next.
    total = torch.zeros_like(x)
    calls = 50
    for _ in range(calls):
        y = x.clone()
        fastddp.all_reduce(y, state=state)
        total += y
    err_ef = ((total / calls - mean).abs().max() / mean.abs().max()).item()
    y = x.clone()
    fastddp.all_reduce(y, dtype=torch.int8)
    err_once = ((y - mean).abs().max() / mean.abs().max()).item()
    assert err_ef < err_once / 5, (err_ef, err_once)
    assert state.stats()["calls"] == calls
    # The state's residuals belong to x: other tensors are refused before any collective,
    # alike on every rank, and the state still serves x.
    two = [x.clone(), x.clone()]
    for other, said in (
        (two, "and this call 2 of 8192"),
        (x[:4095].clone(), "and this call 1 of 4095"),
    ):
        with pytest.raises(ValueError, match="first given 1 tensor\\(s\\) of 4096 elements") as e:
            fastddp.all_reduce(other, state=state)
        assert said in str(e.value) and "a CompressState of its own" in str(e.value)
    with pytest.raises(ValueError, match="as many, but of other sizes"):
        fastddp.all_reduce(torch.ones(4097), state=state)
    with pytest.raises(ValueError, match="tensors\\[0\\] is None, a parameter without a grad"):
        fastddp.all_reduce([None], state=state)
    # Its residuals are shares of an average: a sum would repay a world-th of what it owes.
    with pytest.raises(ValueError, match="first called with op='avg', and this call has op='sum'"):
        fastddp.all_reduce(x.clone(), op="sum", state=state)
    with pytest.raises(ValueError, match="first called with bucket_cap_mb=25, and this call has 1"):
        fastddp.all_reduce(x.clone(), state=state, bucket_cap_mb=1)
    fastddp.all_reduce(x.clone(), state=state)
    assert state.stats()["calls"] == calls + 1
    # Loaded, the state keeps the op its residuals were saved in: refused at the first call
    # (on every rank, in its handshake), and the same call with the saved op goes through.
    loaded = fastddp.CompressState(dtype=torch.int8, error_feedback=True)
    loaded.load_state_dict(state.state_dict())
    with pytest.raises(ValueError, match="first called with op='avg', and this call has op='sum'"):
        fastddp.all_reduce(x.clone(), op="sum", state=loaded)
    y, z = x.clone(), x.clone()
    fastddp.all_reduce(y, state=loaded)
    fastddp.all_reduce(z, state=state)
    assert torch.equal(y, z)  # the same residuals, repaid alike
    # A state's first call under inference_mode (an evaluation's metrics): its buffers are
    # made outside it, so later calls outside it still write them; inference tensors are
    # written in place all the same.
    metrics = fastddp.CompressState(dtype=torch.int8, error_feedback=True)
    with torch.inference_mode():
        m = x.clone()
        fastddp.all_reduce(m, state=metrics)
    assert m.is_inference() and not torch.equal(m, x)
    fastddp.all_reduce(x.clone(), state=metrics)
    with torch.inference_mode():
        fastddp.all_reduce(m, state=metrics)
    assert metrics.stats()["calls"] == 3
    # Stochastic rounding without a state draws new numbers each call: the mean of many calls
    # comes closer to the exact mean than one call (with the same numbers, it would not).
    total = torch.zeros_like(x)
    for i in range(calls):
        y = x.clone()
        fastddp.all_reduce(y, stochastic_rounding=True)
        total += y
        if i == 0:
            first = y
    assert not torch.equal(first, y)
    err_sr = ((total / calls - mean).abs().max() / mean.abs().max()).item()
    err_once = ((first - mean).abs().max() / mean.abs().max()).item()
    assert err_sr < err_once / 3, (err_sr, err_once)


def test_all_reduce_with_error_feedback_state():
    run_ranks(_with_state, 2)


def _float64_default(rank, world):
    # A script that set torch's default dtype to fp64 reduces its fp32 tensors as any other:
    # the buffers and residuals fastddp makes are fp32 whatever the default.
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1001, generator=g)
    cases = [
        dict(dtype=torch.int4, topology="hierarchical"),
        dict(dtype=torch.bfloat16, topology="hierarchical"),
        dict(state=lambda: fastddp.CompressState.from_preset("int8-ef", topology="flat")),
        dict(state=lambda: fastddp.CompressState.from_preset("int8-ef", topology="hierarchical")),
    ]
    for case in cases:
        got = []
        for default in (torch.float32, torch.float64):
            kwargs = {k: v() if callable(v) else v for k, v in case.items()}
            y = x.clone()
            before = torch.get_default_dtype()
            torch.set_default_dtype(default)
            try:
                fastddp.all_reduce(y, **kwargs)
                fastddp.all_reduce(y, **kwargs)  # (the residuals of the first call used)
            finally:
                torch.set_default_dtype(before)
            got.append(y)
        assert got[1].dtype == torch.float32 and torch.equal(got[0], got[1]), case


def test_all_reduce_under_a_float64_default_dtype():
    run_ranks(_float64_default, 2)


def _numpy_numbers(rank, world):
    # numpy's numbers (from a config or an array) are numbers; numpy's bool is not.
    import numpy as np

    x = torch.full((1000,), float(rank + 1))
    y = x.clone()
    fastddp.all_reduce(y, dtype=torch.int8, block_size=np.int64(64), bucket_cap_mb=np.float32(1))
    fastddp.all_reduce(x, dtype=torch.int8, block_size=64, bucket_cap_mb=1.0)
    assert torch.equal(x, y)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number of MiB"):
        fastddp.all_reduce(x, bucket_cap_mb=np.bool_(True))
    with pytest.raises(TypeError, match="block_size must be an int, got "):
        fastddp.all_reduce(x, dtype=torch.int8, block_size=np.bool_(True))


def test_all_reduce_takes_numpy_numbers():
    run_ranks(_numpy_numbers, 2)


def _bad_input(rank, world):
    cases = [
        (lambda: fastddp.all_reduce(torch.ones(3), op="max"), 'op must be "avg" or "sum"'),
        (
            lambda: fastddp.all_reduce([torch.ones(3), torch.ones(2, dtype=torch.float64)]),
            "rank 1: tensors[1] is not float32; it compresses float32 tensors",
        ),
        (lambda: fastddp.all_reduce([torch.ones(3), "x"]), "rank 0: tensors[1] is not a Tensor"),
        (
            lambda: fastddp.all_reduce(
                torch.ones(3), dtype=torch.int8, state=fastddp.CompressState()
            ),
            "pass either state= or the settings (dtype), not both",
        ),
        (lambda: fastddp.all_reduce(torch.ones(3), state=3), "state must be a fastddp."),
        (lambda: fastddp.all_reduce(torch.ones(3), bucket_cap_mb=0), "bucket_cap_mb must be"),
        (
            # (bool("no") is True: it was taken as stochastic rounding on)
            lambda: fastddp.all_reduce(torch.ones(3), stochastic_rounding="no"),
            "fastddp.all_reduce: stochastic_rounding must be True or False",
        ),
        (
            lambda: fastddp.all_reduce(torch.ones(3), bucket_cap_mb=float("inf")),
            "bucket_cap_mb must be a positive number of MiB, at most 1.07374e+09 (a bucket's "
            "elements are counted in int64), got inf",
        ),
        (
            lambda: fastddp.all_reduce(
                torch.ones(3), accumulate_dtype=None, state=fastddp.CompressState()
            ),
            "pass either state= or the settings (accumulate_dtype), not both",
        ),
        (
            lambda: fastddp.all_reduce(torch.ones(3), dtype=torch.float64),
            "fastddp.all_reduce: dtype must be torch.float16, torch.bfloat16, torch.int8, "
            "torch.int4 or torch.int2",
        ),
        (
            lambda: fastddp.all_reduce(torch.ones(3), dtype=torch.float32),
            "dtype=torch.float32 would send the tensors uncompressed; use "
            "torch.distributed.all_reduce",
        ),
        (
            # The rank that passed them names the dtype, which the handshake does not carry.
            lambda: fastddp.all_reduce([torch.ones(3), torch.ones(2, dtype=torch.float64)]),
            "\nHere: tensors[1] is torch.float64; it compresses float32 tensors",
        ),
        (
            lambda: fastddp.all_reduce(torch.ones(3), dtype="auto"),
            "dtype='auto' plans by DDP's step time, which all_reduce has not got",
        ),
        (
            lambda: fastddp.all_reduce(torch.ones(3), dtype="int8-ef"),
            "'int8-ef' is a preset: state=CompressState.from_preset('int8-ef')",
        ),
        (
            lambda: fastddp.all_reduce(torch.ones(3), dtype=torch.int2),
            "pass state=CompressState.from_preset('int2-ef') and the same tensors every call",
        ),
    ]
    group = dist.new_group([0, 1])
    # Tensors that differ between ranks: the first call's handshake says so on every rank.
    sizes = [[3, 4], [4, 3]][rank]
    grads = [torch.ones(3), None if rank == 1 else torch.ones(2)]  # unused on rank 1
    cases += [
        (
            lambda: fastddp.all_reduce(grads),
            "some ranks passed tensors it cannot reduce:\n  rank 1: tensors[1] is None, a "
            "parameter without a gradient on this rank?",
        ),
        (
            # An unused parameter's .grad, passed alone: named as in a list.
            lambda: fastddp.all_reduce(torch.ones(3) if rank == 0 else None),
            "some ranks passed tensors it cannot reduce:\n  rank 1: tensors[0] is None, a "
            "parameter without a gradient on this rank?",
        ),
        (
            # As many elements, laid out otherwise: they would be added by flat index.
            lambda: fastddp.all_reduce(torch.ones((2, 3) if rank == 0 else (3, 2))),
            "rank 0: 1 tensor(s), 6 elements\n  rank 1: 1 tensor(s), 6 elements\n(as many, "
            "but of other shapes)",
        ),
        (
            lambda: fastddp.all_reduce(torch.ones(3), dtype=(torch.bfloat16, torch.float16)[rank]),
            "Give every rank the same settings: CompressState's arguments, or "
            "fastddp.all_reduce's dtype,",
        ),
        (
            lambda: fastddp.all_reduce([torch.ones(3)] if rank == 0 else []),
            "rank 0: 1 tensor(s), 3 elements\n  rank 1: 0 tensor(s), 0 elements",
        ),
        (
            lambda: fastddp.all_reduce(torch.ones(3 + rank)),
            "ranks passed different tensors, so their buckets cannot be combined:\n"
            "  rank 0: 1 tensor(s), 3 elements\n  rank 1: 1 tensor(s), 4 elements",
        ),
        (
            lambda: fastddp.all_reduce([torch.ones(n) for n in sizes], dtype=torch.int8),
            "(as many, but of other shapes)",
        ),
        (
            lambda: fastddp.all_reduce([torch.ones(3)] * (1 + rank)),
            "rank 1: 2 tensor(s), 6 elements",
        ),
        (
            lambda: fastddp.all_reduce(torch.ones(3), group=group, state=fastddp.CompressState()),
            "group differs from state.process_group",
        ),
        (
            lambda: fastddp.all_reduce([torch.ones(3), torch.ones(3, device="meta")]),
            "rank 1: tensors[1] is on another device than tensors[0]",
        ),
        (
            lambda: fastddp.all_reduce(torch.ones(3, device=("cpu", "meta")[rank])),
            "rank 1: tensors[0] is on neither CPU nor CUDA (a meta tensor has no data to reduce)",
        ),
        (
            lambda: fastddp.all_reduce([torch.ones(3), torch.ones(1).expand(4 - rank)]),
            "rank 0: tensors[1] is a view whose elements share memory (expand()): pass t.clone()",
        ),
        (lambda: fastddp.all_reduce({"w": torch.ones(3)}), "tensors is a dict; pass its tensors"),
        (
            lambda: fastddp.all_reduce([torch.ones(3), torch.ones(3).to_sparse() if rank else 0]),
            "rank 1: tensors[1] is sparse (as nn.Embedding(sparse=True) makes gradients): pass "
            "t.to_dense() and copy back",
        ),
        (
            # Buckets of other sizes on each rank: collectives that would not line up.
            lambda: fastddp.all_reduce([torch.ones(2**17)] * 3, bucket_cap_mb=(1, 0.5)[rank]),
            "ranks passed different bucket_cap_mb, so their buckets, and the collectives that "
            "carry them, would not line up:\n  rank 0: bucket_cap_mb=1\n  rank 1: "
            "bucket_cap_mb=0.5",
        ),
        (
            lambda: fastddp.all_reduce(torch.ones(3), op=("avg", "sum")[rank]),
            "ranks passed different ops, so the result would be neither a sum nor an average:\n"
            '  rank 0: op="avg"\n  rank 1: op="sum"',
        ),
    ]
    # An argument refused on one rank only: that rank raises why, the other names it, rather
    # than waiting for it in the handshake (with and without a state, before its first call).
    refused = "rank(s) [1] of 2 refused their arguments, each raising why"
    cases += [
        (lambda: fastddp.all_reduce(torch.ones(3), op=("avg", "max")[rank]), 'op must be "avg"'),
        (lambda: fastddp.all_reduce(torch.ones(3), dtype=(None, torch.float64)[rank]), "dtype m"),
        (lambda: fastddp.all_reduce(torch.ones(3), bucket_cap_mb=(1, -1)[rank]), "bucket_cap_"),
        # Too large to count in the handshake's int64 (it overflowed there, on this rank only).
        (lambda: fastddp.all_reduce(torch.ones(3), bucket_cap_mb=(1, 1e14)[rank]), "at most"),
        (
            lambda: fastddp.all_reduce(
                torch.ones(3), dtype=(None, torch.int8)[rank], state=fastddp.CompressState()
            ),
            "pass either state= or the settings (dtype), not both",
        ),
    ]
    cases[-5:] = [(make, (refused, message)[rank]) for make, message in cases[-5:]]
    # One state for a model's buckets and for all_reduce: their buffers and residuals would
    # mix. Refused both ways, on every rank (each rank's state has the same history).
    model = DDP(torch.nn.Linear(4, 4))
    hooked = fastddp.CompressState.from_preset("int8-ef")
    model.register_comm_hook(hooked, fastddp.compress_hook)
    model(torch.ones(2, 4)).sum().backward()
    reduced = fastddp.CompressState.from_preset("int8-ef")
    fastddp.all_reduce(torch.ones(5), state=reduced)
    other = DDP(torch.nn.Linear(4, 4))
    other.register_comm_hook(reduced, fastddp.compress_hook)
    shaped = fastddp.CompressState.from_preset("int8-ef")
    fastddp.all_reduce(torch.ones(2, 3), state=shaped)
    with torch.inference_mode():
        made_in_inference = torch.ones(3)
    cases += [
        (  # as many elements, summed by flat index: refused at a later call too
            lambda: fastddp.all_reduce(torch.ones(3, 2), state=shaped),
            "fastddp.all_reduce: tensor 0 has shape (3, 2), and the state was first given one "
            "of (2, 3)",
        ),
        (  # refused before any collective, not when its result is written back
            lambda: fastddp.all_reduce([torch.ones(2), made_in_inference]),
            "rank 1: tensors[1] is an inference tensor (made under torch.inference_mode())",
        ),
        (
            lambda: fastddp.all_reduce(made_in_inference.view(3, 1), state=shaped),
            "fastddp.all_reduce: tensors[0] is an inference tensor",
        ),
        (
            lambda: fastddp.all_reduce(torch.ones(3), group=5),
            "fastddp.all_reduce: group must be a torch.distributed.ProcessGroup or None",
        ),
        (
            lambda: fastddp.all_reduce(torch.ones(3), state=hooked),
            "this state reduces a DDP model's buckets (compress_hook)",
        ),
        (
            lambda: other(torch.ones(2, 4)).sum().backward(),
            "compress_hook: this state was given to fastddp.all_reduce",
        ),
        (  # refused as it is registered, rather than in backward
            lambda: fastddp.register_comm_hook(DDP(torch.nn.Linear(4, 4)), reduced),
            "register_comm_hook: this state was given to fastddp.all_reduce",
        ),
    ]
    for make, message in cases:
        with pytest.raises((ValueError, TypeError)) as info:
            make()
        assert message in str(info.value), str(info.value)
    # Every rank raised where the others did (in the same handshake, or before any
    # collective), so the group still works.
    t = torch.ones(4)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(world)))
    # The default group named as such is the state's default group.
    fastddp.all_reduce(t, group=dist.group.WORLD, state=fastddp.CompressState())
    assert torch.equal(t, torch.full((4,), float(world)))
    # Outside a group, as torch.distributed.all_reduce does: nothing; a state cannot be made.
    alone = dist.new_group([0])
    t = torch.full((4,), float(rank + 1))
    fastddp.all_reduce(t, op="sum", group=alone)
    assert torch.equal(t, torch.full((4,), float(rank + 1)))
    if rank == 1:
        with pytest.raises(ValueError, match="this rank is not in process_group"):
            fastddp.CompressState(process_group=alone)


def test_all_reduce_bad_input_raises_on_every_rank():
    run_ranks(_bad_input, 2)


class _Tagged(torch.Tensor):
    """A plain tensor subclass, as a library might tag its tensors with."""


def _tensor_subclass(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    whole = torch.arange(8.0).reshape(4, 2)
    d = distribute_tensor(whole, mesh, [Shard(0)])  # this rank's 2 rows
    # Refused on every rank in the state's first call, before it fixes its layout: the same
    # state then reduces plain tensors (a Parameter among them), and refuses a DTensor again.
    state = fastddp.CompressState.from_preset("int8-ef")
    for i, tensors in enumerate((d, [torch.ones(3), d])):
        with pytest.raises(ValueError) as info:
            fastddp.all_reduce(tensors, state=state)
        text = str(info.value)
        assert (
            f"some ranks passed tensors it cannot reduce:\n  rank 0: tensors[{i}] is a "
            "torch.Tensor subclass (a DTensor?), and all_reduce reduces plain tensors: pass a "
            "DTensor's t.to_local() (a view of its local tensor: the result lands in t), or "
            "another subclass's t.as_subclass(torch.Tensor)\n  rank 1:" in text
        ), text
        assert (
            f"\nHere: tensors[{i}] is a DTensor (a torch.Tensor subclass), and all_reduce "
            "reduces plain tensors: pass t.to_local(), a view of this rank's local tensor: the "
            "result lands in t" in text
        ), text
    for _ in range(2):
        x = [torch.full((2, 2), float(rank + 1)), torch.nn.Parameter(torch.full((3,), 2.0 * rank))]
        fastddp.all_reduce(x, state=state)
        want = torch.cat([torch.full((4,), 1.5), torch.ones(3)])  # (int8: within a step)
        assert torch.allclose(torch.cat([t.detach().view(-1) for t in x]), want, atol=2**-6)
    with pytest.raises(ValueError, match="^fastddp.all_reduce: tensors\\[0\\] is a DTensor \\(a"):
        fastddp.all_reduce([d, torch.ones(3)], state=state)  # (a later call: this rank's own)
    assert state.stats()["calls"] == 2
    # As the message says: the local tensor's reduction lands in the DTensor.
    fastddp.all_reduce(d.to_local(), op="sum")
    assert torch.equal(d.to_local(), whole[:2] + whole[2:])
    # One rank alone passes a subclass, the other plain tensors: both raise, neither waits.
    tagged = torch.ones(3).as_subclass(_Tagged) if rank == 1 else torch.ones(3)
    for kwargs in ({}, {"state": fastddp.CompressState()}):
        with pytest.raises(ValueError) as info:
            fastddp.all_reduce([torch.ones(2), tagged], **kwargs)
        text = str(info.value)
        assert "passed tensors it cannot reduce:\n  rank 1: tensors[1] is a torch.Tensor" in text
        if rank == 1:
            assert (
                "\nHere: tensors[1] is a _Tagged (a torch.Tensor subclass), and all_reduce "
                "reduces plain tensors: pass t.as_subclass(torch.Tensor), a plain tensor over "
                "the same memory" in text
            ), text
    t = torch.ones(4)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(world)))


def test_all_reduce_refuses_a_dtensor_on_every_rank():
    run_ranks(_tensor_subclass, 2)
