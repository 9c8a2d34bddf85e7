"""One reduction of one bucket: what the pipeline (``pipeline.py``) steps through its path's
stages, and the future DDP waits on."""

from typing import Optional

import torch
import torch.distributed as dist

from fastddp.hooks.paths import Path
from fastddp.hooks.runtime import Runtime

__all__ = ["Job"]


class Job:
    """One reduction of one bucket."""

    __slots__ = (
        "path",
        "slot",
        "bucket",
        "groups",
        "world",
        "scale",
        "average",
        "seeds",
        "topo",
        "order",
        "stage",
        "work",
        "result",
        "runtime",
        "deferred",
    )

    def __init__(self, path: Path, slot, bucket, groups, world, average, seeds, topo) -> None:
        self.path = path
        self.slot = slot
        self.bucket = bucket
        self.groups = groups  # the process group of each stage
        self.world = world
        self.average = average
        self.scale = 1.0 / world if average else 1.0
        self.seeds = seeds
        self.topo = topo  # the state's Topology (its groups, for the two-level path)
        self.order = 0  # submission number (set by the pipeline): pending jobs step newest first
        self.stage = 0  # the next stage to run
        self.work: Optional[dist.Work] = None
        device = bucket.device
        # With devices set, the future records CUDA events when its value is set, so that
        # whoever waits on it also waits for the kernels that produced it.
        self.result = torch.futures.Future(devices=[device] if device.type == "cuda" else None)
        self.runtime: Optional[Runtime] = None  # set by the pipeline, as is:
        self.deferred = False  # left in flight past the backward pass (delay=1)

    @property
    def started_all(self) -> bool:
        return self.stage == self.path.stages
