"""The checks of :class:`~fastddp.DiLoCo`: one row per rank, one verdict on every rank.

Each rank checks its own arguments and model and writes what it found into a row: the settings
every rank must share, its node, the ranks of its model's DDP group and its problems. One
``all_gather_object`` gives every rank every row, and :func:`verdict` reads the same rows the
same way on every rank, so a bad argument on one rank raises the same error on all of them
instead of leaving the others waiting in a collective. Nothing here writes to a DiLoCo.
"""

import math
import numbers
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fastddp.hooks.presets import PRESETS
from fastddp.hooks.topology import Topology, node_hash

__all__ = [
    "PARAM_DTYPES", "WHERE", "exchange", "gather", "load_problems", "local_problems",
    "raise_other_steps", "raise_problems", "saved_at", "settings_of", "verdict",
]  # fmt: skip

WHERE = "fastddp.DiLoCo"
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def local_problems(
    model: Any, sync_every: Any, outer_lr: Any, outer_momentum: Any, compress: Any,
    nesterov: Any = True, overlap: Any = False,
) -> list[str]:  # fmt: skip
    """What is wrong with this rank's arguments, one sentence with its fix per problem."""
    found = []
    integral = isinstance(sync_every, numbers.Integral) and not isinstance(sync_every, bool)
    if not integral or sync_every < 1:
        found.append(
            f"sync_every must be an int >= 1 (inner steps per outer round), got {sync_every!r}"
        )
    if not _number(outer_lr) or not 0 < outer_lr < math.inf:
        found.append(
            f"outer_lr must be a positive, finite number (0.7 is DiLoCo's), got {outer_lr!r}"
        )
    if not _number(outer_momentum) or not 0 <= outer_momentum < 1:
        found.append(f"outer_momentum must be in [0, 1) (0.9 is DiLoCo's), got {outer_momentum!r}")
    for name, value in (("nesterov", nesterov), ("overlap", overlap)):
        if not isinstance(value, bool):
            found.append(f"{name} must be True or False, got {value!r}")
    if compress == "auto":
        found.append(
            "compress='auto' plans by DDP's step time, which DiLoCo's rounds have not got: "
            "pass a preset name (int8-ef, say) or None"
        )
    elif compress is not None and not (isinstance(compress, str) and compress in PRESETS):
        found.append(
            f"compress must be None (fp32 across nodes) or a preset name, one of "
            f"{', '.join(PRESETS)}; got {compress!r}"
        )
    if not isinstance(model, nn.Module):
        found.append(
            f"model must be a torch.nn.Module (or DDP over it), got {type(model).__name__}"
        )
        return found
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        found.append("the model has no parameter that requires a gradient: nothing to train")
    odd = sorted({str(p.dtype) for p in params if p.dtype not in PARAM_DTYPES})
    if odd:
        found.append(
            f"parameters must be float32, bfloat16 or float16 (the outer step keeps fp32 "
            f"copies), got {', '.join(odd)}"
        )
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        found.append(f"parameters must be on one device, found {', '.join(devices)}")
    elif devices == ["meta"]:  # (its outer step copies nothing, and state_dict() failed)
        found.append(
            "the parameters are on the meta device: materialise them (to_empty, then "
            "initialise) before DiLoCo"
        )
    return found


def settings_of(
    model: Any, sync_every: Any, outer_lr: Any, outer_momentum: Any, nesterov: Any,
    compress: Any, overlap: Any,
) -> dict[str, Any]:  # fmt: skip
    """The settings every rank must share, in plain types (also saved in state dicts)."""
    params = (
        [p for p in model.parameters() if p.requires_grad] if isinstance(model, nn.Module) else []
    )
    return {
        "sync_every": int(sync_every) if isinstance(sync_every, numbers.Integral) else sync_every,
        "outer_lr": float(outer_lr) if _number(outer_lr) else outer_lr,
        "outer_momentum": float(outer_momentum) if _number(outer_momentum) else outer_momentum,
        "nesterov": bool(nesterov),
        "compress": compress,
        "overlap": bool(overlap),
        "parameters": len(params),
        "numel": sum(p.numel() for p in params),
    }


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _model_group(model: Any) -> Optional[list[int]]:
    """The global ranks of the model's DDP group; None for a module without DDP."""
    if not isinstance(model, DDP):
        return None
    return dist.get_process_group_ranks(model.process_group)


def exchange(
    model: Any, settings: dict[str, Any], problems: list[str], group: Optional[dist.ProcessGroup]
) -> list[dict[str, Any]]:
    """Every rank's row of ``group`` (a collective: every rank calls it)."""
    mine = {
        "settings": settings,
        "shapes": _shapes(model),
        "node": node_hash(),
        "model_group": _model_group(model),
        "problems": problems,
    }
    return gather(mine, group)


def _shapes(model: Any) -> list[tuple[str, tuple, str, bool]]:
    """The model's parameters and buffers in order: name, shape, dtype, whether it requires a
    gradient (nothing for what is not a module)."""
    if not isinstance(model, nn.Module):
        return []
    return [
        (name, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.requires_grad)
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    ]


def gather(obj: Any, group: Optional[dist.ProcessGroup]) -> list[Any]:
    """Every rank's ``obj`` of ``group``, in rank order (a collective: every rank calls it)."""
    rows: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(rows, obj, group=group)
    return rows


def verdict(rows: list[dict[str, Any]], rank: int, group: Optional[dist.ProcessGroup]) -> Topology:
    """The nodes of ``group``, seen from ``rank``; the same ``ValueError`` on every rank if not.

    Checked in order: each rank's own problems, settings that differ between ranks, nodes of
    different sizes, and models not wrapped in DDP over exactly their node's ranks.
    """
    _raise_problems(rows)
    # Models first: their settings' counts (parameters, numel) differ with them, and say less.
    _raise_other_models(rows)
    _raise_disagreement(rows)
    topo = Topology([row["node"] for row in rows], rank)
    if not topo.even:
        raise ValueError(
            f"{WHERE}: each node's ranks share its outer step, one slice each, so every node "
            f"needs the same number of ranks, but the group has {topo.describe()}. Launch the "
            "same number of ranks per node (or give FASTDDP_NODE_ID where host names do not "
            "tell the nodes apart)"
        )
    glob = dist.get_process_group_ranks(group or dist.group.WORLD)
    wrong = []
    for r, row in enumerate(rows):
        node = sorted(glob[m] for m in topo.nodes[topo.node_of[r]])
        have = row["model_group"]
        if (have is None and len(node) > 1) or (have is not None and sorted(have) != node):
            got = "a module without DDP" if have is None else f"DDP over ranks {sorted(have)}"
            wrong.append(f"  rank {glob[r]}: {got}, its node has ranks {node}")
    if wrong:
        raise ValueError(
            f"{WHERE}: the model must be DDP over its node's ranks only (inside the node every "
            "step, across nodes every sync_every steps), but:\n" + "\n".join(wrong) + "\n"
            "Wrap it as DDP(model, process_group=fastddp.DiLoCo.node_group()); a node of one "
            "rank may pass the bare module"
        )
    return topo


def _raise_problems(rows: list[dict[str, Any]]) -> None:
    raise_problems([row["problems"] for row in rows], f"{WHERE}: bad arguments")


def raise_problems(
    per_rank: list[list[str]], header: str, fix: str = "", error: type = ValueError
) -> None:
    """One ``error`` naming each rank's problems (``per_rank``, as every rank sees them), the
    same on every rank; nothing if there are none."""
    where: dict[str, list[int]] = {}
    for r, problems in enumerate(per_rank):
        for problem in problems:
            where.setdefault(problem, []).append(r)
    if not where:
        return
    lines = [
        f"  {p} ({'on every rank' if len(rs) == len(per_rank) else f'rank {_ranks(rs)}'})"
        for p, rs in where.items()
    ]
    raise error(f"{header}:\n" + "\n".join(lines) + (f"\n{fix}" if fix else ""))


def load_problems(
    saved: Any, version: int, settings: dict, layout: dict, sizes: dict[str, Optional[int]]
) -> list[str]:
    """What keeps ``saved`` from loading into this rank's DiLoCo (``settings``, ``layout``, and
    ``sizes``: the elements of its ``global`` and ``pending`` slices, None where it has none).
    Found before anything is loaded, and shared, so that every rank raises or none does."""
    if not isinstance(saved, dict) or saved.get("version") != version:
        got = saved.get("version") if isinstance(saved, dict) else type(saved).__name__
        return [f"not a DiLoCo state dict of version {version} (got {got!r})"]
    found = []
    for name, mine in (("settings", settings), ("layout", layout)):
        theirs = saved.get(name) or {}
        if not isinstance(theirs, dict):
            found.append(f"its {name} entry is a {type(theirs).__name__}, not a dict")
            continue
        diff = [f"{k}: saved {theirs.get(k)!r}, here {v!r}" for k, v in mine.items()
                if theirs.get(k) != v]  # fmt: skip
        if diff:
            found.append(f"the saved {name} differ from this DiLoCo's ({', '.join(diff)})")
    if found:
        return found
    missing = [k for k in ("round", "inner_steps", "global", "outer", "compress", "pending")
               if k not in saved]  # fmt: skip
    if missing:
        return [f"it has no {', '.join(missing)} (damaged, or not what state_dict() returned)"]
    at = saved_at(saved)
    if at is None:
        found.append("its round and inner_steps are not whole numbers")
    for key, numel in sizes.items():
        t = saved[key]
        # With overlap=True no average waits before the first round has ended.
        if t is None and (numel is None or (key == "pending" and at is not None and at[0] == 0)):
            continue
        if not (
            torch.is_tensor(t) and t.dtype == torch.float32 and t.dim() == 1 and t.numel() == numel
        ):
            got = f"{tuple(t.shape)} {t.dtype}" if torch.is_tensor(t) else type(t).__name__
            found.append(f"its {key} slice is {got}, not {numel} float32 elements in one dimension")
    outer = saved["outer"]
    if not (isinstance(outer, dict) and {"state", "param_groups"} <= outer.keys()):
        found.append("its outer entry is not an optimizer's state_dict()")
    else:
        state = outer["state"]
        buffers = [s.get("momentum_buffer") for s in state.values()
                   if isinstance(s, dict)] if isinstance(state, dict) else []  # fmt: skip
        if not isinstance(state, dict) or any(
            b is not None and not (torch.is_tensor(b) and b.numel() == sizes["global"])
            for b in buffers
        ):
            found.append(f"its outer momentum is not a tensor of {sizes['global']} elements")
    return found


def saved_at(saved: Any) -> Optional[tuple[int, int]]:
    """The round and inner step ``saved`` (a state dict) was saved at; None if it has none."""
    try:
        return int(saved["round"]), int(saved["inner_steps"])
    except (TypeError, KeyError, ValueError):
        return None


def raise_other_steps(per_rank: list[Optional[tuple[int, int]]]) -> None:
    """One ``ValueError`` on every rank where the ranks' state dicts were saved at different
    steps (their rounds would pair with other rounds: a checkpoint cut short on some ranks)."""
    if len(set(per_rank)) <= 1:
        return
    lines = [f"  rank {r}: round {at[0]}, inner step {at[1]}" for r, at in enumerate(per_rank)]
    raise ValueError(
        f"{WHERE}.load_state_dict: the ranks' state dicts were saved at different steps, so "
        "their outer rounds would not pair up:\n" + "\n".join(lines) + "\nLoad state dicts "
        "that every rank saved at the same step (one checkpoint of the whole job)"
    )


def _raise_disagreement(rows: list[dict[str, Any]]) -> None:
    first = rows[0]["settings"]
    if all(row["settings"] == first for row in rows):
        return
    keys = [k for k in first if len({repr(row["settings"].get(k)) for row in rows}) > 1]
    lines = [
        f"  rank {r}: " + ", ".join(f"{k}={row['settings'].get(k)!r}" for k in keys)
        for r, row in enumerate(rows)
    ]
    raise ValueError(
        f"{WHERE}: ranks disagree on {', '.join(keys)}, so their outer rounds would not "
        "match:\n" + "\n".join(lines) + "\nGive every rank the same DiLoCo arguments and the "
        "same model"
    )


def _raise_other_models(rows: list[dict[str, Any]]) -> None:
    # The same count and size of trainable parameters, in another order or of other shapes,
    # would average unrelated elements across nodes. (Names are not compared: a node of one
    # rank may pass the bare module, whose names lack DDP's "module.".)
    first = [entry[1:] for entry in rows[0]["shapes"]]
    lines = []
    for r, row in enumerate(rows):
        mine = [entry[1:] for entry in row["shapes"]]
        if mine == first:
            continue
        at = next((i for i, (a, b) in enumerate(zip(mine, first)) if a != b), None)
        if at is None:
            lines.append(f"  rank {r}: {len(mine)} parameters and buffers, rank 0 {len(first)}")
            continue
        lines.append(
            f"  rank {r}: {_said(row['shapes'][at])}, rank 0: {_said(rows[0]['shapes'][at])}"
        )
    if lines:
        raise ValueError(
            f"{WHERE}: the ranks' models differ (parameters and buffers in order: shape, "
            "dtype, whether it requires a gradient), so their outer rounds would average "
            "unrelated elements:\n" + "\n".join(lines) + "\nBuild the same model on every rank"
        )


def _said(entry: tuple[str, tuple, str, bool]) -> str:
    name, shape, dtype, grad = entry
    return f"{name} {list(shape)} {dtype}{'' if grad else ' (no gradient)'}"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
