"""What the typed wrappers of :mod:`fastddp.ops` share: their names and docstrings, and the
fake kernels' device check."""

from typing import Optional

import torch

__all__ = ["bool_seed", "named", "one_device"]


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


def bool_seed(op: str, seed: bool) -> TypeError:
    # torch's schemas take a bool for an int, and seed=True would be seed 1 at every call: the
    # same random numbers every step, whose roundings no longer average out over the steps.
    return TypeError(
        f"fastddp.{op}: seed must be an int, got {seed}: -1 rounds to nearest even, and a "
        "seed >= 0 rounds stochastically with random numbers drawn from it and the element "
        "index; give each call a seed of its own (the step, say)"
    )
