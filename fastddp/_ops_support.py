"""What the typed wrappers of :mod:`fastddp.ops` share: their names and docstrings, and the
fake kernels' device check."""

from typing import Optional

import torch

__all__ = ["named", "one_device"]


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
