"""The plan ``dtype="auto"`` chooses at the end of a trial: one candidate, or one per bucket.

The slowest rank's medians decide, identically on every rank: the fastest candidate left by the
trial (``trial.py``), or the first in ``allow`` order within ``prefer`` of it, so that a mode
compresses only when that pays measurably (``"none"`` ranked ``plain_edge`` faster than
measured).

Then, per bucket: the trial also recorded (``measured.py``) when each bucket reached the hook,
the host time of each codec and the bytes each bucket sent, and a model of the backward pass
fitted to those figures (``planner.py``) proposes a mode per bucket: fewer bytes where the
backward pass cannot hide the transfer, more accurate modes where it can. Rank 0's proposal is
broadcast. It is tried only if the model makes the step shorter by ``mix_gain`` of the uniform
choice's step, by taking turns with the uniform choice for ``verify_rounds`` rounds, and kept
only if the turns confirm the model: faster by half the modelled gain, and by ``prefer`` at
least (where compute and transfers share the same cores, the model's overlap is not there).
Mixed plans are proposed for CPU tensors only: on CUDA the host's clock does not see the kernels.

The trial also timed each level of the network (``links.py``); the plan says what each gave.
"""

import logging
import statistics
from typing import Any, Optional

import torch
import torch.distributed as dist

from fastddp.hooks import candidates, checkpoint, links, measured, planner
from fastddp.hooks.candidates import MIXED, Assignment
from fastddp.hooks.trial import Rules, Trial, ranked

__all__ = ["confirmed", "load", "log", "make", "plain", "restored", "settle"]

logger = logging.getLogger("fastddp")


def make(
    trial: Trial, alive: list[str], states: dict, group, device: torch.device, rules: Rules, **at
) -> tuple[dict[str, Any], Optional[tuple[str, ...]]]:
    """The plan of the uniform choice among the candidates ``alive`` after ``trial``, and a
    mode per bucket proposed to try against it, or None (``states``: the fastddp candidates).

    The plan (``stats()["plan"]``) has ``mode`` (the chosen candidate, or ``"mixed"``),
    ``summary`` (the mode, or the modes of a mixed plan with their numbers of buckets),
    ``uniform`` (the best single candidate), ``step_ms`` (each candidate's measured step on the
    slowest rank), ``trial_ms`` (this rank's measured steps of each candidate),
    ``made_at_step``, ``plans`` (how many so far), ``planned_ms`` (the figure later steps are
    held against) and, where a model was fitted, ``model`` (each candidate's fitted link rate,
    host cost of its codec, measured and modelled reduction times) and ``buckets`` (per bucket
    of a mixed plan: its mode, size, the compute before it and its bytes on the slowest link).
    ``rounds`` lists the candidates of each measured round (a run-off's last), ``round_ms`` the
    slowest rank's medians after each, and ``left`` the candidates left after the last.
    ``links`` has, per level of the network the trial's collectives used (``"intra"``,
    ``"cross"``, ``"flat"``: ``links.py``), a node's ``MB`` and its rate while they were in
    flight (``MBps``), ``busy_ms`` and the ``collectives`` per rank; CPU tensors on Gloo.
    ``verify_ms`` has the turns of a mixed plan against the uniform choice; ``proposed`` the
    model's mixed plan where it was not kept (its modelled gain under ``mix_gain``, or not
    confirmed by its turns). ``last_check_ratio`` is the step over ``planned_ms`` at the last
    check judged (``replan.py``). ``at``: ``made_at_step`` and ``plans``, and ``nodes`` (those the
    trial's collectives spanned).
    """
    plan, step_s, profile = _decide(trial, alive, states, group, device, rules, **at)
    if profile is None:
        return plan, None
    compressed = frozenset(states)
    return plan, _propose(plan, profile, step_s, trial.allow, compressed, group, device, rules)


def _decide(
    trial: Trial, alive: list[str], states: dict, group, device: torch.device, rules: Rules, **at
) -> tuple[dict[str, Any], float, Optional[list[float]]]:
    """The plan of the uniform choice among ``alive``, its step on the slowest rank (seconds),
    and the slowest rank's figures of the per-bucket model (``measured.profile``), or None
    where no bucket is to be planned.
    """
    allow = trial.allow
    medians = [statistics.median(trial.periods("trial", n)) for n in allow]
    profile = None
    if len(alive) > 1 and len(allow) > 1 and device.type == "cpu":
        profile = measured.profile(allow, states, trial.runs())
    n = 0 if profile is None else len(profile)
    timed = links.in_flight(trial.collectives())
    # (The least of the ranks' times in flight, as the most of their negatives.)
    busy = [-s for s in timed[1::3]]
    figures = [*medians, *busy, at.pop("nodes"), n, -n]
    figures = torch.tensor(figures, dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)
    values = figures.tolist()
    seconds = dict(zip(allow, values[: len(allow)]))
    busy = [-s for s in values[len(allow) : len(allow) + len(busy)]]
    sums = torch.tensor([*timed[0::3], *timed[2::3]], dtype=torch.float64, device=device)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    world, nodes = dist.get_world_size(group), int(values[-3])
    k, totals = len(links.LEVELS), sums.tolist()
    measured_links = links.summary(totals[:k], busy, totals[k:], nodes, world)
    if values[-2] != -values[-1] or n == 0:  # a rank without a model: no rank plans buckets
        profile = None
    else:  # the slowest rank's figures, on every rank
        flat = torch.tensor(profile, dtype=torch.float64, device=device)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        profile = flat.tolist()
    rank_by = ranked(seconds, rules.plain_edge)
    fastest = min(rank_by[n] for n in alive)
    choice = next(n for n in allow if n in alive and rank_by[n] <= fastest * (1 + rules.prefer))
    plan = {
        "mode": choice,
        "uniform": choice,
        "trial": True,
        "step_ms": {n: s * 1e3 for n, s in seconds.items()},
        # This rank's measured steps, per candidate, in the order they ran.
        "trial_ms": {n: [p * 1e3 for p in trial.periods("trial", n)] for n in allow},
        "made_at_step": at["made_at_step"],
        "plans": at["plans"],
        "buckets": None,
        "model": None,
        "rounds": [list(r) for r in trial.rounds],  # the candidates of each measured round
        "round_ms": [dict(r) for r in trial.round_ms],  # and what each left them at
        # And those left after the last, in allow order, which is the order of accuracy the
        # per-bucket search keeps (the trial's turns may run "none" last).
        "left": [n for n in allow if n in alive],
        # What each level of the network gave the trial's collectives (links.py).
        "links": measured_links,
    }
    return plan, seconds[choice], profile


def _propose(
    plan: dict[str, Any],
    flat: list[float],
    step_s: float,
    allow: tuple[str, ...],
    compressed: frozenset,
    group,
    device: torch.device,
    rules: Rules,
) -> Optional[tuple[str, ...]]:
    """A mode per bucket from the model fitted to the slowest rank's figures ``flat``, rank 0's
    on every rank, or None where its modelled gain is under ``mix_gain`` of the uniform
    choice's step ``step_s``. Puts the model and the buckets in ``plan``. ``compressed``: the
    candidates that are fastddp states."""
    uniform = plan["uniform"]
    n = int(flat[0])
    numel = [int(v) for v in flat[1 : 1 + n]]
    gaps, cost, reduce_s, sent = {}, {}, {}, {}
    at = 1 + n
    for name in allow:
        gaps[name] = flat[at : at + n]
        cost[name], reduce_s[name] = flat[at + n], flat[at + n + 1]
        sent[name] = flat[at + n + 2 : at + 2 * n + 2]
        at += 2 * n + 2
    # (Compressed modes on CPU tensors block: see pipeline.py.)
    profile = planner.Profile(numel, gaps, cost, sent, reduce_s, compressed)
    rates = planner.calibrate(profile)
    modes = planner.search(profile, rates, [uniform] * n, plan["left"])
    # Rank 0 decides; every rank runs what it sent (all ranks issue the same collectives).
    codes = torch.tensor([allow.index(m) for m in modes], dtype=torch.int64, device=device)
    dist.broadcast(codes, 0 if group is None else dist.get_global_rank(group, 0), group=group)
    modes = [allow[c] for c in codes.tolist()]
    plan["model"] = {
        "rate_MBps": {m: r / 1e6 for m, r in rates.items()},
        "cost_ns_per_element": {m: c * 1e9 for m, c in cost.items()},
        "reduce_ms": {m: s * 1e3 for m, s in reduce_s.items()},
        "modelled_ms": {
            uniform: planner.simulate(profile, [uniform] * n, rates) * 1e3,
            MIXED: planner.simulate(profile, modes, rates) * 1e3,
        },
    }
    plan["buckets"] = [
        {"mode": m, "numel": numel[i], "gap_ms": gaps[m][i] * 1e3, "sent_bytes": sent[m][i]}
        for i, m in enumerate(modes)
    ]
    gain = plan["model"]["modelled_ms"][uniform] - plan["model"]["modelled_ms"][MIXED]
    if any(m != uniform for m in modes) and gain >= rules.mix_gain * step_s * 1e3:
        return tuple(modes)
    return None


def confirmed(
    plan: dict[str, Any], trial: Trial, group, device: torch.device, rules: Rules
) -> bool:
    """Whether the turns confirm the proposed mixed plan: faster than the uniform choice by
    half the modelled gain, and by ``prefer`` of its step at least (the slowest rank's means)."""
    uniform = plan["uniform"]
    means = torch.tensor(
        [statistics.mean(trial.periods("verify", label)) for label in (MIXED, uniform)],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(means, op=dist.ReduceOp.MAX, group=group)
    mixed, alone = means.tolist()
    plan["verify_ms"] = {MIXED: mixed * 1e3, uniform: alone * 1e3}
    modelled = plan["model"]["modelled_ms"]
    predicted = (modelled[uniform] - modelled[MIXED]) / 1e3
    return planner.confirms(mixed, alone, predicted, rules.prefer)


def load(
    states: dict[str, Any], allow: tuple[str, ...], mine: dict, state_dict: Any
) -> tuple[Optional[dict[str, Any]], Assignment]:
    """Load a ``dtype="auto"`` state dict's candidates into ``states``; return its plan (to
    run, not to try) and the assignment it runs. ``mine``: the loading state's settings."""
    saved = checkpoint.checked(state_dict, ("settings", "candidates"), "auto")["settings"]
    if saved.get("dtype") != "auto" or saved.get("allow") != list(allow):
        raise ValueError(
            f"CompressState.load_state_dict: saved settings {saved} do not match this "
            f"state's {mine}; build the state with the settings it was saved with"
        )
    plan = state_dict.get("plan")
    using = restored(plan, allow)
    for name, sd in state_dict["candidates"].items():
        checkpoint.load(states[name], sd)
    if plan is None:
        return None, using
    return {**plain(plan), "trial": False, "summary": candidates.summary(using, allow)}, using


def restored(plan: Optional[dict[str, Any]], allow: tuple[str, ...]) -> Assignment:
    """What a saved ``plan`` runs (None: the first candidate), or raise where it uses a candidate
    that ``allow`` does not hold."""
    if plan is None:
        return allow[0]
    mixed = plan["mode"] == MIXED
    modes = [b["mode"] for b in plan["buckets"]] if mixed else [plan["mode"]]
    bad = [m for m in modes if m not in allow]
    if bad:
        raise ValueError(
            f"CompressState.load_state_dict: the saved plan uses {bad}, which allow "
            f"{list(allow)} does not hold; save and load with the same allow"
        )
    return tuple(modes) if mixed else plan["mode"]


def settle(plan: dict[str, Any], label: str) -> None:
    """Mark ``plan`` made, with ``label`` (a candidate, or :data:`MIXED`) its mode."""
    plan["trial"] = False
    plan["mode"] = label
    if label != MIXED and plan["buckets"] is not None:
        if any(b["mode"] != label for b in plan["buckets"]):
            plan["proposed"] = [b["mode"] for b in plan["buckets"]]  # measured slower
        for b in plan["buckets"]:
            b["mode"] = label
    plan["planned_ms"] = {**plan["step_ms"], **plan.get("verify_ms", {})}[label]


def log(plan: dict[str, Any], step: int) -> None:
    """Say the plan made at ``step`` in one INFO line."""
    figures = {
        **plan["step_ms"],
        **{f"{n} again": s for n, s in plan.get("verify_ms", {}).items()},
    }
    rates = plan.get("links") or {}
    logger.info(
        "fastddp auto: plan %d at step %d: %s (step ms, slowest rank: %s)%s",
        plan["plans"],
        step,
        plan["summary"],
        ", ".join(f"{n} {s:.1f}" for n, s in figures.items()),
        "; collectives' MB/s per node: "
        + ", ".join(f"{level} {r['MBps']:.1f}" for level, r in rates.items())
        if rates
        else "",
    )


def plain(plan: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """A copy of ``plan`` that shares no dict or list with it."""
    if plan is None:
        return None
    return _copied(plan)


def _copied(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _copied(v) for key, v in value.items()}
    if isinstance(value, list):  # (the rounds' lists of candidates among them)
        return [_copied(v) for v in value]
    return value
