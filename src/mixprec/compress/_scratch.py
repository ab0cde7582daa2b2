"""Grow-only named scratch buffers, reused across calls (fresh large allocations cost page faults)."""

from __future__ import annotations

import torch

__all__ = ["Scratch"]


class Scratch:
    """Named buffers, each grown to the largest size asked for and never shrunk; not thread-safe."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D view of ``numel`` elements of buffer ``name`` (contents unspecified)."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel]

    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
