"""compress_hook inside real DDP runs: spawned processes, Gloo, world sizes 2 and 3."""

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.hooks import _reduce

from ._dist import run_ranks

# Odd parameter sizes, so that every bucket has an odd length.
IN, HIDDEN, OUT = 36, 53, 5


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, OUT),
    ).to(dtype)


def _batch(gen, dtype=torch.float32, scale=1.0):
    return torch.randn(16, IN, generator=gen).to(dtype) * scale, torch.randn(16, OUT, generator=gen)


def _backward(model, x, y, loss_scale=1.0):
    loss = nn.functional.mse_loss(model(x).float(), y) * loss_scale
    loss.backward()
    return loss


def _grads(model):
    return torch.cat([p.grad.reshape(-1).float() for p in model.parameters()])


def _tol(dtype):
    # One rounding of each rank's share and one of each partial sum, relative to the largest
    # gradient: a missed 1/world_size or a stale buffer is off by far more.
    return {torch.bfloat16: 2**-6, torch.float16: 2**-9}[dtype]


def _check_close(got, want, dtype, what):
    err = (got - want).abs().max().item()
    bound = _tol(dtype) * want.abs().max().item()
    assert err <= bound, f"{what}: max deviation {err:.3e} > {bound:.3e}"


def _emulate_two_ranks(local, dtype):
    """What a 16-bit all-reduce of two ranks' (g / 2) gives, computed from gathered fp32 grads."""
    parts = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(parts, local)
    a, b = ((p * 0.5).to(dtype) for p in parts)
    return (a.float() + b.float()).to(dtype).float()


def _matches_plain_ddp(rank, world, dtype, as_view, static_graph):
    base = _model()
    kwargs = dict(bucket_cap_mb=0.01, gradient_as_bucket_view=as_view, static_graph=static_graph)
    plain = DDP(copy.deepcopy(base), **kwargs)
    hooked = DDP(copy.deepcopy(base), **kwargs)
    local = copy.deepcopy(base)
    state = fastddp.CompressState(dtype=dtype)
    hooked.register_comm_hook(state, fastddp.compress_hook)
    gen = torch.Generator().manual_seed(100 + rank)
    allocations = []
    for step in range(5):
        x, y = _batch(gen)
        for m in (plain, hooked, local):
            m.zero_grad()
            _backward(m, x, y)
        want, got = _grads(plain), _grads(hooked)
        _check_close(got, want, dtype, f"rank {rank} step {step}")
        # Compression happened: the result is not the fp32 average.
        assert not torch.equal(got, want)
        if world == 2:
            # Gloo's 2-rank sum rounds once, so the result is known exactly.
            expected = _emulate_two_ranks(_grads(local), dtype)
            assert torch.equal(got, expected), f"step {step}: not the exact 16-bit reduction"
        with torch.no_grad():  # the same update everywhere keeps the three models equal
            for ps in zip(plain.parameters(), hooked.parameters(), local.parameters()):
                for p in ps:
                    p -= 0.05 * ps[0].grad
        allocations.append(state.stats()["allocations"])
    stats = state.stats()
    # DDP rebuilds its buckets once, after step 1 (after step 2 with static_graph); from then on
    # the hook must not allocate.
    assert allocations[2] == allocations[-1], f"buffers reallocated after warm-up: {allocations}"
    assert len(stats["buckets"]) >= 2
    assert any(b["numel"] % 2 for b in stats["buckets"].values()), stats["buckets"]
    numel = sum(p.numel() for p in base.parameters())
    assert stats["payload_bytes"] == 5 * numel * 2
    assert stats["calls"] == sum(b["calls"] for b in stats["buckets"].values())
    assert stats["nonfinite_events"] == 0


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_plain_ddp(world, dtype):
    run_ranks(_matches_plain_ddp, world, dtype, True, False)


@pytest.mark.parametrize("as_view,static_graph", [(False, False), (True, True), (False, True)])
def test_matches_plain_ddp_bucket_modes(as_view, static_graph):
    run_ranks(_matches_plain_ddp, 2, torch.bfloat16, as_view, static_graph)


def _default_state_and_no_sync(rank, world):
    base = _model()
    plain = DDP(copy.deepcopy(base), bucket_cap_mb=0.01)
    hooked = DDP(copy.deepcopy(base), bucket_cap_mb=0.01)
    hooked.register_comm_hook(None, fastddp.compress_hook)  # bf16 on the default group
    gen = torch.Generator().manual_seed(7 + rank)
    calls = [0]
    for _ in range(3):
        batches = [_batch(gen) for _ in range(3)]
        for m in (plain, hooked):
            m.zero_grad()
            with m.no_sync():  # accumulate locally, no hook call
                for x, y in batches[:2]:
                    _backward(m, x, y)
            _backward(m, *batches[2])
        _check_close(_grads(hooked), _grads(plain), torch.bfloat16, f"rank {rank} no_sync")
        calls.append(fastddp.hooks._default_state.stats()["calls"])
    assert fastddp.hooks._default_state.stats()["dtype"] == "bfloat16"
    # One call per bucket per synced step, none for the two no_sync micro-batches.
    per_step = [b - a for a, b in zip(calls, calls[1:])]
    assert per_step[1] == per_step[2] <= len(list(base.parameters())), per_step


def test_default_state_and_no_sync():
    run_ranks(_default_state_and_no_sync, 3)


def _fp16_overflow(rank, world):
    base = nn.Linear(IN, OUT)
    model = DDP(base)
    state = fastddp.CompressState(dtype=torch.float16)
    model.register_comm_hook(state, fastddp.compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    gen = torch.Generator().manual_seed(rank)
    x, y = _batch(gen, scale=100.0)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    # Gradients reach ~1e8: far beyond fp16 after dividing by world size.
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    grads = _grads(model)
    assert torch.isinf(grads).any(), "fp16 overflow was clipped instead of becoming inf"
    assert not torch.isnan(grads).all()
    scaler.step(opt)
    scaler.update()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b), "GradScaler did not skip the step"
    assert scaler.get_scale() < 2.0**24
    assert state.stats()["nonfinite_events"] >= 1
    # A scale that fits: finite gradients, the step is taken, and the counter stays put.
    events = state.stats()["nonfinite_events"]
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    opt.zero_grad()
    scaler.scale(nn.functional.mse_loss(model(x / 100), y)).backward()
    assert torch.isfinite(_grads(model)).all()
    scaler.step(opt)
    assert state.stats()["nonfinite_events"] == events


def test_fp16_overflow_propagates_inf_and_is_counted():
    run_ranks(_fp16_overflow, 2)


def _sixteen_bit_and_float64(rank, world):
    # bf16 model: its buckets are already 16-bit and pass through.
    base = _model(torch.bfloat16)
    plain = DDP(copy.deepcopy(base))
    hooked = DDP(copy.deepcopy(base))
    state = fastddp.CompressState()
    hooked.register_comm_hook(state, fastddp.compress_hook)
    gen = torch.Generator().manual_seed(rank)
    x, y = _batch(gen, torch.bfloat16)
    for m in (plain, hooked):
        _backward(m, x, y)
    _check_close(_grads(hooked), _grads(plain), torch.bfloat16, "bf16 pass-through")
    stats = state.stats()
    assert stats["passthrough_calls"] == stats["calls"] > 0
    assert stats["allocations"] == 0

    # float64 model: a clear error on every rank, raised before any collective.
    model = DDP(_model(torch.float64))
    model.register_comm_hook(fastddp.CompressState(), fastddp.compress_hook)
    x, y = _batch(gen, torch.float64)
    with pytest.raises(Exception, match="bucket dtype torch.float64 is not supported"):
        _backward(model, x, y.double())


def test_16bit_buckets_pass_through_and_float64_is_refused():
    run_ranks(_sixteen_bit_and_float64, 2)


def _empty_and_direct(rank, world):
    state = fastddp.CompressState(dtype=torch.float16)
    empty = torch.empty(0)
    fut = _reduce(state, empty, 0)
    assert fut.wait() is empty
    # The worker on an odd-length buffer outside DDP: the average of both ranks, in fp16.
    buf = torch.arange(1, 12, dtype=torch.float32) * (rank + 1)
    out = _reduce(state, buf, 1).wait()
    assert out is buf
    torch.testing.assert_close(buf, torch.arange(1, 12, dtype=torch.float32) * 1.5)
    # Same index, new size (as when DDP rebuilds its buckets): the buffer is reallocated.
    buf = torch.full((5,), float(rank))
    _reduce(state, buf, 1).wait()
    torch.testing.assert_close(buf, torch.full((5,), 0.5))
    assert state.stats()["buckets"][1]["numel"] == 5
    assert state.stats()["allocations"] == 3


def test_empty_and_odd_buffers():
    run_ranks(_empty_and_direct, 2)


def test_state_validation_and_pickling():
    with pytest.raises(ValueError, match="dtype must be torch.float16 or torch.bfloat16"):
        fastddp.CompressState(dtype=torch.int8)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        fastddp.CompressState(process_group="gloo")
    with pytest.raises(TypeError, match="state must be a fastddp.CompressState or None"):
        fastddp.compress_hook({"dtype": torch.float16}, None)
    state = fastddp.CompressState(dtype=torch.float16)
    state._counters["calls"] = 4
    clone = pickle.loads(pickle.dumps(state))
    assert clone.dtype == torch.float16 and clone.process_group is None
    assert clone.stats()["calls"] == 4
    with pytest.raises(ValueError, match="saved dtype 'float16' does not match"):
        fastddp.CompressState().load_state_dict(state.state_dict())
