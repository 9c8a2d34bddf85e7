"""Run a function on several real processes joined by a Gloo process group."""

import faulthandler
import gc
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastddp.distributed import exit_after_shutdown

# Every collective gives up after this long, so a broken test fails instead of hanging.
PG_TIMEOUT = timedelta(seconds=60)


def _entry(rank, fn, world_size, init_method, args):
    faulthandler.enable()  # a rank that aborts in C++ still shows where it was in Python
    torch.set_num_threads(1)  # several ranks share two cores
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=PG_TIMEOUT
    )
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        # Free DDP models (which hold the group) while the interpreter is whole, so that the
        # group's threads are joined here rather than during interpreter shutdown.
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
    # Errors raised above never get here; they reach the parent as usual.
    exit_after_shutdown()


def run_ranks(fn, world_size, *args, timeout=180.0):
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    A rank that raises fails the call with that rank's traceback; the others are terminated.
    ``fn`` must be a module-level function (it is pickled by name).
    """
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, init, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"ranks did not finish within {timeout:.0f} s")
