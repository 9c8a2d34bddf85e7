"""DDP communication hooks that send gradients as fp16, bf16, int8, int4 or int2.

Each module has one job:

- ``codecs``: how a fp32 bucket is encoded into wire rows, summed in fp32 and decoded
  (fp16, bf16; int8, int4 and int2 with block scales);
- ``paths``: which collectives move a bucket (``allreduce``: the collective sums in the wire
  dtype; ``alltoall``: all-to-all, fp32 sum, all-gather; ``hierarchical-*``: fp32 inside the
  node, one of those across nodes; ``passthrough``: 16-bit buckets);
- ``topology``: which ranks share a node, and the groups of the two-level path;
- ``pipeline``: when each stage runs and how result futures complete, on CPU and GPU;
- ``slots``: the persistent per-bucket buffers; ``residuals``: error-feedback residuals across
  bucket layouts and restarts; ``delay``: the gradients in waiting of ``delay=1``; ``state``:
  :class:`CompressState`; ``hook``: the hook itself; ``register``: :func:`register_comm_hook`,
  the hook on a DDP model, with fixed modes' planned buckets and ``"auto"``'s fp32 plans in C++;
- ``auto``: ``dtype="auto"``, which tries fixed states on the job and keeps the fastest, over
  ``candidates`` (the modes it may choose), ``trial`` (their turns), ``measured`` (what a
  measured step records), ``choice`` (the plan chosen), ``planner`` (the per-bucket model),
  ``links`` (each level of the network timed), ``replan`` (when to plan again), ``owed``
  (residuals a candidate left) and ``switch`` (the steps handed to C++).
"""

# auto.py makes CompressState(dtype="auto") an AutoState (it sets CompressState._named).
from fastddp.hooks import auto as auto
from fastddp.hooks.hook import _reduce as _reduce  # the worker, for fastddp.all_reduce
from fastddp.hooks.hook import compress_hook
from fastddp.hooks.presets import PRESETS
from fastddp.hooks.register import register_comm_hook
from fastddp.hooks.state import DEFAULT_BLOCK_SIZE, CompressState

__all__ = ["CompressState", "DEFAULT_BLOCK_SIZE", "PRESETS", "compress_hook", "register_comm_hook"]
