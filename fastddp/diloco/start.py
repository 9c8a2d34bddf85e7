"""Every node starts from the first node's frozen parameters and buffers, as DDP starts from
rank 0's.

The outer step moves only the parameters that require a gradient; the others (a frozen base
under adapters, embeddings kept fixed) and the buffers must still start the same on every
node, or the nodes train different models from the first step. Each rank takes a
fingerprint of each such tensor (SHA-256 of its bytes on the CPU; on a GPU, where the bytes
would first cross to the host, two integer sums of them, plain and weighted by position, at
memory speed), the nodes compare them, and only the tensors that differ from the first
node's cross the link: a model loaded alike everywhere, however large its frozen part, sends
a few bytes. Fingerprints that differ where the bytes do not (another device) cost a send,
never a wrong start.
"""

import hashlib
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["from_first_node", "start_states"]

_CHUNK = 1 << 22  # bytes widened to int64 at a time (32 MiB of scratch)


def start_states(module: torch.nn.Module) -> list[torch.Tensor]:
    """What the outer step does not move but every node must start alike: the parameters
    that require no gradient and the buffers, in module order."""
    frozen = [p for p in module.parameters() if not p.requires_grad]
    return frozen + list(module.buffers())


def from_first_node(
    tensors: list[torch.Tensor], cross: Optional[dist.ProcessGroup], src: int, device
) -> int:
    """Copy into ``tensors`` the values of this rank's peer on the first node (global rank
    ``src``), over ``cross`` (a collective of it), where they differ; returns how many
    differed. ``device``: where the fingerprints meet (the group's backend's)."""
    if not tensors:
        return 0
    prints = torch.stack([_fingerprint(t).to(device) for t in tensors])
    rows = [torch.empty_like(prints) for _ in range(dist.get_world_size(cross))]
    dist.all_gather(rows, prints, group=cross)
    every = torch.stack(rows).cpu()  # (nodes, tensors, 2)
    first = every[dist.get_group_rank(cross, src)]
    differ = [i for i in range(len(tensors)) if not bool((every[:, i] == first[i]).all())]
    with torch.no_grad():
        for i in differ:
            t = tensors[i]
            # As bytes: Gloo broadcasts no bool, and the bytes are what must match.
            flat = t.detach().reshape(-1).contiguous()
            if t.device != torch.device(device):
                flat = flat.to(device)
            dist.broadcast(flat.view(torch.uint8), src=src, group=cross)
            if flat.data_ptr() != t.data_ptr():  # (a contiguous t was received in place)
                t.copy_(flat.view_as(t))
    return len(differ)


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 of ``t``'s bytes: the first 16 bytes of their SHA-256 on the CPU, elsewhere
    two sums of them, the second weighted by position (integer sums wrap alike whatever the
    reduction order): equal for equal bytes."""
    data = t.detach().reshape(-1).contiguous().view(torch.uint8)
    if data.device.type == "cpu":
        digest = hashlib.sha256(data.numpy()).digest()[:16]
        return torch.frombuffer(bytearray(digest), dtype=torch.int64)
    return _sums(data)


def _sums(data: torch.Tensor) -> torch.Tensor:
    """The device's fingerprint of ``data`` (bytes): its plain and position-weighted sums."""
    total = torch.zeros(2, dtype=torch.int64, device=data.device)
    for lo in range(0, data.numel(), _CHUNK):
        part = data[lo : lo + _CHUNK].to(torch.int64)
        where = torch.arange(lo + 1, lo + 1 + part.numel(), dtype=torch.int64, device=data.device)
        total[0] += part.sum()
        total[1] += (part * where).sum()
    return total
