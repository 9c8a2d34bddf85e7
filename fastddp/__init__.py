"""fastddp: fused gradient compression and communication hooks for PyTorch DDP.

Importing fastddp loads the compiled ops (``torch.ops.fastddp``) and never initialises CUDA.
"""

from fastddp import ops
from fastddp._extension import ExtensionError, build_info
from fastddp.cluster import ClusterError
from fastddp.distributed import (
    DistEnv,
    distributed_session,
    init_distributed,
    is_main_process,
    shutdown_distributed,
)
from fastddp.hooks import CompressState, compress_hook
from fastddp.reduce import all_reduce

__version__ = "0.1.0"

__all__ = [
    "all_reduce",
    "ClusterError",
    "CompressState",
    "DistEnv",
    "ExtensionError",
    "build_info",
    "compress_hook",
    "distributed_session",
    "init_distributed",
    "is_main_process",
    "ops",
    "shutdown_distributed",
]
