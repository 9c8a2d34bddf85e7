"""NCCL's completion order on CPU: the hook on the simulated-NCCL backend equals plain Gloo.

On :mod:`fastddp.testing.nccl_sim` a collective's future is complete when the call returns and
its output is NaN until the pipeline waits for it, as a GPU stream would see it under NCCL.
Every mode x path (flat; two-level on 2 nodes x 2 ranks) x world size trains DDP with the
hook on that backend and on plain Gloo from the same weights and data: the gradients of every
step must be bit-identical, and after every backward the current stream must be ordered after
the side stream. From the third step on the buckets run in the native runner. Then waits are
deleted from the hooks' source, one at a time, in the rank processes, and planted defects of
the same kind in the native runner: each must make the run differ.
"""

import copy
import gc
import inspect
import os
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.hooks import native
from fastddp.hooks import pipeline as pipeline_module
from fastddp.hooks.paths import Path
from fastddp.hooks.presets import PRESETS, preset
from fastddp.hooks.state import CompressState
from fastddp.hooks.topology import NODE_ENV
from fastddp.testing import nccl_sim, sim_streams

from .._dist import run_ranks

pytestmark = [pytest.mark.nccl_sim, pytest.mark.multiproc, pytest.mark.timeout(300)]

MODES = list(PRESETS)

Pipeline = pipeline_module.Pipeline
# Planted defects: (class, its function, text to find, replacement).
MUTATIONS = {
    # A later stage that reads the previous collective's output without waiting for it.
    "no-wait-before-later-stage": (Pipeline, "_step", "self._wait(runtime, job.work)\n", "pass\n"),
    # Completion run at once instead of where the collective's output can be read.
    "complete-without-then": (
        Pipeline,
        "_step",
        "runtime.then(job.work, lambda fut, job=job: self._complete_async(job, fut))",
        "self._complete_async(job, job.work.get_future())",
    ),
    # flush() that leaves host reads unordered after the side stream.
    "flush-without-synchronize": (Pipeline, "_flush", "self.synchronize()\n", "pass\n"),
    # A slot's buffers reused (delay=1: its reduced gradient read) before the current stream
    # waits for the previous reduction's decode.
    "settle-without-wait-result": (
        Pipeline,
        "settle",
        "job.runtime.wait_result(job.result)",
        "pass",
    ),
    # flush() that orders host reads after the side stream but not after the decodes that
    # ran in callbacks (on CUDA, on streams of torch's pool).
    "flush-without-waiting-decodes": (
        Pipeline,
        "_flush",
        "job.runtime.wait_result(job.result)\n",
        "pass\n",
    ),
    # stats() reading the flags the side stream adds to without ordering after it.
    "stats-without-synchronize": (
        CompressState,
        "stats",
        "self._pipeline.synchronize()",
        "pass",
    ),
}
# Holds taken away: a buffer a stream still writes, freed with a state dropped in flight.
LIFETIME_MUTATIONS = {
    "no-hold-of-a-delayed-bucket": (
        Pipeline,
        "_complete_async",
        "job.runtime.hold((job.bucket,))",
        "pass",
    ),
    "no-hold-of-a-slot-on-the-side-stream": (Path, "stage", "job.slot.hold(job.runtime)", "pass"),
}
# The same defects in the native runner (csrc/ddp/native_hook.cpp), which runs from step 2 on.
NATIVE_MUTATIONS = {"native-no-wait-before-later-stage": 1, "native-decode-at-once": 2}


class _Net(nn.Module):
    # Layers run in reverse registration order, so that DDP's rebuilt buckets all differ.
    def __init__(self, width=24, depth=5):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def _train(base, group, settings, rank, steps=4):
    """Gradients of each step, the states' runtimes' state after each backward, the state,
    its buckets and its nonfinite events."""
    model = DDP(copy.deepcopy(base), process_group=group, bucket_cap_mb=0.002)
    state = fastddp.CompressState(process_group=group, **settings)
    model.register_comm_hook(state, fastddp.compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    grads, dirty = [], []
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 24, generator=gen)).square().mean().backward()
        dirty.append(any(getattr(r, "dirty", False) for r in state._pipeline._runtimes.values()))
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    stats = state.stats()
    return grads, dirty, state, len(stats["buckets"]), stats["nonfinite_events"]


def _mutate(name, table=MUTATIONS):
    owner, where, old, new = table[name]
    source = textwrap.dedent(inspect.getsource(getattr(owner, where)))
    assert old in source, f"the mutation {name} no longer applies: {old!r} not in {where}"
    scope = {}
    module = vars(inspect.getmodule(owner))
    exec(compile(source.replace(old, new), f"<mutant {name}>", "exec"), module, scope)
    setattr(owner, where, scope[where])


def _sim_equals_gloo(rank, world, nodes, cases, mutation=None):
    os.environ[NODE_ENV] = f"node-{rank * nodes // world}"
    nccl_sim.install()
    sim = dist.new_group(backend=nccl_sim.BACKEND)
    assert dist.get_backend(sim) == nccl_sim.BACKEND
    if mutation in NATIVE_MUTATIONS:
        native._PLANTED_DEFECT = NATIVE_MUTATIONS[mutation]
    elif mutation is not None:
        _mutate(mutation)
    try:
        _compare(rank, sim, cases, mutation)
    finally:
        native._PLANTED_DEFECT = 0


def _compare(rank, sim, cases, mutation):
    torch.manual_seed(0)
    base = _Net()
    for mode, topology, *delay in cases:
        settings = {**preset(mode), "topology": topology, "delay": delay[0] if delay else 0}
        want, _, _, _, events = _train(base, None, settings, rank)
        try:
            got, dirty, state, buckets, got_events = _train(base, sim, settings, rank)
        except Exception as e:  # a planted defect may also be caught by the backend's checks
            assert mutation is not None, f"{mode}/{topology}: {type(e).__name__}: {e}"
            _differs_anywhere(True)
            return
        used = state.stats()["topology_used"]
        assert used == topology, f"{mode}: ran {used}, asked for {topology}"
        assert buckets > 2, f"{mode}/{topology}: {buckets} buckets; the pipeline needs several"
        same = all(torch.equal(a, b) for gs, ws in zip(got, want) for a, b in zip(gs, ws)) and (
            (settings["delay"] or not any(dirty)) and got_events == events
        )
        if mutation is None:
            for step, (gs, ws) in enumerate(zip(got, want)):
                for a, b in zip(gs, ws):
                    assert torch.isfinite(b).all(), f"{mode}: the Gloo run is not finite"
                    assert torch.equal(a, b), (
                        f"{mode}/{topology} step {step}: {(a - b).abs().max()}"
                    )
            # With delay=1 reductions stay in flight after backward by design; the gradients
            # handed back come from settled jobs, which the NaN outputs above would expose.
            assert settings["delay"] or not any(dirty), (
                f"{mode}/{topology}: host reads not ordered after the side stream"
            )
            assert got_events == events, f"{mode}/{topology}: {got_events} nonfinite events"
        elif _differs_anywhere(not same):
            return
    assert mutation is None, f"the planted defect {mutation} survived every case"


def _differs_anywhere(differs: bool) -> bool:
    # Every rank leaves the cases together: a defect may show on one rank's gradients only.
    flag = torch.tensor([float(differs)])
    dist.all_reduce(flag)
    return bool(flag.item())


FLAT = [(mode, "flat") for mode in MODES]


def test_every_mode_on_two_ranks():
    run_ranks(_sim_equals_gloo, 2, 1, FLAT, timeout=280)


def test_every_mode_and_path_on_two_nodes_of_two_ranks():
    cases = FLAT + [(mode, "hierarchical") for mode in MODES]
    run_ranks(_sim_equals_gloo, 4, 2, cases, timeout=280)


def test_delayed_modes_on_two_nodes_of_two_ranks():
    # delay=1 settles a bucket's previous job when the bucket comes back, a step later.
    modes = ["bf16", "bf16-acc-ef", "int8-ef", "int4-ef"]
    cases = [(mode, topology, 1) for mode in modes for topology in ("flat", "hierarchical")]
    run_ranks(_sim_equals_gloo, 4, 2, cases, timeout=280)


def _load_mid_run(rank, world, mode):
    nccl_sim.install()
    sim = dist.new_group(backend=nccl_sim.BACKEND)
    torch.manual_seed(0)
    model = DDP(_Net(), process_group=sim, bucket_cap_mb=0.002)
    state = fastddp.CompressState(process_group=sim, **{**preset(mode), "delay": 1})
    model.register_comm_hook(state, fastddp.compress_hook)
    gen = torch.Generator().manual_seed(rank)
    saved = None
    for _ in range(3):
        model(torch.randn(8, 24, generator=gen)).square().mean().backward()
        saved = saved or state.state_dict()
    running = state._pipeline
    jobs = [entry.job for entry in state._delayed.entries.values() if entry.job is not None]
    # A reduction has the next step to cross the wire: one still has a stage to issue.
    assert any(not job.result.done() for job in jobs) and any(
        r.dirty for r in running._runtimes.values()
    )
    # Rolling back to a checkpoint: the reductions in flight finish before their buffers are
    # dropped, and the stream is ordered after them (on a GPU a freed block could otherwise be
    # handed out while a decode still writes it).
    state.load_state_dict(saved)
    assert all(job.result.done() for job in jobs)
    assert not any(r.dirty for r in running._runtimes.values())
    model(torch.randn(8, 24, generator=gen)).square().mean().backward()  # and training goes on


def test_a_load_mid_run_finishes_the_reductions_in_flight():
    run_ranks(_load_mid_run, 2, "int8-ef")  # two stages: the second waits for the next step


def _host_read_after_flush(rank, world):
    nccl_sim.install()
    sim = dist.new_group(backend=nccl_sim.BACKEND)
    torch.manual_seed(0)
    model = DDP(_Net(), process_group=sim, bucket_cap_mb=0.002)
    state = fastddp.CompressState(process_group=sim, **preset("int8-ef"))
    seen = []

    def hook(state, bucket):
        fut = fastddp.compress_hook(state, bucket)
        # What flush() promises: the bucket can be read here, before anyone waits on fut.
        state.flush()
        seen.append(bucket.buffer().clone())
        return fut

    model.register_comm_hook(state, hook)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):  # the second step has DDP's rebuilt buckets, several of them
        seen.clear()
        model.zero_grad()
        model(torch.randn(8, 24, generator=gen)).sum().backward()
    assert len(seen) > 2, len(seen)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.equal(torch.cat(seen).sort().values, grads.sort().values), "read before decode"


def test_a_host_read_after_flush_sees_the_decoded_bucket():
    run_ranks(_host_read_after_flush, 2)


def _dropped_in_flight(rank, world, planted):
    # delay=1 leaves reductions in flight past every step; a state dropped then (the end of
    # a phase, a rebuilt model) must not free buffers that its streams still write.
    nccl_sim.install()
    sim = dist.new_group(backend=nccl_sim.BACKEND)
    if planted is not None:
        _mutate(planted, LIFETIME_MUTATIONS)
    torch.manual_seed(0)
    model = DDP(_Net(), process_group=sim, bucket_cap_mb=0.002)
    state = fastddp.CompressState(process_group=sim, **{**preset("int8-ef"), "delay": 1})
    model.register_comm_hook(state, fastddp.compress_hook)
    gen = torch.Generator().manual_seed(rank)
    sim_streams.early_frees()  # (what earlier calls in this process left)
    for _ in range(3):
        model(torch.randn(8, 24, generator=gen)).square().mean().backward()
    del model, state
    gc.collect()
    found = sim_streams.early_frees()
    if planted is None:
        assert found == [], found
    else:
        assert found, f"the planted {planted} went unseen"


@pytest.mark.parametrize("planted", [None, *LIFETIME_MUTATIONS])
def test_a_state_dropped_in_flight_frees_nothing_a_stream_still_writes(planted):
    run_ranks(_dropped_in_flight, 2, planted)


@pytest.mark.parametrize("mutation", [*MUTATIONS, *NATIVE_MUTATIONS])
def test_a_deleted_wait_makes_the_run_differ(mutation):
    # delay=1 last: its reductions outlive the backward pass, so later steps and stats()
    # are all that order the reader after them.
    cases = [("bf16", "flat"), ("int8-ef", "flat"), ("bf16-acc-ef", "flat"), ("int8-ef", "flat", 1)]
    run_ranks(_sim_equals_gloo, 2, 1, cases, mutation, timeout=200)


def _backend_semantics(rank, world):
    nccl_sim.install()
    sim = dist.new_group(backend=nccl_sim.BACKEND)
    t = torch.full((6,), float(rank + 1))
    work = dist.all_reduce(t, group=sim, async_op=True)
    assert work.get_future().done(), "an NCCL future is complete once the work is enqueued"
    assert t.isnan().all(), "the output must read as NaN before the wait"
    work.wait()
    assert torch.equal(t, torch.full((6,), 3.0)), t
    # An input written between the call and the wait: NCCL's stream may still be reading it.
    src, out = torch.arange(4.0), torch.empty(4)
    work = dist.all_to_all_single(out, src, group=sim, async_op=True)
    src.add_(1)
    with pytest.raises(nccl_sim.SimRace, match="input of all_to_all_single"):
        work.wait()
    # An output written before the wait: NCCL's stream may still be writing it.
    out = torch.empty(4)
    work = dist.all_gather_into_tensor(out, torch.ones(2), group=sim, async_op=True)
    out[0] = 1.0
    with pytest.raises(nccl_sim.SimRace, match="output of all_gather_single"):
        work.wait()


def test_the_backend_completes_like_nccl_and_sees_races():
    run_ranks(_backend_semantics, 2)
