"""The dtype sets and rounding names that every layer of mixprec shares, defined once.

``LOW_PRECISION_DTYPES`` are the 16-bit formats a gradient travels in and an fp32 sum is rounded back to;
``WIRE_DTYPES`` adds fp32, the formats the fp32-accumulating collectives accept on the wire. ``Rounding``
names how an fp32 value is rounded to a 16-bit one: to nearest (torch's cast, ties to even) or
stochastically (unbiased; see :mod:`mixprec.core.stochastic`).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["LOW_PRECISION_DTYPES", "ROUNDINGS", "WIRE_DTYPES", "Rounding"]

LOW_PRECISION_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
WIRE_DTYPES: tuple[torch.dtype, ...] = (*LOW_PRECISION_DTYPES, torch.float32)

Rounding = Literal["nearest", "stochastic"]
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
