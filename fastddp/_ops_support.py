"""What the typed wrappers of :mod:`fastddp.ops` share: their names and docstrings, the check
of their int arguments, and the fake kernels' device check."""

from typing import Optional

import numpy as np
import torch

__all__ = ["bool_seed", "check_ints", "named", "one_device"]


def one_device(op: str, *tensors: Optional[torch.Tensor]) -> None:
    # A meta tensor among real ones sends the call here, not to the kernels' device checks:
    # without this, a meta flag, residual or scales made a CPU call do nothing at all.
    devices = {t.device for t in tensors if t is not None}
    torch._check(
        len(devices) <= 1,
        lambda: (
            f"fastddp.{op}: the tensors are on {', '.join(sorted(map(str, devices)))}; "
            "allocate them on one device"
        ),
    )


def named(wrapper, name: str, doc: str):
    # The public name and docstring of a wrapper that one of the factories below made.
    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = doc
    return wrapper


def check_ints(op: str, **values) -> None:
    """Raise a TypeError naming the first of ``values`` that is a bool (numpy's too): torch's
    schemas take a bool for an int, so ``block_size=True`` would be a block of 1."""
    for name, value in values.items():
        if isinstance(value, (bool, np.bool_)):
            if name == "seed":
                raise bool_seed(op, value)
            raise TypeError(f"fastddp.{op}: {name} must be an int, got {value!r}")


def bool_seed(op: str, seed: bool) -> TypeError:
    # torch's schemas take a bool for an int, and seed=True would be seed 1 at every call: the
    # same random numbers every step, whose roundings no longer average out over the steps.
    return TypeError(
        f"fastddp.{op}: seed must be an int, got {seed}: -1 rounds to nearest even, and a "
        "seed >= 0 rounds stochastically with random numbers drawn from it and the element "
        "index; give each call a seed of its own (the step, say)"
    )
