"""Argument checks shared by mixprec's public functions: each error names the argument and what is allowed."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "check_bool",
    "check_group",
    "check_choice",
    "check_norm_type",
    "check_tensor",
    "check_dtype",
    "check_positive_int",
    "check_positive_float",
    "check_fraction",
]


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> Any:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}")
    return value


def check_positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}; got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value}")
    return value


def check_positive_float(name: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a real number; got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}; got {value!r}")
    return v


def check_fraction(name: str, value: Any, *, open_low: bool = True, open_high: bool = True) -> float:
    """A float in (0, 1) with each end open or closed as asked."""
    v = check_positive_float(name, value, allow_zero=not open_low)
    if v > 1 or (v == 1 and open_high):
        hi = ")" if open_high else "]"
        lo = "(" if open_low else "["
        raise ValueError(f"{name} must lie in {lo}0, 1{hi}; got {value!r}")
    return v


def check_dtype(name: str, value: Any, allowed: Iterable[torch.dtype]) -> torch.dtype:
    allowed = tuple(allowed)
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, one of {allowed}; got {type(value).__name__}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(str(a) for a in allowed)}; got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False); got {type(value).__name__} {value!r}")
    return value


def check_norm_type(name: str, value: Any) -> float:
    """A p-norm order: a finite number > 0, or math.inf."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a positive number or math.inf; got {type(value).__name__} {value!r}")
    v = float(value)
    if not (v == math.inf or (math.isfinite(v) and v > 0)):
        raise ValueError(f"{name} must be a positive number or math.inf; got {value!r}")
    return v


def check_tensor(
    name: str,
    value: Any,
    dtypes: Iterable[torch.dtype] | None = None,
    *,
    contiguous: bool = False,
    device: torch.device | None = None,
    materialized: bool = False,
) -> torch.Tensor:
    """A tensor, optionally of one of ``dtypes`` (TypeError otherwise), contiguous, on ``device`` and, with
    ``materialized``, not a meta tensor (ValueError)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    if dtypes is not None:
        allowed = tuple(dict.fromkeys(dtypes))  # once each: (input.dtype, torch.float32) may name fp32 twice
        if value.dtype not in allowed:
            raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in allowed)}; got {value.dtype}")
    if contiguous and not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    if device is not None and value.device != device:
        raise ValueError(f"{name} must be on {device}; got {value.device}")
    if materialized and value.is_meta:
        raise ValueError(f"{name} is a meta tensor (shape and dtype only, no data): pass a tensor with storage")
    return value


def check_group(name: str, group: Any) -> Any:
    """``group`` must be a ``torch.distributed.ProcessGroup`` this rank belongs to, or None (the default group).

    TypeError for anything else; ValueError for ``GroupMember.NON_GROUP_MEMBER``, what ``new_group`` returns on
    the ranks outside the new group.
    """
    if not dist.is_available():
        if group is not None:
            raise TypeError(f"{name} must be None: torch.distributed is not available in this build")
        return group
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{name}: this rank is not a member of it (new_group returned GroupMember.NON_GROUP_MEMBER)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{name} must be a torch.distributed ProcessGroup or None; got {type(group).__name__} {group!r}"
        )
    return group
