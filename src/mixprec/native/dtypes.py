"""The element-type codes of the compiled kernels: one table for the whole C boundary.

``csrc/dtypes.h`` holds the same table for the C side (``MIXPREC_F32`` ...); ``tests/test_native_ops.py`` parses
the header and checks that both agree. Every kernel that takes an element type takes one of these codes (a kernel
that reads fewer types refuses the others), so a wrapper never keeps a table of its own.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPE_CODES", "code_of"]

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


def code_of(dtype: torch.dtype) -> int:
    """The kernels' code of ``dtype`` (KeyError for a type no kernel reads)."""
    return DTYPE_CODES[dtype]
