"""``state_dict()`` and ``load_state_dict()`` of :class:`~fastddp.CompressState`.

A state dict holds the settings (checked on load), the counters, and each bucket's counters and
error-feedback residuals on the CPU, stored with the parameters they belong to, so that they
find their parameters again when the resumed DDP lays its buckets out differently; with
``delay=1`` also the reduced gradients in waiting, by parameter (the same on every rank).

A load that fails on some ranks only (one rank given another's file) must not raise there
alone: the others would wait for it in the first reduction's handshake until the process
group's timeout. :func:`deferred` keeps the error instead, and that handshake raises it on
every rank (``handshake.check``).
"""

import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fastddp.hooks import lifecycle
from fastddp.hooks.reshard import holds_residuals, parked
from fastddp.hooks.settings import mismatch
from fastddp.hooks.stats import COUNTERS

__all__ = ["STATE_VERSION", "checked", "deferred", "load", "save"]

# Version of the state_dict() layout: 2 adds rank, world_size and per-rank parked pieces; 3
# adds "key_order", the order in which a bucket's new parameters were keyed (earlier versions:
# first to last), which the keys of residuals and delayed gradients follow.
STATE_VERSION = 3
_ORDERS = ("last-to-first", "first-to-last")  # SlotTable.forward False, True


def save(state: Any) -> dict[str, Any]:
    """Return ``state``'s state dict; pending reductions are finished first."""
    if not state._pipeline._failure:
        state._pipeline.flush()
    group = state.process_group
    rank = dist.get_rank(group) if dist.is_initialized() else None
    world = dist.get_world_size(group) if dist.is_initialized() else None
    buckets: dict[int, dict[str, Any]] = {}
    for position, (_, slot) in enumerate(state._table.by_index()):
        parts = lifecycle.residuals_of(state, slot, rank)
        buckets[position] = {
            "index": slot.index,
            "numel": slot.numel,
            "world": slot.world,
            "params": None if slot.params is None else [list(p) for p in slot.params],
            **slot.counts(),
            **{k: _cpu(v) if torch.is_tensor(v) else v for k, v in parts.items()},
        }
    return {
        "version": STATE_VERSION,
        "rank": rank,
        "world_size": world,
        "settings": state.settings(),
        "key_order": _ORDERS[state._table.forward],
        "seed": state.seed,  # stochastic rounding's: a resumed run draws what it would have
        "counters": dict(state._counters),
        "buckets": buckets,
        "retired_buckets": state._table.retired(),  # counters no live bucket took
        "carry": state._residuals.state(),
        "delayed": state._delayed.state(state._pipeline.settle),
        # fastddp.all_reduce's op, tensor sizes and bucket size, which its residuals belong to
        "all_reduce": None if state._layout is None else _layout(*state._layout),
    }


def _layout(op: str, sizes: tuple, cap: int) -> dict[str, Any]:
    return {"op": op, "sizes": list(sizes), "bucket_elements": cap}


def checked(state_dict: Any, keys: tuple[str, ...], dtype: str) -> dict[str, Any]:
    """``state_dict`` if it is a dict holding ``keys``; else what it looks like and the fix.
    ``dtype``: the loading state's (``"auto"`` or a codec's name); a state dict of the other
    kind (fixed or ``"auto"``) has other keys, and is named as such."""
    where = "CompressState.load_state_dict"
    if not isinstance(state_dict, dict):
        raise TypeError(
            f"{where}: expected the dict that CompressState.state_dict() returned, got "
            f"{type(state_dict).__name__}"
        )
    saved = state_dict.get("settings")
    theirs = saved.get("dtype") if isinstance(saved, dict) else None
    if theirs is not None and (theirs == "auto") != (dtype == "auto"):
        raise ValueError(
            f"{where}: saved by a CompressState of dtype {theirs!r}, loaded into one of dtype "
            f"{dtype!r}; build the state with the settings it was saved with"
        )
    missing = [k for k in keys if k not in state_dict]
    if missing:
        held = ", ".join(map(str, list(state_dict)[:6])) + (", ..." if len(state_dict) > 6 else "")
        raise ValueError(
            f"{where}: not a CompressState.state_dict() (no {', '.join(missing)}; its keys: "
            f"{held or 'none'}); a model's or an optimizer's state dict goes to their own "
            "load_state_dict, this one takes what state.state_dict() returned"
        )
    return state_dict


def _intact(state_dict: dict[str, Any]) -> None:
    """Refuse a dict damaged inside (a bucket left out, a residual cut short or not a tensor,
    a non-finite residual), which would load and then fail, or train on, at the first step."""
    where = "CompressState.load_state_dict"
    version = state_dict.get("version", 1)
    if not isinstance(version, int) or not 1 <= version <= STATE_VERSION:
        raise ValueError(
            f"{where}: state dict version {version!r}, and this fastddp reads versions 1 to "
            f"{STATE_VERSION}; save it again with this version, or load it with the one that "
            "saved it"
        )
    buckets = state_dict["buckets"]
    if not isinstance(buckets, dict):
        raise TypeError(f"{where}: its buckets are a {type(buckets).__name__}, not a dict")
    gone = sorted(set(range(len(buckets))) - {int(k) for k in buckets})
    if gone:
        raise ValueError(
            f"{where}: the state dict's bucket entries {gone} are missing (their residuals "
            "would be lost); load the one state.state_dict() returned, unchanged"
        )
    for position, saved in buckets.items():
        params = saved.get("params")
        total = None if params is None else sum(int(n) for _, n in params)
        for key, whole in (("residual", True), ("shard_residual", False)):
            t = saved.get(key)
            if t is None:
                continue
            problem = None
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1:
                problem = "is not a 1-D float32 tensor"
            elif whole and total is not None and t.numel() != total:
                problem = f"has {t.numel()} elements but its parameters have {total}"
            if problem is None and not bool(torch.isfinite(t).all()):
                problem = "holds non-finite values"
            if problem is not None:
                raise ValueError(
                    f"{where}: bucket entry {position}'s {key} {problem}: the state dict is "
                    "damaged; load the one state.state_dict() returned, unchanged"
                )
    _carry_intact(state_dict.get("carry") or {}, where)


def _carry_intact(carry: dict[str, Any], where: str) -> None:
    """Refuse parked residuals (saved between a load and the buckets that take them) that are
    not 1-D float32 tensors, or hold inf or NaN: they would be repaid into the gradients."""
    parked = [(f"stage1[{k}]", t) for k, t in carry.get("stage1", {}).items()]
    parked += [(f"replicated[{k}]", t) for k, t in carry.get("replicated", {}).items()]
    for k, pieces in carry.get("stage2", {}).items():
        if isinstance(pieces, torch.Tensor):  # version 1: whole
            parked.append((f"stage2[{k}]", pieces))
        else:
            parked += [(f"stage2[{k}] at {o}", t) for o, t in pieces]
    for name, t in parked:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1:
            problem = "is not a 1-D float32 tensor"
        elif not bool(torch.isfinite(t).all()):
            problem = "holds non-finite values"
        else:
            continue
        raise ValueError(
            f"{where}: the parked residual carry.{name} {problem}: the state dict is damaged; "
            "load the one state.state_dict() returned, unchanged"
        )


def deferred(state: Any, load: Callable[[], None], forget: Callable[[], None]) -> None:
    """Run ``load`` (of ``state``); if it fails where other ranks may be waiting, call
    ``forget`` (the state will agree with the others again at its first reduction) and keep
    the error in ``state._load_problem`` for that reduction to raise on every rank. Without
    peers (no process group yet, or a group of one) it raises here."""
    try:
        load()
    except Exception as error:
        group = state.process_group
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            raise
        forget()
        state._load_problem = f"{type(error).__name__}: {error}"
        warnings.warn(f"{error} (every rank raises at this state's next reduction)", stacklevel=3)
    else:
        state._load_problem = None


def load(state: Any, state_dict: dict[str, Any]) -> None:
    """Restore counters and park residuals saved by :func:`save`; the settings must match."""
    checked(state_dict, ("counters", "buckets"), state.codec.name)  # version 1: no "settings"
    _intact(state_dict)
    saved_settings = state_dict.get("settings", {"dtype": state_dict.get("dtype")})
    problem = mismatch(saved_settings, state.settings())
    seed = state_dict.get("seed", state.seed)  # (older state dicts have none)
    if not problem and state.stochastic_rounding and seed != state.seed:
        problem = (
            f"CompressState.load_state_dict: saved seed {seed!r} does not match this state's "
            f"{state.seed!r}, and stochastic rounding draws from it; build the state with "
            f"seed={seed!r}"
        )
    if problem:
        raise ValueError(problem)
    state._reset()
    _key_order(state, state_dict)
    state._counters = {k: int(state_dict["counters"].get(k, 0)) for k in COUNTERS}
    # Only residuals belong to one rank of one world size; counters fit any job.
    if state_dict.get("rank") is not None and holds_residuals(state_dict):
        # (and after how many reductions: the ranks of one save made as many)
        state._loaded_from = (
            int(state_dict["rank"]),
            int(state_dict["world_size"]),
            state._counters["calls"],
        )
    for index, saved in state_dict["buckets"].items():  # (two models: an index twice)
        state._table.keep(int(saved.get("index", index)), saved)
    for index, counts in state_dict.get("retired_buckets", {}).items():
        state._table.saved.setdefault(int(index), dict(counts))
    with_shards = state.error_feedback and state.accumulate_dtype == torch.float32
    state._residuals = parked(state_dict, with_shards)
    state._delayed.load(state_dict.get("delayed"))
    layout = state_dict.get("all_reduce")
    if layout is not None:  # all_reduce's first call after the load must be of the same kind
        state._layout = (layout["op"], tuple(layout["sizes"]), int(layout["bucket_elements"]))


def _key_order(state: Any, state_dict: dict[str, Any]) -> None:
    """Key ``state``'s new parameters in the order the saved residuals and delayed gradients
    were keyed in; refuse them where this state keyed its parameters the other way."""
    order = state_dict.get("key_order", _ORDERS[1])
    if order not in _ORDERS:
        raise ValueError(
            f"CompressState.load_state_dict: key_order {order!r} is not one of {_ORDERS}: the "
            "state dict is damaged; load the one state.state_dict() returned, unchanged"
        )
    forward = order == _ORDERS[1]
    table = state._table
    keyed = holds_residuals(state_dict) or bool(state_dict.get("delayed"))
    if len(table.param_keys) and table.forward != forward and keyed:
        raise ValueError(
            "CompressState.load_state_dict: the state dict keys its residuals by parameter in "
            f"the order {order!r} (an earlier fastddp's), and this state has keyed its "
            f"parameters {_ORDERS[table.forward]!r} already; load it into a new CompressState "
            "before the model's first step"
        )
    if not len(table.param_keys):
        # (also without residuals: dtype="auto"'s candidates name parameters alike, by the
        # first's table, which may hold none)
        table.forward = forward


def _cpu(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().cpu().clone()
