"""Reused flat buffers of the FSDP2 comms."""

import torch

__all__ = ["Buffers"]


class Buffers:
    """One flat buffer per name, device and CUDA stream, grown to the largest request; callers
    view its front.

    FSDP2 runs one collective of a kind at a time on a stream, so reuse on that stream is
    ordered. It runs the all-gather on its all-gather stream in forward and backward, but on
    the current stream for an explicit ``unshard()``: a buffer shared by the two could be
    overwritten while the other stream's collective still reads it, and one grown on a stream
    it was not made on could be handed out again too early. Each stream has its own (so a job
    that does both holds the largest ones twice)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, torch.Tensor] = {}
        self.allocations = 0

    def get(self, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        device = torch.device(device)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        key = (name, device, stream)
        buf = self._by_key.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._by_key[key] = buf
            self.allocations += 1
        return buf[:numel]
