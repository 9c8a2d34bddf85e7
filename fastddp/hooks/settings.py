"""The settings of :class:`~fastddp.CompressState`: checks that raise, and their plain form.

Nothing here writes to a state. :func:`checked` validates the constructor's arguments and
returns them normalised; :func:`plain` gives the settings every rank must share in plain Python
types (as saved in state dicts); :func:`from_plain` turns those back into arguments.
"""

from typing import Any, Optional

import torch
import torch.distributed as dist

from fastddp.codecs import CODECS, checked_block_size
from fastddp.hooks.topology import TOPOLOGIES

__all__ = ["checked", "from_plain", "mismatch", "outside", "plain"]

_WHERE = "CompressState"


def outside(group) -> bool:
    """Whether this rank is outside ``group`` (``new_group``'s stand-in on such a rank)."""
    return isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER


def checked(
    dtype: torch.dtype,
    process_group: Optional[dist.ProcessGroup],
    accumulate_dtype: Optional[torch.dtype],
    error_feedback: bool,
    stochastic_rounding: bool,
    block_size: Optional[int],
    seed: int,
    topology: str,
    delay: int = 0,
) -> dict[str, Any]:
    """Return the arguments of :class:`~fastddp.CompressState`, normalised; raise on bad ones.

    A codec that cannot be summed on the wire (int8) always accumulates in fp32; a
    block-scaled codec gets its default block size.
    """
    block_size = checked_block_size(_WHERE, dtype, block_size)
    if outside(process_group):
        raise ValueError(
            f"{_WHERE}: this rank is not in process_group (torch.distributed.new_group gave it "
            "GroupMember.NON_GROUP_MEMBER); make the state on the group's ranks only"
        )
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"{_WHERE}: process_group must be a torch.distributed.ProcessGroup or "
            f"None (the default group), got {type(process_group).__name__}"
        )
    if accumulate_dtype not in (None, torch.float32):
        raise ValueError(
            f"{_WHERE}: accumulate_dtype must be torch.float32 (sum in fp32) or None (let "
            f"the collective sum in the wire dtype), got {accumulate_dtype!r}"
        )
    if CODECS[dtype].blocks is not None:
        accumulate_dtype = torch.float32  # scaled payloads can only be summed after decoding
    for name, value in (
        ("error_feedback", error_feedback),
        ("stochastic_rounding", stochastic_rounding),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{_WHERE}: {name} must be True or False, got {value!r}")
    if CODECS[dtype].feedback_required and not error_feedback:
        raise ValueError(
            f"{_WHERE}: dtype={dtype} rounds most of a gradient to zero (codes -1, 0, 1) and "
            "trains only with error feedback; pass error_feedback=True (preset "
            f"'{str(dtype).removeprefix('torch.')}-ef')"
        )
    if accumulate_dtype is None:
        _check_summed_on_wire(dtype, error_feedback, stochastic_rounding)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{_WHERE}: seed must be an int, got {seed!r}")
    if topology not in TOPOLOGIES:
        raise ValueError(
            f"{_WHERE}: topology must be one of {', '.join(map(repr, TOPOLOGIES))}, got "
            f"{topology!r}"
        )
    if isinstance(delay, bool) or not isinstance(delay, int) or delay not in (0, 1):
        raise ValueError(
            f"{_WHERE}: delay must be 0 (each step applies its own reduced gradient) or 1 (each "
            f"step applies the gradient reduced during the previous step), got {delay!r}"
        )
    return {
        "dtype": dtype,
        "process_group": process_group,
        "accumulate_dtype": accumulate_dtype,
        "error_feedback": error_feedback,
        "stochastic_rounding": stochastic_rounding,
        "block_size": block_size,
        "seed": seed,
        "topology": topology,
        "delay": delay,
    }


def _check_summed_on_wire(dtype: torch.dtype, error_feedback: bool, stochastic: bool) -> None:
    # A collective that sums 16-bit payloads rounds to nearest at every hop: error feedback
    # cannot return those roundings, and they bias the sum whatever this rank's rounding does.
    name = str(dtype).removeprefix("torch.")
    fix = "pass accumulate_dtype=torch.float32 to sum in fp32"
    if error_feedback:
        also = " (preset 'bf16-acc-ef')" if dtype == torch.bfloat16 else ""
        raise ValueError(
            f"{_WHERE}: error_feedback=True with {name} summed by the collective keeps this "
            "rank's rounding but not those of the collective's sum, so the sum still drifts; "
            f"{fix}{also}"
        )
    if stochastic:
        raise ValueError(
            f"{_WHERE}: stochastic_rounding=True with {name} summed by the collective is not "
            f"unbiased: the collective rounds each partial sum to nearest; {fix}"
        )


def plain(state: Any) -> dict[str, Any]:
    """The settings every rank must share, in plain Python types."""
    return {
        "dtype": state.codec.name,
        "accumulate_dtype": None if state.accumulate_dtype is None else "float32",
        "error_feedback": state.error_feedback,
        "stochastic_rounding": state.stochastic_rounding,
        "block_size": state.block_size,
        "topology": state.topology,
        "delay": state.delay,
    }


def from_plain(settings: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~fastddp.CompressState` arguments of :func:`plain`'s ``settings``."""
    dtypes = {str(d).removeprefix("torch."): d for d in CODECS}
    return {
        "dtype": dtypes[settings["dtype"]],
        "accumulate_dtype": torch.float32 if settings["accumulate_dtype"] else None,
        "topology": settings.get("topology", "auto"),
        "error_feedback": settings["error_feedback"],
        "stochastic_rounding": settings["stochastic_rounding"],
        "block_size": settings["block_size"],
        "delay": settings.get("delay", 0),
    }


def mismatch(saved: dict[str, Any], mine: dict[str, Any]) -> Optional[str]:
    """Why settings saved in a state dict cannot load into a state with ``mine``, or None.

    The topology may differ: residuals carry over between topologies (see residuals.py).
    """
    for key, value in mine.items():
        if key == "topology":
            continue
        default = 0 if key == "delay" else value if key != "dtype" else None
        theirs = saved.get(key, default)
        if theirs != value:
            return (
                f"CompressState.load_state_dict: saved {key} {theirs!r} does not match this "
                f"state's {value!r}; build the state with the settings it was saved with"
            )
    return None
