"""``CompressState(dtype="auto")``: one candidate is that mode; the plan is made by trial, alike
on every rank; a mode per bucket reduces each bucket as that mode does; residuals of a candidate
left behind are repaid; bad settings are refused."""

import copy
import os
import pickle
import re
import statistics
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.bench.common import auto_bytes
from fastddp.hooks import auto, links, pipeline
from fastddp.hooks.topology import NODE_ENV

from .._dist import run_ranks
from .test_hook_core import _grads, _Net

pytestmark = pytest.mark.timeout(240)


def _train(model, steps, rank, opt=True):
    gen = torch.Generator().manual_seed(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if opt else None
    grads = []
    for _ in range(steps):
        model.zero_grad()
        model(torch.randn(8, 24, generator=gen)).square().mean().backward()
        grads.append(_grads(model).clone())
        if optimizer is not None:
            optimizer.step()
    return grads


def _one_candidate(rank, world, name):
    base = _Net(depth=4)
    fixed = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    if name == auto.NONE:
        fixed.register_comm_hook(None, allreduce_hook)
    else:
        fixed.register_comm_hook(fastddp.CompressState.from_preset(name), fastddp.compress_hook)
    chosen = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto", allow=[name])
    chosen.register_comm_hook(state, fastddp.compress_hook)
    want, got = _train(fixed, 8, rank), _train(chosen, 8, rank)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{name} step {step}: {(a - b).abs().max().item():.3e}"
    assert state.stats()["plan"]["mode"] == name and state.stats()["mode"] == name


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["none", "bf16", "bf16-acc", "int8-ef"])
def test_one_candidate_is_that_mode_bit_for_bit(name):
    run_ranks(_one_candidate, 2, name)


def _as_ranked(ms: dict) -> dict:
    return {n: s / (1 + auto.PLAIN_EDGE) if n == "none" else s for n, s in ms.items()}


def _next_rounds(round_ms: list[dict], none_last: bool = False) -> list[list[str]]:
    """The candidates each measured round should leave, from the medians after it: those within
    ELIMINATE of the fastest, then a run-off of the two fastest if they lie within RUNOFF, "none"
    ranked PLAIN_EDGE faster than measured. With ``none_last`` (fastddp.register_comm_hook) a
    later round runs "none" last."""
    out = []
    for i, measured in enumerate(round_ms):
        alive, ms = list(measured), _as_ranked(measured)
        if i < auto.TRIAL_ROUNDS - 1:
            limit = auto.ELIMINATE[min(i, len(auto.ELIMINATE) - 1)] * min(ms.values())
            alive = [n for n in alive if ms[n] <= limit]
        if i == auto.TRIAL_ROUNDS - 2 and len(alive) > 1:
            first, second = sorted(alive, key=ms.get)[:2]
            if ms[second] <= ms[first] * (1 + auto.RUNOFF):
                alive = [n for n in alive if n in (first, second)]
        out.append(alive)
    if none_last:  # (not the candidates left at the end: no round of theirs follows)
        out[:-1] = [[n for n in a if n != "none"] + ["none"] * ("none" in a) for a in out[:-1]]
    return out


def _plan_alike(rank, world, trial, cpp):
    if trial == "run-off":  # no candidate dropped, and a run-off of the two fastest, whatever
        auto.ELIMINATE, auto.RUNOFF = (float("inf"),) * 2, float("inf")  # their figures
    elif trial == "none-favoured":  # "none" ranked infinitely fast: it alone survives round 1
        auto.PLAIN_EDGE = float("inf")
    elif trial == "none-in-run-off":  # no candidate dropped, and "none" in the run-off (with
        auto.ELIMINATE, auto.RUNOFF = (float("inf"),) * 2, float("inf")  # C++ turns: run last)
        auto.PLAIN_EDGE = 1e6
    # No re-plan: steps of a few ms vary twofold on a shared machine, enough for two checks in
    # a row to see a changed step and start another trial (re-plans have tests of their own).
    auto.MARGIN = float("inf")
    model = DDP(_Net(depth=4), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto")
    if cpp:  # the turns of "none" in C++, measured there
        fastddp.register_comm_hook(model, state)
    else:
        model.register_comm_hook(state, fastddp.compress_hook)
    modes, settled, settling = [], [], []  # the steps that wait for the device when stamped
    if not cpp:  # (trial.settle waits on CUDA alone: here, which steps call it)
        auto.trial.settle = lambda device: settled.append(len(modes))
    for _ in range(state.trial_steps + 3):
        _train(model, 1, rank, opt=False)
        modes.append(state.stats()["mode"])
        settling.append(cpp and state._switch.control.settling)  # for the step after
    # The trial: a warm-up step, a round of the candidates that make buffers, then measured
    # rounds of turns in allow order, each of the candidates left in the race.
    allow = auto.DEFAULT_ALLOW
    plan = state.stats()["plan"]
    rounds = plan["rounds"]
    assert rounds[0] == list(allow) and 1 <= len(rounds) <= auto.TRIAL_ROUNDS - 1 + 3
    assert [sorted(r) for r in plan["round_ms"]] == [sorted(r) for r in rounds]
    expected = _next_rounds(plan["round_ms"], cpp)
    assert expected[:-1] == rounds[1:] and sorted(expected[-1]) == sorted(plan["left"])
    # The candidates left are in allow order, the order of accuracy the per-bucket search
    # keeps, also where the turns ran "none" last (fastddp.register_comm_hook).
    assert plan["left"] == [n for n in auto.DEFAULT_ALLOW if n in plan["left"]], plan["left"]
    if trial in ("run-off", "none-in-run-off"):
        assert len(rounds) == auto.TRIAL_ROUNDS - 1 + auto.RUNOFF_ROUNDS, rounds
    if trial == "none-in-run-off":
        assert "none" in plan["left"] and len(plan["left"]) == 2, plan
    elif trial == "none-favoured":
        assert len(rounds) == 1 and plan["left"] == ["none"] and plan["mode"] == "none", plan
    trial = [allow[0], *[n for n in allow if n != "none"], *[n for r in rounds for n in r]]
    assert modes[: len(trial)] == trial, modes
    assert set(plan["step_ms"]) == set(allow)
    assert all(ms > 0 for ms in plan["step_ms"].values())
    # This rank's steps: one per measured round a candidate ran in, its median under the
    # slowest rank's.
    ran = {n: sum(n in r for r in rounds) for n in allow}
    assert {n: len(v) for n, v in plan["trial_ms"].items()} == ran
    assert state.stats()["native_steps"] >= (ran["none"] if cpp else 0) and (
        cpp or state.stats()["native_steps"] == 0
    )
    for n, v in plan["trial_ms"].items():
        assert 0 < statistics.median(v) <= plan["step_ms"][n] + 1e-9
    left = plan["left"]
    assert plan["uniform"] in left
    ranked = _as_ranked(plan["step_ms"])
    fastest = min(ranked[n] for n in left)
    # The first of allow within PREFER, whatever order the turns ran in.
    close = [n for n in allow if n in left and ranked[n] <= fastest * (1 + auto.PREFER)]
    assert plan["uniform"] == close[0], plan
    _check_links(state, plan, world)
    # A model per bucket was fitted (where two candidates were left); a mixed proposal takes
    # turns with the uniform choice.
    buckets, turns = [plan["mode"]], []
    if len(left) < 2:
        assert plan["buckets"] is None
    else:
        buckets = [b["mode"] for b in plan["buckets"]]
        numel = sum(p.numel() for p in model.parameters())
        assert len(buckets) >= 2 and sum(b["numel"] for b in plan["buckets"]) == numel
        assert set(plan["model"]["rate_MBps"]) == set(allow)
        # (A proposal under MIX_GAIN is kept in "proposed" too, but takes no turns.)
        if "verify_ms" in plan:
            assert plan["mode"] == auto.MIXED or "proposed" in plan, plan
            turns = [auto.MIXED, plan["uniform"]] * auto.VERIFY_ROUNDS
        assert modes[len(trial) : len(trial) + len(turns)] == turns, modes
        if plan["mode"] != auto.MIXED:
            assert buckets == [plan["mode"]] * len(buckets)
    # (made at the trial's last step; a proposal's turns follow)
    assert plan["made_at_step"] == len(trial) and plan["plans"] == 1, (plan, modes)
    after = len(trial) + len(turns)
    assert modes[after:] == [plan["mode"]] * (len(modes) - after)
    # Every step of the trial, and the start of the first under the plan (the last measured
    # step's end), waits for the device before its clock reading: in C++ where it ran there.
    if cpp:
        assert settling == [i < after for i in range(len(modes))], (settling, after)
    else:
        assert settled == list(range(after + 1)), (settled, after)
    # Every rank made the same plan from the same (all-reduced) figures.
    codes = [list(allow).index(m) if m in allow else -1 for m in buckets]
    mine = torch.tensor([*codes, *plan["step_ms"].values()])
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    assert all(torch.equal(e, mine) for e in everyone)
    # A resumed state keeps the plan and makes no trial.
    saved = pickle.loads(pickle.dumps(state.state_dict()))
    again = fastddp.CompressState(dtype="auto")
    again.load_state_dict(saved)
    # (its candidates stay on the Python path, where the collectives are timed, loaded too)
    assert saved["candidates"] and all(s._runner is None for s in again._states.values())
    resumed = again.stats()
    assert resumed["plan"] == plan and resumed["mode"] == plan["mode"], (resumed, plan)


def _check_links(state, plan, world):
    # What the network gave the trial's collectives (one node here: every level is "intra"):
    # each fastddp candidate's bytes in each of its measured steps, from both ranks, in as
    # many collectives as its buckets' stages, in flight for part of the steps' time.
    timed = {n: len(ms) for n, ms in plan["trial_ms"].items() if n != "none"}
    sent = stages = 0
    for name, steps in timed.items():
        candidate = state._states[name]
        slots = [slot for _, slot in candidate._table.by_index()]
        sent += steps * sum(s.path.sent_bytes(s, candidate._topology) for s in slots)
        stages += steps * sum(s.path.stages for s in slots)
    assert set(plan["links"]) == {"intra"}, plan["links"]
    intra = plan["links"]["intra"]
    assert intra["MB"] * 1e6 == pytest.approx(world * sent, rel=1e-9), (intra, sent)
    assert intra["collectives"] == stages, (intra, stages)
    steps_ms = sum(sum(ms) for n, ms in plan["trial_ms"].items() if n != "none")
    assert 0 < intra["busy_ms"] < steps_ms, (intra, steps_ms)
    assert intra["MBps"] == pytest.approx(intra["MB"] / intra["busy_ms"] * 1e3)


def _levels_of_two_nodes(rank, world):
    # Two "nodes" of two ranks (told apart by FASTDDP_NODE_ID): bf16 takes two levels, int8
    # with error feedback the flat path over both. Each level's bytes are those its
    # collectives carried: inside the node, across, and over every rank.
    os.environ[NODE_ENV] = f"node-{rank // 2}"
    # No re-plan, no candidate dropped, no run-off, no mixed plan's turns: the plan is made
    # after 3 measured rounds.
    auto.MARGIN, auto.RUNOFF, auto.MIX_GAIN = float("inf"), -1.0, float("inf")
    auto.ELIMINATE = (float("inf"),) * 2
    model = DDP(_Net(depth=4), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto", allow=["bf16", "int8-ef:flat"])
    model.register_comm_hook(state, fastddp.compress_hook)
    # A timed collective's span starts before it is issued: a small one may complete before
    # issue() returns, and a span begun after that would be empty (its level then missing).
    entered, timed = [], []
    real_issue, real_issued = pipeline.issue, links.issued

    def issue(collective):
        entered.append(time.perf_counter())
        return real_issue(collective)

    def issued(job, stage, began, stamp):
        timed.append((began, entered[-1]))
        return real_issued(job, stage, began, stamp)

    pipeline.issue, links.issued = issue, issued
    try:
        # A warm-up, a step of each to make buffers, the rounds, and the step adopting the plan.
        _train(model, 1 + 2 + (auto.TRIAL_ROUNDS - 1) * 2 + 1, rank, opt=False)
    finally:
        pipeline.issue, links.issued = real_issue, real_issued
    assert timed and all(began <= issue for began, issue in timed), timed
    plan = state.stats()["plan"]
    assert plan is not None and not plan["trial"] and len(plan["rounds"]) == 3, plan
    mine = dict.fromkeys(links.LEVELS, 0)
    for name, ms in plan["trial_ms"].items():
        candidate = state._states[name]
        topo = candidate._topology
        for _, slot in candidate._table.by_index():
            sent, cross = slot.path.sent_bytes(slot, topo), slot.path.cross_bytes(slot, topo)
            if name == "bf16":
                assert slot.path.name == "hierarchical-allreduce"
                mine["cross"] += len(ms) * cross
                mine["intra"] += len(ms) * (sent - cross)
            else:
                assert slot.path.name == "alltoall"
                mine["flat"] += len(ms) * sent
    nodes = torch.tensor([float(mine[level]) for level in links.LEVELS], dtype=torch.float64)
    dist.all_reduce(nodes)  # every rank's bytes; the figures are per node
    assert set(plan["links"]) == set(links.LEVELS), plan["links"]
    for level, want in zip(links.LEVELS, nodes.tolist()):
        assert plan["links"][level]["MB"] * 1e6 == pytest.approx(want / 2, rel=1e-9), level


def _kernels_timed(rank, world):
    # Few launches and much work for the GPU a step: the host runs many steps ahead of the
    # kernels, so a step timed by the host's clock alone would be a fraction of the kernels'.
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    nccl = dist.new_group([0], backend="nccl")
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).to(device)
    x = torch.randn(8192, 2048, device=device)

    def steps(model, n):
        for _ in range(n):  # no optimizer and nothing read on the host: no wait for the GPU
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()

    plain = DDP(net, device_ids=[0], process_group=nccl)
    steps(plain, 3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    steps(plain, 5)
    end.record()
    end.synchronize()
    kernels_ms = start.elapsed_time(end) / 5
    for cpp in (False, True):
        model = DDP(net, device_ids=[0], process_group=nccl)
        state = fastddp.CompressState(dtype="auto", process_group=nccl)
        if cpp:
            fastddp.register_comm_hook(model, state)
        else:
            model.register_comm_hook(state, fastddp.compress_hook)
        steps(model, state.trial_steps + 2)
        plan = state.stats()["plan"]
        assert plan is not None and not plan["trial"], plan
        for name, ms in plan["step_ms"].items():  # (the hooks only add to the kernels' time)
            assert ms >= 0.7 * kernels_ms, (cpp, name, ms, kernels_ms, plan["trial_ms"])
    dist.destroy_process_group(nccl)


def test_on_cuda_a_plan_is_held_against_its_own_first_figure():
    # The trial's steps waited for the device at each clock reading, the plan's do not: where
    # the host overlaps the kernels the two differ, and every check would strike against the
    # trial's figure, a trial again every two checks. On the CPU the trial's figure holds.
    from fastddp.hooks import replan

    cpu = replan.Checks()
    assert [cpu.judge(0.07, 100.0, 0.25, False) for _ in range(2)] == pytest.approx([0.7, 0.7])
    assert cpu.strikes == 2
    cuda = replan.Checks()
    ratios = [cuda.judge(s, 100.0, 0.25, True) for s in (0.07, 0.077, 0.07)]
    assert ratios == pytest.approx([1.0, 1.1, 1.0]) and cuda.strikes == 0
    cuda.judge(0.2, 100.0, 0.25, True)  # a link that slows down is seen from there on
    assert cuda.judge(0.2, 100.0, 0.25, True) == pytest.approx(0.2 / 0.07) and cuda.strikes == 2


@pytest.mark.cuda
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_trial_times_the_kernels_not_the_host():
    run_ranks(_kernels_timed, 1)


@pytest.mark.multiproc
def test_each_level_of_two_nodes_is_timed_apart():
    run_ranks(_levels_of_two_nodes, 4)


@pytest.mark.multiproc
@pytest.mark.parametrize("cpp", [False, True], ids=["python", "register_comm_hook"])
@pytest.mark.parametrize("trial", ["as-measured", "run-off", "none-favoured", "none-in-run-off"])
def test_the_plan_is_made_by_trial_and_alike_on_every_rank(trial, cpp):
    run_ranks(_plan_alike, 2, trial, cpp)


def _owed_residuals(rank, world):
    # int8 with error feedback takes turns with plain fp32, which the plan then keeps (PREFER
    # made large, and no candidate dropped: the first candidate in allow order wins). What
    # error feedback kept is added at the plan, so the sum of what was applied equals the sum
    # of the true averages (fixed weights: each step's gradient is known). One bucket: no
    # mixed plan is proposed.
    auto.PREFER, auto.ELIMINATE = 100.0, (1e9, 1e9)
    base = _Net(depth=4)
    model = DDP(copy.deepcopy(base), bucket_cap_mb=25)
    state = fastddp.CompressState(dtype="auto", allow=["none", "int8-ef"])
    model.register_comm_hook(state, fastddp.compress_hook)
    plain = DDP(copy.deepcopy(base), bucket_cap_mb=25)
    steps = state.trial_steps + 1
    got, want = _train(model, steps, rank, opt=False), _train(plain, steps, rank, opt=False)
    plan = state.stats()["plan"]
    assert plan["mode"] == "none" and plan["made_at_step"] < steps, (plan, steps)
    at_plan = plan["made_at_step"]
    kept = (sum(want[:at_plan]) - sum(got[:at_plan])).abs().max().item()
    assert kept > 1e-6, "int8 rounding left nothing in the residuals: the test shows nothing"
    gap = (sum(want) - sum(got)).abs().max().item()
    assert gap < kept / 100, f"the residuals at the plan were lost: {gap:.3e} (kept {kept:.3e})"


@pytest.mark.multiproc
def test_residuals_of_a_candidate_left_behind_are_repaid():
    run_ranks(_owed_residuals, 2)


def _allow_differs(rank, world):
    model = DDP(_Net(depth=2), bucket_cap_mb=0.01)
    allow = ["none", "bf16"] if rank == 0 else ["none", "int8-ef"]
    model.register_comm_hook(
        fastddp.CompressState(dtype="auto", allow=allow), fastddp.compress_hook
    )
    with pytest.raises(ValueError, match=r"ranks disagree on CompressState\(dtype='auto'"):
        model(torch.ones(2, 24)).sum().backward()
    # "auto" on one rank, a fixed mode on the other: their first collectives (the trial's
    # check, the handshake) did not line up, and Gloo aborted; now both meet in a handshake.
    model = DDP(_Net(depth=2), bucket_cap_mb=0.01)
    state = fastddp.CompressState(dtype="auto") if rank == 0 else fastddp.CompressState()
    model.register_comm_hook(state, fastddp.compress_hook)
    with pytest.raises(ValueError, match="ranks disagree on the compression settings") as error:
        model(torch.ones(2, 24)).sum().backward()
    assert "  rank 0: dtype='auto', topology='auto'\n  rank 1: dtype=bfloat16," in str(error.value)
    dist.barrier()


@pytest.mark.multiproc
def test_ranks_that_disagree_on_allow_or_auto_fail_alike():
    run_ranks(_allow_differs, 2)


def _plans_differ(rank, world):
    # A rank that runs a loaded plan issues other collectives than one that starts a trial, or
    # that runs another plan (or holds its steps against another time, and re-plans alone):
    # every rank raises at the first step, none waits for the others.
    allow = ["none", "bf16", "int8-ef"]

    def load(state, mode, ms):
        planned = {"mode": mode, "uniform": mode, "step_ms": {}, "planned_ms": ms}
        planned.update(made_at_step=0, plans=1, buckets=None)
        state.load_state_dict({"settings": state.settings(), "plan": planned, "candidates": {}})

    one, two = r"ranks \[0\]: plan A\n  ranks \[1\]: ", "plan B"
    cases = [(("bf16", 9.0), None, one + "no plan"), (("bf16", 9.0), ("int8-ef", 9.0), one + two),
             (("bf16", 9.0), ("bf16", 8.123456789), one + two)]  # fmt: skip
    for mine, other, want in cases:
        model = DDP(_Net(depth=2), bucket_cap_mb=0.01)
        state = fastddp.CompressState(dtype="auto", allow=allow)
        plan = mine if rank == 0 else other
        if plan is not None:
            load(state, *plan)
        model.register_comm_hook(state, fastddp.compress_hook)
        with pytest.raises(ValueError, match="load_state_dict gave the ranks different plans") as e:
            model(torch.ones(2, 24)).sum().backward()
        assert re.search(want, str(e.value)), str(e.value)
        this = "none" if plan is None else f"{plan[0]}, {plan[1]:.6g} ms a step"  # 8.12346
        assert f"(this rank's: {this})" in str(e.value), str(e.value)
    # Loaded again after steps run: agreed on again.
    model = DDP(_Net(depth=2), bucket_cap_mb=0.01)
    state = fastddp.CompressState(dtype="auto", allow=allow)
    load(state, "bf16", 9.0)
    model.register_comm_hook(state, fastddp.compress_hook)
    model(torch.ones(2, 24)).sum().backward()
    load(state, "bf16", 9.0 - rank)
    with pytest.raises(ValueError, match="load_state_dict gave the ranks different plans"):
        model(torch.ones(2, 24)).sum().backward()
    dist.barrier()


@pytest.mark.multiproc
def test_ranks_that_loaded_different_plans_fail_alike():
    run_ranks(_plans_differ, 2)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(allow=[]), ValueError, "allow is empty"),
        (dict(allow=["bf16", "int9"]), ValueError, r"allow is unknown \['int9'\]"),
        (dict(allow=["bf16", "bf16"]), ValueError, "allow is repeated names"),
        (dict(allow="bf16"), TypeError, "allow must be a list of mode names"),
        # In order: a set's differs from process to process (PYTHONHASHSEED), and with it the
        # reference and the ties' winner.
        (dict(allow={"bf16", "none"}), TypeError, "allow must be a list of mode names, in order"),
        (dict(block_size=0), ValueError, "block_size belongs to a fixed mode"),
        (dict(delay=0.0), ValueError, "delay belongs to a fixed mode"),
        (dict(stochastic_rounding=0), ValueError, "stochastic_rounding belongs to a fixed mode"),
        (dict(allow=["int8-ef:ring"]), ValueError, r"allow is unknown \['int8-ef:ring'\]"),
        (dict(allow=["none:flat"]), ValueError, r"allow is unknown \['none:flat'\]"),
        # A colon naming no path was int8-ef again, as a second candidate.
        (dict(allow=["int8-ef", "int8-ef:"]), ValueError, r"allow is unknown \['int8-ef:'\]"),
        (dict(error_feedback=True), ValueError, "error_feedback belongs to a fixed mode"),
        (dict(dtype="fast"), ValueError, "dtype must be a torch.dtype or 'auto'"),
        (dict(alow=["bf16"]), TypeError, "unexpected keyword argument 'alow'"),
        # With "none" alone no candidate's state checks them: checked all the same.
        (dict(allow=["none"], topology="ring"), ValueError, "topology must be one of"),
        (dict(allow=["none"], seed="x"), TypeError, "seed must be an int, got 'x'"),
        (dict(allow=["none"], process_group=42), TypeError, "process_group must be a torch"),
    ],
)
def test_bad_auto_settings(kwargs, error, message):
    with pytest.raises(error, match=message):
        fastddp.CompressState(**{"dtype": "auto", **kwargs})


def test_a_plan_given_out_shares_nothing_with_the_state():
    # stats()["plan"] and state_dict()["plan"] are copies: the rounds' lists of candidates
    # were the live plan's, so a change to them changed the state.
    from fastddp.hooks import choice

    plan = {"mode": "bf16", "rounds": [["none", "bf16"], ["bf16"]], "links": {"a": [1.0]}}
    out = choice.plain(plan)
    out["rounds"][0].append("int8-ef")
    out["links"]["a"].append(2.0)
    assert plan == {"mode": "bf16", "rounds": [["none", "bf16"], ["bf16"]], "links": {"a": [1.0]}}


def test_allow_without_auto_is_refused_by_name():
    with pytest.raises(TypeError, match="allow= lists the modes dtype='auto' chooses from"):
        fastddp.CompressState(allow=["none", "bf16"])


def test_auto_is_refused_by_all_reduce_and_by_another_allow():
    with pytest.raises(ValueError, match="state has dtype='auto'"):
        fastddp.all_reduce(torch.ones(4), state=fastddp.CompressState(dtype="auto"))
    saved = fastddp.CompressState(dtype="auto", allow=["none", "bf16"]).state_dict()
    with pytest.raises(ValueError, match="do not match this state's"):
        fastddp.CompressState(dtype="auto").load_state_dict(saved)
    plan = {"mode": auto.MIXED, "buckets": [{"mode": "bf16"}, {"mode": "int4-ef"}]}
    with pytest.raises(ValueError, match=r"the saved plan uses \['int4-ef'\], which allow"):
        state = fastddp.CompressState(dtype="auto")
        state.load_state_dict({"settings": state.settings(), "plan": plan, "candidates": {}})
    state = pickle.loads(pickle.dumps(fastddp.CompressState(dtype="auto", allow=["bf16"])))
    assert state.allow == ("bf16",) and "allow=['bf16']" in repr(state)
    flat = fastddp.CompressState(dtype="auto", allow=["bf16", "int8-ef"], topology="flat", seed=3)
    again = pickle.loads(pickle.dumps(flat))
    assert again.settings() == flat.settings() and again.settings()["topology"] == "flat"


class _Chain(torch.nn.Module):
    """Twelve 256-wide layers: three buckets of 1 MiB, each of four layers (one bucket at
    DDP's first step)."""

    def __init__(self, width=256, depth=12):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _Reversed(torch.nn.Module):
    """Layers applied in the reverse of their order of registration: DDP's first bucket layout
    (registration order, reversed) and its rebuilt one (gradients' ready order) differ."""

    def __init__(self, width=24, depth=4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def _named_alike(rank, world):
    # The warm-up step runs int8-ef on DDP's first layout, bf16 first runs on the rebuilt one:
    # each would name the parameters in another order by itself.
    model = DDP(_Reversed(), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto", allow=["int8-ef", "bf16"])
    model.register_comm_hook(state, fastddp.compress_hook)
    _train(model, 4, rank, opt=False)
    tables = [candidate._table.param_keys for candidate in state._states.values()]
    names = [[table.get(p) for p in model.parameters()] for table in tables]
    assert None not in names[0] and names[0] == names[1], names


@pytest.mark.multiproc
def test_every_candidate_names_parameters_alike():
    run_ranks(_named_alike, 2)


def _mixed_plan(rank, world):
    # A mixed plan, loaded as a resumed job would: each bucket is reduced exactly as its mode
    # reduces it alone (error feedback included), and a saved state keeps the plan.
    owner = {}  # parameter -> the bucket that holds it
    first_step = {}

    def recording(state, bucket):
        for p in bucket.parameters():
            owner.setdefault(p, set()).add(bucket.index())
        if not isinstance(state, tuple):
            return fastddp.compress_hook(state, bucket)
        # A fixed mode's (state, hook), after a first step of fp32, as the mixed plan's first
        # bucket (DDP's first step has one bucket: the plan's first mode reduces everything).
        if first_step[state]:
            first_step[state] = not bucket.is_last()
            return allreduce_hook(None, bucket)
        return state[1](state[0], bucket)

    def run(hooked):
        first_step[hooked] = True
        model = DDP(_Chain(), bucket_cap_mb=1)
        model.register_comm_hook(hooked, recording)
        gen = torch.Generator().manual_seed(rank)
        grads = []
        for _ in range(6):
            model.zero_grad()
            model(torch.randn(8, 256, generator=gen)).square().mean().backward()
            grads.append(_grads(model).clone())
        return model, grads

    fixed = {
        "none": run((None, allreduce_hook))[1],
        "bf16": run((fastddp.CompressState.from_preset("bf16"), fastddp.compress_hook))[1],
    }
    last, fixed["int8-ef"] = run(
        (fastddp.CompressState.from_preset("int8-ef"), fastddp.compress_hook)
    )
    sizes = [0] * 3  # elements per bucket, from the second step on
    for p in last.parameters():
        sizes[max(owner[p])] += p.numel()
    owner.clear()
    allow = ["none", "bf16", "int8-ef"]
    modes = ["none", "int8-ef", "bf16"]
    planned = {
        "mode": auto.MIXED,
        "uniform": "bf16",
        "step_ms": {},
        "planned_ms": 1e9,
        "made_at_step": 0,
        "plans": 1,
        "buckets": [{"mode": m, "numel": n} for m, n in zip(modes, sizes)],
    }
    state = fastddp.CompressState(dtype="auto", allow=allow)
    state.load_state_dict({"settings": state.settings(), "plan": planned, "candidates": {}})
    model, got = run(state)
    assert {i for held in owner.values() for i in held} == {0, 1, 2}
    assert state.stats()["mode"] == auto.MIXED and state.stats()["steps_in"][auto.MIXED] == 6
    offset = 0
    for p in model.parameters():
        index = max(owner[p])  # the bucket from the second step on
        want = fixed[modes[index]]
        for step in range(6):
            a, b = got[step][offset : offset + p.numel()], want[step][offset : offset + p.numel()]
            assert torch.equal(a, b), f"bucket {index} ({modes[index]}) step {step}"
        offset += p.numel()
    # The plan's bytes a step, as the benchmarks and the demo report them: each bucket's own.
    payload, _, chose = auto_bytes(state.stats(), sum(sizes))
    fp32, bf16, int8 = (sum(n for m, n in zip(modes, sizes) if m == k) for k in allow)
    assert chose == "mixed (none x1, bf16 x1, int8-ef x1)", chose
    assert fp32 * 4 + bf16 * 2 + int8 <= payload <= fp32 * 4 + bf16 * 2 + int8 * 1.1, payload
    again = pickle.loads(pickle.dumps(state))
    assert again.stats()["mode"] == auto.MIXED
    assert [b["mode"] for b in again.stats()["plan"]["buckets"]] == modes


@pytest.mark.multiproc
def test_a_mode_per_bucket_reduces_each_bucket_as_that_mode():
    run_ranks(_mixed_plan, 2)


def _moved_residuals(rank, world):
    # DDP's first step has one bucket, which the plan's first mode (int8 with error feedback)
    # reduces; then the parameters move to buckets of plain fp32. What int8 kept for them must
    # come back: summed over the steps, their gradients equal the true averages.
    owner = {}

    def recording(state, bucket):
        for p in bucket.parameters():
            owner[p] = bucket.index()
        return fastddp.compress_hook(state, bucket)

    base = _Net(depth=4)
    model = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto", allow=["none", "int8-ef"])
    planned = {"mode": auto.MIXED, "uniform": "none", "step_ms": {}, "planned_ms": 1e9}
    planned.update(made_at_step=0, plans=1, buckets=[{"mode": "int8-ef"}] + [{"mode": "none"}] * 9)
    state.load_state_dict({"settings": state.settings(), "plan": planned, "candidates": {}})
    model.register_comm_hook(state, recording)
    plain = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    got, want = _train(model, 4, rank, opt=False), _train(plain, 4, rank, opt=False)
    offset, moved = 0, []
    for p in model.module.parameters():
        if owner[p] != 0:  # in an fp32 bucket from the second step on
            moved.append(torch.arange(offset, offset + p.numel()))
        offset += p.numel()
    moved = torch.cat(moved)
    assert moved.numel() > 0
    kept = (want[0] - got[0])[moved].abs().max().item()
    assert kept > 1e-6, "int8 rounding left nothing in the residuals: the test shows nothing"
    gap = (sum(want) - sum(got))[moved].abs().max().item()
    assert gap < kept / 100, f"residuals of moved parameters were lost: {gap:.3e} ({kept:.3e})"


@pytest.mark.multiproc
def test_residuals_of_parameters_that_move_to_another_mode_are_repaid():
    run_ranks(_moved_residuals, 2)


def _paths(rank, world):
    # Two "nodes" of two ranks: a candidate that names its path takes it, bit for bit as the
    # fixed mode with that topology, and the two paths are two candidates of one trial.
    import os

    os.environ["FASTDDP_NODE_ID"] = f"node-{rank // 2}"
    base = _Net(depth=4)
    fixed = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    fixed.register_comm_hook(
        fastddp.CompressState.from_preset("int8-ef", topology="flat"), fastddp.compress_hook
    )
    one = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    one.register_comm_hook(
        fastddp.CompressState(dtype="auto", allow=["int8-ef:flat"]), fastddp.compress_hook
    )
    for a, b in zip(_train(one, 4, rank), _train(fixed, 4, rank)):
        assert torch.equal(a, b)
    model = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto", allow=["int8-ef:flat", "int8-ef:hierarchical"])
    model.register_comm_hook(state, fastddp.compress_hook)
    _train(model, state.trial_steps + 1, rank, opt=False)
    candidates = state.stats()["candidates"]
    assert candidates["int8-ef:flat"]["topology_used"] == "flat"
    assert candidates["int8-ef:hierarchical"]["topology_used"] == "hierarchical"
    plan = state.stats()["plan"]
    assert plan is not None and not plan["trial"]
    modes = [plan["mode"]] if plan["buckets"] is None else [b["mode"] for b in plan["buckets"]]
    codes = torch.tensor([state.allow.index(m) for m in modes])
    everyone = [torch.empty_like(codes) for _ in range(world)]
    dist.all_gather(everyone, codes)
    assert all(torch.equal(e, codes) for e in everyone)


@pytest.mark.multiproc
def test_candidates_may_name_their_path():
    run_ranks(_paths, 4)


def _auto_phase(rank, world, path, resume):
    model = DDP(_Net(), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto", allow=["none", "int8-ef"])
    if resume is None:  # a plan made (fewer steps than a check of it: it stays as it is)
        planned = {"mode": "int8-ef", "uniform": "int8-ef", "step_ms": {}, "planned_ms": 1.0}
        planned.update(made_at_step=0, plans=1, buckets=None)
        state.load_state_dict({"settings": state.settings(), "plan": planned, "candidates": {}})
    else:
        state.load_state_dict(fastddp.CompressState.reshard(torch.load(resume), world)[rank])
    model.register_comm_hook(state, fastddp.compress_hook)
    _train(model, 6 if resume is None else 3, rank)
    assert state.stats()["steps_in"]["int8-ef"] == (6 if resume is None else 3)
    everyone = [None] * world
    dist.all_gather_object(everyone, state.state_dict())
    if rank == 0:
        torch.save(everyone, path)
    return state.stats()["plan"]


def _owed_total(saved):
    """The sum of every residual in the int8-ef candidate's state dicts of one job."""
    total = 0.0
    for sd in saved:
        mine = sd["candidates"]["int8-ef"]
        for b in mine["buckets"].values():
            total += sum(
                float(b[k].double().sum())
                for k in ("residual", "shard_residual")
                if b[k] is not None
            )
        carry = mine["carry"]
        total += sum(float(t.double().sum()) for t in carry["stage1"].values())
        total += sum(float(p.double().sum()) for ps in carry["stage2"].values() for _, p in ps)
    return total


@pytest.mark.multiproc
def test_an_auto_state_reshards_to_another_world_size(tmp_path):
    made = run_ranks(_auto_phase, 2, tmp_path / "a.pt", None)[0]
    saved = torch.load(tmp_path / "a.pt")
    regrouped = fastddp.CompressState.reshard(saved, 3)
    assert _owed_total(saved) != 0
    assert abs(_owed_total(regrouped) - _owed_total(saved)) < 1e-6
    # Three ranks go on with the saved plan (no trial), their residuals where they belong.
    plans = run_ranks(_auto_phase, 3, tmp_path / "b.pt", tmp_path / "a.pt")
    for plan in plans:
        assert plan["made_at_step"] == made["made_at_step"] and plan["plans"] == made["plans"]


def _resumed_under_none(rank, world, path, bias):
    # The plan now runs "none"; the int8-ef candidate keeps its residuals for a later trial.
    model = DDP(_Net(bias=bias), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto", allow=["none", "int8-ef"])
    state.load_state_dict(torch.load(path)[rank % 2])
    model.register_comm_hook(state, fastddp.compress_hook)
    try:
        _train(model, 2, rank)
    except ValueError as e:
        return str(e)
    return state.stats()["steps_in"]["none"]


@pytest.mark.multiproc
def test_candidates_the_plan_does_not_run_are_checked_at_the_first_step(tmp_path):
    # Their residuals were taken up, and refused, only when a re-plan's trial reached them:
    # steps or hours later. Now every rank refuses them at the first step, as a fixed mode's.
    run_ranks(_auto_phase, 2, tmp_path / "a.pt", None)
    saved = torch.load(tmp_path / "a.pt")
    for sd in saved:
        sd["plan"].update(mode="none", uniform="none")
    torch.save(saved, tmp_path / "none.pt")
    assert run_ranks(_resumed_under_none, 2, tmp_path / "none.pt", True) == [2, 2]
    for said in run_ranks(_resumed_under_none, 3, tmp_path / "none.pt", True):
        assert "saved by a job of 2 ranks, and this job has 3" in said, said
        assert "CompressState.reshard(saved, 3)" in said
    for said in run_ranks(_resumed_under_none, 2, tmp_path / "none.pt", False):
        assert "the error-feedback residual kept for parameter 2 has 24 elements" in said, said


def _version_2(rank, world):
    # A state dict of an earlier fastddp: every candidate keyed its parameters first to last.
    # Each candidate's table takes that order on load, also bf16's, which holds no residuals
    # and names the parameters for all (its keys checked int8-ef's residuals against others).
    def build():
        model = DDP(_Net(), bucket_cap_mb=0.002)
        state = fastddp.CompressState(dtype="auto", allow=["bf16", "int8-ef"])
        model.register_comm_hook(state, fastddp.compress_hook)
        return model, state

    model, state = build()
    for candidate in state._states.values():
        candidate._table.forward = True
    _train(model, 4, rank)
    saved = state.state_dict()
    assert any(
        b["residual"] is not None for b in saved["candidates"]["int8-ef"]["buckets"].values()
    )
    for candidate in saved["candidates"].values():
        assert candidate.pop("key_order") == "first-to-last"
        candidate["version"] = 2
    model, state = build()
    state.load_state_dict(saved)
    _train(model, 3, rank + 1)
    return {n: c.stats()["parked_residuals"] for n, c in state._states.items()}


@pytest.mark.multiproc
def test_a_version_2_state_dict_keys_every_candidate_alike():
    assert run_ranks(_version_2, 2) == [{"bf16": 0, "int8-ef": 0}] * 2


class _HalfTail(torch.nn.Module):
    # An fp32 layer, then a bf16 one: DDP gives the bf16 gradients a bucket of their own.
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(24, 16), torch.nn.Linear(16, 4).bfloat16()

    def forward(self, x):
        return self.b(self.a(x).bfloat16()).float()


def _sixteen_bit_bucket(rank, world, register):
    model = DDP(_HalfTail(), bucket_cap_mb=0.001)
    state = fastddp.CompressState(dtype="auto")
    if register:
        fastddp.register_comm_hook(model, state)
    else:
        model.register_comm_hook(state, fastddp.compress_hook)
    _train(model, 40, rank)  # through the trial, a run-off and a mixed plan's turns
    stats = state.stats()
    assert stats["plan"] is not None, stats
    assert all(c["passthrough_calls"] > 0 for c in stats["candidates"].values())


@pytest.mark.multiproc
@pytest.mark.parametrize("register", [False, True], ids=["python", "register_comm_hook"])
def test_a_sixteen_bit_bucket_passes_through_the_trial(register):
    run_ranks(_sixteen_bit_bucket, 2, register)
