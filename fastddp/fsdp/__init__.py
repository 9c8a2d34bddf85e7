"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with compressed gradient reductions.

- ``reduce_scatter``: :class:`CompressedReduceScatter`, a compressed reduce-scatter over the
  shard group (:func:`compress_reduce_scatter` installs it);
- ``mesh``: :func:`node_mesh`, the 2-D mesh of nodes × ranks per node;
- ``hybrid``: :func:`hybrid`, sharding inside the node with each shard all-reduced across nodes
  compressed, with error feedback kept per shard (:class:`HybridAllReduce`);
- ``all_gather``: :class:`QuantizedAllGather`, the parameters all-gathered as int8 with block
  scales (:func:`quantize_all_gather` installs it);
- ``install``: :func:`compress_reduce_scatter` and :func:`quantize_all_gather`.
"""

from fastddp.fsdp.all_gather import QuantizedAllGather
from fastddp.fsdp.hybrid import HybridAllReduce, hybrid
from fastddp.fsdp.install import compress_reduce_scatter, quantize_all_gather
from fastddp.fsdp.mesh import node_mesh
from fastddp.fsdp.reduce_scatter import CompressedReduceScatter

__all__ = [
    "CompressedReduceScatter",
    "HybridAllReduce",
    "QuantizedAllGather",
    "compress_reduce_scatter",
    "hybrid",
    "node_mesh",
    "quantize_all_gather",
]
