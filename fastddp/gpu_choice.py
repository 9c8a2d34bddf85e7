"""Which GPU a rank takes, and a name for that GPU that ranks of one node can compare.

Launchers give GPUs to ranks in two ways. torchrun and ``srun --gpus-per-node`` let every
rank of a node see all its GPUs: the rank takes ``cuda:LOCAL_RANK``. ``srun
--gpus-per-task=1``, torchrun's ``--virtual-local-rank`` and a ``CUDA_VISIBLE_DEVICES`` of its
own per rank let each rank see one: every rank takes ``cuda:0``, a different GPU each. From
inside one process the two cases look alike when a node has a single GPU, so the ranks compare
the GPUs' UUIDs before init (:func:`fastddp.joining.agree`) and refuse two ranks on one GPU on
every rank, before NCCL would refuse it on one ("Duplicate GPU") or the two ranks would share
it by halves.
"""

import socket
from typing import Optional

import torch

__all__ = ["cuda_index", "gpu_identity"]


def cuda_index(local_rank: int, visible: int) -> tuple[Optional[int], Optional[str]]:
    """Return ``(index, None)``, the CUDA device for ``local_rank`` among ``visible`` GPUs, or
    ``(None, problem)`` where this rank has none."""
    if local_rank < visible:
        return local_rank, None
    if visible == 1:
        return 0, None  # this rank's own GPU, if the others' are not the same one (agree)
    return None, (
        f"local rank {local_rank} needs cuda:{local_rank} but {visible} GPU(s) are visible on "
        f"{socket.gethostname()}; start at most one process per GPU on each node (a rank that "
        "sees one GPU, as under srun --gpus-per-task=1, takes it whatever its local rank)"
    )


def gpu_identity(index: int) -> tuple[Optional[tuple[str, str]], Optional[str]]:
    """Return ``((uuid, where), None)`` for GPU ``index``, or ``(None, problem)`` where it
    cannot be opened. The UUID is the same in every process that sees the GPU, whatever its
    index there; ``where`` is ``"cuda:I on HOST"``, for messages."""
    where = f"cuda:{index} on {socket.gethostname()}"
    try:
        return (str(torch.cuda.get_device_properties(index).uuid), where), None
    except Exception as error:  # (a driver that lists a GPU it cannot open)
        return None, f"{where} cannot be opened: {error}"
