"""Precision emulation: bit-exact rounding to low-precision formats and matmuls with modelled accumulators."""

from mixprec.core.formats import FORMAT_PRESETS, FloatFormat, get_format
from mixprec.core.rounding import ROUNDING_MODES, round_to, round_to_
from mixprec.emulate.linear import EmulatedLinear, LinearSwap, emulate_linear_layers
from mixprec.emulate.matmul import (
    MATMUL_PRESETS,
    ErrorBounds,
    MatmulModel,
    bounds,
    get_matmul_model,
    matmul,
)

__all__ = [
    "FORMAT_PRESETS",
    "MATMUL_PRESETS",
    "ROUNDING_MODES",
    "EmulatedLinear",
    "ErrorBounds",
    "FloatFormat",
    "LinearSwap",
    "MatmulModel",
    "bounds",
    "emulate_linear_layers",
    "get_format",
    "get_matmul_model",
    "matmul",
    "round_to",
    "round_to_",
]
