"""``fastddp.all_reduce``'s arguments and tensors checked: the state a call uses (a new one
without ``state=``), its bucket size, the tensors it refuses, and the handshake that names an
argument refused on one rank on the others."""

import itertools
import numbers
from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist

from fastddp.codecs import CODECS
from fastddp.hooks import CompressState
from fastddp.hooks.handshake import ARGUMENTS, TENSOR_PROBLEMS, exchange
from fastddp.hooks.presets import named_preset

UNSET = object()  # accumulate_dtype not given (None is a setting: sum in the wire dtype)
_MAX_CAP_MB = 2.0**30  # 2**48 elements, well inside the handshake's int64
_STATELESS_CALLS = itertools.count(1)  # seeds the rounding of calls without state=
# The tensor types reduced: a subclass (a DTensor) reaches the ops through its own dispatch and
# fails there, after a state's first call has fixed its layout to it.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def unlike_first(state: CompressState, sizes: tuple, op: str, cap: int) -> Optional[str]:
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


def unlike_shapes(state: CompressState, tensors: list) -> Optional[str]:
    """How this call's shapes differ from those of the state's first call (this rank's, as the
    handshake compared them across ranks), where the element counts are alike; None if they do
    not. A reshaped tensor would be summed by flat index, and repaid others' residuals."""
    first = state._shapes
    shapes = tuple(t.shape for t in tensors)
    if first is None or shapes == first:  # (one comparison of tuples, at every call)
        return None
    for i, (mine, shape) in enumerate(zip(shapes, first)):
        if mine != shape:
            return (
                f"tensor {i} has shape {tuple(mine)}, and the state was first given one of "
                f"{shape}: of as many elements, but the ranks' tensors are summed, and their "
                "residuals repaid, element by element as first laid out. Pass the tensors in "
                "the shapes of the first call (or give these a CompressState of their own)"
            )
    return None


def settled(
    tensors, dtype, op, group, accumulate_dtype, stochastic_rounding, block_size, topology,
    state, bucket_cap_mb,
) -> tuple[CompressState, int, list]:  # fmt: skip
    """all_reduce's arguments checked: its state (a new one without ``state=``), its bucket
    size in elements and its tensors as a list."""
    where = "fastddp.all_reduce"
    if op not in ("avg", "sum"):
        raise ValueError(f'{where}: op must be "avg" or "sum", got {op!r}')
    # (numpy's numbers too; its bool is no Real)
    number = isinstance(bucket_cap_mb, numbers.Real) and not isinstance(bucket_cap_mb, bool)
    if not (number and 0 < bucket_cap_mb <= _MAX_CAP_MB):
        raise ValueError(
            f"{where}: bucket_cap_mb must be a positive number of MiB, at most {_MAX_CAP_MB:g} "
            f"(a bucket's elements are counted in int64), got {bucket_cap_mb!r}"
        )
    cap = int(float(bucket_cap_mb) * 2**20) // 4  # elements
    if state is None:
        check_dtype(dtype, where)
        try:
            state = CompressState(
                torch.bfloat16 if dtype is None else dtype,
                group,
                accumulate_dtype=torch.float32 if accumulate_dtype is UNSET else accumulate_dtype,
                # (None: the default; anything else CompressState checks, "no" refused.)
                stochastic_rounding=False if stochastic_rounding is None else stochastic_rounding,
                block_size=block_size,
                topology="auto" if topology is None else topology,
                # A state's rounding draws anew with each of its calls; a fresh state per call
                # would draw the same numbers each time, and round the same tensor alike, biased.
                seed=next(_STATELESS_CALLS) if stochastic_rounding else 0,
            )
        except (TypeError, ValueError) as e:
            # The caller built no CompressState: name the call it made, and its arguments
            # (the same names in both but the group's).
            text = str(e).replace("CompressState:", f"{where}:", 1)
            raise type(e)(text.replace(" process_group ", " group ")) from None
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
        if accumulate_dtype is not UNSET:  # None is a setting here (sum in the wire dtype)
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


def refused(tensors, group, state: Optional[CompressState]) -> None:
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
        exchange(stand_in, device_of(items, stand_in), problem=(ARGUMENTS, 0))
    except Exception:
        return  # (the error this rank raises says more than the handshake's)


def problem_of(tensors: list) -> Optional[tuple[int, int, str]]:
    """The first tensor all_reduce cannot take: ``(code, index, message)``, codes as in
    :data:`fastddp.hooks.handshake.TENSOR_PROBLEMS`; None if there is none."""
    inference = None  # whether inference mode is on, asked at the first inference tensor
    for i, t in enumerate(tensors):
        if t is None:
            return 1, i, f"tensors[{i}] is None, {TENSOR_PROBLEMS[1]}"
        if not isinstance(t, torch.Tensor):
            return 2, i, f"tensors[{i}] is a {type(t).__name__}, not a Tensor"
        if type(t) not in _PLAIN:
            return 10, i, _subclass(t, i)
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
        if t.is_inference():
            inference = torch.is_inference_mode_enabled() if inference is None else inference
            if not inference:  # (else the call reduces copies and writes them back)
                return 9, i, f"tensors[{i}] is {TENSOR_PROBLEMS[9]}"
        # A contiguous tensor (the common case, a flag read in C++) shares no elements.
        if not t.is_contiguous() and any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape)):
            return 5, i, f"tensors[{i}] is {TENSOR_PROBLEMS[5]}"
    return None


def _subclass(t: torch.Tensor, i: int) -> str:
    """Why a tensor subclass is refused, and the plain tensor to pass in its place."""
    if callable(getattr(t, "to_local", None)):  # a DTensor: as_subclass would keep its type
        fix = "pass t.to_local(), a view of this rank's local tensor: the result lands in t"
    else:
        fix = "pass t.as_subclass(torch.Tensor), a plain tensor over the same memory"
    return (
        f"tensors[{i}] is a {type(t).__name__} (a torch.Tensor subclass), and all_reduce "
        f"reduces plain tensors: {fix}"
    )


def device_of(tensors: list, state: CompressState) -> torch.device:
    """Where the handshake's row goes: the tensors' device, else the group's backend's."""
    first = tensors[0] if tensors else None
    if isinstance(first, torch.Tensor) and first.device.type in ("cpu", "cuda"):
        return first.device
    if dist.get_backend(state.process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_dtype(dtype, where: str) -> None:
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
