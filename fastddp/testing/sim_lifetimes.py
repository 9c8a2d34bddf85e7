"""Early frees for the notional streams (:mod:`fastddp.testing.sim_streams`).

Each write a side stream makes is tracked by its storage: when the storage is freed while the
write is still hidden from the compute stream, and the writing stream did not hold that
storage, the free is recorded as early. On CUDA the caching allocator would hand the block to
the next tensor made on the stream that made it while the writer's kernels may still run.
"""

import threading
import weakref

import torch

__all__ = ["Life", "early_frees", "track"]


class Life:
    """One write's: whether it is still hidden from the compute stream, and the storages its
    stream holds (a live set)."""

    __slots__ = ("hidden", "held", "pointer", "what")

    def __init__(self, t: torch.Tensor, held: set, by: str) -> None:
        self.hidden, self.held = True, held
        self.pointer = t.untyped_storage().data_ptr()
        self.what = f"a {t.dtype} tensor of shape {tuple(t.shape)} (written by {by})"

    def seen(self) -> None:
        """The write landed for the compute stream (or was written over): nothing to check."""
        self.hidden = False
        with _lock:
            lives = _lives.get(self.pointer)
            if lives is not None:
                lives.pop(id(self), None)


# Reentrant: a free can run inside track() (an allocation there may start the cycle collector).
_lock = threading.RLock()
_lives: dict[int, dict[int, Life]] = {}  # storage pointer -> the hidden writes to it
_early: list[str] = []


def track(t: torch.Tensor, life: Life) -> None:
    """Check ``life`` when ``t``'s storage is freed."""
    if not life.pointer:
        return
    with _lock:
        lives = _lives.get(life.pointer)
        if lives is None:
            lives = _lives[life.pointer] = {}
            weakref.finalize(t.untyped_storage(), _freed, life.pointer)
        lives[id(life)] = life


def _freed(pointer: int) -> None:
    with _lock:
        lives = list(_lives.pop(pointer, {}).values())
        early = [life for life in lives if life.hidden and pointer not in life.held]
        for life in lives:
            life.held.discard(pointer)  # (the next storage at this address is not held)
        for life in early:
            _early.append(
                f"nccl-sim: {life.what} written on a side stream was freed before the "
                "compute stream was ordered after that write, and that stream did not hold "
                "it (on CUDA its memory may go to a new tensor while the write runs)"
            )


def early_frees() -> list[str]:
    """The early frees found since the last call (see the module docstring)."""
    with _lock:
        found = list(_early)
        _early.clear()
    return found
