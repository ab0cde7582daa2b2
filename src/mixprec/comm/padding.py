"""Pad a tensor to a multiple of the group size for a collective, and copy the result back.

Collectives that split a tensor into ``world_size`` equal parts (reduce-scatter based all-reduces) need
``numel`` to be a multiple of the group size and a contiguous 1-D view. :func:`pad_flat` gives that view:
the tensor itself when it already qualifies (no copy), else a zero-padded copy, with a ``copy_back`` that
writes the first ``numel`` elements of the result into the tensor (a no-op in the first case).

The zeros are a valid addend for any sum (they only join the last part), so the reduced padding is zero
again and is dropped by ``copy_back``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mixprec.core.validate import check_positive_int, check_tensor

__all__ = ["pad_flat", "round_up"]


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` (>= 1) that is >= ``n`` (>= 0): the padded length."""
    return -(-n // multiple) * multiple


def pad_flat(
    tensor: torch.Tensor,
    multiple: int,
    *,
    buffer: torch.Tensor | Callable[[int], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, Callable[[], None]]:
    """A contiguous 1-D view of ``tensor`` zero-padded to a multiple of ``multiple``, and its ``copy_back``.

    Args:
        tensor: any shape, dtype and device; read here (copied if it needs padding or is not contiguous).
        multiple: int >= 1, usually the group size.
        buffer: where the copy goes instead of a fresh allocation (reuse it across calls): a 1-D contiguous
            tensor of ``tensor``'s dtype and device with at least the padded length, or a function of the
            padded length returning one (called only when a copy is needed).

    Returns:
        ``(flat, copy_back)``: ``flat`` has ``ceil(numel / multiple) * multiple`` elements; it is
        ``tensor.view(-1)`` itself when ``tensor`` is contiguous and ``numel`` is a multiple, else a copy
        with zeros after the first ``numel`` elements. ``copy_back()`` copies ``flat[:numel]`` into
        ``tensor`` (exact: same dtype) when ``flat`` is a copy and does nothing otherwise.

    Extra memory: none, or the padded copy (in ``buffer`` when given).
    """
    check_tensor("tensor", tensor)
    multiple = check_positive_int("multiple", multiple)
    numel = tensor.numel()
    padded = round_up(numel, multiple)
    if tensor.is_contiguous() and padded == numel:
        return tensor.view(-1), lambda: None
    if callable(buffer):
        buffer = buffer(padded)
    if buffer is None:
        flat = torch.empty(padded, dtype=tensor.dtype, device=tensor.device)
    else:
        check_tensor("buffer", buffer, (tensor.dtype,), contiguous=True, device=tensor.device)
        if buffer.dim() != 1 or buffer.numel() < padded:
            raise ValueError(
                f"buffer must be 1-D with at least {padded} elements (numel {numel} padded to a multiple of "
                f"{multiple}); got shape {tuple(buffer.shape)}"
            )
        flat = buffer[:padded]
    flat[:numel].copy_(tensor.reshape(-1))
    flat[numel:].zero_()

    def copy_back() -> None:
        tensor.copy_(flat[:numel].view(tensor.shape))

    return flat, copy_back
