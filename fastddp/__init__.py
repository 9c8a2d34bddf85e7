"""fastddp: fused gradient compression and communication hooks for PyTorch DDP.

Importing fastddp loads the compiled ops (``torch.ops.fastddp``) and never initialises CUDA.
"""

from fastddp import ops
from fastddp._extension import ExtensionError, build_info
from fastddp.hooks import CompressState, compress_hook

__version__ = "0.1.0"

__all__ = [
    "CompressState",
    "ExtensionError",
    "build_info",
    "compress_hook",
    "ops",
]
