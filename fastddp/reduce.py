"""``fastddp.all_reduce``: the hooks' compressed reduction for tensors outside DDP."""

import itertools
import zlib
from collections.abc import Iterable
from typing import Optional, Union

import torch
import torch.distributed as dist

from fastddp.codecs import CODECS
from fastddp.hooks import CompressState, _reduce
from fastddp.hooks.handshake import ARGUMENTS, TENSOR_PROBLEMS, exchange
from fastddp.hooks.hook import _verify
from fastddp.hooks.presets import named_preset
from fastddp.hooks.settings import outside

__all__ = ["all_reduce"]

_UNSET = object()
_MAX_CAP_MB = 2.0**30  # 2**48 elements, well inside the handshake's int64
_STATELESS_CALLS = itertools.count(1)  # seeds the rounding of calls without state=


def all_reduce(
    tensors: Union[torch.Tensor, Iterable[torch.Tensor]],
    dtype: Optional[torch.dtype] = None,
    op: str = "avg",
    group: Optional[dist.ProcessGroup] = None,
    *,
    accumulate_dtype: Optional[torch.dtype] = _UNSET,  # type: ignore[assignment]
    stochastic_rounding: Optional[bool] = None,
    block_size: Optional[int] = None,
    topology: Optional[str] = None,
    state: Optional[CompressState] = None,
    bucket_cap_mb: float = 25.0,
) -> None:
    r"""Sum or average float32 tensors across ranks, in place, sending them compressed.

    Tensors are packed into buckets of at most ``bucket_cap_mb`` (a single contiguous tensor is
    reduced where it lies, without a copy) and reduced like :func:`fastddp.compress_hook`'s
    buckets: by default as bf16 payloads summed in fp32, so that the error does not grow with
    the number of ranks. Every rank must call it with tensors of the same shapes, in the same
    order: the first call of a state (every call, without ``state``) checks it on every rank.
    A state's later calls check only this rank's tensors against its first call's, with no
    collective: where one rank alone passes others, it raises and the others wait in the
    collective until the group's timeout, as with :func:`torch.distributed.all_reduce`.
    Non-finite values come back as the hooks give them: as they are with a 16-bit wire dtype;
    with int8, int4 and int2, as NaN over their scale's whole block.

    Args:
        tensors (Tensor or list of Tensor): float32 tensors on one device, changed in place.
        dtype (torch.dtype, optional): wire dtype: ``torch.bfloat16`` (default),
            ``torch.float16``, ``torch.int8`` or ``torch.int4`` (``torch.int2``, which needs
            error feedback, through ``state``).
        op (str): ``"avg"`` (default) or ``"sum"``.
        group (ProcessGroup, optional): the group; ``None`` is the default group. On a rank
            outside it (``new_group`` gave it ``GroupMember.NON_GROUP_MEMBER``) the call
            does nothing, as :func:`torch.distributed.all_reduce` does.
        accumulate_dtype (torch.dtype, optional): ``torch.float32`` (default) sums in fp32;
            ``None`` lets the collective sum in the wire dtype.
        stochastic_rounding (bool, optional): round stochastically (default False; with a
            16-bit dtype only when summed in fp32), with new numbers each call.
        block_size (int, optional): elements per scale of int8, int4 and int2 (default 128).
        topology (str, optional): ``"auto"`` (default), ``"flat"`` or ``"hierarchical"``, as
            for :class:`CompressState`.
        state (CompressState, optional): a state to reuse across calls instead of the
            arguments above: it keeps buffers, counters and error-feedback residuals (create
            it with ``error_feedback=True`` for that). Give it the same tensors each call;
            tensors of other sizes, another ``op`` or ``bucket_cap_mb``, are refused.
        bucket_cap_mb (float): largest bucket, in MiB of float32.

    Example::

        >>> grads = [p.grad for p in model.parameters()]
        >>> fastddp.all_reduce(grads)  # averaged across ranks, bf16 on the wire
        >>> fastddp.all_reduce(big, dtype=torch.int8, op="sum")
    """
    where = "fastddp.all_reduce"
    if outside(group):
        return
    try:
        state, cap, tensors = _settled(
            tensors, dtype, op, group, accumulate_dtype, stochastic_rounding, block_size,
            topology, state, bucket_cap_mb,
        )  # fmt: skip
    except (TypeError, ValueError):
        _refused(tensors, group, state)
        raise
    problem = _problem(tensors)
    if not state._verified:
        # The first call of a state checks that every rank passed the same tensors, and
        # tensors it can reduce, in the handshake it makes anyway: a rank that raised alone
        # (a None gradient on one rank) would leave the others waiting in it.
        sizes = () if problem else tuple(t.numel() for t in tensors)
        # A state loaded from a state dict keeps the op and buckets its residuals were saved in.
        unlike = None if problem or state._layout is None else _unlike(state, sizes, op, cap)
        if unlike is not None:
            _refused(tensors, group, state)
            raise ValueError(f"{where}: {unlike}")
        # Shapes, not sizes: a (2, 3) reduced with a (3, 2) would add elements by flat index.
        shapes = () if problem else tuple(tuple(t.shape) for t in tensors)
        digest = zlib.crc32(repr(shapes).encode())
        layout = (len(sizes), sum(sizes), digest)
        found = problem[:2] if problem else (0, 0)
        try:
            _verify(state, _device(tensors, state), layout, found, 1 if op == "avg" else 2, cap)
        except ValueError as e:
            if problem is None:
                raise
            # The handshake's rows carry a code per rank; this rank knows the details too.
            raise ValueError(f"{e}\nHere: {problem[2]}") from None
        state._layout = (op, sizes, cap)
    elif problem:
        # Later calls are not checked across ranks (a collective each): alike on every rank
        # that passes the same. A ValueError, as the first call's handshake raises, so that
        # one except clause catches the same bad tensors at every call.
        raise ValueError(f"{where}: {problem[2]}")
    else:
        unlike = _unlike(state, tuple(t.numel() for t in tensors), op, cap)
        if unlike is not None:
            raise ValueError(f"{where}: {unlike}")
    if not tensors:
        return
    if torch.is_inference_mode_enabled():
        # A state's buffers, made at its first call, must not be inference tensors (a call
        # outside inference mode could not write them), and inference tensors may be written
        # only inside it: reduce outside it, into copies of those, and copy back here.
        with torch.inference_mode(False):
            work = [t.clone() if t.is_inference() else t for t in tensors]
            _reduce_all(state, work, cap, op)
        for t, done in zip(tensors, work):
            if done is not t:
                t.copy_(done)
        return
    _reduce_all(state, tensors, cap, op)


def _unlike(state: CompressState, sizes: tuple, op: str, cap: int) -> Optional[str]:
    """How this call differs from the tensors, op and buckets the state was first called with
    (or saved with), which its buffers and residuals belong to; None if it does not."""
    first_op, first, first_cap = state._layout
    if sizes != first:
        return (
            f"this state was first given {len(first)} tensor(s) of {sum(first)} elements, and "
            f"this call {len(sizes)} of {sum(sizes)}"
            f"{' (as many, but of other sizes)' if len(sizes) == len(first) else ''}: its "
            "buffers and residuals belong to the first ones. Give each set of tensors a "
            "CompressState of its own (or call all_reduce without state=)"
        )
    if op != first_op:
        # Only the first call compares op across ranks; a state keeps it, as its residuals are
        # in its units (an average's share, or the sum's).
        return (
            f"this state was first called with op={first_op!r}, and this call has op={op!r}; "
            "a state keeps its op (its residuals are in its units): give each op a "
            "CompressState of its own"
        )
    if cap != first_cap:  # its buffers (and residuals) are per bucket
        return (
            f"this state was first called with bucket_cap_mb={first_cap * 4 / 2**20:g}, and "
            f"this call has {cap * 4 / 2**20:g}; a state keeps its buckets (its buffers and "
            "residuals are per bucket): pass the same one"
        )
    return None


def _reduce_all(state: CompressState, tensors: list, cap: int, op: str) -> None:
    buckets = _bucketize(tensors, cap)
    with torch.no_grad():
        pending = []
        for index, members in enumerate(buckets):
            single = len(members) == 1 and tensors[members[0]].is_contiguous()
            if single:
                flat = tensors[members[0]].view(-1)
            else:
                flat = torch.cat([tensors[i].reshape(-1) for i in members])
            last = index == len(buckets) - 1
            params = tuple((i, tensors[i].numel()) for i in members)
            fut = _reduce(state, flat, index, is_last=last, average=op == "avg", params=params)
            pending.append((fut, flat, None if single else members))
        for fut, flat, members in pending:
            fut.wait()
            if members is not None:
                offset = 0
                for i in members:
                    n = tensors[i].numel()
                    tensors[i].copy_(flat[offset : offset + n].view_as(tensors[i]))
                    offset += n


def _settled(
    tensors, dtype, op, group, accumulate_dtype, stochastic_rounding, block_size, topology,
    state, bucket_cap_mb,
) -> tuple[CompressState, int, list]:  # fmt: skip
    """all_reduce's arguments checked: its state (a new one without ``state=``), its bucket
    size in elements and its tensors as a list."""
    where = "fastddp.all_reduce"
    if op not in ("avg", "sum"):
        raise ValueError(f'{where}: op must be "avg" or "sum", got {op!r}')
    number = isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool)
    if not (number and 0 < bucket_cap_mb <= _MAX_CAP_MB):
        raise ValueError(
            f"{where}: bucket_cap_mb must be a positive number of MiB, at most {_MAX_CAP_MB:g} "
            f"(a bucket's elements are counted in int64), got {bucket_cap_mb!r}"
        )
    cap = int(bucket_cap_mb * 2**20) // 4  # elements
    if state is None:
        _check_dtype(dtype, where)
        try:
            state = CompressState(
                torch.bfloat16 if dtype is None else dtype,
                group,
                accumulate_dtype=torch.float32 if accumulate_dtype is _UNSET else accumulate_dtype,
                stochastic_rounding=bool(stochastic_rounding),
                block_size=block_size,
                topology="auto" if topology is None else topology,
                # A state's rounding draws anew with each of its calls; a fresh state per call
                # would draw the same numbers each time, and round the same tensor alike, biased.
                seed=next(_STATELESS_CALLS) if stochastic_rounding else 0,
            )
        except (TypeError, ValueError) as e:
            # The caller built no CompressState: name the call it made (the arguments have
            # the same names in both).
            raise type(e)(str(e).replace("CompressState:", f"{where}:", 1)) from None
    else:
        if not isinstance(state, CompressState):
            raise TypeError(
                f"{where}: state must be a fastddp.CompressState, got {type(state).__name__}"
            )
        given = {
            "dtype": dtype,
            "stochastic_rounding": stochastic_rounding,
            "block_size": block_size,
            "topology": topology,
        }
        clash = [k for k, v in given.items() if v is not None]
        if accumulate_dtype is not _UNSET:  # None is a setting here (sum in the wire dtype)
            clash.append("accumulate_dtype")
        if clash:
            raise ValueError(
                f"{where}: pass either state= or the settings ({', '.join(clash)}), not both: "
                "the state already holds its settings"
            )
        if state.dtype == "auto":
            raise ValueError(
                f"{where}: state has dtype='auto', which plans by DDP's step time; give "
                "all_reduce a state of one mode (CompressState.from_preset(...))"
            )
        if state.delay:
            raise ValueError(
                f"{where}: state has delay=1, which only DDP's compress_hook applies (it hands "
                "back the previous step's gradient); give all_reduce a state with delay=0"
            )
        if state._verified and state._layout is None:
            raise ValueError(
                f"{where}: this state reduces a DDP model's buckets (compress_hook) or an FSDP2 "
                "module's gradients; its buffers and residuals belong to them. Give all_reduce "
                "a CompressState of its own"
            )
        ours = state.process_group if state.process_group is not None else dist.group.WORLD
        if group is not None and group is not ours:
            raise ValueError(
                f"{where}: group differs from state.process_group; build the CompressState "
                "with the group you want to reduce over"
            )
    if isinstance(tensors, dict):
        raise TypeError(f"{where}: tensors is a dict; pass its tensors, list(tensors.values())")
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Iterable):
        # One tensor; or None (an unused parameter's .grad) and the like, which the first
        # call's handshake then names on every rank, as it names them in a list.
        tensors = [tensors]
    return state, cap, list(tensors)


def _refused(tensors, group, state: Optional[CompressState]) -> None:
    """An argument was refused on this rank: where the other ranks make the first call's
    handshake (every call's, without ``state=``), make it too, marked, so that they raise
    instead of waiting for this rank; then the caller raises why, here."""
    if not dist.is_initialized():
        return
    if isinstance(state, CompressState) and state.dtype != "auto":
        if state._verified:
            return  # (later calls make no handshake: each rank raises what it meets)
        stand_in = state
    else:
        try:
            stand_in = CompressState(process_group=group)
        except (TypeError, ValueError):
            return  # (the group itself: no handshake could be made over it)
    if dist.get_world_size(stand_in.process_group) == 1:
        return
    items = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    items = list(items) if isinstance(items, (list, tuple)) else []
    try:  # (this rank raises its own error after it, the others theirs in it)
        exchange(stand_in, _device(items, stand_in), problem=(ARGUMENTS, 0))
    except Exception:
        return  # (the error this rank raises says more than the handshake's)


def _bucketize(tensors: list[torch.Tensor], cap: int) -> list[list[int]]:
    """Consecutive tensors grouped into buckets of at most ``cap`` elements (or one tensor)."""
    buckets: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        if not buckets or size + t.numel() > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += t.numel()
    return buckets


def _problem(tensors: list) -> Optional[tuple[int, int, str]]:
    """The first tensor all_reduce cannot take: ``(code, index, message)``, codes as in
    :data:`fastddp.hooks.handshake.TENSOR_PROBLEMS`; None if there is none."""
    for i, t in enumerate(tensors):
        if t is None:
            return 1, i, f"tensors[{i}] is None, {TENSOR_PROBLEMS[1]}"
        if not isinstance(t, torch.Tensor):
            return 2, i, f"tensors[{i}] is a {type(t).__name__}, not a Tensor"
        if t.layout != torch.strided:
            return 7, i, f"tensors[{i}] is {TENSOR_PROBLEMS[7]}"
        if t.dtype != torch.float32:
            return 3, i, f"tensors[{i}] is {t.dtype}; {TENSOR_PROBLEMS[3]}"
        if i == 0 and t.device.type not in ("cpu", "cuda"):  # the others must be alike
            return 6, i, f"tensors[{i}] is on {t.device}, {TENSOR_PROBLEMS[6]}"
        if t.device != tensors[0].device:
            return (
                4,
                i,
                (
                    f"tensors[{i}] is on {t.device} but tensors[0] on {tensors[0].device}; "
                    "reduce each device's tensors in a separate call"
                ),
            )
        # A contiguous tensor (the common case, a flag read in C++) shares no elements.
        if not t.is_contiguous() and any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape)):
            return 5, i, f"tensors[{i}] is {TENSOR_PROBLEMS[5]}"
    return None


def _device(tensors: list, state: CompressState) -> torch.device:
    """Where the handshake's row goes: the tensors' device, else the group's backend's."""
    first = tensors[0] if tensors else None
    if isinstance(first, torch.Tensor) and first.device.type in ("cpu", "cuda"):
        return first.device
    if dist.get_backend(state.process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_dtype(dtype, where: str) -> None:
    """The errors of a ``dtype`` that only a state can carry, in all_reduce's own terms."""
    if dtype == "auto":
        raise ValueError(
            f"{where}: dtype='auto' plans by DDP's step time, which all_reduce has not got; "
            "pass a wire dtype (torch.bfloat16, torch.float16, torch.int8, ...)"
        )
    if dtype == torch.float32:
        raise ValueError(
            f"{where}: dtype=torch.float32 would send the tensors uncompressed; use "
            "torch.distributed.all_reduce for that, or pass a wire dtype (torch.bfloat16, "
            "torch.float16, torch.int8, torch.int4)"
        )
    if isinstance(dtype, str):
        hint = named_preset(dtype, "state=CompressState.from_preset")
        raise TypeError(f"{where}: dtype must be a torch.dtype, got {dtype!r}{hint}")
    if isinstance(dtype, torch.dtype) and dtype in CODECS and CODECS[dtype].feedback_required:
        name = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"{where}: dtype={dtype} trains only with error feedback, which lives in a state "
            f"kept across calls: pass state=CompressState.from_preset('{name}-ef') and the same "
            "tensors every call"
        )
