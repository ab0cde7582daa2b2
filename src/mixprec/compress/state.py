"""What the compressed collectives keep and report: per-call stats, error-feedback residuals, buffers.

* :class:`CompressionStats`: the bytes one call sent from this rank and whether some rank's input (or the
  reduction) was not finite.
* :class:`ErrorFeedback`: the fp32 residuals of one tensor's reductions, carried from call to call.
* :class:`CompressionWorkspace`: reusable buffers, held by at most one pending collective at a time.
* :class:`Traffic`: what a pipeline reports to the function that started it (bytes and the non-finite
  flag), from which that function builds the stats.

See ``docs/compress.md`` for where each residual is taken and added back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.compress._scratch import Scratch

__all__ = ["CompressionStats", "CompressionWorkspace", "ErrorFeedback", "Traffic"]


@dataclass(frozen=True)
class CompressionStats:
    """What one compressed collective sent from this rank (bytes handed to the backend, payload only).

    Attributes:
        numel: elements reduced (the caller's tensor, before any padding).
        world_size: ranks in the group.
        bytes_sent: all bytes this rank sent, both phases, all links.
        bytes_sent_compressed: bytes of uint8 buffers (codes + headers): the flat scheme's all-to-all and
            all-gather; in the hierarchical scheme the inter-node exchange plus the intra-node relay of the
            quantized slices.
        bytes_sent_full_precision: the hierarchical scheme's intra-node reduce-scatter (tensor dtype); 0 flat.
        bytes_sent_intra_node: the hierarchical scheme's intra-node bytes (that reduce-scatter and the
            relay); 0 in the flat scheme, which does not know the topology.
        header_bytes: the part of ``bytes_sent_compressed`` that is per-chunk (min, max) headers.
        fp32_baseline_bytes: what a ring fp32 collective of the same tensor sends per rank:
            ``2 (W-1)/W * 4N`` for an all-reduce, ``(W-1)/W * 4N`` for a reduce-scatter.
        found_nonfinite: some rank's input held NaN/Inf (identical on every rank).
    """

    numel: int
    world_size: int
    bytes_sent: int
    bytes_sent_compressed: int
    bytes_sent_full_precision: int
    bytes_sent_intra_node: int
    header_bytes: int
    fp32_baseline_bytes: int
    found_nonfinite: bool

    @property
    def bytes_sent_inter_node(self) -> int:
        """``bytes_sent - bytes_sent_intra_node`` (in the flat scheme: everything)."""
        return self.bytes_sent - self.bytes_sent_intra_node

    @property
    def ratio_to_fp32(self) -> float:
        """``bytes_sent / fp32_baseline_bytes`` (about 0.25 plus headers in the flat scheme)."""
        return self.bytes_sent / self.fp32_baseline_bytes if self.fp32_baseline_bytes else 0.0


@dataclass(frozen=True)
class Traffic:
    """What a pipeline's finishing work reports: this rank's bytes and the agreed non-finite flag.

    Attributes:
        found_nonfinite: some chunk of the result is flagged, or the result overflowed (same on every rank).
        local_input_bad: whether this rank's own input held NaN/Inf; asked only when ``found_nonfinite``.
        compressed: bytes of uint8 buffers sent (codes + headers).
        header: the per-chunk header part of ``compressed``.
        full_precision: bytes sent in the tensor dtype (the hierarchical intra-node reduce-scatter).
        intra_node: bytes sent inside the node (hierarchical only).
    """

    found_nonfinite: bool
    local_input_bad: Callable[[], bool]
    compressed: int = 0
    header: int = 0
    full_precision: int = 0
    intra_node: int = 0

    def stats(self, numel: int, world_size: int, fp32_baseline_bytes: int) -> CompressionStats:
        """The :class:`CompressionStats` of a call on ``numel`` elements over ``world_size`` ranks."""
        return CompressionStats(
            numel=numel,
            world_size=world_size,
            bytes_sent=self.compressed + self.full_precision,
            bytes_sent_compressed=self.compressed,
            bytes_sent_full_precision=self.full_precision,
            bytes_sent_intra_node=self.intra_node,
            header_bytes=self.header,
            fp32_baseline_bytes=fp32_baseline_bytes,
            found_nonfinite=self.found_nonfinite,
        )


class ErrorFeedback:
    """Error-feedback residuals of ONE tensor's compressed reductions: keep one per tensor (or bucket).

    ``worker``: fp32, what this rank's quantization of its input lost in the last call (the input's
    length, padded to a multiple of the group size; in hierarchical mode the node slice's length). It is
    added to the next call's input before quantizing. ``server``: fp32, what the re-quantization of the
    reduced part this rank owns lost (one part's length); added to that part next call. Both start at
    zero, are created on first use, and are cleared when a call finds NaN/Inf.
    """

    _SIDES = ("worker", "server")

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    @property
    def worker(self) -> torch.Tensor | None:
        return self._residuals.get("worker")

    @property
    def server(self) -> torch.Tensor | None:
        return self._residuals.get("server")

    def residual(self, side: str, numel: int, device: torch.device) -> torch.Tensor:
        """The fp32 residual of ``side`` ("worker"/"server"), created as zeros on first use."""
        res = self._residuals.get(side)
        if res is None:
            res = self._residuals[side] = torch.zeros(numel, dtype=torch.float32, device=device)
        elif res.numel() != numel:
            raise ValueError(
                f"error_feedback holds a {side} residual of {res.numel()} elements but this call needs {numel}: "
                "use one ErrorFeedback per tensor (the same tensor size, group and topology at every call)"
            )
        elif res.device != device:
            res = self._residuals[side] = res.to(device)
        return res

    def reset(self) -> None:
        """Zero both residuals (keeps their memory)."""
        for res in self._residuals.values():
            res.zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"worker": fp32 tensor, "server": fp32 tensor}`` (only those created so far), cloned."""
        return {side: res.detach().clone() for side, res in self._residuals.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the residuals with copies of ``state``'s (a :meth:`state_dict`: keys among "worker" and
        "server", each a 1-D fp32 tensor); sides missing from ``state`` start again from zero on first use.
        Sizes are checked at the next call (they depend on the tensor, group and topology it is used with).
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict; got {type(state).__name__}")
        unknown = set(state) - set(self._SIDES)
        if unknown:
            raise ValueError(f"unknown error-feedback state keys {sorted(unknown)}; expected 'worker', 'server'")
        for side, res in state.items():
            if not isinstance(res, torch.Tensor) or res.dtype != torch.float32 or res.dim() != 1:
                raise TypeError(f"state[{side!r}] must be a 1-D float32 tensor")
        self._residuals = {side: res.detach().clone() for side, res in state.items()}

    def __repr__(self) -> str:
        sizes = ", ".join(f"{side}={res.numel()}" for side, res in self._residuals.items())
        return f"ErrorFeedback({sizes})"


class CompressionWorkspace:
    """Communication and fp32 buffers of compressed collectives, reused across calls.

    Pass the same workspace to repeated calls on same-sized tensors to avoid reallocating (a fresh large
    buffer costs page faults on first touch). One workspace per concurrently pending collective: a started
    collective holds its workspace until its ``wait()`` returns, and starting another one with the same
    workspace meanwhile raises RuntimeError (the second would overwrite buffers the first is still sending).
    Not thread-safe. Holds about ``3 N`` bytes of uint8 buffers plus ``4 N / W`` of fp32 for an N-element
    tensor (more with error feedback, hierarchical mode or padding).
    """

    def __init__(self) -> None:
        self.scratch = Scratch()
        self._busy = False

    def nbytes(self) -> int:
        """Bytes of all buffers this workspace holds now (they grow to the largest call and are kept)."""
        return self.scratch.nbytes()

    def claim(self, name: str) -> Scratch:
        """Mark the workspace held by a started collective and return its buffers; RuntimeError if it is
        held already (``name``: how the caller's argument is called, for the message)."""
        if self._busy:
            raise RuntimeError(
                f"{name} is still held by a started compressed collective whose wait() has not returned: give "
                "each pending collective its own CompressionWorkspace (start_* with workspace=None makes one)"
            )
        self._busy = True
        return self.scratch

    def release(self) -> None:
        """The collective that claimed the workspace no longer uses its buffers."""
        self._busy = False
