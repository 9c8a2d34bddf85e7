"""Reused flat buffers of the FSDP2 comms."""

import torch

__all__ = ["Buffers"]


class Buffers:
    """One flat buffer per name and device, grown to the largest request; callers view its
    front. FSDP2 runs one collective of a kind at a time, on one stream, so reuse is safe."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, torch.device], torch.Tensor] = {}
        self.allocations = 0

    def get(self, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        key = (name, torch.device(device))
        buf = self._by_key.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._by_key[key] = buf
            self.allocations += 1
        return buf[:numel]
