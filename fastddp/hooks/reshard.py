"""Hook state saved by a job of one world size, for a job of another.

Error feedback owes the average the sum of every rank's residuals: each rank adds its own to its
next bucket, and the average sums the ranks. Moving a rank's residuals to another rank therefore
changes nothing but where they are added, while dropping them loses gradient. So a job resumed
at ``W'`` ranks from the state dicts of ``W`` ranks gives new rank ``r`` the residuals of old
ranks ``r``, ``r + W'``, ``r + 2W'``, ... (a rank beyond the old size gets none): the sum is kept
exactly, whatever the two sizes and bucket layouts. Everything is re-parked by parameter
(``residuals.py``), so stage-2 shards are rebuilt for the new size at the first reduction.
"""

from collections.abc import Sequence
from typing import Any

from fastddp.hooks.residuals import Residuals

__all__ = ["holds_residuals", "parked", "reshard"]


def holds_residuals(state_dict: dict[str, Any]) -> bool:
    """Whether a saved state carries error-feedback residuals (anything per rank)."""
    for saved in state_dict.get("buckets", {}).values():
        if saved.get("residual") is not None or saved.get("shard_residual") is not None:
            return True
    carry = state_dict.get("carry") or {}
    return any(carry.get(key) for key in ("stage1", "stage2", "replicated"))


def parked(
    state_dict: dict[str, Any], with_shards: bool, keep_replicated: bool = True
) -> Residuals:
    """One saved rank's residuals, parked by parameter (``CompressState.load_state_dict``).

    ``with_shards``: the state has stage-2 residuals (error feedback summed in fp32).
    """
    out = Residuals()
    for saved in state_dict["buckets"].values():
        params = saved.get("params")
        out.park(
            None if params is None else tuple((int(k), int(n)) for k, n in params),
            saved.get("residual"),
            saved.get("shard_residual"),
            int(saved.get("shard_offset", 0)),
            with_shards=with_shards,
        )
    if state_dict.get("carry"):
        out.load(state_dict["carry"])
    if not keep_replicated:
        out.replicated.clear()  # held identically by every rank; only rank 0's is added
    return out


def reshard(state_dicts: Sequence[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """The state dicts of every rank of one job, regrouped for a job of ``world_size`` ranks.

    See the module docstring. Counters and per-bucket statistics come from the old rank of the
    same number (rank 0's for new ranks beyond the old size).
    """
    where = "CompressState.reshard"
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{where}: world_size must be a positive int, got {world_size!r}")
    if isinstance(state_dicts, (str, bytes, dict)) or not isinstance(state_dicts, Sequence):
        raise TypeError(
            f"{where}: give a list of the state dicts of every rank of the saved job, in rank "
            f"order, got {type(state_dicts).__name__}"
        )
    old = len(state_dicts)
    if old == 0:
        raise ValueError(f"{where}: give the state dicts of every rank of the saved job, got none")
    if all(isinstance(sd, dict) and "candidates" in sd for sd in state_dicts):
        return _reshard_auto(state_dicts, world_size)
    for rank, sd in enumerate(state_dicts):
        if not isinstance(sd, dict) or "buckets" not in sd:
            got = (
                f"a dict of {', '.join(map(str, sd))}"
                if isinstance(sd, dict)
                else type(sd).__name__
            )
            raise TypeError(
                f"{where}: entry {rank} is not a CompressState.state_dict() (got {got})"
            )
    saved_world = state_dicts[0].get("world_size")
    if saved_world is None:
        raise ValueError(
            f"{where}: the state dicts were saved before any process group, so they name no "
            "world size to reshard from; save them in the job, after init_process_group"
        )
    if saved_world != old:
        raise ValueError(
            f"{where}: the state dicts were saved by a job of {saved_world} ranks, and {old} "
            f"were given; give all {saved_world}, in rank order"
        )
    for rank, sd in enumerate(state_dicts):
        if (sd.get("rank"), sd.get("world_size")) != (rank, old):
            raise ValueError(
                f"{where}: entry {rank} was saved by rank {sd.get('rank')} of "
                f"{sd.get('world_size')}; give the {old} state dicts of one job, in rank order "
                f"(entry k saved by rank k of {old})"
            )
        if sd["settings"] != state_dicts[0]["settings"]:
            raise ValueError(
                f"{where}: rank {rank} was saved with settings {sd['settings']}, rank 0 with "
                f"{state_dicts[0]['settings']}; these are not one job's state dicts"
            )
    settings = state_dicts[0]["settings"]
    with_shards = bool(settings.get("error_feedback")) and settings["accumulate_dtype"] == "float32"
    out = []
    for new in range(world_size):
        owed = Residuals()
        for rank in range(new, old, world_size):
            owed.add(parked(state_dicts[rank], with_shards, keep_replicated=rank == 0))
        if new >= old:
            # Owed nothing, but its parameters move as every rank's do (the same collectives
            # at the first reduction), also where rank 0's were parked, not in its buckets.
            zero = parked(state_dicts[0], with_shards)
            owed.sizes, owed.moved = zero.sizes, zero.moved
        source = state_dicts[new if new < old else 0]
        buckets = {
            key: {**saved, "residual": None, "shard_residual": None, "shard_offset": 0}
            for key, saved in source["buckets"].items()
        }
        out.append(
            {
                **source,
                "rank": new,
                "world_size": world_size,
                "counters": dict(source["counters"]),
                "buckets": buckets,
                "carry": owed.state(),
            }
        )
    return out


def _reshard_auto(state_dicts: Sequence[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """``dtype="auto"``'s state dicts: each candidate's regrouped as a fixed state's; the plan,
    which every rank shares, from the old rank of the same number (rank 0's beyond)."""
    names = list(state_dicts[0]["candidates"])
    if any(list(sd["candidates"]) != names for sd in state_dicts):
        raise ValueError(
            "CompressState.reshard: the ranks' state dicts hold other candidates; these are not "
            "one job's state dicts"
        )
    regrouped = {n: reshard([sd["candidates"][n] for sd in state_dicts], world_size) for n in names}
    old = len(state_dicts)
    out = []
    for new in range(world_size):
        candidates = {n: regrouped[n][new] for n in names}
        out.append({**state_dicts[new if new < old else 0], "candidates": candidates})
    return out
