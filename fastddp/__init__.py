"""fastddp: fused gradient compression and communication hooks for PyTorch DDP.

Importing fastddp needs neither the compiled ops nor CUDA: the launcher, cluster detection and
rank setup work without them. The names that compute (:func:`compress_hook`,
:func:`register_comm_hook`, :class:`CompressState`, :func:`all_reduce`, :data:`PRESETS`,
:class:`DiLoCo`, :mod:`fastddp.ops`) load the compiled ops (``torch.ops.fastddp``) when first
used, and a missing or mismatched build raises :class:`ExtensionError` naming the rebuild
command. CUDA is never initialised on import.
"""

import importlib
from typing import Any

from fastddp._extension import ExtensionError, build_info
from fastddp._version import __version__ as __version__
from fastddp.cluster import ClusterError
from fastddp.distributed import (
    DistEnv,
    distributed_session,
    init_distributed,
    is_main_process,
    shutdown_distributed,
)

# Public names whose modules load the compiled ops: imported on first use.
_LAZY = {
    "ops": ("fastddp.ops", None),
    "PRESETS": ("fastddp.hooks", "PRESETS"),
    "CompressState": ("fastddp.hooks", "CompressState"),
    "compress_hook": ("fastddp.hooks", "compress_hook"),
    "register_comm_hook": ("fastddp.hooks", "register_comm_hook"),
    "all_reduce": ("fastddp.reduce", "all_reduce"),
    "DiLoCo": ("fastddp.diloco", "DiLoCo"),
}

__all__ = [
    "all_reduce",
    "ClusterError",
    "CompressState",
    "DiLoCo",
    "DistEnv",
    "ExtensionError",
    "PRESETS",
    "build_info",
    "compress_hook",
    "distributed_session",
    "init_distributed",
    "is_main_process",
    "ops",
    "register_comm_hook",
    "shutdown_distributed",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'fastddp' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
