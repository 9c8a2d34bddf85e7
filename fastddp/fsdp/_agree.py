"""The first call's check across ranks: the same settings everywhere, and every load sound.

FSDP2 hands every rank the same tensors, but each rank builds its comm itself: a comm of other
settings on one rank (another wire dtype, block size or error feedback) would combine payloads
it cannot read, or wait in a collective the others never enter. One all-gather at a comm's
first call carries each rank's settings and whether its ``load_state_dict`` failed, and every
rank raises the same error.
"""

from typing import Callable, Optional

import torch
import torch.distributed as dist

from fastddp.codecs import CODECS, Codec
from fastddp.hooks.handshake import PROTOCOL

__all__ = [
    "HYBRID",
    "agree",
    "agree_install",
    "agree_setup",
    "codec_row",
    "describe",
    "outer_group",
]

HYBRID = "_fastddp_hybrid"  # on the modules hybrid() all-reduces across nodes: its comm


def outer_group(modules: list) -> Optional[dist.ProcessGroup]:
    """The group across which the shard group of ``modules`` (``(name, module)`` pairs) is
    replicated: native HSDP's (a 2-D mesh) or :func:`~fastddp.fsdp.hybrid`'s replicate group;
    None under plain sharding. A check over the shard group alone raises on its ranks only,
    and those of the other shard groups wait for them in the cross-node all-reduce."""
    for _, m in modules:
        comm = getattr(m, HYBRID, None)
        if comm is not None:
            return comm.state.process_group
        group = m._get_fsdp_state()._fsdp_param_group
        if group is not None:
            return getattr(group.mesh_info, "replicate_process_group", None)
    return None


def _on(group: Optional[dist.ProcessGroup]) -> str:
    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"


def _across(outer: Optional[dist.ProcessGroup], bad: bool, device) -> list[int]:
    """After a check over one shard group, one all-gather of its verdict over ``outer`` (one
    rank of every shard group): the job ranks whose shard group found a problem."""
    if outer is None or dist.get_world_size(outer) == 1:
        return []
    mine = torch.tensor([int(bad)], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(outer))]
    dist.all_gather(rows, mine, group=outer)
    return [dist.get_global_rank(outer, r) for r, row in enumerate(rows) if int(row.item())]


def _elsewhere(where: str, others: list[int], what: str) -> ValueError:
    return ValueError(
        f"{where}: ranks of another shard group {what} (the shard group(s) of rank(s) "
        f"{others}), each saying why; give every rank the same arguments"
    )


def agree(
    where: str,
    device: torch.device,
    group: Optional[dist.ProcessGroup],
    settings: tuple[int, ...],
    describe: Callable[[tuple[int, ...]], str],
    problem: Optional[str] = None,
    outer: Optional[dist.ProcessGroup] = None,
) -> None:
    """Raise on every rank of ``group`` (the default group when None) if the ranks' ``settings``
    differ (each shown by ``describe``), or a rank has a load ``problem``; and on every rank
    of ``outer`` (:func:`outer_group`) if another shard group's did. A collective: one
    all-gather of a few int64s on ``device`` (and one of a flag over ``outer``)."""
    mine = torch.tensor([*settings, int(problem is not None)], dtype=torch.int64, device=device)
    size = dist.get_world_size(group)
    rows = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(rows, mine, group=group)
    rows = [tuple(row.tolist()) for row in rows]

    def rank(r: int) -> int:  # named by their rank in the job, as each rank's own error says
        return r if group is None else dist.get_global_rank(group, r)

    error = None
    failed = [rank(r) for r, row in enumerate(rows) if row[-1]]
    if len({row[:-1] for row in rows}) > 1:
        lines = [f"  rank {rank(r)}: {describe(row[:-1])}" for r, row in enumerate(rows)]
        error = ValueError(
            f"{where}: ranks disagree on the settings, so their payloads cannot be combined:\n"
            + "\n".join(lines)
            + "\nGive every rank the same arguments."
        )
    elif failed:
        why = problem if problem is not None else "each of them raises the reason"
        error = ValueError(
            f"{where}: load_state_dict failed on rank(s) {failed} of {dist.get_world_size()} "
            f"({why}); load into every rank the state that same rank saved, in a job of the "
            "same size"
        )
    others = _across(outer, error is not None, device)
    if error is not None:
        raise error
    if others:
        raise _elsewhere(where, others, "disagree on the settings, or failed to load")


def codec_row(codec: Codec, error_feedback: bool = False) -> tuple[int, ...]:
    """A comm's settings as :func:`agree` compares them (with the payloads' protocol)."""
    return (PROTOCOL, codec.code, codec.block_size or 0, int(error_feedback))


def describe(row: tuple[int, ...]) -> str:
    """A :func:`codec_row` in words."""
    protocol, code, block, feedback = row
    names = {entry.code: str(dtype) for dtype, entry in CODECS.items()}
    version = f", fastddp protocol {protocol}" if protocol != PROTOCOL else ""
    block_size = f", block_size={block}" if block else ""
    return f"dtype={names.get(code, '?')}{block_size}, error_feedback={bool(feedback)}{version}"


def agree_install(where: str, modules: list, problem: Optional[Exception]) -> None:
    """Where a comm is installed on FSDP2's ``modules``: raise ``problem`` (its arguments, refused
    on this rank) here, and name the ranks that refused theirs on the others, after one
    all-gather of a flag over the modules' shard group (whose ranks install alike), rather than
    leave those others to wait for this rank in FSDP2's next collective."""
    groups = [m._get_fsdp_state()._fsdp_param_group for _, m in modules]
    group = next((g.mesh_info.shard_process_group for g in groups if g is not None), None)
    if not modules and dist.is_initialized():
        # This rank's model has no sharded module (another model than the others'?), so no
        # shard group: meet the others in the default group, theirs under plain fully_shard
        # (a 1-D mesh over every rank uses it).
        group = dist.group.WORLD
    failed = []
    if group is not None and dist.get_world_size(group) > 1:  # (else nothing to reduce)
        mine = torch.tensor([int(problem is not None)], dtype=torch.int64, device=_on(group))
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, mine, group=group)
        failed = [dist.get_global_rank(group, r) for r, row in enumerate(rows) if row.item()]
    outer = outer_group(modules)
    others = _across(outer, bool(failed) or problem is not None, outer and _on(outer))
    if problem is not None:
        raise problem
    if failed:
        raise ValueError(f"{where}: rank(s) {failed} refused their arguments, each saying why")
    if others:
        raise _elsewhere(where, others, "refused their arguments")


def agree_setup(where, group, shard_ranks, state, reduce_scatter, problem) -> None:
    """:func:`fastddp.fsdp.hybrid`'s set-up, one all-gather over the job: raise alike on every
    rank if a rank's set-up failed (``problem``, raised there), if the replicate ``group``
    pairs ranks of different positions in their shard groups (one node's shard 0 summed with
    another's shard 1), or if the ranks' settings (``state``, ``reduce_scatter``) differ."""
    # (group and shard_ranks are None where this rank's set-up failed before finding them)
    rank = dist.get_rank()
    replicate = [rank] if group is None else dist.get_process_group_ranks(group)
    position = shard_ranks.index(rank) if shard_ranks and rank in shard_ranks else -1
    mine = [position, min(replicate), int(problem is not None)]
    if state is not None:
        s = state.settings()
        mine += [state.codec.code, s["block_size"] or 0, int(s["error_feedback"])]
        mine += [int(s["accumulate_dtype"] is not None), int(s["stochastic_rounding"])]
        entry = CODECS.get(reduce_scatter) if isinstance(reduce_scatter, torch.dtype) else None
        mine.append(entry.code if entry else 0 if reduce_scatter is None else -1)
    mine += [0] * (9 - len(mine))
    on = "cuda" if dist.get_backend() == "nccl" else "cpu"
    row = torch.tensor(mine, dtype=torch.int64, device=on)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    rows = [tuple(r.tolist()) for r in rows]
    if problem is not None:
        raise problem
    failed = [r for r, row in enumerate(rows) if row[2]]
    if failed:
        raise ValueError(f"{where}: the set-up failed on rank(s) {failed}, each saying why")
    positions: dict[int, set] = {}
    for row in rows:
        positions.setdefault(row[1], set()).add(row[0])
    if any(len(p) > 1 for p in positions.values()):
        raise ValueError(
            f"{where}: replicate_group pairs ranks of different positions in their shard "
            'groups (each would sum its shard with another shard): pass mesh["replicate"] '
            'of the mesh whose mesh["shard"] you sharded with (fastddp.fsdp.node_mesh())'
        )
    if len({row[3:] for row in rows}) > 1:
        names = {e.code: str(d) for d, e in CODECS.items()}
        lines = [
            f"  rank {r}: dtype={names.get(row[3], '?')}, block_size={row[4] or None}, "
            f"error_feedback={bool(row[5])}, accumulate_dtype={'float32' if row[6] else None}, "
            f"stochastic_rounding={bool(row[7])}, reduce_scatter={names.get(row[8])}"
            for r, row in enumerate(rows)
        ]
        raise ValueError(
            f"{where}: ranks disagree on the settings, so their payloads cannot be combined:\n"
            + "\n".join(lines)
            + "\nGive every rank the same arguments."
        )
