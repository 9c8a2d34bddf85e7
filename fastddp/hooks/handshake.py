"""The first reduction's handshake: every rank's settings and node, checked alike on every rank.

One all-gather carries each rank's settings, the rank its loaded residuals were saved by, the
tensors they (and delayed gradients) are for, and its node identity. :func:`check` raises the
same error on every rank when the ranks disagree, so that no rank waits in a collective that
another rank left; the rows also give every rank the same
:class:`~fastddp.hooks.topology.Topology`.
"""

import zlib
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fastddp.codecs import CODECS
from fastddp.hooks.topology import TOPOLOGIES, Topology, node_hash

__all__ = ["ARGUMENTS", "PROTOCOL", "TENSOR_PROBLEMS", "check", "exchange", "topology_of"]

# Bumped whenever the bytes exchanged between ranks change meaning; part of the settings check,
# so that ranks running different fastddp versions refuse to mix.
# 3: int8 rows carry their scales behind their values (one all-to-all, one all-gather).
# 4: the settings row carries the topology setting and a node identity.
# 5: and the delay setting.
# 6: and the layout of an all_reduce call (zeros from the hook).
# 7: and the tensors that loaded residuals are for, and what is wrong with all_reduce's tensors.
# 8: and the tensors that loaded delayed gradients (delay=1) are for.
# 9: and all_reduce's tensors whose elements share memory (problem code 5).
# 10: and all_reduce's op (1 "avg", 2 "sum"; 0 from the hook).
# 11: and all_reduce's tensors on neither CPU nor CUDA (problem code 6).
# 12: and all_reduce's bucket size (elements; 0 from the hook), and its sparse tensors
#     (problem code 7); a dtype="auto" state sends a row too (codec code AUTO).
# 13: and whether the rank's last load_state_dict failed; all_reduce's refused arguments
#     (problem code 8); the dtype of the hook's first bucket (16-bit ones shake hands too).
# 14: and all_reduce's inference tensors outside inference mode (problem code 9).
# 15: and the reductions counted in the loaded residuals' state dict (-1: none loaded).
# 16: and all_reduce's tensor subclasses, a DTensor say (problem code 10).
PROTOCOL = 16
_SHARED = 8  # the first columns of a row, which every rank must share
_COLUMNS = 27  # columns of a row
_LOAD = 24  # the column of a failed load
_DTYPE = 25  # the column of the first bucket's dtype (BUCKET_DTYPES, 9 another; 0: none given)
_CALLS = 26  # the column of the loaded state dict's reductions
BUCKET_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
AUTO = 0  # the codec code of a dtype="auto" state's row (no codec's)


# What a rank's all_reduce tensors can be wrong by (code: the rest of the sentence).
TENSOR_PROBLEMS = {
    1: "a parameter without a gradient on this rank? pass torch.zeros_like(p) in its place",
    2: "not a Tensor",
    3: "it compresses float32 tensors. Use torch.distributed.all_reduce for other dtypes, or "
    "pass t.float() and copy back",
    4: "on another device than tensors[0]: reduce each device's tensors in a separate call",
    5: "a view whose elements share memory (expand()): pass t.clone() and copy back",
    6: "on neither CPU nor CUDA (a meta tensor has no data to reduce): pass CPU or CUDA tensors",
    7: "sparse (as nn.Embedding(sparse=True) makes gradients): pass t.to_dense() and copy back",
    9: "an inference tensor (made under torch.inference_mode()), which all_reduce writes in "
    "place and torch lets be written only inside inference mode: call all_reduce inside "
    "that block, or pass t.clone() made outside it and copy back",
    10: "a torch.Tensor subclass (a DTensor?), and all_reduce reduces plain tensors: pass a "
    "DTensor's t.to_local() (a view of its local tensor: the result lands in t), or "
    "another subclass's t.as_subclass(torch.Tensor)",
}
# The problem code of a rank that refused another of all_reduce's arguments (its row is a
# stand-in's: it raises its own error, the others this one).
ARGUMENTS = 8


def exchange(
    state: Any,
    device: torch.device,
    layout: tuple[int, int, int] = (0, 0, 0),
    problem: tuple[int, int] = (0, 0),
    op: int = 0,
    bucket: int = 0,
    dtype: Optional[torch.dtype] = None,
) -> list[tuple[int, ...]]:
    """All-gather every rank's row of the group of ``state`` (a collective: every rank calls it).

    ``layout``: what ``fastddp.all_reduce`` was given (tensors, elements, a digest of their
    sizes), which every rank must share; ``problem``: the code (:data:`TENSOR_PROBLEMS`, 0 for
    none) and index of the first tensor it cannot take; ``op``: its op (1 ``"avg"``, 2
    ``"sum"``); ``bucket``: its largest bucket, in elements. DDP's buckets need none of these
    checks, but the first one's ``dtype``: a model in bf16 on one rank and fp16 on another
    would sum their bits.
    """
    s = state.settings()
    loaded = state._loaded_from or (-1, -1, -1)
    return _gather(
        [
            PROTOCOL,
            state.codec.code,
            int(s["accumulate_dtype"] is not None),
            int(s["error_feedback"]),
            int(s["stochastic_rounding"]),
            s["block_size"] or 0,
            TOPOLOGIES.index(state.topology),
            state.delay,
            *loaded[:2],
            node_hash(),
            *layout,
            *_digest(state._residuals.sizes),
            *problem,
            *_digest({k: t.numel() for k, t in state._delayed.parked.items()}),
            op,
            bucket,
            int(state._load_problem is not None),
            0 if dtype is None else BUCKET_DTYPES.get(dtype, 9),
            loaded[2],
        ],
        state.process_group,
        device,
    )


def exchange_auto(
    topology: str, group, device: torch.device, load_failed: bool = False, loaded: tuple = ()
) -> list[tuple[int, ...]]:
    """The handshake of a ``dtype="auto"`` state, its first collective (before its trial's):
    a row as long as a fixed mode's, so that a rank of either kind meets the other's in it and
    :func:`check` raises on both, where their first collectives would not line up.

    ``loaded``: its candidates (fixed states), whose loaded residuals and delayed gradients the
    row gives as a fixed mode's does: all of them, also those the plan does not run yet, which
    would otherwise raise only when a later trial reaches them."""
    row = [PROTOCOL, AUTO, 0, 0, 0, 0, TOPOLOGIES.index(topology), 0, -1, -1, node_hash()]
    row += [0] * (_COLUMNS - len(row))
    row[_LOAD], row[_CALLS] = int(load_failed), -1
    saved_by = [s._loaded_from for s in loaded if s._loaded_from is not None]
    if saved_by:  # (the candidates of one state dict were saved by one rank)
        row[8:10], row[_CALLS] = saved_by[0][:2], saved_by[0][2]
    row[14:17] = _digest({k: n for s in loaded for k, n in s._residuals.sizes.items()})
    delayed = {k: t.numel() for s in loaded for k, t in s._delayed.parked.items()}
    row[19:22] = _digest(delayed)
    return _gather(row, group, device)


def _gather(row: list[int], group, device: torch.device) -> list[tuple[int, ...]]:
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [tuple(t.tolist()) for t in everyone]


def _alike(
    rows: list[tuple[int, ...]],
    column: int,
    show: Callable[[int], str],
    message: str,
    fix: str,
    given_only: bool = False,
) -> None:
    """Raise ``message``, each rank's ``show(value)`` and the ``fix`` if the ranks' ``column``
    differs (``given_only``: among the rows that give it, not 0)."""
    if len({row[column] for row in rows if row[column] or not given_only}) > 1:
        lines = [f"  rank {r}: {show(row[column])}" for r, row in enumerate(rows)]
        raise ValueError(message + ":\n" + "\n".join(lines) + "\n" + fix)


def _digest(sizes: dict[int, int]) -> tuple[int, int, int]:
    """Tensors, elements and a digest of the sizes (by parameter key) that parked residuals or
    delayed gradients are for (zeros if none).

    Ranks of one model park the same sizes; a rank that loaded another model's state dict would
    raise alone when its first bucket takes them up, while the others wait for it.
    """
    sizes = sorted(sizes.items())
    if not sizes:
        return (0, 0, 0)
    return (len(sizes), sum(n for _, n in sizes), zlib.crc32(repr(sizes).encode()))


def check(rows: list[tuple[int, ...]], load_problem: Optional[str] = None) -> None:
    """Raise the same ``ValueError`` on every rank if the rows disagree, a rank's load failed
    (``load_problem``: this rank's error, if it is one of them) or residuals are amiss."""
    world = len(rows)
    failed = [r for r, row in enumerate(rows) if len(row) > _LOAD and row[_LOAD]]
    if failed and all(row[0] == PROTOCOL for row in rows):
        why = f"here: {load_problem}" if load_problem else "each of them warned why as it loaded"
        raise ValueError(
            f"CompressState.load_state_dict failed on rank(s) {failed} of {world} ({why}); "
            "load into every rank the state dict that same rank saved, into a CompressState "
            "built with the settings it was saved with"
        )
    refused = [r for r, row in enumerate(rows) if row[17] == ARGUMENTS]
    if refused:
        raise ValueError(
            f"fastddp.all_reduce: rank(s) {refused} of {world} refused their arguments, each "
            "raising why; pass the same, valid arguments on every rank"
        )
    if len({row[:_SHARED] for row in rows}) > 1:
        names = {entry.code: str(d).removeprefix("torch.") for d, entry in CODECS.items()}
        lines = [
            (
                f"  rank {rank}: dtype='auto', topology={TOPOLOGIES[row[6]]!r}"
                if row[1] == AUTO
                else f"  rank {rank}: dtype={names.get(row[1], '?')}, accumulate_dtype="
                f"{'float32' if row[2] else None}, error_feedback={bool(row[3])}, "
                f"stochastic_rounding={bool(row[4])}, block_size={row[5] or None}, "
                f"topology={TOPOLOGIES[row[6]]!r}, delay={row[7]}"
            )
            + (f", fastddp protocol {row[0]}" if row[0] != PROTOCOL else "")
            for rank, row in enumerate(rows)
        ]
        raise ValueError(
            "fastddp: ranks disagree on the compression settings, so their payloads cannot be "
            "combined:\n" + "\n".join(lines) + "\nGive every rank the same settings: "
            "CompressState's arguments, or fastddp.all_reduce's dtype, accumulate_dtype, "
            "stochastic_rounding, block_size and topology (and the same fastddp version)."
        )
    troubled = [
        f"  rank {r}: tensors[{row[18]}] is "
        + ("None, " if row[17] == 1 else "not float32; " if row[17] == 3 else "")
        + TENSOR_PROBLEMS[row[17]]
        for r, row in enumerate(rows)
        if row[17]
    ]
    names = {code: str(d).removeprefix("torch.") for d, code in BUCKET_DTYPES.items()}
    _alike(
        rows, _DTYPE, lambda v: names.get(v, "another"),
        "fastddp: the ranks' DDP models hand the hook gradients of different dtypes, so their "
        "payloads cannot be combined (their first buckets)",
        "Give every rank the same model in the same dtype (one cast on some ranks only?)",
        given_only=True,
    )  # fmt: skip
    if troubled:
        raise ValueError(
            "fastddp.all_reduce: some ranks passed tensors it cannot reduce:\n"
            + "\n".join(troubled)
        )
    ops = {0: "none", 1: '"avg"', 2: '"sum"'}
    _alike(
        rows, 22, lambda v: f"op={ops.get(v, '?')}",
        "fastddp.all_reduce: ranks passed different ops, so the result would be neither a sum "
        "nor an average",
        "Pass the same op on every rank.",
    )  # fmt: skip
    _alike(
        rows, 23, lambda v: f"bucket_cap_mb={v * 4 / 2**20:g}",
        "fastddp.all_reduce: ranks passed different bucket_cap_mb, so their buckets, and the "
        "collectives that carry them, would not line up",
        "Pass the same bucket_cap_mb on every rank.",
    )  # fmt: skip
    if len({row[11:14] for row in rows}) > 1:
        same = len({row[11:13] for row in rows}) == 1
        lines = [
            f"  rank {r}: {row[11]} tensor(s), {row[12]} elements" for r, row in enumerate(rows)
        ]
        raise ValueError(
            "fastddp.all_reduce: ranks passed different tensors, so their buckets cannot be "
            "combined:\n"
            + "\n".join(lines)
            + ("\n(as many, but of other shapes)" if same else "")
            + "\nEvery rank must pass tensors of the same shapes, in the same order."
        )
    # With error feedback, none is a layout too: a rank that loaded nothing would skip the
    # collectives that move the others' residuals to the ranks that round their elements.
    _loaded_alike(rows, 14, 3, "residuals" if rows[0][3] else "saved buckets")
    # With delay=1, a rank that loaded none would add zeros where the others add the gradient
    # of the step before the checkpoint.
    _loaded_alike(rows, 19, 7, "delayed gradients", " (delay=1)")
    resized = sorted({row[9] for row in rows if row[8] != -1 and row[9] != world})
    if resized:
        raise ValueError(
            f"fastddp: CompressState.load_state_dict was given error-feedback residuals saved "
            f"by a job of {' and '.join(map(str, resized))} ranks, and this job has {world}. "
            "Residuals are per rank: load the saved state dicts of every rank, regroup them "
            f"with CompressState.reshard(saved, {world}), and load entry r into rank r "
            "(examples/resume.py does this); or start this state without them."
        )
    wrong = [
        f"  rank {rank} loaded the state dict of rank {row[8]} of {row[9]}"
        for rank, row in enumerate(rows)
        if row[8] != -1 and (row[8], row[9]) != (rank, world)
    ]
    if wrong:
        raise ValueError(
            "fastddp: CompressState.load_state_dict was given another rank's residuals:\n"
            + "\n".join(wrong)
            + f"\nSave one state_dict() per rank and load each into the same rank of a job of "
            f"the same world size ({world} now)."
        )
    # The ranks of one save made as many reductions: residuals of other steps would be added
    # twice on some ranks, and lost on others.
    if len({row[_CALLS] for row in rows if row[_CALLS] >= 0}) > 1:
        lines = [
            f"  rank {r}: saved after {row[_CALLS]} reductions" if row[_CALLS] >= 0
            else f"  rank {r}: none loaded"
            for r, row in enumerate(rows)
        ]  # fmt: skip
        raise ValueError(
            "fastddp: CompressState.load_state_dict was given residuals saved at different "
            "steps on different ranks:\n" + "\n".join(lines) + "\nLoad into every rank the "
            "state dict it saved in one save (a save cut short on some ranks leaves their "
            "older files in place)."
        )


def _loaded_alike(
    rows: list[tuple[int, ...]], at: int, needed: int, noun: str, note: str = ""
) -> None:
    """Raise unless every rank loaded the same sizes (:func:`_digest`, columns ``at`` on), or
    none where column ``needed`` (the setting that gives them) is 0 on every rank; ``noun``
    names what was loaded, ``note`` follows it in the first line."""
    if len({row[at : at + 3] for row in rows if row[at] or row[needed]}) <= 1:
        return
    lines = [
        f"  rank {r}: {noun} for {row[at]} tensor(s), {row[at + 1]} elements"
        if row[at]
        else f"  rank {r}: none"
        for r, row in enumerate(rows)
    ]
    raise ValueError(
        f"fastddp: CompressState.load_state_dict was given {noun}{note} for other tensors on "
        "some ranks than on others (or on some ranks only):\n"
        + "\n".join(lines)
        + "\nLoad into each rank the state dict that rank saved, of the same model, on every "
        "rank (or start without them)."
    )


def topology_of(rows: list[tuple[int, ...]], rank: int) -> Topology:
    """The topology the rows describe, seen from ``rank``."""
    return Topology([row[10] for row in rows], rank)
