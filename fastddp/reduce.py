"""``fastddp.all_reduce``: the hooks' compressed reduction for tensors outside DDP."""

import zlib
from collections.abc import Iterable
from typing import Optional, Union

import torch
import torch.distributed as dist

from fastddp._reduce_args import (
    UNSET,
    device_of,
    problem_of,
    refused,
    settled,
    unlike_first,
    unlike_shapes,
)
from fastddp.hooks import CompressState, _reduce
from fastddp.hooks.hook import _verify
from fastddp.hooks.settings import outside

__all__ = ["all_reduce"]


def all_reduce(
    tensors: Union[torch.Tensor, Iterable[torch.Tensor]],
    dtype: Optional[torch.dtype] = None,
    op: str = "avg",
    group: Optional[dist.ProcessGroup] = None,
    *,
    accumulate_dtype: Optional[torch.dtype] = UNSET,  # type: ignore[assignment]
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
            tensors of other sizes or shapes, another ``op`` or ``bucket_cap_mb``, are refused.
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
        state, cap, tensors = settled(
            tensors, dtype, op, group, accumulate_dtype, stochastic_rounding, block_size,
            topology, state, bucket_cap_mb,
        )  # fmt: skip
    except (TypeError, ValueError):
        refused(tensors, group, state)
        raise
    problem = problem_of(tensors)
    if not state._verified:
        # The first call of a state checks that every rank passed the same tensors, and
        # tensors it can reduce, in the handshake it makes anyway: a rank that raised alone
        # (a None gradient on one rank) would leave the others waiting in it.
        sizes = () if problem else tuple(t.numel() for t in tensors)
        # A state loaded from a state dict keeps the op and buckets its residuals were saved in.
        unlike = None if problem or state._layout is None else unlike_first(state, sizes, op, cap)
        if unlike is not None:
            refused(tensors, group, state)
            raise ValueError(f"{where}: {unlike}")
        # Shapes, not sizes: a (2, 3) reduced with a (3, 2) would add elements by flat index.
        shapes = () if problem else tuple(tuple(t.shape) for t in tensors)
        digest = zlib.crc32(repr(shapes).encode())
        layout = (len(sizes), sum(sizes), digest)
        found = problem[:2] if problem else (0, 0)
        try:
            _verify(state, device_of(tensors, state), layout, found, 1 if op == "avg" else 2, cap)
        except ValueError as e:
            if problem is None:
                raise
            # The handshake's rows carry a code per rank; this rank knows the details too.
            raise ValueError(f"{e}\nHere: {problem[2]}") from None
        state._layout, state._shapes = (op, sizes, cap), shapes
    elif problem:
        # Later calls are not checked across ranks (a collective each): alike on every rank
        # that passes the same. A ValueError, as the first call's handshake raises, so that
        # one except clause catches the same bad tensors at every call.
        raise ValueError(f"{where}: {problem[2]}")
    else:
        unlike = unlike_first(state, tuple(t.numel() for t in tensors), op, cap)
        if unlike is None:
            unlike = unlike_shapes(state, tensors)
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
