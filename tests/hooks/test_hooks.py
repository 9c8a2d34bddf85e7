"""compress_hook inside real DDP runs: spawned processes, Gloo, world sizes 2 and 3."""

import copy
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.bench.models import mlp
from fastddp.codecs import CODECS
from fastddp.hooks import _reduce
from fastddp.hooks.presets import PRESETS, preset

from .._dist import run_ranks
from .test_hook_core import _needs_bucket_caps

# Odd parameter sizes, so that every bucket has an odd length.
IN, HIDDEN, OUT = 36, 53, 5


def _model(dtype=torch.float32):
    return mlp([IN, HIDDEN, HIDDEN, OUT], seed=0).to(dtype)


def _batch(gen, dtype=torch.float32, scale=1.0):
    return torch.randn(16, IN, generator=gen).to(dtype) * scale, torch.randn(16, OUT, generator=gen)


def _backward(model, x, y, loss_scale=1.0):
    loss = nn.functional.mse_loss(model(x).float(), y) * loss_scale
    loss.backward()
    return loss


def _grads(model):
    return torch.cat([p.grad.reshape(-1).float() for p in model.parameters()])


def _tol(settings):
    # Relative to the largest gradient. 16-bit: one rounding of each rank's share and one of
    # each partial sum. int8/int4/int2: a block step (absmax / 127, / 7, / 1) at each of the two
    # roundings, plus the carried residual. A missed 1/world_size or a stale buffer is off by
    # far more for 16 and 8 bits; for int4 and int2, test_error_feedback_keeps_the_sum_over_steps
    # is the sharp test.
    dtype = settings.get("dtype", torch.bfloat16)
    tols = {torch.bfloat16: 2**-6, torch.float16: 2**-9, torch.int8: 2**-5}
    return {**tols, torch.int4: 2**-1, torch.int2: 4.0}[dtype]


def _check_close(got, want, settings, what, scale=None):
    err = (got - want).abs().max().item()
    bound = _tol(settings) * (want.abs().max() if scale is None else scale).item()
    assert err <= bound, f"{what}: max deviation {err:.3e} > {bound:.3e}"


def _emulate(local, settings, world):
    """The exact result of the 16-bit paths, from gathered fp32 grads (None if not known).

    With fp32 accumulation: each rank's g / world rounded, summed in fp32 in rank order,
    rounded once. Without: Gloo's 2-rank sum rounds once, which is the same formula.
    """
    dtype = settings.get("dtype", torch.bfloat16)
    exact = dtype != torch.int8 and not settings.get("error_feedback")
    exact = exact and not settings.get("stochastic_rounding")
    if not exact or (settings.get("accumulate_dtype") is None and world != 2):
        return None
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    scale = 1.0 / world  # the kernels multiply by the fp32 reciprocal
    acc = (parts[0] * scale).to(dtype).float()
    for p in parts[1:]:
        acc = acc + (p * scale).to(dtype).float()
    return acc.to(dtype).float()


def _matches_plain_ddp(rank, world, settings, as_view, static_graph, first_buckets=False):
    base = _model()
    kwargs = dict(bucket_cap_mb=0.01, gradient_as_bucket_view=as_view, static_graph=static_graph)
    if first_buckets:  # several buckets from the first step on, not one
        kwargs["bucket_cap_mb_list"] = [kwargs.pop("bucket_cap_mb")] * 8
    plain = DDP(copy.deepcopy(base), **kwargs)
    hooked = DDP(copy.deepcopy(base), **kwargs)
    local = copy.deepcopy(base)
    state = fastddp.CompressState(**settings)
    hooked.register_comm_hook(state, fastddp.compress_hook)
    gen = torch.Generator().manual_seed(100 + rank)
    allocations = []
    for step in range(5):
        x, y = _batch(gen)
        for m in (plain, hooked, local):
            m.zero_grad()
            _backward(m, x, y)
        want, got = _grads(plain), _grads(hooked)
        _check_close(got, want, settings, f"rank {rank} step {step}")
        # Compression happened: the result is not the fp32 average.
        assert not torch.equal(got, want)
        expected = _emulate(_grads(local), settings, world)
        if expected is not None:
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
    assert {b["path"] for b in stats["buckets"].values()} == {state.path}
    numel = sum(p.numel() for p in base.parameters())
    bits = CODECS[state.dtype].bits
    if bits == 16:
        assert stats["payload_bytes"] == 5 * numel * 2
    # The codes, plus a scale per block and padding in these small buckets.
    assert stats["wire_bytes"] < stats["fp32_wire_bytes"] * (bits + 3) / 32
    assert stats["calls"] == sum(b["calls"] for b in stats["buckets"].values())
    assert stats["nonfinite_events"] == 0


_EF, _SR = {"error_feedback": True}, {"stochastic_rounding": True}
# Every preset, and a preset with other settings on top ("preset+what").
MODES = {name: preset(name) for name in PRESETS}
MODES.update({
    "bf16-acc-ef+sr": {**preset("bf16-acc-ef"), **_SR},
    "fp16-acc+ef": {**preset("fp16-acc"), **_EF},
    "int8-ef+sr": {**preset("int8-ef"), **_SR},
    "int8+block32": {**preset("int8"), "block_size": 32},
})  # fmt: skip


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", list(MODES))
def test_matches_plain_ddp(world, mode):
    run_ranks(_matches_plain_ddp, world, MODES[mode], True, False)


@pytest.mark.multiproc
@pytest.mark.parametrize("as_view,static_graph", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("mode", ["bf16", "bf16-acc", "int8-ef+sr"])
def test_matches_plain_ddp_bucket_modes(mode, as_view, static_graph):
    run_ranks(_matches_plain_ddp, 2, MODES[mode], as_view, static_graph)


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["bf16", "int8-ef+sr"])
@_needs_bucket_caps
def test_static_graph_with_several_first_buckets(mode):
    # DDP's first iteration with static_graph reduces every bucket in a callback at the end of
    # the backward pass, each named bucket 0 and none marked last, and then waits for their
    # futures: the hook finishes each there, or DDP waits for good.
    run_ranks(_matches_plain_ddp, 2, MODES[mode], False, True, True)


def _sum_over_steps(rank, world, settings):
    # The same batch every step and no update: plain DDP gives the same average each step.
    # Summed in fp32, every rounding is one that error feedback keeps (summed in 16 bits, the
    # collective's own roundings are not). It owes the fp32 sum only what the last step left
    # in the residuals, so the
    # sum over 12 steps stays within one step's error of 12 times the average; a wrong scale
    # or a lost residual drifts by a multiple of the gradient.
    base = _model()
    plain = DDP(copy.deepcopy(base), bucket_cap_mb=0.01)
    hooked = DDP(copy.deepcopy(base), bucket_cap_mb=0.01)
    hooked.register_comm_hook(fastddp.CompressState(**settings), fastddp.compress_hook)
    x, y = _batch(torch.Generator().manual_seed(100 + rank))
    plain.zero_grad()
    _backward(plain, x, y)
    want = _grads(plain)
    total = torch.zeros_like(want)
    for _ in range(12):
        hooked.zero_grad()
        _backward(hooked, x, y)
        total += _grads(hooked)
    # Within half the one-step tolerance: int4 stays near 0.15 of the largest gradient and
    # int2 near 1.0, and either drifts past 1.4 and 3.5 when the first residual is dropped.
    bound = want.abs().max() / 2
    _check_close(total, want * 12, settings, f"rank {rank}: 12 steps", scale=bound)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "mode",
    [
        m
        for m, s in MODES.items()
        if s.get("error_feedback") and (s.get("accumulate_dtype") or CODECS[s["dtype"]].blocks)
    ],
)
def test_error_feedback_keeps_the_sum_over_steps(world, mode):  # fmt: skip
    run_ranks(_sum_over_steps, world, MODES[mode])


class _Sometimes(nn.Module):
    """Its middle layer is used on even calls only (``find_unused_parameters=True``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.extra = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.c, self.calls = nn.Linear(HIDDEN, OUT), 0

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.calls % 2 == 0:
            h = h + torch.tanh(self.extra(h))
        self.calls += 1
        return self.c(h)


def _unused_with_error_feedback(rank, world, as_view):
    # The same batch every step, no update, `extra` used on even steps. With
    # gradient_as_bucket_view the gradient is the bucket, so what error feedback owed `extra`
    # arrives on its unused steps, and its gradient summed over 12 steps owes plain DDP's only
    # the last residual, within a quarter of one step's largest gradient (near 0.11 here; 0.75
    # when what was owed is dropped). Without, DDP leaves an unused parameter's gradient at
    # zero, as plain DDP does, and drops what was owed.
    settings = MODES["int4-ef"]
    kwargs = dict(bucket_cap_mb=0.01, find_unused_parameters=True, gradient_as_bucket_view=as_view)
    plain, hooked = DDP(_Sometimes(), **kwargs), DDP(_Sometimes(), **kwargs)
    hooked.register_comm_hook(fastddp.CompressState(**settings), fastddp.compress_hook)
    x, y = _batch(torch.Generator().manual_seed(100 + rank))
    totals, unused = [], []
    for model in (plain, hooked):
        grad, total = model.module.extra.weight, 0
        for step in range(12):
            model.zero_grad(set_to_none=False)
            _backward(model, x, y)
            total = total + grad.grad
            if step % 2:
                unused.append(grad.grad.abs().max().item())
        totals.append(total)
    ours, theirs = unused[6:], unused[:6]
    assert theirs == [0.0] * 6, theirs
    if as_view:
        assert all(e > 0 for e in ours), ours
        one_step = totals[0].abs().max() / 6
        err = (totals[1] - totals[0]).abs().max()
        assert err <= one_step / 4, f"rank {rank}: {err:.3e} > {one_step / 4:.3e} after 12 steps"
    else:
        assert ours == [0.0] * 6, ours


@pytest.mark.multiproc
@pytest.mark.parametrize("as_view", [True, False])
def test_error_feedback_and_parameters_unused_in_a_step(as_view):
    run_ranks(_unused_with_error_feedback, 2, as_view)


def _default_state_and_no_sync(rank, world, settings):
    base = _model()
    plain = DDP(copy.deepcopy(base), bucket_cap_mb=0.01)
    hooked = DDP(copy.deepcopy(base), bucket_cap_mb=0.01)
    if settings is None:
        hooked.register_comm_hook(None, fastddp.compress_hook)  # bf16 on the default group
        state = fastddp.hooks.hook._default_state = fastddp.CompressState()
    else:
        state = fastddp.CompressState(**settings)
        hooked.register_comm_hook(state, fastddp.compress_hook)
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
        _check_close(_grads(hooked), _grads(plain), settings or {}, f"rank {rank} no_sync")
        calls.append(state.stats()["calls"])
    if settings is None:
        assert fastddp.hooks.hook._default_state is state  # the hook used the shared default
        assert state.stats()["dtype"] == "bfloat16"
    # One call per bucket per synced step, none for the two no_sync micro-batches.
    per_step = [b - a for a, b in zip(calls, calls[1:])]
    assert per_step[1] == per_step[2] <= len(list(base.parameters())), per_step


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", [None, "bf16-acc", "int8-ef+sr"])
def test_default_state_and_no_sync(mode):
    run_ranks(_default_state_and_no_sync, 3, None if mode is None else MODES[mode])


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


@pytest.mark.multiproc
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
    _check_close(_grads(hooked), _grads(plain), {}, "bf16 pass-through")
    stats = state.stats()
    assert stats["passthrough_calls"] == stats["calls"] > 0
    assert stats["allocations"] == 0

    # float64 model: a clear error on every rank, raised after the first bucket's handshake.
    model = DDP(_model(torch.float64))
    model.register_comm_hook(fastddp.CompressState(), fastddp.compress_hook)
    x, y = _batch(gen, torch.float64)
    with pytest.raises(Exception, match="bucket dtype torch.float64 is not supported"):
        _backward(model, x, y)

    # Sparse gradients: named as such on every rank (the dispatcher's message named no cause).
    model = DDP(torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1)))
    model.register_comm_hook(fastddp.CompressState(), fastddp.compress_hook)
    with pytest.raises(Exception, match=r"a sparse gradient \(nn.Embedding\(sparse=True\)"):
        model(torch.tensor([1, 2, 3])).sum().backward()


@pytest.mark.multiproc
def test_16bit_buckets_pass_through_and_float64_is_refused():
    run_ranks(_sixteen_bit_and_float64, 2)


def _dtypes_differ(rank, world):
    # A model cast on one rank only: its first bucket's dtype is in the handshake, so every
    # rank raises, naming each rank's, where fp16 against bf16 summed their bits silently
    # (DDP's own broadcast at construction copies the bytes: init_sync=False leaves that out).
    for dtypes in ((torch.float16, torch.bfloat16), (torch.float32, torch.float64)):
        model = DDP(_model(dtypes[rank]), init_sync=False)
        model.register_comm_hook(fastddp.CompressState(), fastddp.compress_hook)
        x, y = _batch(torch.Generator().manual_seed(rank), dtypes[rank])
        with pytest.raises(ValueError, match="hand the hook gradients of different dtypes") as e:
            _backward(model, x, y)
        names = [str(d).removeprefix("torch.") for d in dtypes]
        assert f"rank 0: {names[0]}\n  rank 1: {names[1]}" in str(e.value), str(e.value)


@pytest.mark.multiproc
def test_models_of_other_dtypes_on_other_ranks_fail_on_every_rank():
    run_ranks(_dtypes_differ, 2)


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


@pytest.mark.multiproc
def test_empty_and_odd_buffers():
    run_ranks(_empty_and_direct, 2)


BAD_STATES = [
    (
        dict(dtype=torch.float64),
        ValueError,
        "dtype must be torch.float16, torch.bfloat16, torch.int8,",
    ),
    (dict(dtype=[torch.int8]), ValueError, r"dtype must be torch.float16.*got \[torch.int8\]"),
    (dict(process_group="gloo"), TypeError, "process_group must be a torch.distributed"),
    (dict(accumulate_dtype=torch.float16), ValueError, "accumulate_dtype must be torch.float32"),
    (
        dict(block_size=64),
        ValueError,
        "block_size applies to dtype=torch.int8, torch.int4 or torch.int2 only",
    ),
    (dict(dtype=torch.int8, block_size=0), ValueError, "block_size must be between 1 and"),
    (dict(dtype=torch.int8, block_size=2.5), TypeError, "block_size must be an int"),
    (dict(dtype=torch.int4, block_size=16), ValueError, "block_size must be between 32 and 256"),
    (
        dict(dtype=torch.int4, block_size=96),
        ValueError,
        "must be a power of two for dtype=torch.int4",
    ),
    (
        dict(dtype=torch.int2),
        ValueError,
        "trains only with error feedback; pass error_feedback=True",
    ),
    (dict(error_feedback=1), TypeError, "error_feedback must be True or False"),
    (dict(stochastic_rounding="yes"), TypeError, "stochastic_rounding must be True or False"),
    (
        dict(error_feedback=True),
        ValueError,
        r"but not those of the collective's sum.*accumulate_dtype=torch.float32 .*'bf16-acc-ef'",
    ),
    (
        dict(dtype=torch.float16, stochastic_rounding=True),
        ValueError,
        "stochastic_rounding=True with float16 summed by the collective is not unbiased",
    ),
    (dict(seed=None), TypeError, "seed must be an int"),
    (dict(topology="ring"), ValueError, "topology must be one of 'auto', 'flat', 'hierarchical'"),
    (dict(dtype="int8-ef"), ValueError, r"is a preset: CompressState.from_preset\('int8-ef'\)"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_STATES)
def test_bad_state_settings(kwargs, error, message):
    with pytest.raises(error, match=message):
        fastddp.CompressState(**kwargs)


@pytest.mark.parametrize("dtype", [torch.int8, "auto"])
def test_a_state_dict_of_something_else_is_refused(dtype):
    settings = {"dtype": dtype} if dtype == "auto" else {"dtype": dtype, "error_feedback": True}
    state = fastddp.CompressState(**settings)
    with pytest.raises(TypeError, match="expected the dict that CompressState.state_dict()"):
        state.load_state_dict(None)
    model = torch.nn.Linear(2, 2).state_dict()
    with pytest.raises(ValueError, match=r"not a CompressState.state_dict\(\) \(no .*; its keys: "):
        state.load_state_dict(model)
    state.load_state_dict(fastddp.CompressState(**settings).state_dict())  # its own loads
    other = fastddp.CompressState(**({"dtype": "auto"} if dtype != "auto" else preset("bf16")))
    theirs, mine = ("auto", "int8") if dtype != "auto" else ("bfloat16", "auto")
    said = f"saved by a CompressState of dtype '{theirs}', loaded into one of dtype '{mine}'; "
    with pytest.raises(ValueError, match=said + "build the state with the settings"):
        state.load_state_dict(other.state_dict())


def test_a_state_dict_damaged_inside_is_refused():
    def saved(**change):
        sd = fastddp.CompressState.from_preset("int8-ef").state_dict()
        bucket = {"index": 0, "numel": 8, "world": 2, "params": [[0, 6], [1, 2]]}
        sd["buckets"] = {0: {**bucket, "residual": torch.zeros(8)}, 1: {**bucket, "index": 1}}
        sd["buckets"][0].update(change)
        return sd

    def parked(**change):
        sd = saved()
        sd["carry"] = {**sd["carry"], "sizes": {7: 2, 8: 2}, "moved": [7, 8], **change}
        return sd

    fastddp.CompressState.from_preset("int8-ef").load_state_dict(saved())  # intact: loads
    fastddp.CompressState.from_preset("int8-ef").load_state_dict(parked(stage1={7: torch.ones(2)}))
    for sd, message in (
        (saved(residual=torch.zeros(5)), "bucket entry 0's residual has 5 elements but its "),
        (saved(residual=[0.0] * 8), "bucket entry 0's residual is not a 1-D float32 tensor"),
        (saved(residual=torch.full((8,), float("nan"))), "residual holds non-finite values"),
        ({**saved(), "version": 4}, "state dict version 4, and this fastddp reads versions 1"),
        ({**saved(), "key_order": "sideways"}, "key_order 'sideways' is not one of"),
        ({**saved(), "buckets": {1: saved()["buckets"][1]}}, r"bucket entries \[0\] are missing"),
        # Parked residuals (saved between a load and the buckets that take them) are repaid too.
        (parked(stage1={7: torch.tensor([1.0, float("nan")])}), r"carry.stage1\[7\] holds non-f"),
        (parked(stage2={8: [(0, [0.0, 1.0])]}), r"carry.stage2\[8\] at 0 is not a 1-D float32"),
        (parked(replicated={8: torch.full((2,), float("inf"))}), r"carry.replicated\[8\] holds"),
    ):
        with pytest.raises(ValueError, match=message):
            fastddp.CompressState.from_preset("int8-ef").load_state_dict(sd)


def test_state_validation_and_pickling():
    with pytest.raises(TypeError, match="state must be a fastddp.CompressState or None"):
        fastddp.compress_hook({"dtype": torch.float16}, None)
    states = None, fastddp.CompressState.from_preset("int8-ef"), fastddp.CompressState("auto")
    for state in states:
        with pytest.raises(TypeError, match="must be the dist.GradBucket .* got Tensor; regist"):
            fastddp.compress_hook(state, torch.randn(10))
    state = fastddp.CompressState(dtype=torch.int8, error_feedback=True, block_size=64, seed=3)
    state._counters["calls"] = 4
    clone = pickle.loads(pickle.dumps(state))
    assert clone.dtype == torch.int8 and clone.process_group is None
    assert clone.settings() == state.settings() and clone.seed == 3
    assert clone.stats()["calls"] == 4
    assert "dtype=int8" in repr(clone) and "block_size=64" in repr(clone)
    with pytest.raises(ValueError, match="saved dtype 'int8' does not match this state's"):
        fastddp.CompressState().load_state_dict(state.state_dict())
    with pytest.raises(ValueError, match="saved error_feedback True does not match"):
        fastddp.CompressState(dtype=torch.int8, block_size=64).load_state_dict(state.state_dict())
    # Stochastic rounding draws from the seed: a resumed run with another one drifts from
    # the run it resumes. Without it, the seed changes nothing, and any loads.
    rounding = dict(dtype=torch.int8, error_feedback=True, stochastic_rounding=True)
    saved = fastddp.CompressState(**rounding, seed=7).state_dict()
    with pytest.raises(ValueError, match="saved seed 7 does not match this state's 8, and stoc"):
        fastddp.CompressState(**rounding, seed=8).load_state_dict(saved)
    fastddp.CompressState(**rounding, seed=7).load_state_dict(saved)
    fastddp.CompressState(dtype=torch.int8, block_size=64, error_feedback=True).load_state_dict(
        state.state_dict()  # (seed 3 into seed 0)
    )
    assert fastddp.CompressState(dtype=torch.int8).block_size == 128
    assert fastddp.CompressState(dtype=torch.int8).accumulate_dtype == torch.float32


def _mismatched_settings(rank, world):
    model = DDP(_model(), bucket_cap_mb=0.01)
    state = fastddp.CompressState.from_preset(["bf16", "int8", "bf16-acc"][rank])
    model.register_comm_hook(state, fastddp.compress_hook)
    x, y = _batch(torch.Generator().manual_seed(rank))
    with pytest.raises(Exception) as info:
        _backward(model, x, y)
    text = str(info.value)
    assert "ranks disagree on the compression settings" in text, text
    assert "rank 0: dtype=bfloat16, accumulate_dtype=None" in text
    assert "rank 1: dtype=int8, accumulate_dtype=float32" in text
    assert "block_size=128" in text
    assert "rank 2: dtype=bfloat16, accumulate_dtype=float32" in text


@pytest.mark.multiproc
def test_mismatched_settings_fail_on_every_rank():
    run_ranks(_mismatched_settings, 3)


def _bad_load_on_one_rank(rank, world, mode):
    # Rank 1 loads a state dict of other settings: it warns at once, and every rank raises at
    # the first reduction (raised on rank 1 alone, the others would wait there for it).
    model = DDP(_model(), bucket_cap_mb=0.01)
    state = fastddp.CompressState.from_preset(mode) if mode != "auto" else None
    state = state or fastddp.CompressState(dtype="auto", allow=["none", "bf16"])
    model.register_comm_hook(state, fastddp.compress_hook)
    saved = state.state_dict()
    if rank == 1:
        other = fastddp.CompressState.from_preset("int4-ef" if mode != "int4-ef" else "bf16")
        with pytest.warns(UserWarning, match="every rank raises at this state's next reduction"):
            state.load_state_dict(other.state_dict())
    else:
        state.load_state_dict(saved)
    x, y = _batch(torch.Generator().manual_seed(rank))
    with pytest.raises(ValueError) as info:
        _backward(model, x, y)
    text = str(info.value)
    assert "load_state_dict failed on rank(s) [1] of 2" in text, text
    assert ("here: ValueError: " in text) == (rank == 1), text
    # A sound load lifts it (in a new DDP model: one whose backward raised cannot go on).
    state.load_state_dict(saved)
    model = DDP(_model(), bucket_cap_mb=0.01)
    model.register_comm_hook(state, fastddp.compress_hook)
    _backward(model, x, y)


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["int8-ef", "auto"])
def test_a_load_that_fails_on_one_rank_fails_on_every_rank(mode):
    run_ranks(_bad_load_on_one_rank, 2, mode)


def _train(model, state, gen, steps, opt):
    for _ in range(steps):
        x, y = _batch(gen)
        opt.zero_grad()
        _backward(model, x, y)
        opt.step()


def _resume(rank, world, settings, exact):
    def build():
        model = DDP(_model(), bucket_cap_mb=0.01)
        state = fastddp.CompressState(**settings)
        model.register_comm_hook(state, fastddp.compress_hook)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, state, opt = build()
    gen = torch.Generator().manual_seed(rank)
    _train(model, state, gen, 4, opt)
    saved = copy.deepcopy(
        {"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}
    )
    gen_state = gen.get_state()
    assert any(b["residual"] is not None for b in saved["hook"]["buckets"].values())
    _train(model, state, gen, 3, opt)  # the uninterrupted run
    want = _grads(model), [p.detach().clone() for p in model.parameters()]

    model, state, opt = build()  # as after a restart
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["hook"])
    gen.set_state(gen_state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "shared state" warning from the new layout
        _train(model, state, gen, 3, opt)
    stats = state.stats()
    assert stats["parked_residuals"] == 0
    assert stats["calls"] == saved["hook"]["counters"]["calls"] + 1 + 2 * 2  # 1 bucket, then 2
    if exact:
        assert torch.equal(_grads(model), want[0])
        for p, w in zip(model.parameters(), want[1]):
            assert torch.equal(p, w), "resumed run differs from the uninterrupted one"
    else:
        for p, w in zip(model.parameters(), want[1]):
            torch.testing.assert_close(p, w, rtol=0, atol=2e-3)
    # Without the residuals the same steps give different parameters: they were used.
    model, state, opt = build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    gen.set_state(gen_state)
    _train(model, state, gen, 3, opt)
    assert not all(torch.equal(p, w) for p, w in zip(model.parameters(), want[1]))


# The resumed DDP's first step lays out its buckets differently from the uninterrupted run's
# (one bucket, parameters in model order; then two, in gradient order): the residuals must
# follow their parameters. 16-bit rounding to nearest is element-wise, so that resume is exact.
# int8 blocks and stochastic rounding's random numbers depend on the layout: those resume with
# their residuals in place, and differ from the uninterrupted run only in that step's rounding.
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "mode, exact",
    [
        ("bf16-acc-ef", True),
        ("fp16-acc+ef", True),
        ("int8-ef", False),
        ("bf16-acc-ef+sr", False),
    ],
)
def test_resume_from_state_dict(mode, exact):
    run_ranks(_resume, 2, MODES[mode], exact)


def _roll_back(rank, world, mode, register):
    model = DDP(_model(), bucket_cap_mb=0.01)
    state = fastddp.CompressState.from_preset(mode)
    if register:
        fastddp.register_comm_hook(model, state)
    else:
        model.register_comm_hook(state, fastddp.compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    _train(model, state, gen, 4, opt)
    assert state.stats()["parked_residuals"] == 0  # nothing waits after DDP's rebuild
    saved = copy.deepcopy(
        {"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}
    )
    gen_state = gen.get_state()
    _train(model, state, gen, 3, opt)
    want = _grads(model), [p.detach().clone() for p in model.parameters()]
    _train(model, state, gen, 2, opt)  # steps to undo: a loss spike, say
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["hook"])
    gen.set_state(gen_state)
    _train(model, state, gen, 3, opt)
    # The same buckets as the uninterrupted steps: the residuals went back to their own
    # parameters, and the registered hook uses what was loaded.
    assert torch.equal(_grads(model), want[0])
    for p, w in zip(model.parameters(), want[1]):
        assert torch.equal(p, w), "rolled-back run differs from the uninterrupted one"
    stats = state.stats()
    assert stats["calls"] == saved["hook"]["counters"]["calls"] + 3 * len(stats["buckets"])
    assert stats["parked_residuals"] == 0


# Loading a state dict into a state that has been reducing (rolling back to a checkpoint
# without a restart) resumes exactly, on either way of registering the hook.
@pytest.mark.multiproc
@pytest.mark.parametrize("register", [False, True], ids=["python-hook", "registered"])
@pytest.mark.parametrize("mode", ["bf16-acc", "bf16-acc-ef", "int8-ef"])
def test_roll_back_to_a_state_dict_mid_run(mode, register):
    run_ranks(_roll_back, 2, mode, register)


def _large_int8_bucket(rank, world):
    state = fastddp.CompressState(dtype=torch.int8, error_feedback=True)
    g = torch.Generator().manual_seed(rank)
    n = 1_000_003
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    want = torch.stack(parts).double().mean(0)
    buf = x.clone()
    _reduce(state, buf, 0).wait()
    rel = ((buf.double() - want).norm() / want.norm()).item()
    assert rel < 0.04, rel  # heavy-tailed values, two quantisations: about 2 %
    stats = state.stats()
    assert stats["wire_bytes"] <= 0.27 * stats["fp32_wire_bytes"], stats
    # The residual holds exactly what this rank's quantisations dropped.
    assert 0 < state._table.slots[("i", 0)].residual.abs().max() <= x.abs().max() / 127


@pytest.mark.multiproc
def test_int8_sends_a_quarter_of_fp32_bytes():
    run_ranks(_large_int8_bucket, 3)


def _registration_errors(rank, world):
    model = DDP(_model())
    model.register_comm_hook(fastddp.CompressState(), fastddp.compress_hook)
    with pytest.raises(RuntimeError, match="can only be called once"):
        model.register_comm_hook(fastddp.CompressState(), fastddp.compress_hook)
    frozen = _model()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(RuntimeError, match="doesn't have any parameter that requires a gradient"):
        DDP(frozen)


@pytest.mark.multiproc
def test_registering_twice_and_a_model_without_gradients():
    # Both refused by DDP itself, before fastddp's hook could run; listed in the README table.
    run_ranks(_registration_errors, 2)
